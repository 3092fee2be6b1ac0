"""--lr-schedule (train/optim.py LRSchedule): linear and cosine equal transformers'
get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup step for step (their lr_lambda
formulas re-written below from transformers/optimization.py; bench/check_schedules.py compares
with transformers itself), --lr-min floors them as get_cosine_with_min_lr_schedule_with_warmup's
min_lr does, the default keeps earlier runs' schedules, and a resumed run continues the schedule."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

import llmtune
from cli_helpers import run_cli
from llmtune.errors import LlmtuneError
from llmtune.train.checkpoint import write_checkpoint
from llmtune.train.config import RUN_ONLY, make_config
from llmtune.train.optim import LRSchedule
from llmtune.train.preflight import warn_futile


# ------------------------------------------------------------------ transformers' lr_lambda, re-written
def hf_linear(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def hf_cosine(step: int, warmup: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


CASES = [(0, 1), (0, 37), (5, 37), (10, 100), (37, 37), (50, 20)]  # (warmup, total steps), warmup past the end too


@pytest.mark.parametrize("warmup,total", CASES)
@pytest.mark.parametrize("lr0", [1.0, 3e-4])
def test_linear_and_cosine_equal_transformers_at_every_step(warmup, total, lr0):
    lin = LRSchedule(lr0, warmup=warmup, kind="linear", total_steps=total)
    cos = LRSchedule(lr0, warmup=warmup, kind="cosine", total_steps=total)
    for step in range(total + 3):  # past the end too (transformers clamps at 0)
        assert abs(lin.lr(step / total, step) - lr0 * hf_linear(step, warmup, total)) <= 1e-7 * lr0, step
        assert abs(cos.lr(step / total, step) - lr0 * hf_cosine(step, warmup, total)) <= 1e-7 * lr0, step


@pytest.mark.parametrize("warmup,total", CASES)
def test_lr_min_floors_linear_and_cosine(warmup, total):
    lr0, lr_min = 1e-3, 1e-4
    cos = LRSchedule(lr0, lr_min, warmup=warmup, kind="cosine", total_steps=total)
    lin = LRSchedule(lr0, lr_min, warmup=warmup, kind="linear", total_steps=total)
    for step in range(total + 3):
        # cosine: transformers' get_cosine_with_min_lr_schedule_with_warmup(min_lr=lr_min)
        assert abs(cos.lr(0, step) - lr0 * hf_cosine(step, warmup, total, min_lr_rate=lr_min / lr0)) <= 1e-7 * lr0
        # linear: the same interpolation between lr0 and lr_min
        want = lr0 * hf_linear(step, warmup, total) if step < warmup else (
            lr_min + (lr0 - lr_min) * hf_linear(step, warmup, total))
        assert abs(lin.lr(0, step) - want) <= 1e-7 * lr0
        if step >= warmup:
            assert cos.lr(0, step) >= lr_min and lin.lr(0, step) >= lr_min


def test_constant_and_halflife_keep_their_warmup_and_decay():
    """What runs did before --lr-schedule (llama.cpp's lr_opt; warmup lr x (step + 1) / N)."""
    half = LRSchedule(1e-3, 1e-5, 0, 4, kind="halflife")
    assert [half.lr(e, 10) for e in (0, 2, 4)] == pytest.approx([1e-3, 1e-4, 1e-5])
    const = LRSchedule(1e-3, warmup=4, kind="constant")
    assert [const.lr(0, i) for i in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_default_schedule_is_what_runs_did_before():
    assert make_config().lr_schedule == "constant"
    assert make_config(lr_min=1e-6).lr_schedule == "halflife"
    assert make_config(lr_schedule="cosine", lr_min=1e-6).lr_schedule == "cosine"


@pytest.mark.parametrize("flags,message", [
    ({"lr_schedule": "exp"}, "^--lr-schedule: unknown schedule 'exp'"),
    ({"lr_schedule": "halflife"}, "^--lr-schedule halflife: needs --lr-min"),
    ({"lr_schedule": "constant", "lr_min": 1e-6}, "^--lr-min: the constant schedule does not decay"),
    ({"lr_schedule": "cosine", "decay_epochs": 1.0}, "^--decay-epochs: only --lr-schedule halflife uses it"),
])
def test_bad_schedule_flags_are_one_line(flags, message):
    with pytest.raises(LlmtuneError, match=message):
        make_config(**flags)


def _lrs(path) -> list[tuple[int, float]]:
    return [(r["global_step"], r["lr"]) for r in map(json.loads, path.read_text().splitlines())
            if r["type"] == "train_step"]


@pytest.mark.determinism
def test_a_run_follows_cosine_and_a_resume_continues_it(stories_path, tmp_path, wiki100k_path):
    """Every step's lr in --metrics is transformers' cosine over epochs x steps per epoch; a run
    resumed from a mid-run checkpoint logs the same rates and writes the same bytes."""
    data = tmp_path / "d.txt"
    data.write_text(wiki100k_path.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    run = dict(ctx=64, batch=256, epochs=2, lr=1e-3, lr_schedule="cosine", warmup=3, lr_min=1e-4)
    whole = tmp_path / "whole.gguf"
    llmtune.finetune(stories_path, data, whole, metrics=str(tmp_path / "whole.jsonl"), checkpoint_every=4,
                     keep_checkpoints=20, **run)
    lrs = _lrs(tmp_path / "whole.jsonl")
    total = len(lrs)
    assert 10 <= total <= 40 and [s for s, _ in lrs] == list(range(1, total + 1))
    for step, lr in lrs:  # global_step is 1-based: the rate of 0-based step global_step - 1
        want = 1e-3 * hf_cosine(step - 1, 3, total, min_lr_rate=0.1)
        assert abs(lr - want) <= 1e-7 * 1e-3, step
    ckpt = whole.with_name("whole.gguf.ckpt-000004.npz")  # in epoch 1, just past the warmup
    resumed = tmp_path / "resumed.gguf"
    resumed.with_name("resumed.gguf.ckpt-000004.npz").write_bytes(ckpt.read_bytes())
    llmtune.finetune(stories_path, data, resumed, metrics=str(tmp_path / "resumed.jsonl"),
                     resume=resumed.with_name("resumed.gguf.ckpt-000004.npz"))
    assert _lrs(tmp_path / "resumed.jsonl") == lrs[4:]
    assert resumed.read_bytes() == whole.read_bytes()


@pytest.mark.determinism
def test_a_checkpoint_from_before_these_settings_resumes(stories_path, tmp_path, wiki100k_path):
    """A checkpoint written before --lr-schedule, --eval-every, ... existed (its config and settings
    hash without them, as the earlier llmtune wrote them) resumes, and writes the same bytes."""



    new = ("lr_schedule", "eval_every", "early_stop", "min_delta", "select_metric", "save_best")
    data = tmp_path / "d.txt"
    data.write_text(wiki100k_path.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    run = dict(ctx=64, batch=256, epochs=1, lr=1e-3, lr_min=1e-4)  # the half-life decay of earlier runs
    whole = tmp_path / "whole.gguf"
    llmtune.finetune(stories_path, data, whole, checkpoint_every=3, keep_checkpoints=10, **run)
    with np.load(whole.with_name("whole.gguf.ckpt-000003.npz")) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(z["meta"].tobytes())
    for key in new:
        del meta["config"][key]
    shaping = {k: v for k, v in meta["config"].items() if k not in RUN_ONLY}
    meta["fingerprint"]["settings"] = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()
    del meta["selection"], meta["format"], meta["version"]
    old = tmp_path / "old.gguf"
    write_checkpoint(old.with_name("old.gguf.ckpt-000003.npz"), arrays, meta)
    llmtune.finetune(stories_path, data, old, resume=old.with_name("old.gguf.ckpt-000003.npz"))
    assert old.read_bytes() == whole.read_bytes()


def test_a_warmup_as_long_as_the_run_warns(stories_path, tmp_path, wiki100k_path, monkeypatch, capsys):
    """--warmup past the run's last step: the rate never reaches --lr (it ended at 1e-8 of 1e-5 in
    the run that found it); one line naming the run's steps and a warmup that fits."""
    data = tmp_path / "d.txt"
    data.write_text(wiki100k_path.read_text(encoding="utf-8")[:1500], encoding="utf-8")
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf", "--ctx", 64,
                           "--batch", 128, "--epochs", 1, "--warmup", 1000)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "--warmup" in line]
    assert lines == ["warning: --warmup 1000: the run has 13 optimizer steps (1 x 13 per epoch), so it ends still "
                     "warming up, at a learning rate of 1.3e-07 (--lr 1e-05); try --warmup 1 (about a tenth of the "
                     "run)"], err
    for warmup, warned in ((12, False), (13, True)):  # 13: the constant rate reaches --lr at the last step only
        warns = []
        cfg = make_config(warmup=warmup, epochs=1)
        warn_futile(cfg, LRSchedule(cfg.lr, warmup=warmup, kind="constant"), 13, warns.append)
        assert bool(warns) == warned, (warmup, warns)
