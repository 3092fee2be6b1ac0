"""The backend interface: a backend knows kernels and memory, never models.

A kernel is `kernel(out, *inputs, **attrs) -> array`. For ops that are views (ops.OPS[op].view)
`out` is None and the kernel returns a view of its first input; otherwise it writes into `out`
(a buffer planned by graph/planner.py) and returns it. Each backend declares its kernel table
(op name -> kernel) explicitly, covering exactly graph/ops.OPS (tests/test_kernels_cover_ops.py).
`llmtune.backends.get_backend` picks a backend by name; this module imports none of them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class Backend:
    name = "base"
    kernels: dict[str, Callable]  # op name -> kernel, set by each backend

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)

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

    def host_resident_bytes(self) -> int | None:
        """Bytes this process holds where the backend keeps its tensors, when that memory is the
        process's own (the cpu: its resident set); None for a device with memory of its own."""
        return None

    # -- execution -----------------------------------------------------------------------
    def accumulate(self, dst: Any, src: Any) -> None:
        """dst += src (gradient accumulation into parameter-gradient buffers)."""
        raise NotImplementedError

    # -- optimizer (fused over one flat buffer holding every trainable parameter) ----------
    def adamw_step(self, w, g, m, v, *, lr: float, beta1: float, beta2: float, eps: float, wd: float, t: int) -> None:
        raise NotImplementedError

    def sgd_step(self, w, g, *, lr: float, wd: float) -> None:
        raise NotImplementedError

