"""CLI polish (issue 15): --version, one meaning per short flag, unwrapped output when piped,
errors that name the flag that is wrong, and the loader cases the issue lists that are not the
fuzzer's (tests/test_fuzz.py, tests/test_loader_hardening.py)."""

from __future__ import annotations

import io
import os
import re
import stat

import pytest
import typer
from gguf import GGUFValueType as VT
from rich.table import Table

from cli_helpers import run_cli
from llmtune import __version__, cli
from llmtune.ui.console import NoWrapConsole
from test_fuzz import STORIES, parse, with_kv


def test_version(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"llmtune {__version__}"


def test_a_short_flag_means_one_thing_in_every_command():
    """-c is --ctx, -b --batch, -o --output... wherever they appear (llama.cpp's meanings);
    init's old `-c FILE` (for --config) still works, hidden, with a warning."""
    group = typer.main.get_command(cli.app)
    meaning: dict[str, set] = {}
    for name, command in group.commands.items():
        for param in command.params:
            if getattr(param, "param_type_name", "") != "option" or param.hidden:
                continue
            longs = [o for o in param.opts if o.startswith("--")]
            for short in (o for o in param.opts + param.secondary_opts if re.fullmatch(r"-[A-Za-z]", o)):
                meaning.setdefault(short, set()).add(longs[0] if longs else f"{name}:{param.name}")
    clashes = {short: longs for short, longs in meaning.items() if len(longs) > 1}
    assert not clashes, clashes
    assert meaning["-c"] == {"--ctx"} and meaning["-b"] == {"--batch"} and meaning["-o"] == {"--output"}


def test_init_keeps_its_old_short_config_flag(tmp_path, monkeypatch, capsys):
    vocab = STORIES.parent / "vocab" / "ggml-vocab-llama-spm.gguf"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[model]\nn_embd = 16\nn_layer = 1\nn_head = 2\nn_ff = 32\nn_ctx = 32\n")
    code, out, err = run_cli(monkeypatch, capsys, "init", "-c", cfg, "--vocab-from", vocab, "-o", tmp_path / "a.gguf")
    assert code == 0 and "init's -c is deprecated" in err and (tmp_path / "a.gguf").exists()
    code, out, err = run_cli(monkeypatch, capsys, "init", "--vocab-from", vocab, "-o", tmp_path / "b.gguf")
    assert code == 2 and err.startswith("error: --config: missing")


def test_piped_output_does_not_wrap():
    console = NoWrapConsole(file=io.StringIO())  # not a terminal
    path = "/a/rather/long/folder/name/that/goes/on/" * 5 + "model.gguf"
    table = Table()
    table.add_column("path")
    table.add_column("size", justify="right")
    table.add_row(path, "1,234.5 MiB")
    console.print(table)
    console.print(f"wrote {path} (1.1 MiB) " * 3)
    lines = console.file.getvalue().splitlines()
    assert any(path in line and "1,234.5 MiB" in line for line in lines)
    assert lines[-1].strip() == f"wrote {path} (1.1 MiB) " * 2 + f"wrote {path} (1.1 MiB)"
    assert NoWrapConsole(file=io.StringIO(), width=60).width == 60  # an explicit width still wins


def test_info_piped_keeps_each_row_on_one_line(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "info", STORIES)
    assert code == 0
    assert re.search(r"^\s*n_ctx_train\s+2048\s+llama\.context_length\s*$", out, re.M), out


def test_context_length_stored_as_a_float_is_refused(tmp_path, monkeypatch, capsys):
    """Even a whole number: llama.cpp's get_key refuses a float for an integer key."""
    path = tmp_path / "f.gguf"
    path.write_bytes(with_kv(parse(STORIES.read_bytes()), "llama.context_length", VT.FLOAT32, 128.0))
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat. " * 20)
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", path, text, "--ctx", "16", "--chunks", "1")
    assert code == 2 and err.strip() == f"error: {path}: metadata key llama.context_length is not an integer (128.0)"


# ------------------------------------------------------------------------------ issue 43: outputs
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_json_results_get_the_mode_of_every_output(tmp_path, monkeypatch, capsys, umask):
    """perplexity --json and eval --json are written as every output is (0666 less the umask), not
    mkstemp's 0600."""
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat. " * 20)
    tasks = tmp_path / "mc.jsonl"
    tasks.write_text('{"question": "Q?", "choices": ["yes", "no"], "answer": 0}\n' * 2)
    old = os.umask(umask)
    try:
        runs = (["perplexity", STORIES, text, "--ctx", "16", "--chunks", "1", "--json", tmp_path / "p.json"],
                ["eval", STORIES, tasks, "--ctx", "64", "--json", tmp_path / "e.json"])
        for args in runs:
            code, _, err = run_cli(monkeypatch, capsys, *args)
            assert code == 0, err
    finally:
        os.umask(old)
    for name in ("p.json", "e.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


VOCAB = STORIES.parent / "vocab" / "ggml-vocab-llama-spm.gguf"


def test_o_replaces_a_gguf_but_never_a_data_file_without_force(tmp_path, monkeypatch, capsys):
    """A mistyped -o (a user's data file) is refused in one line, the file untouched; an earlier
    GGUF output is replaced as before; --force replaces anything; an empty file is nothing to lose."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[model]\nn_embd = 16\nn_layer = 1\nn_head = 2\nn_ff = 32\nn_ctx = 32\n")
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat. " * 40)
    commands = {"export": ["export", STORIES, "--type", "f16"],
                "init": ["init", "--config", cfg, "--vocab-from", VOCAB],
                "finetune": ["finetune", STORIES, text, "--ctx", "32", "--epochs", "1"]}
    for name, args in commands.items():
        data = tmp_path / f"{name}-notes.jsonl"
        data.write_text('{"text": "my only copy"}\n')
        code, out, err = run_cli(monkeypatch, capsys, *args, "-o", data)
        assert code == 2 and err.strip() == (f"error: {data}: exists and is not a GGUF; refusing to overwrite it "
                                             "(choose another -o path, or add --force to replace it)"), (name, err)
        assert data.read_text() == '{"text": "my only copy"}\n' and not list(tmp_path.glob("*.ckpt-*"))
        code, _, err = run_cli(monkeypatch, capsys, *args, "-o", data, "--force")
        assert code == 0 and data.read_bytes()[:4] == b"GGUF", (name, err)
        code, _, err = run_cli(monkeypatch, capsys, *args, "-o", data)  # now a GGUF: replaced without --force
        assert code == 0, (name, err)
        empty = tmp_path / f"{name}-empty"
        empty.touch()
        assert run_cli(monkeypatch, capsys, *args, "-o", empty)[0] == 0 and empty.read_bytes()[:4] == b"GGUF"
