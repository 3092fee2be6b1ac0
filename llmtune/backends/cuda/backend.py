"""The CUDA backend: cupy arrays, cuBLAS for matmuls, RawKernels for everything else.

Importing this package never imports cupy: `available()` and `CUDABackend()` do, lazily, so a
CPU-only install (no cupy, no driver) can import every llmtune module.

Laid out as llm.c's llmc/: `runtime.py` (the device and the compiled source), `gemm.py` (cuBLAS
products), `launch.py` (grids and argument helpers), and one module per section of graph/ops.py
(elementwise, quant, shape, embeddings, norm, rope, attention, kvcache, loss, optim), each a
mixin of the `_k_<op>` launchers of its ops with its CUDA C (`<section>.cu`) beside it. The
backend below is those mixins plus memory; its kernel table follows the one convention of
both backends (base.kernel_table: the kernel of op X is `k_X` / `_k_X`), so adding an op is
one launcher and one kernel in one section. Kernel semantics follow backends/cpu.py op for op.
The source is compiled once per float type (`typedef <float|double> real;`), so float64 (gradient
checks) costs nothing extra;
`precision="tf32"|"bf16"` runs matmuls on tensor cores with float32 accumulation.
"""

from __future__ import annotations

import numpy as np

from llmtune.backends.base import Backend, Kernel, kernel_table
from llmtune.backends.cuda.attention import AttentionKernels
from llmtune.backends.cuda.elementwise import ElementwiseKernels
from llmtune.backends.cuda.embeddings import EmbeddingKernels
from llmtune.backends.cuda.gemm import GemmKernels
from llmtune.backends.cuda.kvcache import CacheKernels
from llmtune.backends.cuda.launch import Launcher
from llmtune.backends.cuda.loss import LossKernels
from llmtune.backends.cuda.norm import NormKernels
from llmtune.backends.cuda.optim import OptimizerKernels
from llmtune.backends.cuda.quant import QuantKernels
from llmtune.backends.cuda.rope import RopeKernels
from llmtune.backends.cuda.runtime import C_TYPES, CupyRuntime
from llmtune.backends.cuda.shape import ShapeKernels
from llmtune.errors import LlmtuneError

PRECISIONS = ("f32", "tf32", "bf16")


class CUDABackend(ElementwiseKernels, GemmKernels, QuantKernels, ShapeKernels, EmbeddingKernels, NormKernels,
                  RopeKernels, AttentionKernels, CacheKernels, LossKernels, OptimizerKernels, Launcher, Backend):
    """Kernels of backends/cpu.py on an NVIDIA GPU. float32, or float64 for gradient checks.

    precision: matmul inputs as stored ("f32"), or rounded to TF32 / bf16 on tensor cores with
    float32 accumulation ("tf32", "bf16"); weights, activations and optimizer state stay float32.
    `runtime` replaces the cupy runtime (tests run the same kernels under a CPU emulator)."""

    name = "cuda"

    def __init__(self, dtype=np.float32, runtime=None, precision: str = "f32"):
        super().__init__(dtype)
        if self.dtype not in C_TYPES:
            raise LlmtuneError(f"--backend cuda: dtype {self.dtype} is not supported (float32 or float64)")
        if precision not in PRECISIONS or (precision != "f32" and self.dtype != np.float32):
            raise LlmtuneError(f"--precision: {precision!r} is not available for {self.dtype} (choose "
                               "f32, tf32 or bf16 with float32)")
        self.precision = precision
        self.rt = runtime if runtime is not None else CupyRuntime()
        if hasattr(self.rt, "prepare"):
            self.rt.prepare(self.dtype)
        self.xp = self.rt.xp
        self.device_name = getattr(self.rt, "device_name", "?")
        self.kernels = {op: Kernel(getattr(self, method)) for op, method in self.KERNELS.items()}

    def asarray(self, host, dtype=None):
        if isinstance(host, self.xp.ndarray):
            return self._contig(host, dtype)
        host = np.asarray(host)
        return self.rt.to_device(host, dtype or host.dtype)

    def to_numpy(self, arr) -> np.ndarray:
        return self.rt.to_host(arr)

    def zeros(self, shape, dtype=None):
        return self.xp.zeros(shape, dtype=dtype or self.dtype)

    def arena(self, nbytes):
        return self.xp.empty(max(int(nbytes), 1), dtype=np.uint8)

    def view(self, arena, shape, dtype, offset=0):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return arena[offset : offset + n].view(dtype).reshape(shape)

    def synchronize(self) -> None:
        self.rt.synchronize()

    def available_memory(self):
        """Free device memory in bytes (the finetune memory check), or None when unknown."""
        probe = getattr(self.rt, "free_memory", None)
        return probe() if probe is not None else None

    def accumulate(self, dst, src) -> None:
        self.xp.add(dst, src, out=dst)


# op name -> launcher method, one per op of graph/ops.OPS (bound per instance in __init__)
CUDABackend.KERNELS = kernel_table(CUDABackend, "_k_", names=True)
