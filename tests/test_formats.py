"""Dataset formats (train/records.py): Alpaca, ShareGPT, chat, prompt/completion and text records
from .jsonl, .json (an array, or an object holding one), .parquet, .csv and folders. Each fixture's
loss mask is compared with the text, written here by hand, that must carry loss (Alpaca's output,
ShareGPT's gpt turns, each with the end-of-turn EOS) and the prompt text that must not; a .json
array never trains as plain text; a record of unknown shape is one line naming the file, the
record, its keys and the formats accepted (exit 2, nothing written)."""

from __future__ import annotations

import builtins
import csv
import gzip
import io
import json
import warnings
from pathlib import Path

import pytest

from cli_helpers import run_cli
from llmtune.errors import LlmtuneError, LlmtuneWarning
from llmtune.eval import generate
from llmtune.model.loaded import load_model
from llmtune.train.chat import build_dataset, read_records, sample_prompt
from llmtune.train.checkpoint import file_sha256

# the toy chat template of test_chat.py, with a tool role
TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}[{{ m.content }}]\n{% elif m.role == 'user' %}"
            "User: {{ m.content }}\n{% elif m.role == 'tool' %}Tool: {{ m.content }}\n{% else %}"
            "Bot: {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")

ALPACA = [
    {"instruction": "Name a color.", "input": "", "output": "Red."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "Five.", "system": "Be brief."},
]
ALPACA_MULTILINE = {"instruction": "Sum:\nall of them.", "input": "1\n2", "output": "Three."}
# rendered with TEMPLATE: what carries loss, and the whole text (hand-written)
ALPACA_LOSS = ["Red.</s>", "Five.</s>"]
ALPACA_TEXT = ["User: Name a color.\nBot: Red.</s>", "[Be brief.]\nUser: Add the numbers.\n2 and 3\nBot: Five.</s>"]

SHAREGPT = [
    {"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi there."},
                       {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Weather?"},
                       {"from": "tool", "value": "sunny"}, {"from": "gpt", "value": "It is sunny."}]},
    {"conversations": [{"from": "human", "value": "Bye."}, {"from": "gpt", "value": "Goodbye."}]},
]
# a token straddling the start of a turn ("▁Hello": the space is the template's) carries loss
# (stories260K's vocabulary has "▁Hello" but no "▁Goodbye")
SHAREGPT_LOSS = [" Hello.</s> It is sunny.</s>", "Goodbye.</s>"]
# (SPM: text after a special token starts with the dummy-prefix space, as in HF's llama tokenizer)
SHAREGPT_TEXT = ["[Be kind.]\nUser: Hi there.\nBot: Hello.</s> User: Weather?\nTool: sunny\nBot: It is sunny.</s>",
                 "User: Bye.\nBot: Goodbye.</s>"]


@pytest.fixture(scope="module")
def model(stories_path):
    return load_model(stories_path)


@pytest.fixture()
def template(tmp_path) -> Path:
    path = tmp_path / "toy.jinja"
    path.write_text(TEMPLATE)
    return path


def pieces(tok, ids) -> str:
    """The text of token ids, piece by piece (SPM's ▁ as a space, EOS as </s>)."""
    return b"".join(tok.token_to_bytes(int(i)) for i in ids).decode().replace("▁", " ")


def check_masks(model, data, want_loss, want_text, template=None, fmt="auto", want_format=None, ctx=96):
    ds, _ = build_dataset(model, data, ctx, 0.0, fmt=fmt, chat_template=template)
    tok = model.tokenizer
    assert ds.format == (want_format or ds.format) and len(ds.examples) == len(want_loss)
    for ex, loss, text in zip(ds.examples, want_loss, want_text):
        assert pieces(tok, ex.ids[ex.loss]) == loss  # exactly these tokens carry loss
        assert pieces(tok, ex.ids[ex.ids != tok.bos_id]) == " " + text  # SPM's dummy prefix first
    # the trainer's view: the masked targets are the same tokens
    x, y = ds.gather(range(len(ds.examples)))
    for r, ex in enumerate(ds.examples):
        assert (y[r][y[r] >= 0] == ex.ids[ex.loss]).all()
    return ds


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_alpaca_jsonl_masks_the_output(tmp_path, model, template):
    check_masks(model, write_jsonl(tmp_path / "a.jsonl", ALPACA), ALPACA_LOSS, ALPACA_TEXT, template,
                want_format="alpaca")


