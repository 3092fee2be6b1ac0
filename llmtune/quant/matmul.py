"""Matrix products with a weight kept in its GGUF storage type (the CPU kernels of ops.qlinear,
qlinear_back, qget_rows and dequantize).

A frozen weight W[n_out, n_in] stays as its block bytes (a view of the file's memory map); each
product dequantizes a few MiB of rows at a time into a reused per-thread scratch and hands that
block to BLAS, so no more than one block of W is ever in float32.

Activations are rounded as ggml's CPU matmul rounds them (ggml-cpu.c ggml_compute_forward_mul_mat:
src1 is converted to the weight type's `vec_dot_type` before the dot products):

| weight type | vec_dot_type | rounding of each activation row |
| --- | --- | --- |
| F16 | F16 | x -> fp16 (round to nearest even) |
| BF16 | BF16 | x -> bf16 (round to nearest even, ggml_compute_fp32_to_bf16) |
| Q8_0, Q4_0, Q5_0 | Q8_0 | blocks of 32: d = amax/127 (stored fp16), q = rint(x * 127/amax) |
| Q4_1, Q5_1 | Q8_1 | as Q8_0, plus s = fp16(d * sum(q)) (d unrounded) for the weight's min term |
| Q4_K, Q5_K, Q6_K | Q8_K | blocks of 256: iscale = -127/x[argmax|x|], q = min(127, rint(iscale x)), d = 1/iscale (f32)
|

(x86 AVX2/AVX-512 builds: quantize_row_q8_0/q8_1 of ggml-cpu/arch/x86/quants.c, which round half
to even and scale by 127/amax; quantize_row_q8_K_ref for Q8_K. The repacked Q4_0/Q4_K layouts of
ggml-cpu/repack.cpp quantize the activations the same way, ggml_quantize_mat_q8_0_4x8 /
q8_K_4x8, and llamafile's tinyBLAS computes the same integer dot products.)

ggml's dot product of a weight block with a quantized activation block is exact integer
arithmetic times the two scales, so the dequantized activation block times the dequantized
weight block gives the same number up to float summation order. The one exception is the min
term of Q4_1/Q5_1: ggml multiplies the weight's min by the stored s = fp16(d sum q) where the
dequantized activations sum to fp16(d) sum q; the difference, per activation block, is added
as a small extra product with the weights' mins, so that term is reproduced too.

Up to native.MAX_ROWS activation rows (a decode step, a short prompt) go to the compiled block
product of llmtune/native when it is built: the same integers, multiplied as ggml multiplies them,
with no float copy of the weight; this module's numpy path is its reference and fallback.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from llmtune.native import kernels as native
from llmtune.quant.types import ACT_BLOCK, QTYPES, QType, qtype_of, row_bytes  # noqa: F401 - the registry, re-exported

F32 = np.float32


# float32 elements of the per-thread weight scratch: the rows dequantized for one BLAS call
SCRATCH_ELEMENTS = 1 << 22  # 16 MiB
# float32 bytes dequantized per numpy pass: the temporaries of one pass stay in L2
_PASS_BYTES = 1 << 20


# ------------------------------------------------------------------------------------ dequantization
def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (a column pair of a block array) as float32 [nb, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(F32)


def _deq_f16(b, o):
    np.copyto(o, np.ascontiguousarray(b).view(np.float16).reshape(o.shape))


def _deq_bf16(b, o):
    bits = np.ascontiguousarray(b).view(np.uint16).reshape(o.shape)
    if o.dtype == F32:
        np.left_shift(bits, 16, out=o.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(o, (bits.astype(np.uint32) << 16).view(F32))


def _deq_q8_0(b, o):
    np.copyto(o, b[:, 2:].view(np.int8))
    o *= _f16(b[:, 0:2])


def _nibbles(qs, o2):
    """Low nibbles of qs [nb, n] into o2[:, 0], high nibbles into o2[:, 1] ([nb, 2, n] float)."""
    np.copyto(o2[:, 0], qs & 15)
    np.copyto(o2[:, 1], qs >> 4)


def _deq_q4_0(b, o):
    _nibbles(b[:, 2:18], o.reshape(-1, 2, 16))
    o -= 8  # ggml: ((q & 0xF) - 8) * d, exact in float
    o *= _f16(b[:, 0:2])


def _deq_q4_1(b, o):
    _nibbles(b[:, 4:20], o.reshape(-1, 2, 16))
    o *= _f16(b[:, 0:2])
    o += _f16(b[:, 2:4])


def _q5_levels(qh4, qs16):
    """5-bit levels [nb, 32] uint8 of Q5_0 / Q5_1: value e has its high bit at bit e of qh."""
    q = np.empty((qs16.shape[0], 2, 16), np.uint8)
    np.bitwise_and(qs16, 15, out=q[:, 0])
    np.right_shift(qs16, 4, out=q[:, 1])
    q = q.reshape(-1, 32)
    q |= np.unpackbits(qh4, axis=1, bitorder="little") << 4
    return q


def _deq_q5_0(b, o):
    np.copyto(o, _q5_levels(b[:, 2:6], b[:, 6:22]))
    o -= 16
    o *= _f16(b[:, 0:2])


def _deq_q5_1(b, o):
    np.copyto(o, _q5_levels(b[:, 4:8], b[:, 8:24]))
    o *= _f16(b[:, 0:2])
    o += _f16(b[:, 2:4])


def _k_scale_min(b):
    """The 8 sub-block scales and mins of Q4_K / Q5_K blocks (ggml get_scale_min_k4), float32
    d * sc and dmin * m, as ggml's dequantize_row_q4_K computes them."""
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return _f16(b[:, 0:2]) * sc.astype(F32), _f16(b[:, 2:4]) * mn.astype(F32)


