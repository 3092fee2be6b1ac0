"""The README's promises about the command line (issue 26), each run the way a user meets it:
refusal of a run that does not fit, a closed pipe, streaming output and Ctrl-C, one-line flag
errors with the closest real flag, unwrapped piped output, literal help, consistent wording."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from rich.console import Console
from rich.text import Text

import llmtune
from cli_helpers import run_cli
from llmtune import cli
from llmtune.errors import Interrupted, plural
from llmtune.eval import perplexity as ppl
from llmtune.eval.perplexity import PerplexityProgress, PerplexityResult
from llmtune.resources import prefer_small_pages
from llmtune.train.events import EpochEnd, EpochResult, Step
from llmtune.ui.console import NoWrapConsole
from llmtune.ui.finetune import FinetuneReporter
from llmtune.ui.format import percent
from llmtune.ui.perplexity import perplexity_progress
from llmtune.ui.usage import closest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
WIKI = REPO / "data" / "wikitext-100k.txt"
MMLU = DATA / "benchmarks" / "mmlu-20.jsonl"


def _one_line_error(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture()
def small_text(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(WIKI.read_text()[:20000])
    return path


def _llmtune(*args, **popen):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    env.pop("LLMTUNE_MEMORY_LIMIT", None)
    env.update(popen.pop("env", {}))
    return subprocess.Popen([sys.executable, "-m", "llmtune.cli", *map(str, args)], env=env, **popen)


# ------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("command", ["perplexity", "eval"])
def test_a_run_that_does_not_fit_is_refused_before_allocating(command, small_text, monkeypatch, capsys):
    monkeypatch.setenv("LLMTUNE_MEMORY_LIMIT", "300K")
    args = [STORIES, small_text, "--ctx", "64"] if command == "perplexity" else [STORIES, MMLU, "--ctx", "256"]
    code, out, err = run_cli(monkeypatch, capsys, command, *args)
    _one_line_error(code, err, str(STORIES), "needs about", "MiB of memory", "only 0.3 MiB is available",
                    "(lower --batch or --ctx)")
    assert out == ""
    monkeypatch.setenv("LLMTUNE_MEMORY_LIMIT", "lots")
    _one_line_error(*run_cli(monkeypatch, capsys, command, *args)[::2], "LLMTUNE_MEMORY_LIMIT=lots: not a size")


def test_an_allocation_that_fails_anyway_is_one_line(small_text, monkeypatch, capsys):
    """numpy's (or cupy's) MemoryError from any command: the same one line, exit 2, no traceback."""


    def no_memory(*args, **kwargs):
        np.empty((2**40, 2**20), dtype=np.float32)  # numpy's own _ArrayMemoryError (4 EiB)

    monkeypatch.setattr(ppl, "_accumulate", no_memory)
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", STORIES, small_text, "--ctx", "64")
    _one_line_error(code, err, "llmtune perplexity: could not allocate", "MiB is available", "(lower --batch or --ctx)")


# ------------------------------------------------------------------------------ closed pipes
def _closed_pipe_run(tmp_path, *args):
    """Run with both streams on pipes, read one byte of output, close them: the command must
    finish its work (exit 0) with nothing said about the pipe."""
    proc = _llmtune(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    first = proc.stdout.read(1)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0
    return first


@pytest.mark.parametrize("command", ["info", "tokenize", "perplexity", "eval", "generate", "export", "init"])
def test_a_closed_pipe_stops_the_output_not_the_work(command, tmp_path, small_text):
    out = tmp_path / "out"
    args = {
        "info": ["info", STORIES],
        "tokenize": ["tokenize", STORIES, WIKI],
        "perplexity": ["perplexity", STORIES, WIKI, "--ctx", "64", "--batch", "64", "--chunks", "40",
                       "--json", out / "p.json"],
        "eval": ["eval", STORIES, MMLU, "--ctx", "256", "--json", out / "e.json"],
        "generate": ["generate", STORIES, "-p", "Once upon a time", "-n", "200", "--temp", "0"],
        "export": ["export", STORIES, "--type", "q8_0", "-o", out / "e.gguf"],
        "init": ["init", "--config", DATA.parent.parent / "configs" / "llama-15m.toml",
                 "--vocab-from", DATA / "vocab" / "ggml-vocab-llama-spm.gguf", "-o", out / "i.gguf"],
    }[command]
    out.mkdir()
    assert _closed_pipe_run(tmp_path, *args)
    written = {"perplexity": "p.json", "eval": "e.json", "export": "e.gguf", "init": "i.gguf"}.get(command)
    if written:
        assert (out / written).stat().st_size > 0


def test_a_closed_pipe_with_head(tmp_path):
    """The issue's own reproduction: `llmtune ... 2>&1 | head -2` exits 0 and writes its file."""
    cmd = (f"{sys.executable} -m llmtune.cli perplexity {STORIES} {WIKI} --ctx 64 --batch 64 --chunks 60 "
           f"--json {tmp_path / 'p.json'} 2>&1 | head -c 20; exit ${{PIPESTATUS[0]}}")
    res = subprocess.run(["bash", "-c", cmd], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("[1]"), res
    assert json.loads((tmp_path / "p.json").read_text())["partial"] is False


# ------------------------------------------------------------------------------ streaming and Ctrl-C
def _read_until(proc, marker: bytes, timeout: float = 120) -> bytes:
    buf, t0 = b"", time.monotonic()
    while marker not in buf:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk and time.monotonic() - t0 < timeout, buf
        buf += chunk
    return buf


def test_perplexity_streams_and_ctrl_c_keeps_the_chunks_done(tmp_path):
    """Piped, the running values arrive while the run goes on; SIGINT then prints the estimate
    over the chunks done and writes --json for them, marked partial, and exits 130."""
    out_json = tmp_path / "p.json"
    proc = _llmtune("perplexity", STORIES, WIKI, "--ctx", "64", "--batch", "64", "--json", out_json,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    streamed = _read_until(proc, b"[2]")
    assert proc.poll() is None  # still running: ~1000 chunks to go
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    out = (streamed + rest).decode()
    assert proc.returncode == 130, err
    done = len(re.findall(r"\[\d+\]", out.splitlines()[0]))
    assert f"Estimate over the {done} of 986 chunks done (interrupted): PPL = " in out
    assert err.decode().strip().endswith("interrupted by Ctrl-C (SIGINT)")
    data = json.loads(out_json.read_text())
    assert data["partial"] is True and len(data["chunks"]) == done and data["n_chunks_planned"] == 986


def test_eval_streams_each_task_and_ctrl_c_keeps_the_tasks_done(tmp_path):
    out_json = tmp_path / "e.json"
    tasks = tmp_path / "many.jsonl"
    tasks.write_text(MMLU.read_text() * 30)  # 600 tasks
    proc = _llmtune("eval", STORIES, tasks, "--ctx", "256", "--batch", "256", "--json", out_json,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    streamed = _read_until(proc, b"\n2\t")
    assert proc.poll() is None and streamed.startswith(b"task\tacc_norm\n1\t")
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    data = json.loads(out_json.read_text())
    assert data["partial"] is True and 2 <= data["n_tasks"] < 600 and data["n_tasks_planned"] == 600
    assert f"the {data['n_tasks']} of 600 tasks done" in rest.decode()


# ------------------------------------------------------------------------------ flag errors
@pytest.mark.parametrize("args, words", [
    (["finetune", STORIES, WIKI, "-o", "x.gguf", "--learning-rate", "1e-4"], ["--learning-rate", "did you mean --lr?"]),
    (["generate", STORIES, "--n", "5"], ["--n:", "did you mean --n-predict?"]),
    (["finetune", STORIES, WIKI, "--epoch", "2"], ["did you mean --epochs?"]),
    (["generate", STORIES, "-s", "5"], ["-s:", "did you mean --seed?"]),
    (["perplexity", STORIES, WIKI, "--ctx", "many"], ["--ctx:", "'many'"]),
    (["perplexity", STORIES], ["missing the TEXT argument"]),
    (["finetun"], ["finetun: no such command (did you mean finetune?)"]),
])
def test_a_flag_mistake_is_one_line_naming_the_closest_flag(args, words, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, *args)
    _one_line_error(code, err, *words)


def test_no_misleading_suggestion(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", STORIES, "--tokens", "5")
    _one_line_error(code, err, "--tokens: no such option for llmtune generate (llmtune generate --help lists them)")
    assert closest("--n", ["--min-p", "--top-k", "--n-predict", "--repeat-last-n"]) == ["--n-predict"]
    assert closest("--tokens", ["--min-p", "--top-k", "--top-p", "--temp"]) == []


def test_no_stray_lines_when_not_a_terminal(small_text, monkeypatch, capsys):
    """Errors are the one line; a success writes no lone newline on stderr (no progress bar off a terminal)."""
    for command in (["perplexity", STORIES, small_text, "--ctx", "64", "--chunks", "2"],
                    ["eval", STORIES, MMLU, "--ctx", "256", "--tasks", "3"]):
        code, out, err = run_cli(monkeypatch, capsys, *command)
        assert code == 0 and err == "", err
        code, out, err = run_cli(monkeypatch, capsys, *command[:2], small_text.parent / "nope.txt")
        _one_line_error(code, err, "nope.txt: no such file")


# ------------------------------------------------------------------------------ wrapping and help
def test_export_piped_does_not_wrap_or_pad(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "export", STORIES, "--type", "q8_0", "-o", tmp_path / "q.gguf")
    assert code == 0
    assert "* rows do not split into blocks of the wanted type: llama.cpp's fallback type\n" in out
    assert not [line for line in out.splitlines() if line != line.rstrip()]
    code, out, err = run_cli(monkeypatch, capsys, "info", STORIES)
    assert code == 0 and not [line for line in out.splitlines() if line != line.rstrip()]


def _commands():
    return typer.main.get_command(cli.app).commands


def test_help_renders_every_text_literally():
    """No help text loses a [word] to rich markup: what --help renders is what the code says."""
    for name, command in _commands().items():
        texts = [command.help or ""] + [p.help or "" for p in command.params if getattr(p, "help", None)]
        for text in texts:
            assert Text.from_markup(text).plain == text.replace("\\[", "["), (name, text)


def test_help_shows_readable_placeholders(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "init", "--help")
    assert code == 0 and "TOML [model] table" in out
    for name in ["", *_commands()]:  # "": llmtune --help
        code, out, _ = run_cli(monkeypatch, capsys, *([name] if name else []), "--help")
        assert code == 0 and not re.search(r"<(bool|int|float|str|path|list\[\w+\])>|\{[a-z_]+\}", out), (name, out)
    code, out, _ = run_cli(monkeypatch, capsys, "generate", "--help")
    assert re.search(r"--lora\s+FILE", out) and re.search(r"--temp\s+X", out) and re.search(r"--top-k\s+N", out)
    assert re.search(r"--prompt\s+-p\s+TEXT", out) and "MODEL" in out


def test_command_pages_name_every_flag():
    """Each command's synopsis on its page (docs/COMMAND.md) names every flag it has (long or
    short), so the pages cannot drift from --help; and the README stays a summary (≤ 250 lines)."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    pages = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    synopsis = {m.group(1): m.group(0) for m in re.finditer(r"```bash\nllmtune (\w+) .*?```", pages, re.S)}
    assert {"finetune", "generate", "perplexity", "eval", "export"} <= set(synopsis)
    for name, command in _commands().items():
        if name in synopsis:
            missing = [p.opts[0] for p in command.params if getattr(p, "opts", None) and p.opts[0].startswith("-")
                       and not getattr(p, "hidden", False)
                       and not any(re.search(re.escape(o) + r"(?![\w-])", synopsis[name]) for o in p.opts)]
            assert not missing, (name, missing)


def test_shared_options_are_declared_once():
    """--lora, --lora-scale, --backend and --precision read the same in every command."""
    helps: dict[str, set] = {}
    for command in _commands().values():
        for p in command.params:
            for flag in ("--lora", "--lora-scale", "--backend", "--precision"):
                if flag in getattr(p, "opts", ()):
                    helps.setdefault(flag, set()).add(p.help.split(" \\[default")[0])
    assert set(helps) == {"--lora", "--lora-scale", "--backend", "--precision"}
    assert all(len(h) == 1 for h in helps.values()), helps


# ------------------------------------------------------------------------------ consistent wording
def test_plurals():
    assert plural(1, "epoch") == "1 epoch" and plural(2, "token") == "2 tokens"
    assert plural(1, "pass", "passes") == "1 pass"


def test_an_empty_file_reads_the_same_in_perplexity_and_finetune(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    for command in (["perplexity", STORIES, empty], ["finetune", STORIES, empty, "-o", tmp_path / "o.gguf"]):
        _one_line_error(*run_cli(monkeypatch, capsys, *command)[::2], f"error: {empty}: file is empty")


def test_a_cut_jsonl_line_names_line_and_column(tmp_path, monkeypatch, capsys):
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"text": "a whole line"}\n{"text": "a cut li\n')
    code, _, err = run_cli(monkeypatch, capsys, "finetune", STORIES, cut, "-o", tmp_path / "o.gguf")
    _one_line_error(code, err, f"{cut}:2: invalid JSON (unterminated string starting at column 10)")
    tasks = tmp_path / "cut-mc.jsonl"
    tasks.write_text(MMLU.read_text().splitlines()[0] + '\n{"question": "cut\n')
    code, _, err = run_cli(monkeypatch, capsys, "eval", STORIES, tasks)
    _one_line_error(code, err, "line 2: not JSON (unterminated string starting at column 14)")


def test_a_gzipped_gguf_gets_a_gzip_hint(tmp_path, monkeypatch, capsys):
    packed = tmp_path / "model.gguf.gz"
    packed.write_bytes(gzip.compress(STORIES.read_bytes()))
    _one_line_error(*run_cli(monkeypatch, capsys, "info", packed)[::2], "gzip-compressed", "gunzip")


def test_a_short_flag_is_the_same_wherever_its_long_flag_is():
    """`-s` was --seed in generate only: a long flag has the same short ones in every command."""
    shorts: dict[str, set] = {}
    for command in _commands().values():
        for p in command.params:
            opts = [o for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())) if o.startswith("-")]
            longs = [o for o in opts if o.startswith("--")]
            if longs and not getattr(p, "hidden", False):
                shorts.setdefault(longs[0], set()).add(tuple(sorted(o for o in opts if not o.startswith("--"))))
    assert {flag: s for flag, s in shorts.items() if len(s) > 1} == {}


def test_generate_warns_past_the_training_context_and_greedy_has_no_seed(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", STORIES, "-p", "Once upon a time", "-n", "2",
                             "--temp", "0", "-c", "4096")
    assert code == 0 and out.startswith("Once upon a time")
    assert f"warning: --ctx 4096 is more than the 2048 tokens {STORIES} was trained on" in err
    assert "greedy" in err and "seed" not in err and "2 tokens (-n reached)" in err


def test_generate_refuses_a_prompt_longer_than_the_context_before_printing_it(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", STORIES, "-c", "4", "-p", "Once upon a time")
    _one_line_error(code, err, "the prompt has 5 tokens, more than the context of 4")
    assert out == ""


def test_a_batch_mistake_names_only_the_flag_given(small_text, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "finetune", STORIES, small_text, "-o", tmp_path / "o.gguf",
                           "-c", "64", "-b", "100")
    _one_line_error(code, err, "--batch 100: must be a multiple of --ctx 64")
    assert "--ubatch" not in err


def test_tokenize_shows_a_carriage_return_escaped(tmp_path, monkeypatch, capsys):
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"one line\r\ntwo")
    code, out, err = run_cli(monkeypatch, capsys, "tokenize", STORIES, crlf)
    assert code == 0 and "'\\r'" in out and "\r" not in out


def test_benchmark_accuracy_is_a_percentage_everywhere():

    assert percent(0.35) == "35.00 %" and percent(0.35, 0.109424) == "35.00 ± 10.94 %" and percent(None) == "-"


# ------------------------------------------------------------------------------ finetune's own promises
def test_finetune_survives_head(tmp_path):
    """`llmtune finetune ... 2>&1 | head -2` (the issue's reproduction): exit 0, and the model and
    its last checkpoint are written though nobody reads the output any more."""
    out = tmp_path / "pipe.gguf"
    text = tmp_path / "t.txt"
    text.write_text(WIKI.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    cmd = (f"{sys.executable} -m llmtune.cli finetune {STORIES} {text} -c 64 --epochs 1 --lr 1e-3 "
           f"--keep-checkpoints 1 -o {out} 2>&1 | head -2; exit ${{PIPESTATUS[0]}}")
    res = subprocess.run(["bash", "-c", cmd], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 2, res
    assert out.exists() and list(tmp_path.glob("pipe.gguf.ckpt-*.npz"))


def test_finetune_progress_streams_off_a_terminal(small_text, tmp_path, monkeypatch, capsys):
    """With stderr redirected there is no bar, but a line about every tenth of an epoch, each
    before the epoch's result."""
    code, out, err = run_cli(monkeypatch, capsys, "finetune", STORIES, small_text, "-o", tmp_path / "o.gguf",
                             "-c", 32, "--epochs", 1, "--lr", 1e-3)
    assert code == 0, err
    lines = err.splitlines()
    steps = [i for i, line in enumerate(lines) if re.match(r"epoch 1 step \d+/\d+: loss [0-9.]+, acc", line)]
    epoch = next(i for i, line in enumerate(lines) if line.startswith("epoch 1: train loss"))
    total = int(re.search(r"step \d+/(\d+)", lines[steps[0]]).group(1))
    assert 10 <= len(steps) <= 12 and steps[-1] < epoch and lines[steps[-1]].startswith(f"epoch 1 step {total}/{total}")


def _reporter_at(width: int):
    """A FinetuneReporter whose consoles are a terminal of `width` columns (captured)."""


    out = NoWrapConsole(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    err = NoWrapConsole(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    return FinetuneReporter(out, err), out, err


def _epoch(i: int):

    return EpochEnd(EpochResult(i, 2.684712, 0.052143, 0.382144, 0.004102, 2.804401, 0.154503, 0.313804, 0.016802,
                                tokens_per_s=1845.2, seconds=7.71, bench_accuracy=0.35, bench_accuracy_err=0.1094))


def test_finetune_at_80_columns_breaks_between_fields_never_inside(monkeypatch):
    """On an 80-column terminal the bar keeps its step counter, and the epoch line and summary
    break between fields: every number is whole on one line."""

    reporter, out, err = _reporter_at(80)
    numbers = ["2.6847 ± 0.0521", "0.3821 ± 0.0041", "2.8044 ± 0.1545", "0.3138 ± 0.0168", "35.00 ± 10.94 %"]
    with reporter:
        reporter(Step(1, 1234, 3120, 1234, 2.7, 2.68, 0.38, 1e-3, 1845.0))
        reporter(_epoch(1))
        reporter(_epoch(2))
    shown = re.sub(r"\x1b\[\??[0-9;]*[a-zA-Z]", "\n", err.file.getvalue() + out.file.getvalue())  # live redraws
    assert "1234/3120" in shown
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    for text in (err.file.getvalue(), out.file.getvalue()):  # the two epochs: each number twice, whole
        for n in numbers:
            assert text.count(n) == 2, (n, text)
    wide, wide_out, _ = _reporter_at(200)
    with wide:
        wide(_epoch(1))
    assert "┃ epoch" in wide_out.file.getvalue()  # a terminal wide enough keeps the table


def test_finetune_summary_and_elapsed_cover_a_resumed_run(small_text, tmp_path, monkeypatch, capsys):
    """After --resume the summary lists every epoch of the run, and --metrics' elapsed_s goes on
    from where the checkpoint left it instead of starting again at 0."""
    out, metrics = tmp_path / "o.gguf", tmp_path / "m.jsonl"

    llmtune.finetune(STORIES, small_text, out, ctx=32, epochs=2, lr=1e-3, keep_checkpoints=2, metrics=str(metrics))
    first = next(p for p in sorted(tmp_path.glob("o.gguf.ckpt-*.npz")))
    before = [r["elapsed_s"] for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "train_step"]
    code, stdout, err = run_cli(monkeypatch, capsys, "finetune", STORIES, small_text, "-o", out, "--resume", first)
    assert code == 0, err
    assert re.search(r"│\s+1 │", stdout) and re.search(r"│\s+2 │", stdout), stdout
    after = [r["elapsed_s"] for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "train_step"]
    half = len(before) // 2
    assert after[:half] == before[:half] and after[half] >= after[half - 1] > 0
    assert "all epochs done" in err and "all 2 epochs" not in err


def test_a_signal_between_a_pass_and_its_report_still_shows_its_chunks():
    """Interrupted after a pass's sums but before its values streamed: the line gets the values of
    every chunk the partial estimate counts before it closes (no estimate over unseen chunks)."""



    buf = io.StringIO()
    out, err = Console(file=buf, force_terminal=False), Console(file=io.StringIO(), force_terminal=False)
    with pytest.raises(Interrupted):
        with perplexity_progress(err, out) as on_progress:
            on_progress(PerplexityProgress(2, 9, 128, 576, 70.1, 0.1, (98.3865, 70.0978)))
            exc = Interrupted(2)
            exc.partial = PerplexityResult(chunks=[98.3865, 70.0978, 61.2914], ppl=61.29, ppl_err=19.9, n_tokens=192,
                                           tokens_per_s=1.0)
            raise exc
    assert buf.getvalue() == "[1]98.3865,[2]70.0978,[3]61.2914,\n"


def test_commands_take_no_huge_page_advice_unless_asked(monkeypatch):
    """A command turns off numpy's transparent-huge-page advice before any big array (first
    touches of advised memory compact fragmented memory: seconds), unless the user set
    NUMPY_MADVISE_HUGEPAGE, which then decides."""
    from numpy._core.multiarray import _set_madvise_hugepage  # noqa: PLC0415 - optional, probed where used


    previous = _set_madvise_hugepage(True)
    try:
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
        assert prefer_small_pages() and _set_madvise_hugepage(True) is False
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
        assert not prefer_small_pages() and _set_madvise_hugepage(True) is True
    finally:
        _set_madvise_hugepage(previous)
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    probe = ("import sys; from numpy._core.multiarray import _set_madvise_hugepage as hp; from llmtune import cli\n"
             "sys.argv = ['llmtune', '--version']\n"
             "try:\n    cli.main()\nexcept SystemExit:\n    pass\nprint('advice', hp(True))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert done.stdout.strip().splitlines()[-1] == "advice False", done.stdout + done.stderr


def test_the_greedy_promise_names_the_files_it_holds_for():
    """Greedy output equals llama.cpp's token for token on f32/f16 files (tests/test_generate.py's
    recorded llama.cpp continuations); on quantized files the two tools sum in other orders and a
    greedy path can part at a near-tie (issue 43: 3 of 4 chat prompts on SmolLM2 Q4_1), so every
    place that makes the promise states its scope."""
    texts = {"README.md": (REPO / "README.md").read_text(), "docs/generate.md": (REPO / "docs/generate.md").read_text(),
             "generate --help": cli.generate_cmd.__doc__}
    for where, text in texts.items():
        flat = " ".join(text.split())
        for m in re.finditer(r"token for token", flat):
            scope = flat[max(0, m.start() - 120): m.end() + 60]
            assert re.search(r"f32", scope), f"{where}: {scope!r}"
