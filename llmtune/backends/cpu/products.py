"""The CPU products of a weight kept in its GGUF storage type (the kernels of ops.qlinear,
qlinear_back, qget_rows and dequantize) and the float32 copies a run may keep of frozen matrices.

A frozen weight W[n_out, n_in] stays as its block bytes (a view of the file's memory map); each
product dequantizes a few MiB of rows at a time into a reused per-thread scratch and hands that
block to BLAS, so no more than one block of W is ever in float32.

Activations are rounded as ggml's CPU matmul rounds them (quant/codecs.py: each weight type's
vec_dot_type). ggml's dot product of a weight block with a quantized activation block is exact
integer arithmetic times the two scales, so the dequantized activation block times the dequantized
weight block gives the same number up to float summation order. (The repacked Q4_0/Q4_K layouts of
ggml-cpu/repack.cpp quantize the activations the same way, ggml_quantize_mat_q8_0_4x8 / q8_K_4x8,
and llamafile's tinyBLAS computes the same integer dot products.) The one exception is the min
term of Q4_1/Q5_1: ggml multiplies the weight's min by the stored s = fp16(d sum q) where the
dequantized activations sum to fp16(d) sum q; the difference, per activation block, is added
as a small extra product with the weights' mins, so that term is reproduced too.

Up to native.MAX_ROWS activation rows (a decode step, a short prompt) go to the compiled block
product (native/qdot.c) when it is built: the same integers, multiplied as ggml multiplies them,
with no float copy of the weight; this module's numpy path is its reference and fallback.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from llmtune.backends.cpu.native import kernels as native
from llmtune.quant import codecs
from llmtune.quant.codecs import block_mins, dequantize_rows
from llmtune.quant.types import ACT_BLOCK, QTYPES, QType, qtype_of, row_bytes  # noqa: F401 - the registry, re-exported

F32 = np.float32

# float32 elements of the per-thread weight scratch: the rows dequantized for one BLAS call
SCRATCH_ELEMENTS = 1 << 22  # 16 MiB

codecs.use_compiled_decoder(native.dequantize_rows)


def round_activations(x: np.ndarray, act: str):
    """x [M, K] rounded as ggml converts it to `act` and back (quant/codecs.py round_activations,
    whose values the compiled Q8_0/Q8_1 rounding gives bit for bit)."""
    if act in ("q8_0", "q8_1"):
        taken = native.round_q8(np.ascontiguousarray(x, dtype=F32), act == "q8_1")
        if taken:
            return taken
    return codecs.round_activations(x, act)


# ------------------------------------------------------------------------------------ products
_local = threading.local()


def _scratch(n: int, dtype) -> np.ndarray:
    """A per-thread buffer of at least n elements (kept, so every product reuses it)."""
    dtype = np.dtype(dtype)
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < n * dtype.itemsize:
        buf = _local.buf = np.empty(max(n * dtype.itemsize, 1), np.uint8)
    return buf[: n * dtype.itemsize].view(dtype)


def _block_rows(n_rows: int, n_cols: int) -> int:
    return max(1, min(n_rows, SCRATCH_ELEMENTS // max(1, n_cols)))


class FloatCopies:
    """Float32 copies of stored matrices, made on first use while their total stays within
    `budget` bytes, for passes that multiply the same frozen weights over and over (perplexity,
    benchmarks, generation): a product with a kept copy skips the per-block decode. The numbers
    are those of the stored path (the activations are rounded the same way), up to BLAS's
    summation order. Owned by the weights bound for an evaluation (Backend.bind(...,
    float_copies=True)) and freed with them; keyed by the block bytes' address and shape (the
    file's memory map does not move while they are bound)."""

    def __init__(self, budget: int, pack: bool = False):
        self.budget, self.used, self.arrays = budget, 0, {}
        self.block_mins: dict = {}  # beside a kept copy: its Q4_1 / Q5_1 block mins (mins)
        self.lock = threading.Lock()
        # a training run's: the packed forms of its frozen float32 matrices, and of its stored
        # ones instead of their float copies (stored_pack)
        self.pack = pack
        self.packs: dict = {}
        # called with a frozen matrix (float32, or stored blocks) once both its packed forms
        # exist: the file pages under it may go (GGUFFile.drop_pages, which ignores arrays
        # outside its own mapping), so the peak holds the packs and not the file besides
        self.releases: list = []

    def packing(self) -> bool:
        """Whether packed() can keep copies: a training run's, with the compiled product built."""
        return self.pack and native.pack_wt_available()

    @staticmethod
    def packed_bytes(shape: tuple) -> int:
        """Bytes packed() keeps for a matrix of `shape` multiplied both ways (forward, input gradient)."""
        if len(shape) != 2:
            return 0
        return native.pack_wt_bytes(shape) + native.pack_wt_bytes(shape, transposed=True)

    def packed(self, dense: np.ndarray, transposed: bool = False) -> np.ndarray | None:
        """A frozen float32 matrix packed for the compiled product (native.pack_wt; transposed:
        for g @ W), both directions made at its first product while they fit the budget and kept
        while bound; None without `pack`, over budget, or without the kernel. On a training
        pass's rows the compiled product runs ~1.3-1.7x numpy's BLAS (BENCHMARKS)."""
        key = (dense.__array_interface__["data"][0], dense.shape, dense.strides)
        return self._packs(key, transposed, dense.shape, lambda: dense, dense)

    def stored_pack(self, raw: np.ndarray, qtype: str, n_in: int, transposed: bool = False) -> np.ndarray | None:
        """The packed form of a stored matrix's float32 decode (QLoRA's frozen base; transposed:
        for g @ W), both directions made at its first product from one decode that is not kept:
        with packing the packed forms replace the float copies (get keeps none), a third less
        memory. None without `pack`, over budget, or without the kernel."""
        key = (raw.__array_interface__["data"][0], raw.shape, raw.strides, qtype)
        shape = (raw.shape[0], n_in)
        return self._packs(key, transposed, shape, lambda: dequantize_rows(raw, qtype, np.empty(shape, F32)), raw)

    def _packs(self, key: tuple, transposed: bool, shape: tuple, decoded, source: np.ndarray) -> np.ndarray | None:
        """The packed form (`transposed` or not) of the matrix under `key`: at the first call
        both directions from decoded() (float32 [n_out, n_in]), then `source` released."""
        packed = self.packs.get(key + (transposed,))
        if packed is not None or not self.pack:
            return packed
        nbytes = self.packed_bytes(shape)
        if nbytes > 0:
            # one pack per matrix, whichever worker gets here first; the budget read under the lock
            # too: read before it, the other worker's pack of this very matrix (the budget's last)
            # made it look full, and this product ran on numpy's BLAS, other bits, now and then
            with self.lock:
                packed = self.packs.get(key + (transposed,))
                if packed is None and self.used + nbytes <= self.budget:
                    dense = decoded()
                    both = native.pack_wt(dense), native.pack_wt(dense, transposed=True)
                    if all(p is not None for p in both):
                        self.packs[key + (False,)], self.packs[key + (True,)] = both
                        self.used += both[0].nbytes + both[1].nbytes
                        packed = both[transposed]
                        for release in self.releases:
                            release(source)
        return packed

    def get(self, raw: np.ndarray, qtype: str, n_in: int) -> np.ndarray | None:
        """The float32 copy of a stored matrix, made at its first product while it fits the
        budget; None over budget, or where packed forms replace the copies (stored_pack)."""
        if self.pack:
            return None
        key = (raw.__array_interface__["data"][0], raw.shape, raw.strides, qtype)
        dense = self.arrays.get(key)
        if dense is None and self.budget:
            with self.lock:  # one decode per matrix, whichever worker gets here first (budget: as in _packs)
                dense = self.arrays.get(key)
                if dense is None and self.used + raw.shape[0] * n_in * 4 <= self.budget:
                    dense = dequantize_rows(raw, qtype, np.empty((raw.shape[0], n_in), F32))
                    self.arrays[key] = dense
                    self.used += dense.nbytes
        return dense

    def mins(self, raw: np.ndarray, qtype: str) -> np.ndarray:
        """block_mins(raw, qtype), kept beside the copy of a matrix that has one (1/32 of its size:
        a Q4_1 / Q5_1 product's correction reads them every time)."""
        key = (raw.__array_interface__["data"][0], raw.shape, raw.strides, qtype)
        m = self.block_mins.get(key)
        if m is None:
            m = self.block_mins[key] = np.ascontiguousarray(block_mins(raw, qtype).T)
        return m


