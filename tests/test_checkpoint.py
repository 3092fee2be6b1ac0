"""Long runs that lose nothing (issue 15): checkpoints and exact resume, signals, the divergence
guard, checks before the first step.

The signal tests run the real CLI in a subprocess whose Trainer.train_step sends the signal to
its own process after a chosen step (DRIVER below): the handlers see a real SIGINT / SIGTERM /
SIGKILL, at a step the test picks (at random for the kill), with no timing races."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT

import llmtune
import llmtune.convert.init as init
import llmtune.resources as resources
import llmtune.train.metrics as ft
import llmtune.ui.info as info_ui
from cli_helpers import run_cli
from llmtune import cli
from llmtune.errors import Interrupted, LlmtuneError
from llmtune.gguf.file import load_gguf, write_gguf
from llmtune.train import checkpoint as ckpts
from llmtune.train.metrics import LossWatch
from llmtune.train.signals import StopRequest, signals_held
from test_fuzz import STORIES, parse, with_kv

CTX, BATCH, EPOCHS, LR = 16, 32, 2, 1e-3
ARGS = ["-c", CTX, "-b", BATCH, "--epochs", EPOCHS, "--lr", LR, "--seed", 3]
SETTINGS = dict(ctx=CTX, batch=BATCH, epochs=EPOCHS, lr=LR, seed=3)

DRIVER = r"""
import os, signal, sys
from llmtune.train import trainer

plan = {}  # optimizer step -> signals to send to this process right after it
for item in filter(None, os.environ.get("SIGNAL_PLAN", "").split(",")):
    step, name = item.split(":")
    plan.setdefault(int(step), []).append(getattr(signal, name))
train_step = trainer.Trainer.train_step

def signalling_step(self, *args, **kwargs):
    loss = train_step(self, *args, **kwargs)
    for sig in plan.get(self.steps_done, []):
        os.kill(os.getpid(), sig)
    return loss

