"""What a block type's bytes and ggml's activation rounding mean, in numpy: the decoders of every
storage type a frozen matrix keeps (rows of block bytes -> float32) and the rounding ggml's CPU matmul
applies to activations before its dot products (ggml-cpu.c ggml_compute_forward_mul_mat converts src1
to the weight type's `vec_dot_type`):

| weight type | vec_dot_type | rounding of each activation row |
| --- | --- | --- |
| F16 | F16 | x -> fp16 (round to nearest even) |
| BF16 | BF16 | x -> bf16 (round to nearest even, ggml_compute_fp32_to_bf16) |
| Q8_0, Q4_0, Q5_0 | Q8_0 | blocks of 32: d = amax/127 (stored fp16), q = rint(x * 127/amax) |
| Q4_1, Q5_1 | Q8_1 | as Q8_0, plus s = fp16(d * sum(q)) (d unrounded) for the weight's min term |
| Q4_K, Q5_K, Q6_K | Q8_K | blocks of 256: iscale = -127/x[argmax|x|], q = min(127, rint(iscale x)), d = 1/iscale (f32)
|

(x86 AVX2/AVX-512 builds: quantize_row_q8_0/q8_1 of ggml-cpu/arch/x86/quants.c, which round half
to even and scale by 127/amax; quantize_row_q8_K_ref for Q8_K.)

These are the references: the CPU backend's products (backends/cpu/products.py) and its compiled
decoders (backends/cpu/native/dequant.c) compute the same values, and the CUDA kernels are tested
against them. The compiled decoders, when the CPU backend has loaded them, take over
`dequantize_rows` (`use_compiled_decoder`): this package sits below backends/ and cannot import them.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from llmtune.quant.types import qtype_of

F32 = np.float32

# float32 bytes dequantized per numpy pass: the temporaries of one pass stay in L2
_PASS_BYTES = 1 << 20
# the CPU backend's compiled decoders (the same values, ~10x faster): (raw, qtype, out) -> bool taken
_compiled_decoder: Optional[Callable[[np.ndarray, str, np.ndarray], bool]] = None


def use_compiled_decoder(decoder: Optional[Callable[[np.ndarray, str, np.ndarray], bool]]) -> None:
    """Let `dequantize_rows` hand float32 rows to `decoder` first (it returns False where it
    declines: no build, LLMTUNE_NATIVE=0, a type it does not take); None: numpy only."""
    global _compiled_decoder
    _compiled_decoder = decoder

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
    if _compiled_decoder is not None and _compiled_decoder(raw, qtype, out):
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
        return _round_q8_0(x, with_sum=act == "q8_1")
    if act == "q8_K":
        return _round_q8_k(x), None
    raise ValueError(f"unknown activation type {act!r}")
