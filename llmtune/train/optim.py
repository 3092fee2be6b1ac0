"""Optimizers (state on the backend, fused over one flat buffer) and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.quant import dynamic8

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


OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep float32 moments


def keeps_f32_state(name: str, size: int, min_8bit_size: int = MIN_8BIT_SIZE) -> bool:
    """adamw8bit's float32 exceptions, as bitsandbytes: tensors under min_8bit_size values (norms,
    biases), and the token embedding, whose rows of rare tokens see zero gradients for many steps
    (bitsandbytes.nn.StableEmbedding registers 32-bit optimizer state for it; its layer norm is not
    added here, since it would change the model's architecture)."""
    return size < min_8bit_size or name.startswith("token_embd.")


class Optimizer:
    """AdamW (ggml_opt_step_adamw), AdamW with block-wise 8-bit moments (bitsandbytes.optim.AdamW8bit,
    quant/dynamic8.py) or SGD over the trainer's flat parameter/gradient buffers. `tensors`: the
    (name, size) laid end to end in the buffer (default: one unnamed tensor of n); with adamw8bit,
    blocks never span two of them and keeps_f32_state ones keep float32 moments."""

    def __init__(self, kind: str, backend, n: int, *, wd: float = 0.0, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, tensors=None, min_8bit_size: int = MIN_8BIT_SIZE,
                 lr_factors: dict[str, float] | None = None):
        """lr_factors: a learning-rate factor per tensor name (torch's parameter groups; LoRA+),
        default 1."""
        kind = kind.lower()
        if kind not in OPTIMIZERS:
            raise LlmtuneError(f"--optimizer: unknown optimizer {kind!r} (choose {', '.join(OPTIMIZERS)})")
        self.kind, self.backend, self.wd = kind, backend, wd
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.t = 0
        tensors = [("", n)] if tensors is None else tensors
        self.groups = _lr_groups(tensors, lr_factors or {})
        self.m = self.v = None
        if kind == "adamw":
            self.m, self.v = backend.zeros((n,)), backend.zeros((n,))
        elif kind == "adamw8bit":
            self._init_8bit(n, tensors, lr_factors or {}, min_8bit_size)

    def _init_8bit(self, n: int, tensors, lr_factors: dict, min_8bit_size: int) -> None:
        """Runs of consecutive tensors with the same state kind and learning-rate factor: ("8bit",
        buffer range, state range, block range, block starts within the run) or ("f32", buffer
        range, state range); self.run_factors holds each run's factor."""
        be = self.backend
        self.runs, offset, n8, n32, n_blocks = [], 0, 0, 0, 0
        for name, size in tensors:
            kind = ("f32" if keeps_f32_state(name, size, min_8bit_size) else "8bit", lr_factors.get(name, 1.0))
            if self.runs and self.runs[-1][0] == kind:
                self.runs[-1][1].append(size)
            else:
                self.runs.append((kind, [size]))
            offset += size
        self.run_factors = [factor for (_, factor), _ in self.runs]
        if offset != n:
            raise ValueError(f"tensor sizes sum to {offset}, not the buffer's {n}")
        runs, offset = [], 0
        for (kind, _), sizes in self.runs:
            size = sum(sizes)
            if kind == "f32":
                runs.append(("f32", slice(offset, offset + size), slice(n32, n32 + size)))
                n32 += size
            else:
                starts = dynamic8.block_starts(sizes)
                blocks = slice(n_blocks, n_blocks + starts.size - 1)
                runs.append(("8bit", slice(offset, offset + size), slice(n8, n8 + size), blocks, be.asarray(starts)))
                n8, n_blocks = n8 + size, n_blocks + starts.size - 1
            offset += size
        self.runs = runs
        # all-zero blocks: code index 0 with absmax 0 dequantizes to 0 (bitsandbytes' zero init)
        self.m, self.v = be.zeros((n8,), np.uint8), be.zeros((n8,), np.uint8)
        self.absmax_m, self.absmax_v = be.zeros((n_blocks,)), be.zeros((n_blocks,))
        self.m32, self.v32 = be.zeros((n32,)), be.zeros((n32,))
        self.code_m, self.code_v = (be.asarray(dynamic8.dynamic_map(s).astype(be.dtype)) for s in (True, False))

    def _state(self) -> dict:
        """The optimizer's state buffers by checkpoint array name (see train/checkpoint.py)."""
        if self.kind == "adamw":
            return {"adam_m": self.m, "adam_v": self.v}
        if self.kind == "adamw8bit":
            return {"adam8_m": self.m, "adam8_v": self.v, "adam8_absmax_m": self.absmax_m,
                    "adam8_absmax_v": self.absmax_v, "adam8_f32_m": self.m32, "adam8_f32_v": self.v32}
        return {}

    @property
    def state_bytes(self) -> int:
        """Device bytes of the state: 8 per value (adamw); adamw8bit: 2 per value plus one float per
        block of each moment and the block tables, 8 per value of its float32 exceptions; 0 (sgd)."""
        extra = 0
        if self.kind == "adamw8bit":
            extra = self.code_m.nbytes + self.code_v.nbytes + sum(r[4].nbytes for r in self.runs if r[0] == "8bit")
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
        hp = dict(beta1=self.beta1, beta2=self.beta2, eps=self.eps, wd=self.wd, t=self.t)
        if self.kind == "adamw8bit":
            for run, factor in zip(self.runs, self.run_factors):
                kind, sl, st = run[:3]
                if kind == "f32":
                    self.backend.adamw_step(w[sl], g[sl], self.m32[st], self.v32[st], lr=lr * factor, **hp)
                else:
                    b = run[3]
                    self.backend.adamw8bit_step(w[sl], g[sl], self.m[st], self.v[st], self.absmax_m[b],
                                                self.absmax_v[b], run[4], self.code_m, self.code_v,
                                                lr=lr * factor, **hp)
            return
        for start, stop, factor in self.groups:
            part = slice(start, stop)
            if self.kind == "adamw":
                self.backend.adamw_step(w[part], g[part], self.m[part], self.v[part], lr=lr * factor, **hp)
            else:
                self.backend.sgd_step(w[part], g[part], lr=lr * factor, wd=self.wd)


def _lr_groups(tensors, lr_factors: dict[str, float]) -> list[tuple[int, int, float]]:
    """(start, stop, lr factor) runs of the flat buffer, one per run of tensors with one factor."""
    groups: list[list] = []
    offset = 0
    for name, size in tensors:
        factor = lr_factors.get(name, 1.0)
        if groups and groups[-1][2] == factor:
            groups[-1][1] += size
        else:
            groups.append([offset, offset + size, factor])
        offset += size
    return [tuple(g) for g in groups]
