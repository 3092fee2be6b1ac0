"""Tensor quantization: ggml block formats, with the K-quants (Q4_K, Q5_K, Q6_K) in vectorized numpy.

The `gguf` package quantizes F16, BF16, Q8_0, Q4_0/1 and Q5_0/1 but only *de*quantizes the K-quants.
This module follows ggml's reference quantizers (ggml-quants.c: quantize_row_q{4,5,6}_K_ref with
make_qkx2_quants / make_qx_quants), which is what llama-quantize runs when no importance matrix is
given. Blocks are laid out byte for byte as ggml's block_q4_K / block_q5_K / block_q6_K, so
`gguf.quants.dequantize` and llama.cpp read them back.

Every sub-block search runs for all blocks at once: the per-row loops of the C code become loops
over the (few) candidate scales, each step a whole-array numpy expression. Arithmetic stays in
float32 and sums run in the C loops' order, so the bytes equal those of an element-by-element
float32 port of the reference (tests/kquant_ref.py). A llama.cpp build that fuses a*b+c into FMA
can break an occasional near-tie between two candidate scales the other way.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

QK_K = 256  # elements per K-quant super-block
GROUP_MAX_EPS = np.float32(1e-15)  # ggml: a group whose |x| max is below this is all zeros
_CHUNK_BLOCKS = 512  # super-blocks per step: temporaries of 128K floats stay in cache (2x faster than 4096)

F32 = np.float32


def block_size(qtype: QT) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: QT) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][1]


def row_fits(n_cols: int, qtype: QT) -> bool:
    """Whether a row of `n_cols` values splits into whole blocks of `qtype`."""
    return n_cols % block_size(qtype) == 0


def nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    """Bytes a tensor of logical `shape` takes when stored as `qtype`."""
    n = int(np.prod(shape))
    return n // block_size(qtype) * type_size(qtype)


# --- public entry -------------------------------------------------------------------------------


def quantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """`data` (float, logical shape) encoded as `qtype`, in the form the GGUF writer takes.

    F32 / F16 come back as float arrays; every other type as uint8 blocks in "byte shape"
    (last axis = bytes per row), as `gguf.quants.quantize` returns them.
    """
    x = np.asarray(data, dtype=F32)
    if qtype == QT.F32:
        return np.ascontiguousarray(x)
    if qtype == QT.F16:
        return x.astype(np.float16)
    if qtype in _K_QUANTIZERS:
        return _quantize_k(x, qtype)
    return gguf.quants.quantize(x, qtype)


def dequantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """The float32 values of `data` stored as `qtype` (logical shape)."""
    if qtype == QT.F32:
        return np.asarray(data, dtype=F32)
    if qtype == QT.F16:
        return np.asarray(data, dtype=np.float16).astype(F32)
    return gguf.quants.dequantize(np.asarray(data), qtype)


def _quantize_k(x: np.ndarray, qtype: QT) -> np.ndarray:
    if x.ndim == 0 or not row_fits(x.shape[-1], qtype):
        raise ValueError(f"row size {x.shape[-1] if x.ndim else 0} is not a multiple of {QK_K} ({qtype.name})")
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], type_size(qtype)), dtype=np.uint8)
    quantize_blocks = _K_QUANTIZERS[qtype]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = quantize_blocks(np.ascontiguousarray(blocks[start:stop]))
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * type_size(qtype))


# --- ggml's sub-block scale searches, vectorized over rows -----------------------------------------
#
# Internally the values of a group run along axis 0 and the groups along axis 1 ("column" layout,
# (n, rows)): numpy then reduces over axis 0 one element after the other, the order of ggml's C loops,
# so near-ties between candidate scales are broken exactly as the reference breaks them.


def _levels(iscale: np.ndarray, shifted: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """nearest_int(iscale * x) clamped to [lo, hi]; ggml's nearest_int rounds half to even like rint."""
    return np.clip(np.rint(iscale * shifted), lo, hi)


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Affine fit x ~ scale * L - the_min with L in [0, nmax], per row (ggml make_qkx2_quants).

    Starts from the min/max fit, then tries nstep+1 stretched grids; each candidate gets the weighted
    least-squares scale and min for its levels, and the one with the lowest weighted squared error wins.
    `x`, `weights`: (rows, n). Returns (scale, the_min, L) with L (rows, n) float32 levels.
    """
    xt = np.ascontiguousarray(x.T, dtype=F32)
    w = np.ascontiguousarray(weights.T, dtype=F32)
    xmax = xt.max(axis=0)
    xmin = np.minimum(xt.min(axis=0), F32(0))
    flat = xmax == xmin
    sum_w = w.sum(axis=0)
    sum_x = (w * xt).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (xmax - xmin)
        scale = F32(1) / iscale
        levels = _levels(iscale, xt - xmin, 0, nmax)
        best_err = _weighted_sq_err(scale, xmin, levels, xt, w)
        mn = xmin.copy()
        for step in range(nstep + 1):
            # the grid is stretched around the *current* best min, as in ggml
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (xmax - mn)
            cand = _levels(iscale, xt - mn, 0, nmax)
            wl = w * cand
            sum_l = wl.sum(axis=0)
            sum_l2 = (wl * cand).sum(axis=0)
            sum_xl = (wl * xt).sum(axis=0)
            det = sum_w * sum_l2 - sum_l * sum_l
            c_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            c_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = c_min > 0  # a positive min cannot be stored: refit the scale with min = 0
            c_scale = np.where(positive, sum_xl / sum_l2, c_scale)
            c_min = np.where(positive, F32(0), c_min)
            err = _weighted_sq_err(c_scale, c_min, cand, xt, w)
            better = (det > 0) & (err < best_err)
            levels = np.where(better, cand, levels)
            best_err = np.where(better, err, best_err)
            scale = np.where(better, c_scale, scale)
            mn = np.where(better, c_min, mn)
    scale = np.where(flat, F32(0), scale).astype(F32)
    mn = np.where(flat, xmin, mn).astype(F32)
    levels[:, flat] = 0
    return scale, -mn, levels.T


def _weighted_sq_err(scale, mn, levels, xt, w):
    diff = scale * levels + mn - xt
    return (w * (diff * diff)).sum(axis=0)


def make_qx_quants(x: np.ndarray, nmax: int):
    """Symmetric fit x ~ scale * (L - nmax) with L in [0, 2*nmax), per row (ggml make_qx_quants, rmse_type 1).

    The scale is signed so the largest-magnitude value maps to -nmax exactly; 18 nearby grids are
    tried and the x^2-weighted least-squares scale of the best one kept. `x`: (rows, n).
    Returns (scale, L) with L (rows, n) float32 levels.
    """
    xt = np.ascontiguousarray(x.T, dtype=F32)
    vmax = xt[np.abs(xt).argmax(axis=0), np.arange(xt.shape[1])]
    zero = np.abs(vmax) < GROUP_MAX_EPS
    vmax = np.where(zero, F32(1), vmax)
    w = xt * xt
    wx = w * xt

    def fit(iscale):
        lv = _levels(iscale, xt, -nmax, nmax - 1)
        return lv, (wx * lv).sum(axis=0), (w * lv * lv).sum(axis=0)

    with np.errstate(divide="ignore", invalid="ignore"):
        levels, sumlx, suml2 = fit(-F32(nmax) / vmax)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            cand, slx, sl2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / vmax)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            levels = np.where(better, cand, levels)
            scale = np.where(better, slx / sl2, scale)
            best = np.where(better, scale * slx, best)
    levels = levels + nmax
    levels[:, zero] = 0
    return np.where(zero, F32(0), scale).astype(F32), levels.T


# --- Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins ---------------------------------------


def _fit_scale_min_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared Q4_K/Q5_K step: per-sub-block affine fit, 6-bit scales/mins, then requantized levels.

    Returns (d, dmin as float16 (nb,), packed 12-byte scales (nb, 12), levels uint8 (nb, 256)).
    """
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    av_x = np.sqrt(np.ascontiguousarray((sub * sub).T).sum(axis=0) / F32(32))  # ggml order (see above)
    weights = av_x[:, None] + np.abs(sub)  # ggml: emphasise large values, floor at the RMS
    scales, mins, levels = make_qkx2_quants(sub, weights, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.clip(np.rint(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    d = (max_scale / F32(63)).astype(np.float16)
    dmin = (max_min / F32(63)).astype(np.float16)

    # requantize against the scales as they will be decoded (fp16 super-scale x 6-bit sub-scale)
    d_sub = (d.astype(F32)[:, None] * ls)[..., None]
    m_sub = (dmin.astype(F32)[:, None] * lm)[..., None]
    xb = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(np.rint((xb + m_sub) / d_sub), 0, nmax)
    levels = np.where(d_sub != 0, requant, levels.reshape(nb, 8, 32))
    return d, dmin, _pack_scale_min_k4(ls, lm), levels.reshape(nb, QK_K).astype(np.uint8)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into ggml's 12-byte layout (inverse of get_scale_min_k4)."""
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """(nb, 256) float32 -> (nb, 144) block_q4_K bytes: d, dmin, scales[12], qs[128]."""
    d, dmin, scales, levels = _fit_scale_min_blocks(x, 15, -1.0, 0.1, 20)
    pairs = levels.reshape(-1, 4, 2, 32)  # each 64 values: low nibble = first 32, high = next 32
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


def quantize_q5_k_blocks(x: np.ndarray) -> np.ndarray:
    """(nb, 256) float32 -> (nb, 176) block_q5_K bytes: d, dmin, scales[12], qh[32], qs[128]."""
    d, dmin, scales, levels = _fit_scale_min_blocks(x, 31, -0.5, 0.1, 15)
    low = (levels & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (levels >> 4).reshape(-1, 8, 32)  # 5th bit of sub-block i goes to bit i of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs], axis=1)


# --- Q6_K: 16 sub-blocks of 16 with signed 8-bit scales -----------------------------------------------


def quantize_q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """(nb, 256) float32 -> (nb, 210) block_q6_K bytes: ql[128], qh[64], scales[16] (int8), d."""
    nb = x.shape[0]
    scales, levels = make_qx_quants(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    max_scale = scales[np.arange(nb), np.abs(scales).argmax(axis=1)]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d = (F32(1) / iscale).astype(np.float16)
    sc = np.clip(np.rint(iscale[:, None] * scales), -128, 127).astype(np.int8)

    d_sub = (d.astype(F32)[:, None] * sc)[..., None]
    xb = x.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(np.rint(xb / d_sub), -32, 31) + 32
    levels = np.where(d_sub != 0, requant, levels.reshape(nb, 16, 16)).astype(np.uint8).reshape(nb, 2, 4, 32)

    low = levels & 0xF  # per 128-half: ql[l] = q0 | q2 << 4, ql[32 + l] = q1 | q3 << 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(nb, 128)
    high = levels >> 4  # qh[l] holds the top 2 bits of q0..q3 at bit 0, 2, 4, 6
    qh = (high << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    out = np.concatenate([ql, qh.reshape(nb, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    out[zero] = 0  # ggml zeroes an all-zero block entirely
    return out


_K_QUANTIZERS = {
    QT.Q4_K: quantize_q4_k_blocks,
    QT.Q5_K: quantize_q5_k_blocks,
    QT.Q6_K: quantize_q6_k_blocks,
}

# Types `quantize` can produce.
QUANTIZABLE_TYPES = (
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K,
)
