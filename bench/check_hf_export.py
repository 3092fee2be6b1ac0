"""`llmtune export MODEL.gguf --hf DIR` against transformers: does the folder load, compute the same
logits and tokenize the same?

    python bench/check_hf_export.py [--record] [--smollm PATH] [--wikitext PATH]

For SmolLM2-135M-Instruct (Q4_1, dequantised: both sides use the same float32 weights),
tests/data/stories260K.gguf (SPM vocabulary) and tiny random models of the mapped families made by
bench/check_families.py's FAMILIES rows (`llmtune init --config`): export with --hf, load with
AutoModelForCausalLM / AutoTokenizer (float32, eager attention), and compare
- logits on a few prompts with llmtune's forward pass over the GGUF's weights dequantised to
  float32 (max |diff| / max |logit|, target <= 1e-4);
- AutoTokenizer's ids with llmtune's tokenizer over a WikiText-2 slice and a mixed-script text;
- the chat template rendered by transformers and by llmtune (when the file has one), and the
  rendered conversation's tokens (special tokens parsed);
then phi3 with LongRoPE and llama3-tiny's random rope factors are refused, and every llama.cpp
test vocabulary (its models/ggml-vocab-*.gguf, complete: the tests' slim copies lack merges, so the
tiny models take these too) has its tokenizer.json checked with the `tokenizers` library against
llama.cpp's expected ids (test-tokenizer-0's .inp/.out).
--record only writes tests/data/hf_export/stories260K.json: transformers' logits for stories260K on a few
tokens (the test compares the exported folder's tensors and these numbers), and gpt2-tiny.json: the same
for gpt2-tiny (`llmtune init` of configs/gpt2-tiny.toml, seed 0, random weights; every 97th vocabulary
column). Needs torch and transformers (neither is a dependency of llmtune).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import family_check  # noqa: E402
from check_families import FAMILIES  # noqa: E402
from llmtune.arch.hf_config import llama3_factors  # noqa: E402
from llmtune.backends.cpu import CPUBackend  # noqa: E402
from llmtune.convert.export import export_hf  # noqa: E402
from llmtune.convert.init import init_model  # noqa: E402
from llmtune.errors import LlmtuneError  # noqa: E402
from llmtune.gguf.file import load_gguf, write_gguf  # noqa: E402
from llmtune.graph.planner import Program  # noqa: E402
from llmtune.model.loaded import Model, check_model  # noqa: E402
from llmtune.tokenizer import Tokenizer  # noqa: E402
from llmtune.tokenizer.chat_template import ChatTemplate  # noqa: E402
from llmtune.tokenizer.hf_files import tokenizer_files  # noqa: E402

SMOLLM = Path("/work/models/SmolLM2-135M-Instruct.Q4_1.gguf")
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
LLAMACPP_VOCABS = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
FIXTURE = ROOT / "tests" / "data" / "hf_export" / "stories260K.json"
GPT2_FIXTURE = FIXTURE.with_name("gpt2-tiny.json")
GPT2_COLUMNS = 97  # gpt2-tiny.json keeps every 97th of the 50,257 logits
PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The cat sat on the mat and",
           "1 + 1 = 2; 12345 * 678 = ? Héllo wörld — naïve café.",
           # longer than the tiny gemmas' 32-token sliding window
           "One day, Lily went to the park with her mom. She saw a big red ball under a tree and ran to get it. "
           "The ball was stuck, so she asked a boy to help her. They pulled and pulled until it came out!"]
MIXED = ("English, Français: l'été; Deutsch: Größe; Ελληνικά; Русский текст; 中文字符和标点。"
         "日本語のテキスト; 한국어; العربية; हिन्दी; emoji 🙂🚀; "
         "tabs\tand  double  spaces\n\nnew lines 3.14159 1,000,000")
FAMILY_ROWS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2")  # phi3: below, without LongRoPE


def llmtune_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llmtune's logits for `ids`, every weight dequantised to float32 (no quantized products)."""
    gf = load_gguf(path)
    hp, present = check_model(gf)
    model = Model(gf.path, gf, hp, {s.name: gf.tensor(s.name) for s in present})
    _, nodes, logits = model.build(1, len(ids))
    prog = Program([logits], CPUBackend(), params={nodes[n]: w for n, w in model.weights.items()})
    out = prog.run(tokens=np.asarray([ids], np.int32), pos=np.arange(len(ids), dtype=np.int32))
    return np.asarray(out[0], np.float64).reshape(len(ids), -1)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def load_folder(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def compare_tokens(tok: Tokenizer, hf_tok, text: str) -> tuple[int, int, str]:
    """(tokens, first differing position or -1, context) of llmtune's ids vs AutoTokenizer's."""
    ours = tok.encode(text, add_special=True, parse_special=True)
    theirs = hf_tok(text)["input_ids"]
    diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), -1)
    if diff < 0 and len(ours) != len(theirs):
        diff = min(len(ours), len(theirs))
    where = "" if diff < 0 else f" at {diff}: ours {ours[diff:diff + 4]} theirs {theirs[diff:diff + 4]}"
    return len(ours), diff, where