def _deq_q4_k(b, o):
    d, m = _k_scale_min(b)
    nb = b.shape[0]
    o4 = o.reshape(nb, 4, 2, 32)  # 64-value groups: low nibbles = sub-block 2j, high = 2j+1
    qs = b[:, 16:144].reshape(nb, 4, 32)
    np.copyto(o4[:, :, 0], qs & 15)
    np.copyto(o4[:, :, 1], qs >> 4)
    o4 *= d.reshape(nb, 4, 2, 1)
    o4 -= m.reshape(nb, 4, 2, 1)


def _deq_q5_k(b, o):
    d, m = _k_scale_min(b)
    nb = b.shape[0]
    q = np.empty((nb, 4, 2, 32), np.uint8)
    qs = b[:, 48:176].reshape(nb, 4, 32)
    np.bitwise_and(qs, 15, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    q8 = q.reshape(nb, 8, 32)  # sub-block s, position l: 5th bit is bit s of qh[l]
    qh = b[:, 16:48]
    for s in range(8):
        q8[:, s] |= ((qh >> s) & 1) << 4
    o8 = o.reshape(nb, 8, 32)
    np.copyto(o8, q8)
    o8 *= d.reshape(nb, 8, 1)
    o8 -= m.reshape(nb, 8, 1)


def _deq_q6_k(b, o):
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)  # half n, then bytes l and l + 32
    qh = b[:, 128:192].reshape(nb, 2, 32)
    q = np.empty((nb, 2, 4, 32), np.uint8)  # value 128 n + 32 k + l
    np.bitwise_and(ql, 15, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    for k in range(4):
        q[:, :, k] |= ((qh >> (2 * k)) & 3) << 4
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(F32)  # ggml: (d * sc) * q
    o5 = o.reshape(nb, 2, 4, 2, 16)  # scale index 8 n + 2 k + l // 16
    np.copyto(o5, q.reshape(nb, 2, 4, 2, 16))
    o5 -= 32
    o5 *= scale.reshape(nb, 2, 4, 2, 1)


_DEQUANT = {
    "F16": _deq_f16, "BF16": _deq_bf16, "Q8_0": _deq_q8_0, "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1,
    "Q5_0": _deq_q5_0, "Q5_1": _deq_q5_1, "Q4_K": _deq_q4_k, "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k,
}


def dequantize_rows(raw: np.ndarray, qtype: str, out: np.ndarray) -> np.ndarray:
    """Rows of block bytes raw [rows, row bytes] (uint8) -> out [rows, n_cols] (float32 or
    float64; the values are float32's either way), a few hundred KiB per numpy pass."""
    qt = qtype_of(qtype)
    rows, n_cols = out.shape
    if raw.shape != (rows, n_cols // qt.block * qt.size) or n_cols % qt.block:
        raise ValueError(f"{qtype}: raw rows {raw.shape} do not hold [{rows}, {n_cols}] values")
    if out.dtype != F32:
        tmp = dequantize_rows(raw, qtype, np.empty(out.shape, F32))
        np.copyto(out, tmp)
        return out
    if native.dequantize_rows(raw, qtype, out):  # the compiled decoders: the same values, ~10x faster
        return out
    fn = _DEQUANT[qtype]
    step = max(1, _PASS_BYTES // max(1, 4 * n_cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks = raw[r0:r1].reshape(-1, qt.size)
        fn(blocks, out[r0:r1].reshape(-1, qt.block))
    return out


def block_mins(raw: np.ndarray, qtype: str) -> np.ndarray:
    """The min m of every block of Q4_1 / Q5_1 rows: float32 [rows, n_blocks]."""
    qt = qtype_of(qtype)
    blocks = raw.reshape(raw.shape[0], -1, qt.size)
    return np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(F32)


# ------------------------------------------------------------------------------------ activations
def _round_q8_0(x, with_sum=False):
    """ggml-cpu quantize_row_q8_0 / q8_1 (x86), dequantized: x [M, K] float32 -> x~ (and, for
    Q8_1, the per-block correction s - fp16(d) sum q)."""
    xb = x.reshape(x.shape[0], -1, 32)
    # max |x| per block as the largest magnitude bit pattern (an integer reduction is faster)
    amax = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).reshape(xb.shape).max(axis=-1, keepdims=True).view(F32)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.multiply(xb, inv)
    np.rint(q, out=q)
    dh = d.astype(np.float16).astype(F32)
    corr = None
    if with_sum:
        sq = q.sum(axis=-1, keepdims=True)  # integers: exact
        s = (d * sq).astype(np.float16).astype(F32)
        corr = (s - dh * sq)[..., 0]
    q *= dh
    return q.reshape(x.shape), corr


def _round_q8_k(x):
    """ggml quantize_row_q8_K_ref, dequantized (d stays float32)."""
    xb = x.reshape(x.shape[0], -1, 256)
    idx = np.abs(xb).argmax(axis=-1)[..., None]  # the first largest |x|, as the reference's strict >
    mx = np.take_along_axis(xb, idx, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, F32(-127) / mx, F32(0)).astype(F32)
        d = np.where(mx != 0, F32(1) / iscale, F32(0)).astype(F32)
    q = np.multiply(xb, iscale)
    np.rint(q, out=q)
    np.minimum(q, F32(127), out=q)
    q *= d
    return q.reshape(x.shape)


_F16_MIN_NORMAL = np.uint32(0x38800000)  # 2**-14 as float32 bits
_F16_OVERFLOW = np.uint32(0x477FF000)  # 65520: rounds to inf


def _round_f16(x):
    """x rounded to the nearest fp16 (ties to even), as float32: mantissa rounding on the bits in
    fp16's normal range, a fixed 2**-24 quantum below it (numpy's own float16 cast is slower)."""
    bits = x.view(np.uint32)
    r = (bits + (np.uint32(0x0FFF) + ((bits >> 13) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    mag = bits & np.uint32(0x7FFFFFFF)
    small = mag < _F16_MIN_NORMAL
    if small.any():
        r[small] = (np.rint(x[small] * F32(2.0**24)) * F32(2.0**-24)).view(np.uint32)
    big = mag >= _F16_OVERFLOW
    if big.any():
        nan = mag > np.uint32(0x7F800000)
        r[big] = np.where(nan[big], bits[big], (bits[big] & np.uint32(0x80000000)) | np.uint32(0x7F800000))
    return r.view(F32)


def _round_bf16(x):
    bits = x.view(np.uint32)
    r = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    nan = np.isnan(x)
    if nan.any():  # ggml keeps NaN a (quiet) NaN: its upper half with the quiet bit set
        r[nan] = (bits[nan] & np.uint32(0xFFFF0000)) | np.uint32(0x00400000)
    return r.view(F32)


def round_activations(x: np.ndarray, act: str):
    """x [M, K] rounded as ggml converts it to `act` (a vec_dot_type) and back: (x~ float32,
    the Q8_1 correction [M, K/32] or None)."""
    x = np.ascontiguousarray(x, dtype=F32)
    if act == "f16":
        return _round_f16(x), None
    if act == "bf16":
        return _round_bf16(x), None
    if act in ("q8_0", "q8_1"):
        return native.round_q8(x, act == "q8_1") or _round_q8_0(x, with_sum=act == "q8_1")
    if act == "q8_K":
        return _round_q8_k(x), None
    raise ValueError(f"unknown activation type {act!r}")


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