trainer.Trainer.train_step = signalling_step
from llmtune.cli import main
main()
"""


def run_driver(*args, plan: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`llmtune ARGS` in a fresh process that signals itself per `plan` ("STEP:SIGNAME,...")."""
    env = {**os.environ, "SIGNAL_PLAN": plan, "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-c", DRIVER, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def text(tmp_path_factory, wiki100k_path) -> Path:
    """~56 optimizer steps per epoch at ctx 16, batch 32: a whole run takes seconds."""
    path = tmp_path_factory.mktemp("ckpt") / "text.txt"
    path.write_text(wiki100k_path.read_text(encoding="utf-8")[:1500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stories_path, text) -> dict:
    """Uninterrupted runs (full finetune and LoRA): the bytes every resumed run must reproduce."""
    folder = tmp_path_factory.mktemp("reference")
    full = llmtune.finetune(stories_path, text, folder / "full.gguf", metrics=str(folder / "full.jsonl"), **SETTINGS)
    llmtune.finetune(stories_path, text, folder / "lora.gguf", lora_rank=2, lora_dropout=0.1, **SETTINGS)
    steps = full.n_train_windows // (BATCH // CTX)
    return {"full": sha256(folder / "full.gguf"), "lora": sha256(folder / "lora.gguf"), "steps": steps,
            "metrics": folder / "full.jsonl"}


def metrics_records(path: Path) -> list[dict]:
    """--metrics records without their timings (which differ from run to run)."""
    timing = ("elapsed_s", "tokens_per_s", "seconds", "mfu")
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- resume


@pytest.mark.determinism
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_after_sigkill_is_byte_identical(kind, stories_path, text, reference, tmp_path):
    """SIGKILL at a random step after a checkpoint, then --resume: the same sha256 as a run that
    was never interrupted (the LoRA run with dropout, whose masks follow the step)."""
    steps, every = reference["steps"], 5
    kill_at = random.Random().randrange(every + 1, 2 * steps - 1)  # after the first checkpoint, before the end
    out, metrics = tmp_path / f"{kind}.gguf", tmp_path / "m.jsonl"
    extra = ["--lora-rank", 2, "--lora-dropout", 0.1] if kind == "lora" else ["--metrics", metrics]
    r = run_driver("finetune", stories_path, text, "-o", out, *ARGS, *extra, "--checkpoint-every", every,
                   plan=f"{kill_at}:SIGKILL")
    assert r.returncode == -signal.SIGKILL, (kill_at, r.stderr[-2000:])
    assert not out.exists()
    found = ckpts.checkpoints_of(out)
    assert found and found[-1][0] <= kill_at, (kill_at, found)
    code = run_cli_inprocess("finetune", stories_path, text, "-o", out, "--resume", found[-1][1])
    assert code == 0, kill_at
    assert sha256(out) == reference[kind], f"killed after step {kill_at}, resumed at {found[-1][0]}"
    assert ckpts.checkpoints_of(out) == [] and leftovers(tmp_path) == []  # the finished run tidies up
    if kind == "full":  # the metrics file continues where the checkpoint was: no duplicated records
        assert metrics_records(metrics) == metrics_records(reference["metrics"])


def run_cli_inprocess(*args):
    """The CLI in this process, its output left to pytest's capture: the exit code."""

    saved = sys.argv
    sys.argv = ["llmtune", *map(str, args)]
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        sys.argv = saved
    return code


def test_sigint_finishes_the_step_writes_a_checkpoint_and_says_how_to_resume(stories_path, text, reference, tmp_path):
    out = tmp_path / "run.gguf"
    r = run_driver("finetune", stories_path, text, "-o", out, *ARGS, plan="7:SIGINT")
    assert r.returncode == 130, r.stderr[-2000:]
    ckpt = out.with_name("run.gguf.ckpt-000007.npz")
    assert f"checkpoint written to {ckpt}" in r.stderr
    resume = re.search(r"^resume with: (llmtune finetune .*)$", r.stderr, re.M)
    assert resume and resume.group(1).endswith(f"--resume {ckpt}"), r.stderr[-2000:]
    assert "Ctrl-C (SIGINT): finishing step 7, then writing a checkpoint" in r.stderr and "Traceback" not in r.stderr
    assert ckpt.exists() and not out.exists() and leftovers(tmp_path) == []
    # the printed command, run as printed, finishes the run with the uninterrupted bytes
    code = run_cli_inprocess(*resume.group(1).split()[1:])
    assert code == 0 and sha256(out) == reference["full"]


def test_sigterm_exits_143_with_a_checkpoint(stories_path, text, tmp_path):
    out = tmp_path / "run.gguf"
    r = run_driver("finetune", stories_path, text, "-o", out, *ARGS, plan="4:SIGTERM")
    assert r.returncode == 143, r.stderr[-2000:]
    assert "SIGTERM: stopped after step 4" in r.stderr and "resume with: llmtune finetune" in r.stderr
    assert [p.name for _, p in ckpts.checkpoints_of(out)] == ["run.gguf.ckpt-000004.npz"]
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_second_ctrl_c_aborts_at_once(stories_path, text, tmp_path):
    out = tmp_path / "run.gguf"
    r = run_driver("finetune", stories_path, text, "-o", out, *ARGS, "--checkpoint-every", 3, plan="5:SIGINT,5:SIGINT")
    assert r.returncode == 130, r.stderr[-2000:]
    assert "Ctrl-C (SIGINT) again: aborted at once" in r.stderr and "Traceback" not in r.stderr
    # no checkpoint for step 5: the last one (step 3) is named, with the command that resumes it
    assert [s for s, _ in ckpts.checkpoints_of(out)] == [3]
    assert f"the last checkpoint is {out}.ckpt-000003.npz" in r.stderr and "--resume" in r.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_stop_request_handlers():
    """The first signal only asks; the second raises Interrupted; the old handlers come back."""
    before = signal.getsignal(signal.SIGINT)
    asked = []
    with pytest.raises(Interrupted) as exc:
        with StopRequest(asked.append) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested and asked == [signal.SIGINT]
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
    assert exc.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is before


def test_signals_held_deliver_after_the_block():
    """A signal inside signals_held() waits for the block's end, then reaches the handler installed
    before (here raising Interrupted), which is back in place; none: the block just ends."""
    def raising(signum, frame):
        raise Interrupted(signum, "interrupted")

    before = signal.signal(signal.SIGINT, raising)
    try:
        done = []
        with pytest.raises(Interrupted):
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # where an unheld signal's handler would have run
                    pass
                done.append("whole block")
        assert done == ["whole block"] and signal.getsignal(signal.SIGINT) is raising
        with signals_held():
            done.append("quiet block")
        assert done[-1] == "quiet block"
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_in_other_commands_says_interrupted(stories_path, monkeypatch, capsys):
    """Typer turns KeyboardInterrupt into a silent exit 130; main's handler speaks first."""

    def interrupted(path):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass
        raise AssertionError("not interrupted")

    monkeypatch.setattr(info_ui, "render_info", interrupted)
    code, out, err = run_cli(monkeypatch, capsys, "info", stories_path)
    assert code == 130 and "interrupted by Ctrl-C (SIGINT)" in err


@pytest.mark.determinism
def test_resume_from_the_final_checkpoint_only_writes_the_model(stories_path, text, reference, tmp_path):
    out = tmp_path / "run.gguf"
    llmtune.finetune(stories_path, text, out, keep_checkpoints=1, **SETTINGS)
    (step, last), = ckpts.checkpoints_of(out)  # --keep-checkpoints keeps them after the run
    assert step == 2 * reference["steps"] and ckpts.read_meta(last)["epoch"] == EPOCHS
    out.unlink()
    events = []
    res = llmtune.finetune(stories_path, text, out, resume=last, callback=lambda e: events.append(e.kind))
    assert "step" not in events and sha256(out) == reference["full"]
    assert [e.epoch for e in res.epochs] == [1, 2]  # the finished epochs' results come back


def test_keep_checkpoints(stories_path, text, tmp_path):
    out = tmp_path / "run.gguf"
    seen = []
    llmtune.finetune(stories_path, text, out, checkpoint_every=4, keep_checkpoints=2, epochs=1,
                     callback=lambda e: seen.append(e.step) if e.kind == "checkpoint" else None,
                     **{k: v for k, v in SETTINGS.items() if k != "epochs"})
    steps = [s for s, _ in ckpts.checkpoints_of(out)]
    assert len(seen) > 3 and steps == seen[-2:]
    # a checkpoint holds the trainable buffer, AdamW's moments and the epoch's window order
    z = np.load(ckpts.checkpoint_path(out, steps[-1]))
    n = z["weights"].size
    assert z["adam_m"].shape == z["adam_v"].shape == (n,) and z["order"].dtype == np.int64
    assert ckpts.read_meta(ckpts.checkpoint_path(out, steps[-1]))["config"]["lr"] == LR


def test_resume_refuses_other_inputs_or_settings(stories_path, text, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run.gguf"
    llmtune.finetune(stories_path, text, out, keep_checkpoints=1, **{**SETTINGS, "epochs": 1})
    (_, ckpt), = ckpts.checkpoints_of(out)
    other = tmp_path / "other.txt"
    other.write_text(text.read_text() + " more", encoding="utf-8")
    damaged = tmp_path / "damaged.npz"
    damaged.write_bytes(ckpt.read_bytes()[:5000])
    for args, words in (
        ([text, "--lr", "0.002"], ["--lr: 0.002 differs from the 0.001 checkpoint", str(ckpt)]),
        ([other], ["--resume", str(ckpt), "the data", "differs from the one the checkpoint was trained on"]),
        ([text, "--resume", damaged], [f"--resume {damaged}: not a readable llmtune checkpoint"]),
        ([text, "--resume", text], [f"--resume {text}: is not a .npz file, not a finetune checkpoint (--resume takes "
                                    "a checkpoint: a run writes them beside its -o as OUT.gguf.ckpt-STEP.npz)"]),
        # the model, or the run's own -o, instead of the checkpoint: never numpy's advice to unpickle it
        ([text, "--resume", stories_path], [f"--resume {stories_path}: is a GGUF model file, not a finetune "
                                            "checkpoint (--resume takes a checkpoint: a run writes them beside"]),
        ([text, "--resume", out], [f"--resume {out}: is a GGUF model file, not a finetune checkpoint (--resume takes "
                                   f"a checkpoint: the newest beside this file is {ckpt})"]),
        # a setting the checkpoint's run did not have: no "None" in the words
        ([text, "--lora-rank", "4"], [f"--lora-rank: 4, but checkpoint {ckpt} is a full finetune (--resume "
                                      "continues a run"]),
        ([text, "--pack"], [f"--pack: checkpoint {ckpt} was trained without it (--resume continues"]),
    ):
        resume = [] if "--resume" in map(str, args) else ["--resume", ckpt]
        code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, *args, "-o", tmp_path / "x.gguf", *resume)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        for word in words:
            assert word in " ".join(err.split()), (word, err)
        assert "None" not in err and "pickle" not in err, err
    # settings that do not shape the weights may change
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, text, "-o", tmp_path / "y.gguf",
                           "--resume", ckpt, "--metrics", tmp_path / "new.jsonl", "--backend", "cpu")
    assert code == 0, err


# ---------------------------------------------------------------------------------------------- leftovers


def test_stale_temp_files_are_reported_not_deleted(stories_path, text, tmp_path):
    out = tmp_path / "run.gguf"
    stale = [tmp_path / "run.gguf.k3j2x9.tmp", tmp_path / "run.gguf.ckpt-000040.npz.a8b7c6.tmp"]
    for p in stale:
        p.write_bytes(b"\0" * 1000)
    old = ckpts.checkpoint_path(out, 999)
    old.write_bytes(b"someone's checkpoint")
    warnings = []
    llmtune.finetune(stories_path, text, out,
                     callback=lambda e: warnings.append(e.message) if e.kind == "warning" else None,
                     **{**SETTINGS, "epochs": 1})
    for p in stale:
        assert p.exists() and any(str(p) in w and "interrupted run" in w for w in warnings), warnings
    assert old.exists() and any(f"add --resume {old}" in w for w in warnings)


# ---------------------------------------------------------------------------------------------- divergence


def test_lr_1e3_stops_naming_the_step_and_writes_nothing(stories_path, text, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, text, "-o", out, *ARGS[:-4], "--lr", "1e3",
                           "--checkpoint-every", 1)
    assert code == 3, err
    line = err.strip().splitlines()[-1]
    assert re.match(r"error: training diverged at step (\d+): the loss is ", line), line
    step = int(re.match(r"error: training diverged at step (\d+)", line).group(1))
    assert "no model written" in line and not out.exists()
    kept = ckpts.checkpoints_of(out)  # the last good checkpoint stays, and is named
    assert kept and kept[-1][0] == step - 1 and f"the last good checkpoint is {kept[-1][1]}" in line


def test_nan_weights_stop_at_step_one_naming_the_tensor_and_perplexity_says_so(stories_path, text, tmp_path,
                                                                              monkeypatch, capsys):

    src = load_gguf(stories_path)
    nan_model = tmp_path / "nan.gguf"

    def tensors():
        for name, info in src.tensors.items():
            data = np.array(info.raw)
            if name == "blk.1.ffn_up.weight":
                data.reshape(-1)[5] = np.nan
            yield name, data, info.type

    write_gguf(nan_model, src.arch, src.meta, tensors())
    code, _, err = run_cli(monkeypatch, capsys, "finetune", nan_model, text, "-o", tmp_path / "o.gguf", *ARGS)
    assert code == 3 and "training diverged at step 1: the loss is nan; the gradient of " in err, err
    assert not (tmp_path / "o.gguf").exists()
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", nan_model, text, "--ctx", "16", "--chunks", "2")
    assert code == 2 and "the model's logits are not finite (NaN or inf) in chunk 1" in err, err
    assert len(err.strip().splitlines()) == 1


def test_huge_finite_logits_give_an_infinite_perplexity(stories_path, text, tmp_path, monkeypatch, capsys):
    """A diverged model's mean nll can be past exp's range: ppl inf, not OverflowError."""

    src = load_gguf(stories_path)
    big = tmp_path / "big.gguf"
    write_gguf(big, src.arch, src.meta, ((n, np.array(i.raw) * (1e4 if n == "output.weight" else 1), i.type)
                                         for n, i in src.tensors.items()))
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", big, text, "--ctx", "16", "--chunks", "2")
    assert code == 0 and "Final estimate: PPL = inf" in out, (out, err)


def test_loss_spike_warns():

    watch = LossWatch()
    messages = [watch.check(x) for x in [2.0, 2.1, 1.9, 2.0, 2.05, 2.0, 9.0, 9.5, 2.0, 30.0]]
    assert [i for i, m in enumerate(messages) if m] == [6, 9]
    assert "9.0000 is 4.5 x its running average 2.0083" in messages[6]


# ---------------------------------------------------------------------------------------------- checks before work


def test_disk_space_is_checked_before_the_first_step(stories_path, text, tmp_path, monkeypatch):

    monkeypatch.setattr(resources, "free_disk", lambda folder: 10_000)
    events = []
    with pytest.raises(LlmtuneError, match=r"the output \(1\.1 MiB\) and 2 checkpoints .* MiB is free"):
        llmtune.finetune(stories_path, text, tmp_path / "o.gguf", callback=lambda e: events.append(e.kind), **SETTINGS)
    assert "step" not in events and not (tmp_path / "o.gguf").exists()


def test_a_failing_metrics_file_never_costs_the_model(stories_path, text, tmp_path, monkeypatch):


    class Full:
        def __init__(self):
            self.n = 0

        def write(self, s):
            self.n += 1
            if self.n > 3:
                raise OSError(28, "No space left on device")

        def writelines(self, lines):
            pass

        def flush(self):
            pass

        def close(self):
            raise OSError(28, "No space left on device")

    real_open = builtins.open
    monkeypatch.setattr(ft, "open", lambda p, *a, **k: Full() if str(p).endswith("m.jsonl") else real_open(p, *a, **k),
                        raising=False)
    warnings = []
    out = tmp_path / "o.gguf"
    llmtune.finetune(stories_path, text, out, metrics=str(tmp_path / "m.jsonl"), **{**SETTINGS, "epochs": 1},
                     callback=lambda e: warnings.append(e.message) if e.kind == "warning" else None)
    assert out.exists()
    assert len(warnings) == 1 and "--metrics" in warnings[0] and "No space left on device" in warnings[0]


@pytest.mark.parametrize("flag", ["--metrics", "-o"])
def test_outputs_that_are_inputs_name_their_flag(flag, stories_path, text, tmp_path, monkeypatch, capsys):
    args = {"-o": tmp_path / "o.gguf", "--metrics": tmp_path / "m.jsonl"}
    args[flag] = stories_path
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, text, *ARGS,
                           *(x for kv in args.items() for x in kv))
    assert code == 2 and f"choose another {flag} path" in err, err


