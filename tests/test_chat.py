"""Chat and instruction data: real chat templates rendered and tokenized as HF transformers does
(tests/data/chat_templates.json, recorded by bench/check_chat_templates.py), loss masks (the
trainer's loss equals one computed independently), data-format errors, and training on a small
chat set making the model answer in the trained format."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import numpy as np
import pytest

import llmtune
from cli_helpers import run_cli
from family_check import REPO, local_copy
from llmtune.backends.cpu import CPUBackend
from llmtune.backends.cpu.threads import blas_threads
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf
from llmtune.graph.planner import Program
from llmtune.model.loaded import load_model
from llmtune.tokenizer import Tokenizer
from llmtune.tokenizer.chat_template import ChatTemplate, encode
from llmtune.train.chat import ExampleBuilder, build_dataset, read_records

FIXTURE = json.loads((REPO / "tests" / "data" / "chat_templates.json").read_text())
CASES = [(t, c) for t in FIXTURE["templates"] for c in FIXTURE["conversations"]]
_tokenizers: dict = {}


def tokenizer_for(template: str, tmp: Path) -> Tokenizer:
    vocab = FIXTURE["templates"][template]["vocab"]
    if vocab not in _tokenizers:
        _tokenizers[vocab] = Tokenizer.from_gguf(load_gguf(local_copy(vocab, tmp)))
    return _tokenizers[vocab]


def template_for(name: str, tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate.for_model(None, tok, override=REPO / FIXTURE["templates"][name]["file"])


# ------------------------------------------------------------------------------ rendering
@pytest.mark.parametrize("template,conversation", CASES)
def test_render_matches_transformers(template, conversation, tmp_path):
    """Text as transformers' apply_chat_template renders it, and its ids: transformers' for the BPE
    vocabularies; for SentencePiece ones llama.cpp's llama-tokenize of the same text (transformers'
    GGUF converter drops llama.cpp's space after special tokens and Phi-3's right-strip of them,
    see bench/check_chat_templates.py), which llmtune's tokenizer follows."""
    rec = FIXTURE["templates"][template]["transformers"][conversation]
    conv = FIXTURE["conversations"][conversation]
    tok = tokenizer_for(template, tmp_path)
    tmpl = template_for(template, tok)
    if "error" in rec:
        with pytest.raises(LlmtuneError, match="the chat template failed: " + rec["error"][:30]):
            tmpl.render(conv["messages"], conv["add_generation_prompt"], **FIXTURE["template_kwargs"])
        return
    text = tmpl.render(conv["messages"], conv["add_generation_prompt"], **FIXTURE["template_kwargs"])
    assert text == rec["text"]
    ids = encode(tok, text)
    assert ids == rec["ids_llama.cpp"]
    if tok.kind == "bpe":
        assert ids == rec["ids"]


# (template, the loss-carrying text of the "system-multi" conversation's two assistant turns)
MASKS = {
    "qwen2.5": "Blue.<|im_end|>Green, with ünïcödé and emoji 🌊\nand a second line.<|im_end|>",
    "llama3.1": "Blue.<|eot_id|>Green, with ünïcödé and emoji 🌊\nand a second line.<|eot_id|>",
    "phi3.5": "Blue.<|end|>Green, with ünïcödé and emoji 🌊\nand a second line.<|end|>",
    # the system message moves into the last user turn; </s> is the end of turn
    "mistral-nemo": "Blue.</s>Green, with ünïcödé and emoji 🌊\nand a second line.</s>",
}


@pytest.mark.parametrize("template", sorted(MASKS))
def test_assistant_masks_of_real_templates(template, tmp_path):
    """Only the assistant turns' content and their end-of-turn token carry loss."""
    tok = tokenizer_for(template, tmp_path)
    conv = FIXTURE["conversations"]["system-multi"]
    tmpl = template_for(template, tok)
    tmpl.special.update(FIXTURE["template_kwargs"])
    ex = ExampleBuilder(tok, tmpl).chat(conv["messages"], "x.jsonl:1")
    got = b"".join(tok.token_to_bytes(int(i)) for i in ex.ids[ex.loss]).decode("utf-8")
    assert got.replace(" ", "") == MASKS[template].replace(" ", "")  # (SPM pieces carry their own spaces)
    everything = ExampleBuilder(tok, tmpl, train_on_prompt=True).chat(conv["messages"], "x.jsonl:1")
    assert everything.loss[1:].all() and not everything.loss[0]


