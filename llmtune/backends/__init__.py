"""Backends execute graph ops: cpu (numpy), cuda (cupy).

`get_backend` picks one by name from a registry (`register_backend`): each entry is a factory
that imports its backend module only when called, so importing this package stays light, and
base.py (the interface every backend implements) imports none of them. A new backend is its
module and one `register_backend` call; code outside backends/ asks the backend's capabilities
(base.py), never its name.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from llmtune.backends.base import Backend
from llmtune.errors import LlmtuneError

_FACTORIES: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make `factory(dtype, precision)` the backend named `name` (--backend NAME)."""
    _FACTORIES[name.lower()] = factory


def _cpu(dtype, precision: str) -> Backend:
    from llmtune.backends.cpu import CPUBackend  # noqa: PLC0415 - a backend loads when asked for (docstring)

    if precision != "f32":
        raise LlmtuneError(f"--precision {precision}: needs the cuda backend (cpu computes in f32)")
    return CPUBackend(dtype)


def _cuda(dtype, precision: str) -> Backend:
    from llmtune.backends.cuda import CUDABackend, available  # noqa: PLC0415 - a backend loads when asked for
    from llmtune.backends.dist import use_local_device, world  # noqa: PLC0415 - ranks matter to the cuda backend only

    if world().size > 1 and available():  # one GPU per rank, chosen from its rank on the machine
        use_local_device()
    return CUDABackend(dtype, precision=precision)


register_backend("cpu", _cpu)
register_backend("cuda", _cuda)


def get_backend(name: str = "cpu", dtype=np.float32, precision: str = "f32") -> Backend:
    """A registered backend by name ('cpu', 'cuda', ...), or 'auto' (cuda when cupy sees a device,
    else cpu).

    precision: matmul precision, "f32", or on cuda "tf32" / "bf16" (tensor cores, float32
    accumulation and weights)."""
    name = (name or "cpu").lower()
    if name == "auto":
        from llmtune.backends import cuda  # noqa: PLC0415 - its availability probe only when asked

        name = "cuda" if cuda.available() else "cpu"
    factory = _FACTORIES.get(name)
    if factory is None:
        raise LlmtuneError(f"--backend: unknown backend {name!r} (choose {', '.join(_FACTORIES)} or auto)")
    return factory(dtype, precision)