def test_metrics_equal_to_output_and_unwritable_folders(stories_path, text, tmp_path, monkeypatch, capsys):
    same = tmp_path / "o.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, text, "-o", same, "--metrics", same, *ARGS)
    assert code == 2 and "--metrics" in err and "is the -o file too" in err

    def no_temp(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(resources.tempfile, "mkstemp", no_temp)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, text, "-o", tmp_path / "x.gguf", *ARGS)
    assert code == 2 and f"-o {tmp_path / 'x.gguf'}: cannot write in {tmp_path} (Permission denied)" in err


def test_json_dir_names_json(stories_path, text, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, text, "--ctx", "16", "--json", tmp_path)
    assert code == 2 and "give a file name with --json" in err and not re.search(r"\s-o\b", err)


def test_ctx_beyond_the_training_context_warns(stories_path, text, tmp_path, monkeypatch, capsys):


    short = tmp_path / "short.gguf"
    short.write_bytes(with_kv(parse(STORIES.read_bytes()), "llama.context_length", VT.UINT32, 8))
    warnings = []
    llmtune.finetune(short, text, tmp_path / "o.gguf",
                     callback=lambda e: warnings.append(e.message) if e.kind == "warning" else None,
                     **{**SETTINGS, "epochs": 1})
    assert any("--ctx 16 is more than the 8 tokens" in w for w in warnings), warnings
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", short, text, "--ctx", "16", "--chunks", "1")
    assert code == 0 and re.search(r"^warning: --ctx 16 is more than the 8 tokens .*short\.gguf was trained on", err,
                                   re.M), err


def test_init_refuses_a_model_that_does_not_fit(tmp_path, monkeypatch, capsys):
    """init streams: it needs memory for the header and one piece of a tensor, not the model."""

    monkeypatch.setattr(init, "available_memory", lambda: 10 * 2**20)
    vocab = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "init", "--config", "configs/llama-15m.toml", "--vocab-from", vocab,
                           "-o", tmp_path / "n.gguf")
    assert code == 2 and re.search(r"24,407,712 parameters needs about 1\d MiB of memory \(the header and 14,563 "
                                   r"rows of token_embd.weight\) but only 10 MiB is available", err), err
    assert not (tmp_path / "n.gguf").exists()


def test_finetune_toml_values_of_the_wrong_type(stories_path, text, tmp_path):
    cfg = tmp_path / "run.toml"
    for line, words in (('ctx = "64"', "ctx = '64' should be an integer"),
                        ("lr = true", "lr = True should be a number"),
                        ("no-shuffle = 1", "no-shuffle = 1 should be true or false")):
        cfg.write_text(line + "\n")
        with pytest.raises(LlmtuneError, match="^" + re.escape(f"{cfg}: {words}") + "$"):
            llmtune.finetune(stories_path, text, tmp_path / "o.gguf", config_file=cfg)
