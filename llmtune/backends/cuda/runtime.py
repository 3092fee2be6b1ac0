"""The device runtime (cupy: NVRTC-compiled RawKernels, cuBLAS, host/device copies) and the CUDA C
source it compiles.

`kernel_source(dtype)` is the one translation unit: `typedef <float|double> real;`, the storage
types' #defines (quant/types.py), common.cu, then each section's .cu in ops.py's order with the
#defines of its module (C_DEFINES) in front; a `#line` directive before each file makes
compiler errors name the file and line they are in. The tests compile the same source with g++
under a CPU emulator (tests/cuda_emu.py) that stands in for this runtime.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.quant.types import c_defines

C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
# the sections with C source, in ops.py's order: <name>.py launches the kernels of <name>.cu
SECTIONS = ("elementwise", "quant", "embeddings", "norm", "rope", "attention", "kvcache", "loss", "optim")


def _c_file(name: str) -> str:
    text = (Path(__file__).parent / name).read_text()
    return f'#line 1 "{name}"\n{text}'


@functools.lru_cache(maxsize=None)
def kernel_source(dtype) -> str:
    """The CUDA C of every section, specialised for one float type."""
    parts = [f"typedef {C_TYPES[np.dtype(dtype)]} real;\n", c_defines(), _c_file("common.cu")]
    for name in SECTIONS:
        module = importlib.import_module(f"{__package__}.{name}")
        parts += [f"#define {k} {v}\n" for k, v in getattr(module, "C_DEFINES", {}).items()]
        parts.append(_c_file(f"{name}.cu"))
    return "\n".join(parts)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when cupy sees a device."""
    try:
        import cupy  # noqa: PLC0415 - optional ([cuda] extra), loaded where used
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"cupy is not importable ({_one_line(exc)}); install it with pip install 'llmtune[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({_one_line(exc)})"
    return None if n > 0 else "no CUDA device found"


def available() -> bool:
    """True when cupy is importable and sees at least one device. Never raises."""
    try:
        return unavailable_reason() is None
    except Exception:
        return False


class CupyRuntime:
    """Device primitives on a real GPU through cupy (kernels compiled with NVRTC, cuBLAS gemm)."""

    def __init__(self):
        reason = unavailable_reason()
        if reason is not None:
            raise LlmtuneError(f"--backend cuda: {reason}")
        import cupy  # noqa: PLC0415 - optional ([cuda] extra), loaded where used

        self.xp = cupy
        self._functions = {}
        self._modules = {}
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props.get("name", b"?")
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)

    def free_memory(self) -> int:
        free, _total = self.xp.cuda.runtime.memGetInfo()
        return int(free) + int(self.xp.get_default_memory_pool().free_bytes())

    def prepare(self, dtype) -> None:
        """Compile the kernels and load cuBLAS now, so a broken toolkit fails with one clear line."""
        try:
            self._function("sgd_step", dtype)
            from cupy_backends.cuda.libs import cublas  # noqa: F401, PLC0415 - loads libcublas (optional, [cuda])

            self.xp.cuda.device.get_cublas_handle()
        except Exception as exc:
            if type(exc).__name__ == "CompileException":  # a bug in the kernel source, not the user's setup
                raise
            raise LlmtuneError(f"--backend cuda: cannot load NVRTC or cuBLAS ({_one_line(exc)})") from None

    def _function(self, name, dtype):
        key = (name, np.dtype(dtype))
        fn = self._functions.get(key)
        if fn is None:
            module = self._modules.get(key[1])
            if module is None:
                module = self._modules[key[1]] = self.xp.RawModule(code=kernel_source(dtype))
            fn = self._functions[key] = module.get_function(name)
        return fn

    def launch(self, name, dtype, grid, block, args) -> None:
        self._function(name, dtype)(grid, block, args)

    def gemm(self, dtype, plan, x_ptr: int, y_ptr: int, c_ptr: int, precision: str = "f32") -> None:
        """precision "tf32" / "bf16": float32 in and out, tensor-core products of inputs rounded to
        TF32 / bf16 with float32 accumulation (cuBLAS's FAST_TF32 / FAST_16BF compute types)."""
        from cupy_backends.cuda.libs import cublas  # noqa: PLC0415 - optional ([cuda] extra)

        dtype = np.dtype(dtype)
        one, zero = np.ones((), dtype), np.zeros((), dtype)
        handle = self.xp.cuda.device.get_cublas_handle()
        cublas.setPointerMode(handle, 0)  # CUBLAS_POINTER_MODE_HOST: alpha/beta are host scalars
        size = dtype.itemsize
        for ox, oy, oc in plan.offsets:
            head = (handle, plan.trans_x, plan.trans_y, plan.m_cm, plan.n_cm, plan.k, one.ctypes.data)
            x, y, c = x_ptr + ox * size, y_ptr + oy * size, c_ptr + oc * size
            if precision == "f32" or dtype != np.float32:
                fn = cublas.sgemmStridedBatched if dtype == np.float32 else cublas.dgemmStridedBatched
                fn(*head, x, plan.ldx, plan.stride_x, y, plan.ldy, plan.stride_y,
                   zero.ctypes.data, c, plan.ldc, plan.stride_c, plan.batch)
                continue
            # cuBLAS enum values (cublasComputeType_t, cudaDataType_t, cublasGemmAlgo_t) as fallbacks
            compute = {"tf32": getattr(cublas, "CUBLAS_COMPUTE_32F_FAST_TF32", 77),
                       "bf16": getattr(cublas, "CUBLAS_COMPUTE_32F_FAST_16BF", 75)}[precision]
            r32 = getattr(self.xp.cuda.runtime, "CUDA_R_32F", 0)
            cublas.gemmStridedBatchedEx(*head, x, r32, plan.ldx, plan.stride_x, y, r32, plan.ldy, plan.stride_y,
                                        zero.ctypes.data, c, r32, plan.ldc, plan.stride_c, plan.batch, compute,
                                        getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1))

    @staticmethod
    def ptr(a) -> int:
        return a.data.ptr

    def to_device(self, host, dtype):
        return self.xp.array(host, dtype=dtype, order="C")

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()
