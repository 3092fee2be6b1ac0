"""--lr-schedule linear / cosine against transformers itself: llmtune's LRSchedule and
transformers' get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup /
get_cosine_with_min_lr_schedule_with_warmup (driving a torch optimizer, stepped once per optimizer
step as the HF Trainer does) give the same learning rate at every step.

    python bench/check_schedules.py        # needs torch and transformers (bench-only)

Prints the largest difference per case; exits 1 when one is above 1e-7 x lr.
"""

from __future__ import annotations

import sys

import torch
from transformers import (
    get_cosine_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from llmtune.train.optim import LRSchedule

LR = 3e-4
CASES = [(0, 1), (0, 50), (5, 50), (10, 200), (50, 50), (60, 30)]  # (warmup, total steps)


def hf_rates(make, total: int, **kwargs) -> list[float]:
    """The lr each optimizer step of a run of `total` steps trains at (the scheduler stepped after each)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make(opt, num_training_steps=total, **kwargs)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def main() -> int:
    worst = 0.0
    print(f"{'schedule':<18} {'warmup':>6} {'total':>6} {'max |ours - transformers| / lr':>32}")
    for warmup, total in CASES:
        runs = {
            "linear": (get_linear_schedule_with_warmup, {}, {}),
            "cosine": (get_cosine_schedule_with_warmup, {}, {}),
            "cosine lr_min": (get_cosine_with_min_lr_schedule_with_warmup, {"min_lr": LR / 10}, {"lr_min": LR / 10}),
        }
        for name, (make, hf_kwargs, ours_kwargs) in runs.items():
            theirs = hf_rates(make, total, num_warmup_steps=warmup, **hf_kwargs)
            ours = LRSchedule(LR, warmup=warmup, kind=name.split()[0], total_steps=total, **ours_kwargs)
            diff = max(abs(ours.lr(s / total, s) - r) for s, r in enumerate(theirs)) / LR
            worst = max(worst, diff)
            print(f"{name:<18} {warmup:>6} {total:>6} {diff:>32.3g}")
    print(f"largest difference: {worst:.3g} x lr ({'ok' if worst <= 1e-7 else 'ABOVE 1e-7'})")
    return 0 if worst <= 1e-7 else 1


if __name__ == "__main__":
    sys.exit(main())
