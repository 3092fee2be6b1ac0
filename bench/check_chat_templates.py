"""llmtune's chat-template rendering against HF transformers' apply_chat_template, for the real
templates llama.cpp ships in models/templates/ (Llama 3.x, Qwen2.5, Gemma 2, Phi-3.5, Mistral Nemo).

    python bench/check_chat_templates.py --llama-cpp PATH/TO/llama.cpp [--record]

Each template is paired with a vocabulary of llama.cpp's models/ that transformers' GGUF loader
reads (Llama 3 and Qwen2 their own; Phi-3.5 phi-3's; Gemma 2 and Mistral Nemo, whose vocabularies
llama.cpp does not ship, llama's SentencePiece one: their turn markers are then plain text, which
both sides must still render and tokenize alike). For every conversation below transformers
renders the text and the ids (`apply_chat_template(..., tokenize=False)` and `tokenize=True`), or
raises (a template's own raise_exception, e.g. Gemma refusing a system turn); llmtune must give
the same text, or error message. The ids are also taken from llama.cpp's llama-tokenize of that
text (no BOS added, special tokens parsed): transformers' converter of GGUF vocabularies keeps the
BPE ones exact, but for SentencePiece ones it drops what llama.cpp (and the models' own HF
tokenizer.json) do, the space llama.cpp puts before text after a special token and the
right-stripping of Phi-3's special tokens (the "\n" after <|end|>); there llmtune's ids are
llama.cpp's, and both are recorded.

--record  copy the templates to tests/data/chat_templates/, write transformers' results to
          tests/data/chat_templates.json (tests/test_chat.py checks them without transformers),
          and for the big BPE vocabularies a slim copy (tests/data/chat_templates/*.gguf.gz, as
          bench/check_tokenizers.py slims: every id kept, only what these texts use filled in),
          checked to give the same ids as the full one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
OUT_DIR = DATA / "chat_templates"
FIXTURE = DATA / "chat_templates.json"
sys.path.insert(0, str(ROOT / "tests"))
import family_check  # noqa: E402

TEMPLATES = {  # name -> (llama.cpp template file, vocabulary, the copy the tests use)
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "ggml-vocab-llama-bpe.gguf",
                 "tests/data/chat_templates/ggml-vocab-llama-bpe.chat.gguf.gz"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "ggml-vocab-llama-bpe.gguf",
                 "tests/data/chat_templates/ggml-vocab-llama-bpe.chat.gguf.gz"),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", "ggml-vocab-qwen2.gguf",
                "tests/data/chat_templates/ggml-vocab-qwen2.chat.gguf.gz"),
    "gemma2": ("google-gemma-2-2b-it.jinja", "ggml-vocab-llama-spm.gguf", "tests/data/vocab/ggml-vocab-llama-spm.gguf"),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "ggml-vocab-phi-3.gguf",
               "tests/data/vocab/ggml-vocab-phi-3.gguf"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "ggml-vocab-llama-spm.gguf",
                     "tests/data/vocab/ggml-vocab-llama-spm.gguf"),
}

# Llama 3.2's template prints today's date (strftime_now) unless given one: fixed, so the fixture holds
TEMPLATE_KWARGS = {"date_string": "26 Jul 2024"}

CONVERSATIONS = {
    "single": ([{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}], False),
    "prompt": ([{"role": "user", "content": "Write a haiku about the sea."}], True),
    "system-multi": ([{"role": "system", "content": "You are a terse assistant."},
                      {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                      {"role": "user", "content": "  Another one, please!  "},
                      {"role": "assistant", "content": "Green, with ünïcödé and emoji 🌊\nand a second line."}], False),
    "system-prompt": ([{"role": "system", "content": "Answer in French."},
                       {"role": "user", "content": "Good morning"}], True),
    "bad-order": ([{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Hm."}], False),
}


def transformers_results(name: str, template: str, vocab: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vocab.parent), gguf_file=vocab.name)
    out = {}
    for conv, (messages, gen) in CONVERSATIONS.items():
        try:
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen,
                                           **TEMPLATE_KWARGS)
            ids = tok.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=gen,
                                          return_dict=False, **TEMPLATE_KWARGS)
            out[conv] = {"text": text, "ids": [int(i) for i in ids]}
        except Exception as exc:  # noqa: BLE001 - the template's own error is a result too
            out[conv] = {"error": str(exc)}
    return out


def llama_tokenize(bin_dir: Path, vocab: Path, text: str, tmp: Path) -> list[int]:
    import subprocess

    f = tmp / "chat.txt"
    f.write_bytes(text.encode("utf-8"))
    done = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(vocab), "-f", str(f), "--ids", "--log-disable",
                           "--no-bos"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llmtune_results(template_path: Path, vocab: Path) -> dict:
    from llmtune.errors import LlmtuneError
    from llmtune.gguf.file import load_gguf
    from llmtune.tokenizer import Tokenizer
    from llmtune.tokenizer.chat_template import ChatTemplate, encode

    tok = Tokenizer.from_gguf(load_gguf(vocab))
    tmpl = ChatTemplate.for_model(None, tok, override=template_path)
    out = {}
    for conv, (messages, gen) in CONVERSATIONS.items():
        try:
            text = tmpl.render(messages, add_generation_prompt=gen, **TEMPLATE_KWARGS)
            out[conv] = {"text": text, "ids": encode(tok, text)}
        except LlmtuneError as exc:
            out[conv] = {"error": str(exc)}
    return out


def slim_chat_vocab(vocab: Path, out: Path, texts: list[str]) -> None:
    """bench/check_tokenizers.py's slim copy, for chat text (special-token strings parsed)."""
    import check_tokenizers as ct
    from llmtune.tokenizer import tokenizer as tk

    class Tok(tk.Tokenizer):  # slim_vocab tokenizes its texts without parsing special tokens
        def encode(self, text, add_special=True, parse_special=False):
            return super().encode(text, add_special=False, parse_special=True)

    real = tk.Tokenizer
    tk.Tokenizer = Tok
    try:
        ct.slim_vocab(vocab, out, texts, "")
    finally:
        tk.Tokenizer = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path,
                    help="llama.cpp's source tree (models/, models/templates/)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    fixture = {"conversations": {k: {"messages": m, "add_generation_prompt": g} for k, (m, g) in CONVERSATIONS.items()},
               "template_kwargs": TEMPLATE_KWARGS, "templates": {}}
    print("| template | vocabulary | conversation | text = transformers | ids = transformers | ids = llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, (file, vocab_name, test_vocab) in TEMPLATES.items():
            src = args.llama_cpp / "models" / "templates" / file
            vocab = args.llama_cpp / "models" / vocab_name
            theirs = transformers_results(name, src.read_text(encoding="utf-8"), vocab)
            ours = llmtune_results(src, vocab)
            for conv in CONVERSATIONS:
                t, o = theirs[conv], ours[conv]
                if "error" in t:
                    same = "error" in o and t["error"] in o["error"]
                    print(f"| {name} | {vocab_name} | {conv} | both raise: {same} ({t['error'][:50]}) | | |")
                else:
                    t["ids_llama.cpp"] = llama_tokenize(args.llama_cpp / "build" / "bin", vocab, t["text"], tmp)
                    print(f"| {name} | {vocab_name} | {conv} | {t['text'] == o.get('text')} | "
                          f"{t['ids'] == o.get('ids')} "
                          f"| {t['ids_llama.cpp'] == o.get('ids')} |")
            fixture["templates"][name] = {"file": f"tests/data/chat_templates/{file}",
                                          "source": f"llama.cpp models/templates/{file}",
                                          "vocab": test_vocab, "transformers": theirs}
            if args.record:
                OUT_DIR.mkdir(exist_ok=True)
                shutil.copyfile(src, OUT_DIR / file)
                slim = ROOT / test_vocab
                if slim.parent == OUT_DIR:
                    texts = [r["text"] for t in TEMPLATES.values() if t[1] == vocab_name
                             for r in llmtune_results(args.llama_cpp / "models" / "templates" / t[0], vocab).values()
                             if "text" in r]
                    slim_chat_vocab(vocab, slim, texts)
                slimmed = llmtune_results(src, family_check.local_copy(slim, tmp))
                assert slimmed == ours, f"{name}: the slim vocabulary {test_vocab} tokenizes differently"
    if args.record:
        import transformers

        fixture["recorded_with"] = f"transformers {transformers.__version__}"
        FIXTURE.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {FIXTURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