# ------------------------------------------------------------------------------ data files
TOY_TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}[{{ m.content }}]\n{% elif m.role == 'user' %}"
                "User: {{ m.content }}\n{% else %}Bot: {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}Bot: {% endif %}")
ANIMALS = [("cat", "meow"), ("dog", "woof"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"), ("owl", "hoot"),
           ("pig", "oink"), ("frog", "ribbit"), ("bee", "buzz"), ("horse", "neigh")]


def chat_rows(repeat: int = 1, system: bool = False) -> list[dict]:
    rows = []
    for _ in range(repeat):
        for animal, sound in ANIMALS:
            msgs = [{"role": "user", "content": f"What does a {animal} say?"},
                    {"role": "assistant", "content": f"A {animal} says {sound}."}]
            if system:
                msgs.insert(0, {"role": "system", "content": "Answer in one sentence."})
            rows.append({"messages": msgs})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture()
def toy_template(tmp_path) -> Path:
    path = tmp_path / "toy.jinja"
    path.write_text(TOY_TEMPLATE)
    return path


@pytest.mark.parametrize("line,message", [
    ('{"messages": [{"role": "user"}]}', ':2: message 1: record has no "content" field'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', ":2: message 1: unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', ":2: the conversation has no assistant turn"),
    ('{"messages": []}', ':2: "messages" must be a non-empty list'),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}',
     ':2: message 1: "content" must be a string'),
    ('{"text": "x"}', ':2: record has no "messages" field'),
    ("{not json", ":2: invalid JSON"),
])
def test_bad_chat_records(tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [chat_rows()[0], line])
    with pytest.raises(LlmtuneError) as exc:
        read_records(path)
    assert str(exc.value).startswith(f"{path}{message}"), str(exc.value)


def test_bad_completion_record(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(LlmtuneError, match=r"d.jsonl:2: record has no \"completion\" field"):
        read_records(path)


def test_template_that_raises_names_the_data_line(tmp_path, stories_path):
    tmpl = tmp_path / "strict.jinja"
    tmpl.write_text("{% for m in messages %}{% if m.role == 'system' %}\n{{ raise_exception('no system turns') }}"
                    "{% endif %}{{ m.content }}{% endfor %}")
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows()[:2] + chat_rows(system=True)[:1])
    with pytest.raises(LlmtuneError) as exc:
        build_dataset(load_model(stories_path), data, 64, 0.0, chat_template=tmpl)
    assert str(exc.value) == f"{data}:3: {tmpl}: line 2: the chat template failed: no system turns"


def test_completion_format_masks_the_prompt(tmp_path, stories_path):
    model = load_model(stories_path)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}] * 3)
    ds, _ = build_dataset(model, data, 32, 0.0)
    tok = model.tokenizer
    ex = ds.examples[0]
    assert ex.ids[0] == tok.bos_id and ex.ids[-1] == tok.eos_id
    assert tok.decode(ex.ids[ex.loss]) .strip() == "4" and ex.loss[-1]  # the completion and EOS
    x, y = ds.gather([0])
    n = len(ex.ids) - 1
    assert (y[0, n:] == -1).all() and (x[0, n:] == tok.eos_id).all()  # padding: no loss
    assert (y[0, :n][~ex.loss[1:]] == -1).all()


def test_truncated_and_dropped_examples_are_counted(tmp_path, stories_path, toy_template):
    long = {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows()[:4] + [long])
    ds, _ = build_dataset(load_model(stories_path), data, 40, 0.0, chat_template=toy_template)
    assert (ds.n_truncated, ds.n_dropped, ds.n_train) == (1, 1, 4)


def test_chat_data_needs_a_template(tmp_path, stories_path):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows()[:2])
    with pytest.raises(LlmtuneError, match="has no chat template .*--chat-template FILE.jinja"):
        build_dataset(load_model(stories_path), data, 64, 0.0)