# frozen float32 matrices bound for training (CPUBackend.bind) -> the FloatCopies that may keep
# their packed form: id -> (weak reference, copies), so an array that is gone never matches
_FROZEN: dict = {}


def register_frozen(w: np.ndarray, copies: FloatCopies) -> None:
    """Mark w, a float32 matrix that stays unchanged while it is alive (a training run's frozen
    base), so its products may use a packed copy kept in `copies` (frozen_copies)."""
    key = id(w)
    # (the callback holds the dict itself: at interpreter exit the module's globals may be gone)
    _FROZEN[key] = (weakref.ref(w, lambda _, key=key, frozen=_FROZEN: frozen.pop(key, None)), copies)


def frozen_copies(w) -> FloatCopies | None:
    """The FloatCopies w was registered with (register_frozen), or None."""
    entry = _FROZEN.get(id(w))
    return entry[1] if entry is not None and entry[0]() is w else None


def packed_product(out2: np.ndarray, x2: np.ndarray, dense: np.ndarray, copies: FloatCopies | None,
                   transposed: bool = False) -> bool:
    """out2 = x2 @ dense^T (transposed: x2 @ dense) through dense's packed copy in `copies`
    (native.sgemm_packed); False where there is none or the compiled product does not take the
    case (the caller's BLAS then)."""
    return bool(_packed_call(out2, x2, dense, copies, transposed, bind=False))


