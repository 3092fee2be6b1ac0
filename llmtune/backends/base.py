"""The backend interface: a backend knows kernels and memory, never models.

A kernel is `kernel(out, *inputs, **attrs) -> array`. For ops that are views (ops.OPS[op].view)
`out` is None and the kernel returns a view of its first input; otherwise it writes into `out`
(a buffer planned by graph/planner.py) and returns it. Each backend declares its kernel table
(op name -> kernel) explicitly, covering exactly graph/ops.OPS (tests/test_kernels_cover_ops.py).
`llmtune.backends.get_backend` picks a backend by name; this module imports none of them.

A backend also owns the policies that depend on where its kernels run, so code outside
backends/ asks it instead of testing its name: `replays` (programs re-run as pre-bound calls,
planner.Replay), `default_batch_tokens`, `workers` (work items at once), `decode_context` and
`step_tuner` (host thread settings), `resident_bytes` (the memory probe) and `bind` (a model's
weights placed on it, with the float copies of quantized matrices an evaluation keeps).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.graph.ops import OPS
from llmtune.quant.qtensor import backend_array


class Backend:
    name = "base"  # for reports and metadata only: policies are the capabilities below
    precision = "f32"  # matmul precision (cuda: also "tf32" / "bf16")
    kernels: dict[str, Callable]  # op name -> kernel, set by each backend
    # programs whose inputs live in fixed buffers re-run as pre-bound kernel calls (planner.Replay):
    # worth it where Python work per kernel shows (host kernels), not where launches are queued
    replays = False
    # tokens per evaluation pass when --batch is not given: accelerators amortise launches over
    # bigger batches
    default_batch_tokens = 8192

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

    maps_host_arrays = False  # True where a backend array may be a host numpy array (a memory-mapped file's bytes)

    def peak_flops(self) -> Optional[float]:
        """The float32 product rate (FLOP/s) this backend's matrix products peak at (the cpu: numpy's
        GEMM on all cores, the best measured: backends/cpu/probes.py): what a finetune's model FLOP
        utilisation is a share of; None where unknown."""
        return None

    def decode_cost(self, qtype: str) -> Optional[float]:
        """How many times a product with a frozen matrix stored as `qtype` takes, decoded per
        product, against the same product on a float32 copy (a training run's float copies); None
        where the backend keeps no copies."""
        return None

    def resident_bytes(self) -> Optional[int]:
        """The memory probe: bytes this backend's arrays hold in this process's own memory now
        (the cpu: the process's resident size), None where they live elsewhere (a device)."""
        return None

    def bind(self, model, *, float_copies: bool = False) -> "BoundWeights":
        """`model`'s tensors (a Model, or a dict name -> array / QTensor) as this backend's arrays,
        by name, for Program params (llama.cpp's weight buffers): a quantized matrix as its block
        bytes, everything else as floats in the backend's dtype. float_copies: an evaluation that
        multiplies the same frozen weights pass after pass may keep float copies of the quantized
        ones (a backend that can: the cpu), owned by the returned weights."""

        tensors = model.tensors() if hasattr(model, "tensors") else model
        return BoundWeights({name: backend_array(self, w) for name, w in tensors.items()})

    # -- parallelism ---------------------------------------------------------------------
    def workers(self, requested: Optional[int], n_items: int) -> int:
        """How many work items (forward passes, micro-batches) run at once: one, on a backend
        that queues its own work."""
        _check_workers(requested)
        return 1

    def decode_context(self):
        """The block a token-by-token decode runs in (host thread settings)."""
        return nullcontext()

    def release_zeros(self, buf: Any) -> None:
        """Hand back the memory of a stretch of a buffer that holds zeros and will be written before
        it is read for anything but zeros (host pages: backends/cpu/pages.py); a device keeps it."""

    def compile_steps(self, steps: list, names: list, sole: list) -> Optional[Callable]:
        """One call running a replay's consecutive compiled steps (the kernels' `encode`), or None
        where this backend compiles none (its kernels then run one Python call each). sole[k]: the
        index of the one step that reads step k's value (-1: none, several, or outside the run)."""
        return None

    def compiles_steps(self) -> bool:
        """Whether compile_steps compiles (a decode program may then attend over the whole cache:
        the compiled attention reads only the visible positions)."""
        return False

    def step_tuner(self, n_workers: int) -> Callable:
        """A factory of blocks that one repeated step (a training step's micro-batches) runs in."""
        return nullcontext

    # -- execution -----------------------------------------------------------------------
    def accumulate(self, dst: Any, src: Any) -> None:
        """dst += src (gradient accumulation into parameter-gradient buffers)."""
        raise NotImplementedError

    # The longest causal attention a graph for this backend computes with the plain [T, T]
    # composition (its few large products); longer ones blockwise (ops.flash_attn). None: the
    # graph builder's default (arch/context.py PLAIN_ATTENTION_MAX_T).
    plain_attention_max: Optional[int] = None

    def sum_squares(self, flat: Any) -> float:
        """sum(flat^2) as a host float (a step's gradient norm squared; not finite exactly where
        some element is not, or where the sum overflows the backend's accumulator)."""
        return float(self.to_numpy(flat.dot(flat)))

    # -- optimizer (fused over one flat buffer holding every trainable parameter) ----------
    def adamw_step(self, w, g, m, v, *, lr: float, beta1: float, beta2: float, eps: float, wd: float, t: int) -> None:
        raise NotImplementedError

    def adamw8bit_step(self, w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v, *, lr: float, beta1: float,
                       beta2: float, eps: float, wd: float, t: int) -> None:
        """bitsandbytes' AdamW8bit over block-wise 8-bit moments (quant/dynamic8.py): m, v uint8
        map indices, absmax_m/_v one float per block, starts int64 [n_blocks + 1], code_m/_v the
        signed/unsigned dynamic maps; each block is dequantized, updated as adamw_step, requantized."""
        raise NotImplementedError

    def sgd_step(self, w, g, *, lr: float, wd: float) -> None:
        raise NotImplementedError



class BoundWeights(dict):
    """A model's tensors placed on a backend (name -> backend array), and what the placement
    owns: `float_copies`, the float32 copies of quantized matrices an evaluation keeps (or None)."""

    float_copies = None


def _check_workers(requested: Optional[int]) -> None:

    if requested is not None and requested < 1:
        raise LlmtuneError(f"workers: must be positive (got {requested})")


@dataclass(frozen=True)
class Kernel:
    """An op's kernel on one backend, every way it runs in one record. `run(out, *args, **attrs)`
    computes it (Program.run; calling the record calls it); `bind(out, *args, **attrs)`, where
    given, returns a call with no arguments for buffers that stay put (a replayed program,
    graph/planner.py Replay), or None where it declines and run serves; `encode(out, *args,
    **attrs)`, where given, returns the op's step of a compiled program (native/program.py),
    which a replayed decode step runs as one call, or None where the compiled op does not take
    the case."""

    run: Callable
    bind: Optional[Callable] = None
    encode: Optional[Callable] = None

    def __call__(self, out, *args, **attrs):
        return self.run(out, *args, **attrs)


def kernel_table(source, prefix: str, names: bool = False, bind: Optional[dict] = None,
                 encode: Optional[dict] = None) -> dict:
    """The kernel table of a backend by the one convention of all of them: the kernel of op X is
    `source`'s attribute `prefix + X` (cpu.py's module functions k_X, the CUDA backend's methods
    _k_X; of a tuple of sources, the first that has it), for every op of graph/ops.OPS it has, as
    a Kernel record with the op's entries of
    `bind` and `encode` (op -> callable); names=True gives the attribute names instead.
    tests/test_kernels_cover_ops.py checks that every op has one and that none is left over."""

    sources = source if isinstance(source, tuple) else (source,)
    found = {op: src for op in OPS for src in reversed(sources) if hasattr(src, prefix + op)}
    ops = [op for op in OPS if op in found]
    if names:
        return {op: prefix + op for op in ops}
    bind, encode = bind or {}, encode or {}
    stray = (set(bind) | set(encode)) - set(ops)
    if stray:
        raise ValueError(f"bind / encode for ops without a kernel: {sorted(stray)}")
    return {op: Kernel(getattr(found[op], prefix + op), bind.get(op), encode.get(op)) for op in ops}