def test_alpaca_without_a_chat_template_uses_the_alpaca_prompt(tmp_path, model):
    """stories260K has no chat template: the Stanford Alpaca prompt, the output (and EOS) trained."""
    ds = check_masks(model, write_jsonl(tmp_path / "a.jsonl", ALPACA[1:]), ["Five.</s>"], [
        "Be brief.\n\n### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\nFive.</s>"])
    assert ds.template is None
    check_masks(model, write_jsonl(tmp_path / "c.jsonl", [ALPACA_MULTILINE]), ["Three.</s>"], [
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\nSum:\nall of them.\n\n### Input:\n"
        "1\n2\n\n### Response:\nThree.</s>"], ctx=512)
    ds, _ = build_dataset(model, write_jsonl(tmp_path / "b.jsonl", ALPACA[:1]), 512, 0.0)
    assert pieces(model.tokenizer, ds.examples[0].ids[1:]).startswith(" "
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nName a color.\n\n### Response:\n")


def test_sample_prompt_is_rendered_as_training_renders_prompts(tmp_path, model, monkeypatch, capsys):
    """--sample-prompt samples after the prompt the model is trained to answer: on Alpaca data
    without a chat template the Alpaca prompt of the text (it sampled a raw continuation), with a
    template a user turn and the generation prompt, on prompt/completion data the text itself:
    each the tokens a training example has before its first loss-carrying one."""
    gen = tmp_path / "gen.jinja"
    gen.write_text(TEMPLATE + "{% if add_generation_prompt %}Bot: {% endif %}")
    record = {"instruction": "Name a color.", "output": "Red."}

    def prompt_of(rows, template=None):
        ds, _ = build_dataset(model, write_jsonl(tmp_path / "d.jsonl", rows), 512, 0.0, chat_template=template)
        ex = ds.examples[0]
        return ds, ex.ids[: int(ex.loss.argmax())].tolist()

    ds, want = prompt_of([record])
    assert sample_prompt(model.tokenizer, ds.template, ds.format, "Name a color.") == (want, True)
    ds, want = prompt_of([record], gen)
    assert sample_prompt(model.tokenizer, ds.template, ds.format, "Name a color.") == (want, True)
    assert pieces(model.tokenizer, want).strip() == "User: Name a color.\nBot:"
    ds, want = prompt_of([{"prompt": "Once upon a time", "completion": " there was a cat."}])
    assert sample_prompt(model.tokenizer, ds.template, ds.format, "Once upon a time") == (want, False)

    seen = []  # what a run samples after
    init = generate.TrainingSampler.__init__
    monkeypatch.setattr(generate.TrainingSampler, "__init__",
                        lambda self, trainer, ids: seen.append(ids) or init(self, trainer, ids))
    data = write_jsonl(tmp_path / "a.jsonl", [record] * 4)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", model.path, data, "-o", tmp_path / "o.gguf", "--ctx", 256,
                           "--batch", 256, "--epochs", 1, "--val-split", 0, "--sample-prompt", "Name a color.")
    assert code == 0, err
    assert seen == [prompt_of([record])[1]]
    assert [line for line in err.splitlines() if line.startswith("sample (epoch 1")][0].count("Name a color. -> ") == 1


def test_sharegpt_masks_the_gpt_turns(tmp_path, model, template):
    check_masks(model, write_jsonl(tmp_path / "s.jsonl", SHAREGPT), SHAREGPT_LOSS, SHAREGPT_TEXT, template,
                want_format="sharegpt")
    # "messages" holding from/value is ShareGPT too
    rows = [{"messages": r["conversations"]} for r in SHAREGPT]
    check_masks(model, write_jsonl(tmp_path / "m.jsonl", rows), SHAREGPT_LOSS, SHAREGPT_TEXT, template,
                want_format="sharegpt")


@pytest.mark.parametrize("wrap", [lambda rows: rows, lambda rows: {"version": 1, "data": rows}])
def test_json_array_is_records_never_text(tmp_path, model, template, wrap):
    data = tmp_path / "a.json"
    data.write_text(json.dumps(wrap(ALPACA), indent=2))
    check_masks(model, data, ALPACA_LOSS, ALPACA_TEXT, template, want_format="alpaca")
    data.write_text(json.dumps(wrap([{"text": "One story."}, {"text": "Another one."}])))
    assert read_records(data).format == "text"  # documents, not the JSON punctuation
    with pytest.raises(LlmtuneError, match=r"--format plain: .*a.json is a .json file of records, not plain text"):
        read_records(data, "plain")
    data.write_text("".join(json.dumps(r) + "\n" for r in ALPACA))  # JSONL named .json
    with pytest.raises(LlmtuneError,
                       match=r"a.json: invalid JSON \(Extra data at line 2 column 1\); one record per line is JSONL"):
        read_records(data)


