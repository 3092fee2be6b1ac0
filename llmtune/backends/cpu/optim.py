"""The CPU backend's optimizer updates (as cuda/optim.py is the CUDA one's): AdamW
(ggml_opt_step_adamw), bitsandbytes' 8-bit AdamW, and the gradient's sum of squares, each split
over the cores in fixed ranges so the bits do not depend on their count; AdamW and the sum of
squares in one compiled pass where native/optim.c is built (the same bits as the numpy below)."""

from __future__ import annotations

import functools

import numpy as np

from llmtune.backends.cpu.native import kernels as native
from llmtune.backends.cpu.threads import parallel_ranges
from llmtune.quant import dynamic8

_ADAMW_BLOCK = 1 << 15  # elements per pass of the AdamW update: its temporary stays in L2
_SUMSQ_BLOCK = 1 << 16  # elements per partial sum of squares (a fixed split: the same bits on any core count)


def adamw_range(w, g, m, v, start, stop, *, lr, beta1, beta2, eps, wd, t):
    """The AdamW update of elements start..stop, one cache-sized block at a time: one trip
    through memory, not ten. In float32 one compiled pass (native.adamw, the same bits)."""
    if native.adamw(w[start:stop], g[start:stop], m[start:stop], v[start:stop], lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, wd=wd, t=t):
        return
    c1, c2 = 1.0 / (1.0 - beta1**t), 1.0 / (1.0 - beta2**t)
    keep = 1.0 - lr * wd
    tmp = np.empty(min(_ADAMW_BLOCK, stop - start), dtype=w.dtype)
    for s in range(start, stop, _ADAMW_BLOCK):
        e = min(s + _ADAMW_BLOCK, stop)
        ws, gs, ms, vs = w[s:e], g[s:e], m[s:e], v[s:e]
        tt = tmp[: e - s]
        ms *= beta1
        np.multiply(gs, 1.0 - beta1, out=tt)
        ms += tt
        vs *= beta2
        np.multiply(gs, gs, out=tt)
        tt *= 1.0 - beta2
        vs += tt
        np.multiply(vs, c2, out=tt)
        np.sqrt(tt, out=tt)
        tt += eps
        np.divide(ms, tt, out=tt)
        tt *= lr * c1
        if wd:
            ws *= keep
        ws -= tt


_ADAM8_CHUNK = 128  # quantization blocks per pass of the 8-bit AdamW update (32K values: in L2)


def adamw8bit_range(w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v, start, stop, *, lr, beta1, beta2,
                     eps, wd, t):
    """The 8-bit AdamW update of the blocks that start in start..stop, a few blocks at a time:
    dequantize, the AdamW update in the float type, requantize (new absmax per block)."""
    c1, c2 = 1.0 / (1.0 - beta1**t), 1.0 / (1.0 - beta2**t)
    keep = 1.0 - lr * wd
    first, last = np.searchsorted(starts[:-1], [start, stop])
    for b0 in range(first, last, _ADAM8_CHUNK):
        b1 = min(b0 + _ADAM8_CHUNK, last)
        s, e = starts[b0], starts[b1]
        local = starts[b0 : b1 + 1] - s
        gs = g[s:e]
        ms = dynamic8.dequantize(m[s:e], absmax_m[b0:b1], local, code_m)
        vs = dynamic8.dequantize(v[s:e], absmax_v[b0:b1], local, code_v)
        ms *= beta1
        ms += gs * (1.0 - beta1)
        vs *= beta2
        vs += gs * gs * (1.0 - beta2)
        upd = ms * c1
        upd /= np.sqrt(vs * c2) + eps
        upd *= lr
        ws = w[s:e]
        if wd:
            ws *= keep
        ws -= upd
        m[s:e], absmax_m[b0:b1] = dynamic8.quantize(ms, local, code_m, keep_sign=True)
        v[s:e], absmax_v[b0:b1] = dynamic8.quantize(vs, local, code_v)


def sum_squares(flat) -> float:
    """In float64 (a float32 square cannot overflow it: not finite means a NaN or inf), over
    fixed blocks split across the cores, the partials summed in block order: the same bits
    whatever the core count. One compiled read of the buffer (native.sum_squares)."""
    parts = np.zeros(-(-flat.size // _SUMSQ_BLOCK), np.float64)

    def part(start, stop):
        got = native.sum_squares(flat[start:stop], _SUMSQ_BLOCK)
        if got is None:
            # not np.dot: OpenBLAS splits a long dot over its threads, and the sum would follow their count
            got = [np.square(b).sum() for b in (flat[s : min(s + _SUMSQ_BLOCK, stop)].astype(np.float64)
                                                for s in range(start, stop, _SUMSQ_BLOCK))]
        parts[start // _SUMSQ_BLOCK : start // _SUMSQ_BLOCK + len(got)] = got

    parallel_ranges(part, flat.size, _SUMSQ_BLOCK)
    return float(np.sum(parts))


def adamw_step(w, g, m, v, *, lr, beta1, beta2, eps, wd, t) -> None:
    # ggml_opt_step_adamw: decoupled decay, bias-corrected moments, eps after the sqrt.
    # Elementwise, so a large buffer splits over the cores (numpy releases the GIL) with the
    # same bits; each part is blocked so its temporaries stay in cache.
    step = functools.partial(adamw_range, w, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd, t=t)
    parallel_ranges(step, w.size, _ADAMW_BLOCK)


def adamw8bit_step(w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v, *, lr, beta1, beta2, eps, wd, t) -> None:
    # bitsandbytes' AdamW8bit (kOptimizerStatic8bit2StateBlockwise): blocks are independent,
    # so the buffer splits over the cores at block starts with the same bits
    step = functools.partial(adamw8bit_range, w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v,
                             lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd, t=t)
    parallel_ranges(step, w.size, dynamic8.BLOCK)
