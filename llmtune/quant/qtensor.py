"""A matrix kept in its GGUF storage type: the block bytes (usually a view of the file's memory
map) with its logical shape, decoded only where a product or a row lookup needs it
(backends/cpu/products.py, backends/cuda/quant.py). Code that wants floats gets them:
`np.asarray(w)` and `w.astype(np.float32)` dequantize the whole matrix (quant/codecs.py)."""

from __future__ import annotations

import numpy as np

from llmtune.quant.codecs import dequantize_rows
from llmtune.quant.types import QTYPES, row_bytes
from llmtune.resources import available_memory


class QTensor:
    """W[rows, cols] as `qtype` blocks: raw is uint8 [rows, bytes per row]."""

    __slots__ = ("raw", "qtype", "shape")
    ndim = 2
    dtype = np.dtype(np.float32)  # what it decodes to

    def __init__(self, raw: np.ndarray, qtype: str, shape: tuple[int, int]):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise ValueError(f"QTensor: {shape} is not a matrix")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8:
            raw = raw.reshape(shape[0], -1).view(np.uint8)
        raw = raw.reshape(shape[0], -1)
        if raw.shape[1] != row_bytes(qtype, shape[1]):
            raise ValueError(f"QTensor: {raw.shape} bytes do not hold a {qtype} matrix {shape}")
        self.raw, self.qtype, self.shape = raw, qtype, shape

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes as stored (the memory a frozen copy costs)."""
        return int(self.raw.nbytes)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        out = dequantize_rows(self.raw, self.qtype, np.empty(self.shape, np.float32))
        return out.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:  # noqa: ARG002 - always a new array
        return self.dequantize(dtype)

    def __array__(self, dtype=None, copy=None):  # noqa: ARG002
        return self.dequantize(dtype or np.float32)

    def __repr__(self) -> str:
        return f"QTensor({self.qtype}, {self.shape}, {self.nbytes:,} bytes)"


def stored(info, keep: bool = True):
    """A GGUF tensor (gguf.file.TensorInfo) as a model weight: its raw bytes as a QTensor when it
    is a matrix of a type the quantized product reads (and `keep`), else float32 (F32 tensors as
    views of the memory map)."""
    name = info.type.name
    if keep and name in QTYPES and len(info.shape) == 2:
        return QTensor(info.raw, name, info.shape)
    return None


def backend_array(backend, w):
    """The array a backend binds for a model tensor: the raw bytes of a QTensor, else the float
    values in the backend's dtype."""
    if isinstance(w, QTensor):
        return backend.asarray(w.raw)
    return backend.asarray(np.asarray(w).astype(backend.dtype, copy=False))


def shape_only(w) -> np.ndarray:
    """A float32 stand-in with w's shape and no memory (graphs are built from shapes)."""
    return np.broadcast_to(np.float32(0), tuple(w.shape))


def float_copy_bytes(tensors) -> int:
    """Bytes of float32 copies of every quantized matrix among `tensors` (name -> array / QTensor)."""
    return sum(4 * w.size for w in tensors.values() if isinstance(w, QTensor))


def evaluation_budget(tensors, compiled_decoders: bool) -> int:
    """Bytes of float32 copies an evaluation command may keep of the quantized matrices among
    `tensors` (perplexity, eval, generate: the same frozen weights multiplied pass after pass).
    A copy saves a product its block decode and costs 4 bytes a weight, 4-8x the stored size, so
    the budget follows the decoder's speed, the model's size and the free memory: with the compiled
    decoders (`compiled_decoders`: the CPU backend's, ~1 GB/s a core) the decode is a few percent of a pass of
    perplexity's or eval's batch (and a decode step multiplies the blocks directly), so none are
    kept and the peak stays near llama.cpp's (the file plus activations); with numpy's decoders
    (~10x slower) up to the stored size again, within a quarter of the available memory."""
    if compiled_decoders:
        return 0
    avail = available_memory()
    stored = sum(w.nbytes for w in tensors.values() if isinstance(w, QTensor))
    return min(float_copy_bytes(tensors), stored, avail // 4) if avail else 0


def training_budget(tensors, need: int, available: int | None, packed: int = 0, share: int = 2) -> int:
    """Bytes of float32 copies a training run may keep of its frozen quantized matrices (QLoRA's
    base: every forward and backward multiplies them again, and the per-block decode would cost as
    much as the products), and of packed copies for the compiled forward product (`packed`: the
    bytes those would take; FloatCopies.packed): what they take, where that fits in 1/`share` of
    what the run leaves free (`need`: its estimate without them; half by default, leaving the rest
    to whatever runs beside; all of it, share=1, under a memory limit the user set); the rest
    stays as stored. 0 when memory is unknown."""
    if available is None:
        return 0
    return min(float_copy_bytes(tensors) + packed, max(0, (available - need) // share))