def bind_packed_product(out2: np.ndarray, x2: np.ndarray, dense: np.ndarray, copies: FloatCopies | None,
                        transposed: bool = False):
    """packed_product as a call with no arguments (a replayed program), or None."""
    return _packed_call(out2, x2, dense, copies, transposed, bind=True)


def _packed_call(out2, x2, dense, copies, transposed: bool, bind: bool):
    packed = copies.packed(dense, transposed) if copies is not None else None
    return _sgemm(out2, x2, packed, dense.shape, transposed, bind)


def stored_packed_product(out2: np.ndarray, x2: np.ndarray, raw: np.ndarray, qtype: str, n_in: int,
                          copies: FloatCopies | None, transposed: bool = False, bind: bool = False):
    """out2 = x2 @ W^T (transposed: x2 @ W) for W stored as `qtype` blocks raw [n_out, row bytes]
    through its decode's packed form in `copies` (FloatCopies.stored_pack): True (bind: a call
    with no arguments, for a replayed program) where it is kept and the compiled product takes
    the case, else False (None)."""
    packed = copies.stored_pack(raw, qtype, n_in, transposed) if copies is not None and x2.dtype == F32 else None
    return _sgemm(out2, x2, packed, (raw.shape[0], n_in), transposed, bind)


def _sgemm(out2, x2, packed, shape: tuple, transposed: bool, bind: bool):
    """native.sgemm_packed (bind: its bound form) with W [n_out, n_in] = `shape`'s packed form."""
    if packed is None:
        return None if bind else False
    n, k = shape[::-1] if transposed else shape
    return (native.bind_sgemm_packed if bind else native.sgemm_packed)(out2, x2, packed, n, k)


class WithCopies:
    """A stored matrix's block bytes as an evaluation binds them on the cpu: `raw`, the
    FloatCopies its products may keep a float32 copy in (None: no copies), and its packed form."""

    __slots__ = ("raw", "copies", "_packed")

    def __init__(self, raw: np.ndarray, copies: FloatCopies | None):
        self.raw, self.copies = raw, copies

    def packed(self, qtype: str):
        """The matrix repacked for the compiled AVX-512 product (native.pack), made at first use
        and kept while the weight is bound; None where there is no packed kernel."""
        try:
            return self._packed
        except AttributeError:
            self._packed = native.pack(self.raw, qtype)
            return self._packed


