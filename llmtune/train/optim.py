"""Optimizers (state on the backend, fused over one flat buffer) and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtune.errors import LlmtuneError


@dataclass
class LRSchedule:
    """llama.cpp's lr_opt: half-life decay from lr0 to lr_min over decay_epochs (then lr_min),
    constant when lr_min <= 0; plus linear warmup over the first `warmup` steps."""

    lr0: float
    lr_min: float = 0.0
    decay_epochs: float = 0.0
    epochs: float = 1.0
    warmup: int = 0

    def __post_init__(self):
        if not (self.lr0 > 0 and math.isfinite(self.lr0)):
            raise LlmtuneError(f"--lr: must be a positive number, got {self.lr0}")
        if self.lr_min > self.lr0:
            raise LlmtuneError(f"--lr-min: {self.lr_min} is above --lr {self.lr0}")
        self.scale_epoch = 0.0
        if 0 < self.lr_min < self.lr0:
            if not (0 < self.decay_epochs < self.epochs):
                self.decay_epochs = self.epochs
            self.scale_epoch = math.log2(self.lr0 / self.lr_min) / self.decay_epochs

    def lr(self, epoch: float, step: int) -> float:
        """epoch: fractional progress (steps done / steps per epoch); step: 0-based optimizer step."""
        if self.lr_min <= 0:
            r = self.lr0
        elif epoch >= self.decay_epochs:
            r = self.lr_min
        else:
            r = self.lr0 * 0.5 ** (epoch * self.scale_epoch)
        if self.warmup > 0 and step < self.warmup:
            r *= (step + 1) / self.warmup
        return r


class Optimizer:
    """AdamW (ggml_opt_step_adamw) or SGD over the trainer's flat parameter/gradient buffers."""

    def __init__(self, kind: str, backend, n: int, *, wd: float = 0.0, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, groups=None):
        """groups: (start, stop, lr factor) runs of the flat buffers, torch's parameter groups
        (LoRA+); default one group of factor 1."""
        kind = kind.lower()
        if kind not in ("adamw", "sgd"):
            raise LlmtuneError(f"--optimizer: unknown optimizer {kind!r} (choose adamw or sgd)")
        self.kind, self.backend, self.wd = kind, backend, wd
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.t = 0
        self.groups = list(groups) if groups else [(0, n, 1.0)]
        self.m = backend.zeros((n,)) if kind == "adamw" else None
        self.v = backend.zeros((n,)) if kind == "adamw" else None

    @property
    def state_bytes(self) -> int:
        return 0 if self.m is None else 2 * self.m.nbytes

    def step(self, w, g, lr: float) -> None:
        self.t += 1
        for start, stop, factor in self.groups:
            part = slice(start, stop)
            if self.kind == "adamw":
                self.backend.adamw_step(w[part], g[part], self.m[part], self.v[part], lr=lr * factor, beta1=self.beta1,
                                        beta2=self.beta2, eps=self.eps, wd=self.wd, t=self.t)
            else:
                self.backend.sgd_step(w[part], g[part], lr=lr * factor, wd=self.wd)
