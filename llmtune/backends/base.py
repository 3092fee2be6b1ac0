"""The backend interface: a backend knows kernels and memory, never models.

A kernel is `kernel(out, *inputs, **attrs) -> array`. For ops that are views (ops.OPS[op].view)
`out` is None and the kernel returns a view of its first input; otherwise it writes into `out`
(a buffer planned by graph/planner.py) and returns it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class Backend:
    name = "base"

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.kernels: dict[str, Callable] = {}

    # -- memory --------------------------------------------------------------------------
    def asarray(self, host: np.ndarray, dtype=None) -> Any:
        raise NotImplementedError

    def to_numpy(self, arr: Any) -> np.ndarray:
        raise NotImplementedError

    def zeros(self, shape, dtype=None) -> Any:
        raise NotImplementedError

    def arena(self, nbytes: int) -> Any:
        """A raw byte buffer from which planned tensors are viewed."""
        raise NotImplementedError

    def view(self, arena: Any, shape, dtype, offset: int = 0) -> Any:
        """A tensor of `shape`/`dtype` at byte `offset` (64-byte aligned) of an arena."""
        raise NotImplementedError

    def synchronize(self) -> None:
        pass

    # -- execution -----------------------------------------------------------------------
    def run(self, op: str, out: Any, inputs: list, attrs: dict) -> Any:
        kernel = self.kernels.get(op)
        if kernel is None:
            raise NotImplementedError(f"backend {self.name} has no kernel for op {op!r}")
        return kernel(out, *inputs, **attrs)

    def accumulate(self, dst: Any, src: Any) -> None:
        """dst += src (gradient accumulation into parameter-gradient buffers)."""
        raise NotImplementedError

    # -- optimizer (fused over one flat buffer holding every trainable parameter) ----------
    def adamw_step(self, w, g, m, v, *, lr: float, beta1: float, beta2: float, eps: float, wd: float, t: int) -> None:
        raise NotImplementedError

    def sgd_step(self, w, g, *, lr: float, wd: float) -> None:
        raise NotImplementedError


def get_backend(name: str = "cpu", dtype=np.float32, precision: str = "f32") -> Backend:
    """'cpu', 'cuda', or 'auto' (cuda when cupy sees a device, else cpu).

    precision: matmul precision, "f32", or on cuda "tf32" / "bf16" (tensor cores, float32
    accumulation and weights)."""
    from llmtune.errors import LlmtuneError

    name = (name or "cpu").lower()
    if name == "auto":
        from llmtune.backends import cuda

        name = "cuda" if cuda.available() else "cpu"
    if name == "cpu":
        from llmtune.backends.cpu import CPUBackend

        if precision != "f32":
            raise LlmtuneError(f"--precision {precision}: needs the cuda backend (cpu computes in f32)")
        return CPUBackend(dtype)
    if name == "cuda":
        from llmtune.backends.cuda import CUDABackend

        return CUDABackend(dtype, precision=precision)

    raise LlmtuneError(f"--backend: unknown backend {name!r} (choose cpu, cuda or auto)")
