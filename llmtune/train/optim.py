"""Optimizers (state on the backend, fused over one flat buffer) and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtune.errors import LlmtuneError


SCHEDULES = ("constant", "linear", "cosine", "halflife")


@dataclass
class LRSchedule:
    """The learning rate of each optimizer step (0-based `step`, `epoch`: its fractional epoch).

    halflife: llama.cpp's lr_opt: half-life decay from lr0 to lr_min over decay_epochs (then
    lr_min); constant: lr0. Both warm up as llmtune always has: lr x (step + 1) / warmup.
    linear / cosine: transformers' get_linear_schedule_with_warmup and
    get_cosine_schedule_with_warmup (num_cycles 0.5) step for step over total_steps (a run's
    epochs x steps per epoch): warmup lr0 x step / warmup (step 0 trains at 0, as there), then
    a decay that reaches 0 at step total_steps; with lr_min > 0 it reaches lr_min instead
    (lr_min + (lr0 - lr_min) x factor, transformers' get_cosine_with_min_lr_schedule_with_warmup's
    min_lr), so after warmup the rate never falls below lr_min."""

    lr0: float
    lr_min: float = 0.0
    decay_epochs: float = 0.0
    epochs: float = 1.0
    warmup: int = 0
    kind: str = "halflife"
    total_steps: int = 0  # linear / cosine: the steps the decay spans

    def __post_init__(self):
        if not (self.lr0 > 0 and math.isfinite(self.lr0)):
            raise LlmtuneError(f"--lr: must be a positive number, got {self.lr0}")
        if self.lr_min > self.lr0:
            raise LlmtuneError(f"--lr-min: {self.lr_min} is above --lr {self.lr0}")
        if self.kind not in SCHEDULES:
            raise LlmtuneError(f"--lr-schedule: unknown schedule {self.kind!r} (choose {', '.join(SCHEDULES)})")
        self.scale_epoch = 0.0
        if self.kind == "halflife" and 0 < self.lr_min < self.lr0:
            if not (0 < self.decay_epochs < self.epochs):
                self.decay_epochs = self.epochs
            self.scale_epoch = math.log2(self.lr0 / self.lr_min) / self.decay_epochs

    def lr(self, epoch: float, step: int) -> float:
        """epoch: fractional progress (steps done / steps per epoch); step: 0-based optimizer step."""
        if self.kind in ("linear", "cosine"):
            return self._decayed(step)
        if self.kind == "constant" or self.lr_min <= 0:
            r = self.lr0
        elif epoch >= self.decay_epochs:
            r = self.lr_min
        else:
            r = self.lr0 * 0.5 ** (epoch * self.scale_epoch)
        if self.warmup > 0 and step < self.warmup:
            r *= (step + 1) / self.warmup
        return r

    def _decayed(self, step: int) -> float:
        """transformers' linear / cosine lr_lambda at `step`, times lr0 (floored at lr_min after warmup)."""
        if step < self.warmup:
            return self.lr0 * (float(step) / float(max(1, self.warmup)))
        span = float(max(1, self.total_steps - self.warmup))
        if self.kind == "linear":
            factor = max(0.0, float(self.total_steps - step) / span)
        else:
            factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * (float(step - self.warmup) / span))))
        return self.lr_min + (self.lr0 - self.lr_min) * factor


class Optimizer:
    """AdamW (ggml_opt_step_adamw) or SGD over the trainer's flat parameter/gradient buffers."""

    def __init__(self, kind: str, backend, n: int, *, wd: float = 0.0, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8):
        kind = kind.lower()
        if kind not in ("adamw", "sgd"):
            raise LlmtuneError(f"--optimizer: unknown optimizer {kind!r} (choose adamw or sgd)")
        self.kind, self.backend, self.wd = kind, backend, wd
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.t = 0
        self.m = backend.zeros((n,)) if kind == "adamw" else None
        self.v = backend.zeros((n,)) if kind == "adamw" else None

    @property
    def state_bytes(self) -> int:
        return 0 if self.m is None else 2 * self.m.nbytes

    def step(self, w, g, lr: float) -> None:
        self.t += 1
        if self.kind == "adamw":
            self.backend.adamw_step(w, g, self.m, self.v, lr=lr, beta1=self.beta1, beta2=self.beta2,
                                    eps=self.eps, wd=self.wd, t=self.t)
        else:
            self.backend.sgd_step(w, g, lr=lr, wd=self.wd)