def qlinear(out: np.ndarray, x: np.ndarray, raw: np.ndarray, qtype: str, round_x: bool = True,
            copies: FloatCopies | None = None) -> np.ndarray:
    """out[..., n_out] = x[..., n_in] @ W^T for W stored as `qtype` block bytes raw [n_out, row
    bytes]; round_x: the activations rounded as ggml's CPU matmul rounds them (see the module
    docstring), else used as they are. copies: where a float32 copy of W may be kept (FloatCopies)."""
    qt = qtype_of(qtype)
    n_out, n_in = out.shape[-1], x.shape[-1]
    x2, o2 = x.reshape(-1, n_in), out.reshape(-1, n_out)
    if round_x and native.qlinear(o2, x2, raw, qtype):  # a few rows: the compiled block product, no float copy
        return out
    corr = None
    if round_x:
        xr, corr = round_activations(x2, qt.act)
        xr = xr.astype(x.dtype, copy=False)
    else:
        xr = np.ascontiguousarray(x2)
        if stored_packed_product(o2, xr, raw, qtype, n_in, copies):
            return out
    dense = copies.get(raw, qtype, n_in) if copies is not None and x.dtype == F32 else None
    if dense is not None:
        np.matmul(xr, dense.T, out=o2)
        if corr is not None and qt.has_min:
            o2 += (corr @ copies.mins(raw, qtype)).astype(x.dtype, copy=False)
        return out
    rb = _block_rows(n_out, n_in)
    w = _scratch(rb * n_in, x.dtype)
    if n_out <= rb or xr.shape[0] == 1:
        part = None
    else:  # OpenBLAS runs W_block @ x^T (then a transposed copy) faster than x @ W_block^T into a column slice
        part = np.empty((min(rb, n_out), xr.shape[0]), x.dtype)
    for r0 in range(0, n_out, rb):
        r1 = min(n_out, r0 + rb)
        wb = dequantize_rows(raw[r0:r1], qtype, w[: (r1 - r0) * n_in].reshape(r1 - r0, n_in))
        if part is None:
            np.matmul(xr, wb.T, out=o2[:, r0:r1])
        else:
            np.matmul(wb, xr.T, out=part[: r1 - r0])
            o2[:, r0:r1] = part[: r1 - r0].T
        if corr is not None and qt.has_min:
            o2[:, r0:r1] += (corr @ block_mins(raw[r0:r1], qtype).T).astype(x.dtype, copy=False)
    return out


def bind_qlinear(out: np.ndarray, x: np.ndarray, raw: np.ndarray, qtype: str, round_x: bool = True):
    """qlinear(out, x, raw, qtype, round_x) as a call with no arguments, for buffers that stay
    where they are (a replayed program, graph/planner.py Replay): the compiled product with its
    arguments converted once, or None where qlinear would not use it."""
    if not (round_x and x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    return native.bind_qlinear(out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), raw, qtype)


def qlinear_back(out: np.ndarray, g: np.ndarray, raw: np.ndarray, qtype: str,
                 copies: FloatCopies | None = None) -> np.ndarray:
    """out[..., n_in] = g[..., n_out] @ W: the input gradient of qlinear (straight through the
    rounding of the activations), W dequantized a row block at a time, or its float32 copy where
    `copies` keeps one (a training run's frozen base, Trainer)."""
    n_in, n_out = out.shape[-1], g.shape[-1]
    g2, o2 = g.reshape(-1, n_out), out.reshape(-1, n_in)
    if stored_packed_product(o2, g2, raw, qtype, n_in, copies, transposed=True):
        return out
    dense = copies.get(raw, qtype, n_in) if copies is not None and out.dtype == F32 else None
    rb = _block_rows(n_out, n_in)
    w = _scratch(rb * n_in, out.dtype) if dense is None else None
    part = None
    for r0 in range(0, n_out, rb):  # the same row blocks with or without a copy: the same sums
        r1 = min(n_out, r0 + rb)
        if dense is not None:
            wb = dense[r0:r1]
        else:
            wb = dequantize_rows(raw[r0:r1], qtype, w[: (r1 - r0) * n_in].reshape(r1 - r0, n_in))
        if r0 == 0:
            np.matmul(g2[:, r0:r1], wb, out=o2)
        else:
            if part is None:
                part = np.empty_like(o2)
            np.matmul(g2[:, r0:r1], wb, out=part)
            o2 += part
    return out


def qget_rows(out: np.ndarray, raw: np.ndarray, ids: np.ndarray, qtype: str) -> np.ndarray:
    """out[..., n_cols] = W[ids]: the rows of a stored matrix, dequantized (ggml_get_rows)."""
    flat = np.asarray(ids).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= raw.shape[0]):
        raise IndexError(f"row id outside 0..{raw.shape[0] - 1}")
    dequantize_rows(raw[flat], qtype, out.reshape(flat.size, out.shape[-1]))
    return out


def dequantize(out: np.ndarray, raw: np.ndarray, qtype: str) -> np.ndarray:
    """The whole stored matrix as float: out [..., n_cols]."""
    n_cols = out.shape[-1]
    dequantize_rows(raw.reshape(-1, raw.shape[-1]), qtype, out.reshape(-1, n_cols))
    return out
