"""Backends execute graph ops: cpu (numpy), cuda (cupy).

`get_backend` picks one by name. It imports the chosen backend module only when called, so
importing this package stays light, and base.py (the interface both implement) imports neither.
"""

from __future__ import annotations

import numpy as np

from llmtune.backends.base import Backend


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
        from llmtune.backends.cuda import CUDABackend, available
        from llmtune.backends.dist import use_local_device, world

        if world().size > 1 and available():  # one GPU per rank, chosen from its rank on the machine
            use_local_device()
        return CUDABackend(dtype, precision=precision)

    raise LlmtuneError(f"--backend: unknown backend {name!r} (choose cpu, cuda or auto)")