def test_parquet_records(tmp_path, model, template):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # noqa: PLC0415 - optional, probed where used

    data = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([{"system": None, **r} for r in ALPACA]), data)  # a null system: none
    check_masks(model, data, ALPACA_LOSS, ALPACA_TEXT, template, want_format="alpaca")
    pq.write_table(pa.Table.from_pylist(SHAREGPT), data)  # nested lists of structs, as HF datasets ship them
    check_masks(model, data, SHAREGPT_LOSS, SHAREGPT_TEXT, template, want_format="sharegpt")
    data.write_bytes(b"PAR1 not really")
    with pytest.raises(LlmtuneError, match=r"a.parquet: cannot read as Parquet"):
        read_records(data)


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):

    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    data = tmp_path / "a.parquet"
    data.write_bytes(b"PAR1")
    with pytest.raises(LlmtuneError, match=r"a.parquet: reading Parquet needs pyarrow \(pip install pyarrow"):
        read_records(data)


def test_csv_records(tmp_path, model, template):
    data = tmp_path / "a.csv"
    with data.open("w", newline="") as fh:
        w = csv.DictWriter(fh, ["instruction", "input", "output", "system"])
        w.writeheader()
        w.writerows(ALPACA)
    check_masks(model, data, ALPACA_LOSS, ALPACA_TEXT, template, want_format="alpaca")
    with data.open("w", newline="") as fh:  # a conversation in a JSON cell
        w = csv.writer(fh)
        w.writerow(["id", "conversations"])
        w.writerows([[i, json.dumps(r["conversations"])] for i, r in enumerate(SHAREGPT)])
    check_masks(model, data, SHAREGPT_LOSS, SHAREGPT_TEXT, template, want_format="sharegpt")


def test_folder_of_files(tmp_path, model, template):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "1.jsonl", ALPACA[:1])
    (folder / "2.json").write_text(json.dumps(ALPACA[1:]))
    (folder / "README.md").write_text("not data")
    ds = check_masks(model, folder, ALPACA_LOSS, ALPACA_TEXT, template, want_format="alpaca")

    before = file_sha256(folder)
    write_jsonl(folder / "1.jsonl", ALPACA[:1] * 2)
    assert file_sha256(folder) != before and ds.n_train == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LlmtuneError, match=r"empty: the folder holds no data file"):
        read_records(empty)


@pytest.mark.parametrize("fmt,rows,want", [
    ("alpaca", [{"instruction": "x", "output": "y"}], "alpaca"),
    ("sharegpt", SHAREGPT, "sharegpt"),
    ("chat", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}], "chat"),
    ("completion", [{"prompt": "a", "completion": "b"}], "completion"),
    ("text", [{"text": "a"}], "text"),
])
def test_format_flag_names_each_format(tmp_path, fmt, rows, want):
    assert read_records(write_jsonl(tmp_path / "d.jsonl", rows), fmt).format == want


@pytest.mark.parametrize("record,message", [
    ({"instruction": "x"}, 'record has no "output" field'),
    ({"instruction": "x", "output": 3}, '"output" must be a string'),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "message 1: unknown role 'robot' (use human, gpt, system"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "the conversation has no assistant turn"),
])
def test_bad_records(tmp_path, record, message):
    fmt = "alpaca" if "instruction" in record else "sharegpt"
    data = write_jsonl(tmp_path / "d.jsonl", [record])
    with pytest.raises(LlmtuneError) as exc:
        read_records(data, fmt)
    assert str(exc.value).startswith(f"{data}:1: {message}"), str(exc.value)


def test_unknown_record_shape_is_one_line(tmp_path, stories_path, monkeypatch, capsys):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"question": "q", "answer": "a"}]))
    out_path = tmp_path / "o.gguf"
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", out_path)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {data}: record 1: unknown record shape (keys: question, answer); "
                          "accepted: text "), err
    for fmt in ("completion", "chat", "sharegpt", "alpaca"):
        assert f"{fmt} {{" in err
    assert not out_path.exists() and list(tmp_path.iterdir()) == [data]
    (tmp_path / "d.csv").write_text("q,a\n1,2\n")
    with pytest.raises(LlmtuneError, match=r"d.csv: row 1: unknown record shape \(keys: q, a\)"):
        read_records(tmp_path / "d.csv")


# ------------------------------------------------------------------------------ compressed, BOM, misnamed
BOM = b"\xef\xbb\xbf"
CHAT = [{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}] * 3


