"""Optimizers (state on the backend, fused over one flat buffer) and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.quant import dynamic8


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


OPTIMIZERS = ("adamw", "adamw8bit", "sgd")


class Optimizer:
    """AdamW (ggml_opt_step_adamw), AdamW with block-wise 8-bit moments (bitsandbytes.optim.AdamW8bit,
    quant/dynamic8.py) or SGD over the trainer's flat parameter/gradient buffers. `sizes`: the
    tensors laid end to end in the buffer (default: one); 8-bit blocks never span two of them."""

    def __init__(self, kind: str, backend, n: int, *, wd: float = 0.0, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, sizes=None):
        kind = kind.lower()
        if kind not in OPTIMIZERS:
            raise LlmtuneError(f"--optimizer: unknown optimizer {kind!r} (choose {', '.join(OPTIMIZERS)})")
        self.kind, self.backend, self.wd = kind, backend, wd
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.t = 0
        self.m = self.v = None
        if kind == "adamw":
            self.m, self.v = backend.zeros((n,)), backend.zeros((n,))
        elif kind == "adamw8bit":
            starts = dynamic8.block_starts([n] if sizes is None else sizes)
            if starts[-1] != n:
                raise ValueError(f"tensor sizes sum to {starts[-1]}, not the buffer's {n}")
            # all-zero blocks: code index 0 with absmax 0 dequantizes to 0 (bitsandbytes' zero init)
            self.m, self.v = backend.zeros((n,), np.uint8), backend.zeros((n,), np.uint8)
            self.absmax_m, self.absmax_v = backend.zeros((starts.size - 1,)), backend.zeros((starts.size - 1,))
            self.starts = backend.asarray(starts)
            self.code_m, self.code_v = (backend.asarray(dynamic8.dynamic_map(s).astype(backend.dtype)) for s in (True, False))

    def _state(self) -> dict:
        """The optimizer's state buffers by checkpoint array name (see train/checkpoint.py)."""
        if self.kind == "adamw":
            return {"adam_m": self.m, "adam_v": self.v}
        if self.kind == "adamw8bit":
            return {"adam8_m": self.m, "adam8_v": self.v, "adam8_absmax_m": self.absmax_m,
                    "adam8_absmax_v": self.absmax_v}
        return {}

    @property
    def state_bytes(self) -> int:
        """Device bytes of the state: 8 per value (adamw), 2 per value plus one float per block of
        each moment and the block table (adamw8bit), 0 (sgd)."""
        extra = self.starts.nbytes + self.code_m.nbytes + self.code_v.nbytes if self.kind == "adamw8bit" else 0
        return sum(b.nbytes for b in self._state().values()) + extra

    def state_arrays(self) -> dict:
        """Host copies of the state (float moments as float32, 8-bit ones as they are); on a
        float32 cpu backend the buffers themselves, so a checkpoint costs no second copy."""
        host = self.backend.to_numpy
        return {name: np.asarray(host(buf), dtype=np.uint8 if buf.dtype == np.uint8 else np.float32)
                for name, buf in self._state().items()}

    def load_state(self, arrays: dict) -> None:
        """Continue from state_arrays() (one-line errors: a missing array or another layout)."""
        for name, buf in self._state().items():
            src = arrays.get(name)
            if src is None or src.shape != buf.shape:
                raise LlmtuneError(f"checkpoint: {name} has {None if src is None else src.shape}, this run's "
                                   f"{self.kind} state is {buf.shape}")
            buf[...] = self.backend.asarray(np.asarray(src).astype(buf.dtype, copy=False))

    def step(self, w, g, lr: float) -> None:
        self.t += 1
        hp = dict(lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, wd=self.wd, t=self.t)
        if self.kind == "adamw":
            self.backend.adamw_step(w, g, self.m, self.v, **hp)
        elif self.kind == "adamw8bit":
            self.backend.adamw8bit_step(w, g, self.m, self.v, self.absmax_m, self.absmax_v, self.starts,
                                        self.code_m, self.code_v, **hp)
        else:
            self.backend.sgd_step(w, g, lr=lr, wd=self.wd)
