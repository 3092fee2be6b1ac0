"""--eval-every, --early-stop (--min-delta, --select-metric) and --save-best (train/selection.py)
on a run whose validation loss falls, then rises: stories260K overfitting 1.5 KB of WikiText at a
high learning rate (the validation loss falls until step 12 of 30, then rises). The best pass,
the stop and the written weights follow the rule; a resumed run keeps the best step and writes
the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

import llmtune
from cli_helpers import run_cli
from llmtune.errors import LlmtuneError
from llmtune.model.loaded import load_model
from llmtune.train.config import make_config, resume_config
from llmtune.train.events import Evaluation
from llmtune.train.optim import LRSchedule
from llmtune.train.preflight import validation_passes, warn_futile
from llmtune.train.selection import Selection

WINOGRANDE = Path(__file__).parent / "data" / "benchmarks" / "winogrande-10.csv"
# 10 steps an epoch of 2 windows of 64 tokens; validation every 3 steps and at the epoch ends (10, 20)
RUN = dict(ctx=64, batch=128, epochs=3, lr=3e-3, val_split=0.3, eval_every=3)


@pytest.fixture(scope="module")
def rising(tmp_path_factory, wiki100k_path) -> Path:
    path = tmp_path_factory.mktemp("es") / "rising.txt"
    path.write_text(wiki100k_path.read_text(encoding="utf-8")[:1500], encoding="utf-8")
    return path


def records(path, kind) -> list[dict]:
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["type"] == kind]


def weights(path) -> dict:

    return {k: np.asarray(v, np.float32) for k, v in load_model(path).weights.items()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, stories_path, rising):
    """The uninterrupted run: patience 2, the best kept; every checkpoint kept (one at each
    validation pass)."""
    d = tmp_path_factory.mktemp("stopped")
    res = llmtune.finetune(stories_path, rising, d / "o.gguf", metrics=str(d / "m.jsonl"), early_stop=2, save_best=True,
                           checkpoint_every=3, keep_checkpoints=100, **RUN)
    return d, res


def test_early_stop_and_save_best_on_a_rising_validation_loss(stopped):
    d, res = stopped
    val = records(d / "m.jsonl", "validation")
    losses = [r["loss"] for r in val]
    steps = [r["global_step"] for r in val]
    assert set(val[0]) >= {"type", "epoch", "global_step", "loss", "loss_err", "accuracy", "accuracy_err"}
    assert steps == sorted({*range(3, steps[-1] + 1, 3), *range(10, steps[-1] + 1, 10)})  # every 3 steps, epoch ends
    best = int(np.argmin(losses))
    assert 0 < best and losses[-1] > losses[best]  # the validation loss fell, then rose
    # stopped after the 2 passes that did not improve on the best, before 3 epochs x 10 steps
    assert len(val) == best + 1 + 2 and res.stopped_at == steps[-1] < 30
    assert res.best_step == steps[best] and res.best_value == pytest.approx(losses[best])
    sel = records(d / "m.jsonl", "selected")
    assert sel == [{"type": "selected", "metric": "val_loss", "value": losses[best], "global_step": steps[best],
                    "epoch": val[best]["epoch"], "saved": True, "stopped_at": steps[-1]}]
    assert records(d / "m.jsonl", "train_step")[-1]["global_step"] == steps[-1]
    # -o holds the weights of the best step: the checkpoint written at it, tensor by tensor
    with np.load(d / f"o.gguf.ckpt-{steps[best]:06d}.npz") as z:
        flat, meta = z["weights"], json.loads(z["meta"].tobytes())
    out, offset = weights(d / "o.gguf"), 0
    for name in meta["trainable"]:
        n = out[name].size
        assert np.array_equal(out[name].reshape(-1), flat[offset : offset + n]), name
        offset += n
    last = np.load(d / f"o.gguf.ckpt-{steps[-1]:06d}.npz")["weights"]
    assert not np.array_equal(last, flat)  # the last step's weights were not written


@pytest.mark.determinism
def test_a_resumed_run_keeps_the_best_and_writes_the_same_bytes(stopped, stories_path, rising, tmp_path):
    d, res = stopped
    steps = [r["global_step"] for r in records(d / "m.jsonl", "validation")]
    after_best = steps[steps.index(res.best_step) + 1]  # one pass past the best: the patience count is 1 there
    for at in (after_best, steps[-1]):  # mid-run, and the final checkpoint (training over: only the write is left)
        out = tmp_path / f"r{at}.gguf"
        ckpt = out.with_name(f"{out.name}.ckpt-{at:06d}.npz")
        ckpt.write_bytes((d / f"o.gguf.ckpt-{at:06d}.npz").read_bytes())
        meta = json.loads(np.load(ckpt)["meta"].tobytes())
        assert meta["selection"]["best_step"] == res.best_step
        again = llmtune.finetune(stories_path, rising, out, resume=ckpt)
        assert (again.best_step, again.stopped_at) == (res.best_step, res.stopped_at)
        assert out.read_bytes() == (d / "o.gguf").read_bytes()


def test_eval_benchmark_runs_at_the_eval_every_cadence(stories_path, rising, tmp_path):
    """--select-metric benchmark: --eval-benchmark scored at every pass; selection follows it."""
    m = tmp_path / "m.jsonl"
    res = llmtune.finetune(stories_path, rising, tmp_path / "o.gguf", metrics=str(m), eval_benchmark=str(WINOGRANDE),
                           select_metric="benchmark", save_best=True, **{**RUN, "epochs": 1, "eval_every": 4})
    bench = records(m, "benchmark")
    assert [r["global_step"] for r in bench] == [0, 4, 8, 10]  # before training, every 4 steps, the epoch end
    scored = bench[1:]
    best = max(range(len(scored)), key=lambda i: (scored[i]["accuracy"], -i))  # the first of the highest
    assert res.best_step == scored[best]["global_step"] and res.best_value == scored[best]["accuracy"]
    assert res.epochs[0].bench_accuracy == scored[-1]["accuracy"]


def test_min_delta_decides_what_improves():
    sel = Selection("val_loss", min_delta=0.1, patience=2)
    for step, loss in enumerate([3.0, 2.95, 2.5, 2.45, 2.44], start=1):
        sel.update(Evaluation(1, step, val_loss=loss))
    # 2.95 is not 0.1 better than 3.0; 2.5 is; 2.45 and 2.44 are not (counted against 2.5)
    assert (sel.best_step, sel.best_value, sel.since_best, sel.should_stop) == (3, 2.5, 2, True)
    acc = Selection("val_accuracy")
    for step, a in enumerate([0.2, 0.3, 0.25], start=1):
        acc.update(Evaluation(1, step, val_accuracy=a))
    assert (acc.best_step, acc.since_best, acc.should_stop) == (2, 1, False)  # patience 0: never stops


@pytest.mark.parametrize("flags,message", [
    ({"min_delta": 0.1}, "^--min-delta: needs --early-stop or --save-best"),
    ({"select_metric": "val_accuracy"}, "^--select-metric: needs --early-stop or --save-best"),
    ({"save_best": True, "select_metric": "bleu"}, "^--select-metric: unknown metric 'bleu'"),
    ({"save_best": True, "select_metric": "benchmark"}, "^--select-metric benchmark: needs --eval-benchmark"),
    ({"early_stop": -1}, r"^--early-stop: must be >= 0"),
    ({"eval_every": -2}, r"^--eval-every: must be >= 0"),
])
def test_bad_selection_flags_are_one_line(flags, message):
    with pytest.raises(LlmtuneError, match=message):
        make_config(**flags)


def test_no_validation_windows_to_select_on(stories_path, rising, tmp_path):
    with pytest.raises(LlmtuneError, match="^--early-stop: there are no validation windows"):
        llmtune.finetune(stories_path, rising, tmp_path / "o.gguf", **{**RUN, "val_split": 0.0}, early_stop=2)
    with pytest.raises(LlmtuneError, match="^--eval-every: there are no validation windows"):
        llmtune.finetune(stories_path, rising, tmp_path / "o.gguf", **{**RUN, "val_split": 0.0})


def test_an_early_stop_that_can_never_stop_the_run_warns(stories_path, rising, tmp_path, monkeypatch, capsys):
    """One epoch validated once: --early-stop 2 would need 4 passes (the best, 2 without improvement,
    and one left to skip: the last pass ends the run anyway). One line saying so, and an --eval-every
    that gives them."""
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, rising, "-o", tmp_path / "o.gguf",
                           "--ctx", 64, "--batch", 128, "--epochs", 1, "--lr", "3e-3", "--val-split", 0.3,
                           "--early-stop", 2)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "--early-stop" in line]
    assert lines == ["warning: --early-stop 2: can never stop this run: it validates 1 time (at each epoch's end), "
                     "and stopping early takes 4 (the best, 2 without improvement, and one left to skip); "
                     "add --eval-every 2"], err
    for settings, warned in (({"eval_every": 2}, False), ({"eval_every": 4}, True), ({"epochs": 4}, False)):
        warns = []
        cfg = make_config(**{**RUN, "eval_every": 0, "epochs": 1, "early_stop": 2, **settings})
        warn_futile(cfg, LRSchedule(cfg.lr), 10, warns.append)  # 10 steps an epoch
        assert bool(warns) == warned and all("lower --eval-every to 2" in w for w in warns), (settings, warns)
    # the loop's passes: every 3 steps and at the epoch ends of 3 epochs of 10 (step 30 is both)
    assert validation_passes(3, 10, 3) == 12 and validation_passes(1, 10, 0) == 1 and validation_passes(2, 4, 2) == 4


def test_save_best_writes_the_best_adapter(stories_path, rising, tmp_path):
    """LoRA: -o is the adapter of the best pass (its A/B equal the checkpoint written at that step)."""

    out = tmp_path / "a.gguf"
    res = llmtune.finetune(stories_path, rising, out, lora_rank=2, early_stop=2, save_best=True, checkpoint_every=3,
                           keep_checkpoints=100, **{**RUN, "lr": 3e-2})
    assert 0 < res.best_step < res.stopped_at
    with np.load(out.with_name(f"a.gguf.ckpt-{res.best_step:06d}.npz")) as z:
        flat, names = z["weights"], json.loads(z["meta"].tobytes())["trainable"]
    tensors = {t.name: np.asarray(t.data, np.float32).reshape(-1) for t in gguf.GGUFReader(out).tensors}
    written = np.concatenate([tensors[name] for name in names])  # in the trainer's (checkpoint's) order
    assert np.array_equal(written, flat)


def test_resume_keeps_the_benchmark_that_selects():
    """--eval-benchmark may change on resume (it only reports), except when it is the selection
    metric: then a different file would choose the best step by other numbers."""

    saved = {**RUN, "save_best": True, "eval_benchmark": str(WINOGRANDE)}
    other = str(WINOGRANDE.with_name("other.csv"))
    assert resume_config(saved, "ck", eval_benchmark=other).eval_benchmark == other
    with pytest.raises(LlmtuneError, match="^--eval-benchmark: .* differs from"):
        resume_config({**saved, "select_metric": "benchmark"}, "ck", eval_benchmark=other)