def data_bytes(suffix: str, rows: list) -> bytes:
    """`rows` as the bytes of a .jsonl, .json, .csv (keys of the first row as header) or .txt file."""
    if suffix == ".jsonl":
        return "".join(json.dumps(r) + "\n" for r in rows).encode()
    if suffix == ".json":
        return json.dumps(rows).encode()
    if suffix == ".csv":
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue().encode()
    return "".join(r["text"] + "\n" for r in rows).encode()


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".txt"])
@pytest.mark.parametrize("bom", [False, True])
@pytest.mark.parametrize("gz", [False, True])
def test_compressed_and_bom_files_read_by_their_inner_suffix(tmp_path, suffix, bom, gz):
    """chat.jsonl.gz is JSONL (its inner suffix), never its JSON as plain text; a UTF-8 byte-order
    mark (Excel's "CSV UTF-8", Notepad) is dropped in every format, never a key's first character,
    a JSON decode error or tokens."""
    rows = [{"instruction": "Name a color.", "output": "Red."}, {"instruction": "Add.", "output": "Five."}]
    if suffix == ".txt":
        rows = [{"text": "One story."}, {"text": "Another one."}]
    data = (BOM if bom else b"") + data_bytes(suffix, rows)
    path = tmp_path / f"d{suffix}{'.gz' if gz else ''}"
    path.write_bytes(gzip.compress(data) if gz else data)
    records = read_records(path)
    if suffix == ".txt":
        assert records.format == "plain" and records.items == ["One story.\nAnother one.\n"]
    else:
        assert records.format == "alpaca"
        assert records.items == [(None, "Name a color.", None, "Red."), (None, "Add.", None, "Five.")]


def test_compressed_parquet_and_folders_of_compressed_files(tmp_path):
    """A .parquet.gz is Parquet (a byte-order mark does not apply: Parquet is binary, and a BOM
    inside a string cell is that cell's text); a folder takes .jsonl.gz files as JSONL."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "1.jsonl.gz").write_bytes(gzip.compress(data_bytes(".jsonl", ALPACA[:1])))
    (folder / "2.json").write_text(json.dumps(ALPACA[1:]))
    (folder / "notes.gz").write_bytes(gzip.compress(b"not data"))
    assert read_records(folder).wheres == [f"{folder / '1.jsonl.gz'}:1", f"{folder / '2.json'}: record 1"]
    with pytest.raises(LlmtuneError, match=r"--format plain: .*1.jsonl.gz is a .jsonl file of records"):
        read_records(folder / "1.jsonl.gz", "plain")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # noqa: PLC0415 - optional, probed where used

    plain = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ALPACA), plain)
    packed = tmp_path / "a.parquet.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_records(packed).items == read_records(plain).items and read_records(packed).format == "alpaca"


@pytest.mark.parametrize("name,content,words", [
    ("chat.txt", "".join(json.dumps(r) + "\n" for r in CHAT),
     "chat.txt: 3 of its first 3 lines are JSON records (chat), but a .txt file trains as plain text; to train the "
     "records name it .jsonl or add --format chat"),
    ("chat", json.dumps(CHAT, indent=1),
     "chat: it is a JSON array of records, but a file without a data suffix trains as plain text; to train the "
     "records name it .json"),
])
def test_json_records_in_plain_text_warn_once(tmp_path, stories_path, monkeypatch, capsys, name, content, words):
    data = tmp_path / name
    data.write_text(content)
    with pytest.warns(LlmtuneWarning) as caught:
        assert read_records(data).format == "plain"
    assert len(caught) == 1 and str(caught[0].message).startswith(f"{data}: " + words.split(": ", 1)[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_records(data, "plain").format == "plain"  # asked for: no warning
        (tmp_path / "story.txt").write_text('Once upon a time.\n{"a": 1}\nThe end.\n')
        assert read_records(tmp_path / "story.txt").format == "plain"  # one JSON line is not records
    # the CLI: one warning line, then the run goes on as plain text (stopped here: too short for --ctx 1024)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                           "--ctx", "1024")
    assert code == 2 and "shorter than one training window" in err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: {data}: " + words.split(": ", 1)[1] + " (--format plain: the text, without this warning)"], err


def test_a_record_format_on_plain_text_names_format_plain(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("Once upon a time.\n")
    with pytest.raises(LlmtuneError) as exc:
        read_records(data, "text")
    assert str(exc.value) == (f"{data}:1: invalid JSON (expecting value at column 1); --format text reads JSON "
                              "records, one per line: plain text is --format plain (or auto)")