# ------------------------------------------------------------------------------ the loss
def independent_loss(model, rows: list[dict]) -> float:
    """Mean NLL over the assistant tokens (content and EOS) of every conversation, computed
    without llmtune's data code: jinja2 renders, the assistant spans come from rendering the
    conversation up to each turn (with the generation prompt, and through the turn), and the logits
    of one full forward pass per conversation give the log-probabilities, in float64."""

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(TOY_TEMPLATE)
    tok = model.tokenizer
    enc = lambda text: tok.encode(text, add_special=False, parse_special=True)  # noqa: E731
    be = CPUBackend()
    total, count = 0.0, 0
    for row in rows:
        msgs = row["messages"]
        ids = enc(tmpl.render(messages=msgs, add_generation_prompt=False, eos_token="</s>"))
        _, nodes, logits = model.build(1, len(ids))
        prog = Program([logits], be, params={n: be.asarray(np.asarray(model.weights[k])) for k, n in nodes.items()})
        out = np.asarray(prog.run(tokens=np.asarray([ids], np.int32), pos=np.arange(len(ids), dtype=np.int32))[0],
                         dtype=np.float64)
        logp = out - out.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(enc(tmpl.render(messages=msgs[:i], add_generation_prompt=True, eos_token="</s>")))
            end = len(enc(tmpl.render(messages=msgs[: i + 1], add_generation_prompt=False, eos_token="</s>")))
            for t in range(start, end):  # token t, predicted at position t - 1
                total -= logp[t - 1, ids[t]]
                count += 1
    return total / count


def test_trainer_loss_is_the_mean_over_assistant_tokens(tmp_path, stories_path, toy_template):
    """The first step's loss (before any update) over 6 conversations in micro-batches of 2 (each
    with its own number of loss tokens) equals the independent mean over all assistant tokens."""

    rows = chat_rows(system=True)[:6]
    rows[1]["messages"][2]["content"] = "A much longer answer, so the micro-batches differ in loss tokens."
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with blas_threads(1):
        res = llmtune.finetune(stories_path, data, tmp_path / "o.gguf", chat_template=str(toy_template), ctx=128,
                               batch=6 * 128, ubatch=2 * 128, epochs=1, lr=1e-3, val_split=0.0, shuffle=False)
    want = independent_loss(load_model(stories_path), rows)
    assert abs(res.first_loss - want) / want < 1e-5, (res.first_loss, want)


def test_training_on_a_chat_set_answers_in_its_format(tmp_path, stories_path, toy_template, monkeypatch, capsys):
    """A few epochs on 30 conversations: the greedy sample after training is a trained answer."""
    data = write_jsonl(tmp_path / "animals.jsonl", chat_rows(repeat=3))
    with blas_threads(1):
        code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "t.gguf",
                                 "--chat-template", toy_template, "--ctx", "48", "--batch", "240", "--epochs", "8",
                                 "--lr", "3e-3", "--val-split", "0", "--sample-prompt", "What does a cow say?")
    assert code == 0, err
    assert "30 chat examples, one per window" in err and "tokens carry loss per epoch" in err
    samples = [line for line in err.splitlines() if line.startswith("sample (epoch")]
    assert len(samples) == 8
    assert samples[-1].endswith("What does a cow say? -> A cow says moo."), samples
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(""))
    code, out, err = run_cli(monkeypatch, capsys, "generate", tmp_path / "t.gguf", "--chat", "--chat-template",
                             toy_template, "-p", "What does a pig say?", "--temp", "0")
    assert code == 0 and out.strip() == "A pig says oink." and "end of generation" in err, (out, err)


def test_cli_finetune_data_errors(tmp_path, stories_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [chat_rows()[0], '{"messages": [{"role": "user", "content": "hi"}]}'])
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                             "--chat-template", tmp_path / "none.jinja")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{data}:2: the conversation has no assistant turn" in err
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, REPO / "data" / "wikitext-100k.txt",
                             "-o", tmp_path / "o.gguf", "--train-on-prompt")
    assert code == 2 and "--train-on-prompt: only prompt/completion and chat data" in err
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                             "--sample-every", "3")
    assert code == 2 and "--sample-every: needs --sample-prompt" in err