def check(name: str, path: Path, tmp: Path, texts: dict[str, str]) -> dict:
    folder = tmp / f"{name}-hf"
    export_hf(path, folder)
    model, hf_tok = load_folder(folder)
    tok = Tokenizer.from_gguf(load_gguf(path))
    worst, row = 0.0, {"family": name}
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special=True)
        ours, theirs = llmtune_logits(path, ids), hf_logits(model, ids)
        worst = max(worst, float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
    row["logits_rel"] = worst
    for label, text in texts.items():
        n, diff, where = compare_tokens(tok, hf_tok, text)
        row[f"tok_{label}"] = f"{n} tokens, {'same' if diff < 0 else 'DIFFER' + where}"
    gf = load_gguf(path)
    if gf.get("tokenizer.chat_template"):
        chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Tell me a story."}]
        ours = ChatTemplate.for_model(gf, tok).render(chat, add_generation_prompt=True)
        theirs = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        row["chat_template"] = "same" if ours == theirs else "DIFFER"
        same = tok.encode(theirs, add_special=False, parse_special=True) == hf_tok(theirs, add_special_tokens=False)[
            "input_ids"]
        row["chat_tokens"] = "same" if same else "DIFFER"  # special tokens in text, their lstrip/rstrip
    return row


def tiny_model(family: str, tmp: Path, config: Path | None = None, optional=()) -> Path:
    """bench/check_families.py's random-weight model of `family` (`config`: another shape, with the
    optional tensors `optional`)."""
    case = FAMILIES[family]
    out = tmp / f"{family}-{'own' if config else 'tiny'}.gguf"
    full = LLAMACPP_VOCABS / Path(case.vocab).name.removesuffix(".gz")  # the slim test copies lack merges
    vocab = full if full.is_file() else family_check.local_copy(case.vocab, tmp)
    return init_model(config or case.config, vocab, out, 0, test_weights=True,
                      optional=tuple(optional) if config else tuple(case.optional))


def plain_phi3(tmp: Path) -> Path:
    """configs/phi3-tiny.toml without LongRoPE (whose long/short choice transformers makes per input
    length and llama.cpp per context size: no exact export, refused)."""
    lines = (ROOT / "configs" / "phi3-tiny.toml").read_text().splitlines()
    out = tmp / "phi3-plain.toml"
    out.write_text("\n".join(ln for ln in lines if not ln.startswith(("n_ctx_orig", "rope_attn_factor"))) + "\n")
    return out


def untied_gpt2(tmp: Path) -> Path:
    """configs/gpt2-tiny.toml with its own output matrix (lm_head.weight, tie_word_embeddings false)."""
    text = (ROOT / "configs" / "gpt2-tiny.toml").read_text().replace("tied_output = true", "tied_output = false")
    out = tmp / "gpt2-untied.toml"
    out.write_text(text)
    return out


def llama3_model(tmp: Path, numbers=(8.0, 1.0, 4.0, 8192)) -> Path:
    """configs/llama3-tiny.toml with rope_freqs.weight as the converter computes Llama 3.1's (Meta's
    factor 8, low 1, high 4, context 8192), the other weights random."""
    src = tiny_model("llama3", tmp, ROOT / "configs" / "llama3-tiny.toml", optional=("rope_freqs.weight",))
    gf = load_gguf(src)
    hp, _ = check_model(gf)
    factors = llama3_factors(hp, *numbers).astype(np.float32)
    specs = ((n, factors if n == "rope_freqs.weight" else np.asarray(t.raw),
              GGMLQuantizationType.F32 if n == "rope_freqs.weight" else t.type) for n, t in gf.tensors.items())
    return write_gguf(tmp / "llama3-rope.gguf", gf.arch, gf.meta, specs)


def vocab_vectors() -> None:
    """tokenizer.json of each llama.cpp test vocabulary against llama.cpp's expected ids (.inp/.out)."""
    from tokenizers import Tokenizer as HFTokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    from test_tokenizer import read_vocab_tests  # noqa: PLC0415 - the tests' reader of test-tokenizer-0's files

    for path in sorted(LLAMACPP_VOCABS.glob("ggml-vocab-*.gguf")):
        if not Path(f"{path}.inp").is_file():
            continue
        gf = load_gguf(path)
        try:
            files = tokenizer_files(Tokenizer.from_gguf(gf), gf.metadata, 2048, str(path))
        except LlmtuneError as exc:
            print(json.dumps({"vocab": path.name, "refused": str(exc).split(": ", 1)[1]}))
            continue
        ht = HFTokenizer.from_str(json.dumps(files["tokenizer.json"]))
        cases = read_vocab_tests(path, LLAMACPP_VOCABS)
        same = sum(ht.encode(t, add_special_tokens=False).ids == want for t, want in cases)
        print(json.dumps({"vocab": path.name, "llama.cpp vectors equal": f"{same}/{len(cases)}"}), flush=True)


def record(tmp: Path) -> None:
    """tests/data/hf_export/stories260K.json and gpt2-tiny.json: transformers' logits of the exported models."""
    record_one(ROOT / "tests" / "data" / "stories260K.gguf", "tests/data/stories260K.gguf", FIXTURE, tmp, 1)
    gpt2 = init_model(ROOT / "configs" / "gpt2-tiny.toml", ROOT / "tests" / "data" / "vocab" / "ggml-vocab-gpt-2.gguf",
                      tmp / "gpt2-tiny.gguf", 0, test_weights=True)
    record_one(gpt2, "llmtune init configs/gpt2-tiny.toml (tests/data/vocab/ggml-vocab-gpt-2.gguf, seed 0, "
               "test_weights)", GPT2_FIXTURE, tmp, GPT2_COLUMNS)


def record_one(path: Path, what: str, fixture: Path, tmp: Path, every: int) -> None:
    import transformers

    folder = tmp / f"rec-{fixture.stem}"
    export_hf(path, folder)
    model, hf_tok = load_folder(folder)
    ids = hf_tok(PROMPTS[0])["input_ids"][:12]
    logits = hf_logits(model, ids)[:, ::every]
    fixture.parent.mkdir(parents=True, exist_ok=True)
    fixture.write_text(json.dumps({
        "model": what, "ids": ids, "text": PROMPTS[0], "columns": f"every {every}",
        "logits": [[round(float(v), 6) for v in row] for row in logits],
        "version": f"transformers {transformers.__version__}", "by": "bench/check_hf_export.py --record",
    }) + "\n")
    print(f"wrote {fixture.relative_to(ROOT)} ({fixture.stat().st_size} bytes)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help="write the test fixture")
    ap.add_argument("--smollm", type=Path, default=SMOLLM)
    ap.add_argument("--wikitext", type=Path, default=WIKITEXT)
    ap.add_argument("--wiki-bytes", type=int, default=100_000)
    args = ap.parse_args()
    texts = {"mixed": MIXED}
    if args.wikitext.is_file():
        texts["wiki"] = args.wikitext.read_text(encoding="utf-8")[: args.wiki_bytes]
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if args.record:
            record(tmp)
            return 0
        models = {"stories260K": ROOT / "tests" / "data" / "stories260K.gguf"}
        if args.smollm.is_file():
            models["smollm2-135m-q4_1"] = args.smollm
        for fam in FAMILY_ROWS:
            models[f"{fam}-tiny"] = tiny_model(fam, tmp)
        models["phi3-tiny-no-longrope"] = tiny_model("phi3", tmp, plain_phi3(tmp))
        models["gpt2-tiny-untied"] = tiny_model("gpt2", tmp, untied_gpt2(tmp))
        models["llama3-tiny-rope-8-1-4-8192"] = llama3_model(tmp)
        for name, path in models.items():
            print(json.dumps(check(name, path, tmp, texts)), flush=True)
        if LLAMACPP_VOCABS.is_dir():
            vocab_vectors()
        for fam in ("phi3", "llama3"):  # no exact mapping (llama3-tiny: random factors): refused
            try:
                export_hf(tiny_model(fam, tmp), tmp / f"{fam}-refused")
                print(json.dumps({"family": f"{fam}-tiny", "refused": "NO"}))
            except LlmtuneError as exc:
                print(json.dumps({"family": f"{fam}-tiny", "refused": str(exc)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
