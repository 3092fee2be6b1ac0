"""Block-wise 8-bit quantization with bitsandbytes' "dynamic" map: the storage of AdamW8bit's
moments (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2021).

Each block of up to BLOCK consecutive values (a block never spans two tensors) keeps one absmax,
the largest |x| in it, and one byte per value: the index of the map entry nearest x / absmax.
The map (bitsandbytes.functional.create_dynamic_map, max_exponent_bits=7, total_bits=8) is a
dynamic-exponent float: 10^-6..1 in 7 decades, each decade finer than the one below it, plus 0 and
1.0 exactly; the signed map (first moments) spends the byte on both signs, the unsigned one (second
moments, never negative) on twice the resolution of positive values.
"""

from __future__ import annotations

import functools

import numpy as np

# values per absmax: bitsandbytes' BLOCKSIZE_2STATE today (csrc/ops.cu; the paper and bitsandbytes up to
# 0.44 used 2048, which lets one large gradient in a block zero the second moments of the others:
# BENCHMARKS.md, "8-bit AdamW", measures both)
BLOCK = 256
_DECADES = 7  # max_exponent_bits


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted float32 values of bitsandbytes' create_dynamic_map(signed): in decade i
    (scale 10^(i-6)) the midpoints of 2^i (signed) or 2^(i+1) (unsigned) equal steps of 0.1..1."""
    values = [0.0, 1.0]
    for i in range(_DECADES):
        steps = 2**i if signed else 2 ** (i + 1)
        bounds = np.linspace(0.1, 1.0, steps + 1, dtype=np.float32)  # torch.linspace's float32 bounds
        means = ((bounds[:-1] + bounds[1:]) / np.float32(2)).astype(np.float64)
        scale = 10.0 ** (i - (_DECADES - 1))
        values += list(scale * means) + (list(-scale * means) if signed else [])
    assert len(values) == 256
    out = np.array(sorted(values), dtype=np.float32)
    out.flags.writeable = False
    return out


def midpoints(code: np.ndarray) -> np.ndarray:
    """The 255 boundaries between neighbouring map entries, (c[i] + c[i+1]) * 0.5 in the map's
    float type (the CUDA kernel computes the same values the same way)."""
    return (code[:-1] + code[1:]) * code.dtype.type(0.5)


_BUCKET_SHIFT = 15  # float32 bits >> 15: sign, exponent and 8 mantissa bits (2^17 buckets)


@functools.lru_cache(maxsize=None)
def _bucket_table(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(table, midpoints + inf) for quantizing float32 without a binary search: table[bits >> 15]
    is the number of midpoints below the smallest float of that bucket; no bucket holds more than
    one midpoint (checked), so the entry is table[k] + (midpoint[table[k]] < x)."""
    mid = midpoints(dynamic_map(signed))
    bits = np.arange(1 << (32 - _BUCKET_SHIFT), dtype=np.uint64) << _BUCKET_SHIFT
    ends = [b.astype(np.uint32).view(np.float32) for b in (bits, bits | ((1 << _BUCKET_SHIFT) - 1))]
    lo, hi = np.fmin(*ends), np.fmax(*ends)
    finite = np.isfinite(lo) & np.isfinite(hi)
    table = np.where(finite, np.searchsorted(mid, lo, side="left"), 0)
    assert np.all(np.searchsorted(mid, hi[finite], side="left") <= table[finite] + 1)
    return table.astype(np.int32), np.append(mid, np.float32(np.inf))


def nearest(x: np.ndarray, code: np.ndarray, signed: bool) -> np.ndarray:
    """The number of midpoints of `code` (dynamic_map(signed), in x's float type) below each x:
    the index of its nearest entry, ties to the lower one (np.searchsorted(midpoints, x) exactly;
    float32 through the bucket table)."""
    if x.dtype != np.float32:
        return np.searchsorted(midpoints(code), x, side="left")
    table, mid = _bucket_table(signed)
    q = table[x.view(np.uint32) >> _BUCKET_SHIFT]
    q += mid[q] < x
    return q


def block_starts(sizes, block: int = BLOCK) -> np.ndarray:
    """int64 [n_blocks + 1]: where each block starts in a flat buffer of tensors of these sizes
    laid end to end (every tensor starts a block, as bitsandbytes keeps one state per tensor), then
    the total."""
    starts, offset = [], 0
    for size in sizes:
        starts.extend(range(offset, offset + int(size), block))
        offset += int(size)
    return np.array(starts + [offset], dtype=np.int64)


def block_absmax(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The largest |x| of each block (starts relative to x, last entry x.size)."""
    if x.size == 0:
        return np.zeros(0, dtype=x.dtype)
    return np.maximum.reduceat(np.abs(x), starts[:-1])


def quantize(x: np.ndarray, starts: np.ndarray, code: np.ndarray, keep_sign: bool = False):
    """(codes uint8, absmax) of x: per block absmax, then each x / absmax to the nearest map entry
    (ties to the lower one; an all-zero block stores 0 / absmax 0). keep_sign: a value whose entry
    has the other sign (a small negative rounding to +0) moves one entry towards its own sign, as
    bitsandbytes' kOptimizerStatic8bit2StateBlockwise does for the first moment."""
    absmax = block_absmax(x, starts)
    # an all-zero block divides by 1 (its values stay 0); a plain division, as the CUDA kernel's
    scaled = x / np.repeat(np.where(absmax > 0, absmax, absmax.dtype.type(1)), np.diff(starts))
    q = nearest(scaled, code.astype(x.dtype), signed=bool(code[0] < 0))
    if keep_sign:
        flip = (q < int(np.searchsorted(code, 0))) != (scaled < 0)  # entries below 0's index are negative
        q[flip] += np.where(scaled[flip] > 0, 1, -1)
    return q.astype(np.uint8), absmax


def dequantize(q: np.ndarray, absmax: np.ndarray, starts: np.ndarray, code: np.ndarray) -> np.ndarray:
    """code[q] * the block's absmax, in absmax's float type."""
    return code.astype(absmax.dtype)[q] * np.repeat(absmax, np.diff(starts))
