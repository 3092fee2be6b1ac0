"""Scalar, element-by-element float32 ports of ggml's reference K-quant quantizers (test oracle).

Deliberately written as plain loops in the order of ggml-quants.c (quantize_row_q4_K_ref,
quantize_row_q5_K_ref, quantize_row_q6_K_ref) so the vectorized versions in llmtune.quant.blocks
can be checked block by block. Slow: only for a handful of blocks.
"""

from __future__ import annotations

import numpy as np

f = np.float32
QK_K = 256
EPS = f(1e-15)


def _nearest(v) -> int:
    return int(np.rint(f(v)))


def make_qkx2(x, w, nmax, rmin, rdelta, nstep):
    n = len(x)
    lo, hi = x[0], x[0]
    sum_w = w[0]
    sum_x = f(sum_w * x[0])
    for i in range(1, n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sum_w = f(sum_w + w[i])
        sum_x = f(sum_x + f(w[i] * x[i]))
    lo = min(lo, f(0))
    if hi == lo:
        return f(0), f(-lo), [0] * n
    iscale = f(f(nmax) / f(hi - lo))
    scale = f(f(1) / iscale)
    L = [max(0, min(nmax, _nearest(f(iscale * f(x[i] - lo))))) for i in range(n)]
    best = f(0)
    for i in range(n):
        diff = f(f(f(scale * f(L[i])) + lo) - x[i])
        best = f(best + f(w[i] * f(diff * diff)))
    for step in range(nstep + 1):
        iscale = f(f(f(f(rmin) + f(f(rdelta) * f(step))) + f(nmax)) / f(hi - lo))
        aux = []
        sum_l = sum_l2 = sum_xl = f(0)
        for i in range(n):
            v = f(iscale * f(x[i] - lo))
            lv = max(0, min(nmax, _nearest(v))) if np.isfinite(v) else 0
            aux.append(lv)
            wl = f(w[i] * f(lv))
            sum_l = f(sum_l + wl)
            sum_l2 = f(sum_l2 + f(wl * f(lv)))
            sum_xl = f(sum_xl + f(wl * x[i]))
        det = f(f(sum_w * sum_l2) - f(sum_l * sum_l))
        if det > 0:
            this_scale = f(f(f(sum_w * sum_xl) - f(sum_x * sum_l)) / det)
            this_min = f(f(f(sum_l2 * sum_x) - f(sum_l * sum_xl)) / det)
            if this_min > 0:
                this_min = f(0)
                this_scale = f(sum_xl / sum_l2)
            err = f(0)
            for i in range(n):
                diff = f(f(f(this_scale * f(aux[i])) + this_min) - x[i])
                err = f(err + f(w[i] * f(diff * diff)))
            if err < best:
                L, best, scale, lo = aux, err, this_scale, this_min
    return scale, f(-lo), L


def make_qx(x, nmax):
    n = len(x)
    amax, vmax = f(0), f(0)
    for v in x:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    if amax < EPS:
        return f(0), [0] * n

    def fit(iscale):
        L, slx, sl2 = [], f(0), f(0)
        for v in x:
            lv = max(-nmax, min(nmax - 1, _nearest(f(iscale * v))))
            L.append(lv + nmax)
            w = f(v * v)
            slx = f(slx + f(f(w * v) * f(lv)))
            sl2 = f(sl2 + f(f(w * f(lv)) * f(lv)))
        return L, slx, sl2

    L, sumlx, suml2 = fit(f(f(-nmax) / vmax))
    scale = f(sumlx / suml2) if suml2 else f(0)
    best = f(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        cand, slx, sl2 = fit(f(f(-(f(nmax) + f(f(0.1) * f(step)))) / vmax))
        if sl2 > 0 and f(slx * slx) > f(best * sl2):
            L, scale = cand, f(slx / sl2)
            best = f(scale * slx)
    return scale, L


def _k4_block(x, nmax, rmin, rdelta, nstep):
    L = [0] * QK_K
    scales, mins = [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        sum_x2 = f(0)
        for v in sub:
            sum_x2 = f(sum_x2 + f(v * v))
        av_x = f(np.sqrt(f(sum_x2 / f(32))))
        w = [f(av_x + abs(v)) for v in sub]
        s, m, lv = make_qkx2(sub, w, nmax, rmin, rdelta, nstep)
        scales.append(s)
        mins.append(m)
        L[32 * j:32 * j + 32] = lv
    max_scale = max([f(0)] + scales)
    max_min = max([f(0)] + mins)
    inv_s = f(f(63) / max_scale) if max_scale > 0 else f(0)
    inv_m = f(f(63) / max_min) if max_min > 0 else f(0)
    ls = [min(63, max(0, _nearest(f(inv_s * s)))) for s in scales]
    lm = [min(63, max(0, _nearest(f(inv_m * m)))) for m in mins]
    d = np.float16(f(max_scale / f(63)))
    dmin = np.float16(f(max_min / f(63)))
    for j in range(8):
        dj = f(f(d) * f(ls[j]))
        if not dj:
            continue
        mj = f(f(dmin) * f(lm[j]))
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nearest(f(f(x[32 * j + i] + mj) / dj))))
    sc = np.zeros(12, np.uint8)
    for j in range(8):
        if j < 4:
            sc[j] = ls[j]
            sc[j + 4] = lm[j]
        else:
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            sc[j - 4] |= (ls[j] >> 4) << 6
            sc[j] |= (lm[j] >> 4) << 6
    head = np.array([d, dmin], np.float16).view(np.uint8)
    return head, sc, L


def q4_k_block(x) -> np.ndarray:
    x = [f(v) for v in x]
    head, sc, L = _k4_block(x, 15, -1.0, 0.1, 20)
    qs = np.zeros(128, np.uint8)
    for c in range(4):
        for j in range(32):
            qs[32 * c + j] = L[64 * c + j] | (L[64 * c + j + 32] << 4)
    return np.concatenate([head, sc, qs])


def q5_k_block(x) -> np.ndarray:
    x = [f(v) for v in x]
    head, sc, L = _k4_block(x, 31, -0.5, 0.1, 15)
    qh = np.zeros(32, np.uint8)
    ql = np.zeros(128, np.uint8)
    m1, m2 = 1, 2
    for c in range(4):
        for j in range(32):
            l1, l2 = L[64 * c + j], L[64 * c + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql[32 * c + j] = l1 | (l2 << 4)
        m1 <<= 2
        m2 <<= 2
    return np.concatenate([head, sc, qh, ql])


def q6_k_block(x) -> np.ndarray:
    x = [f(v) for v in x]
    L = [0] * QK_K
    scales = []
    for b in range(16):
        s, lv = make_qx(x[16 * b:16 * b + 16], 32)
        scales.append(s)
        L[16 * b:16 * b + 16] = lv
    amax, smax = f(0), f(0)
    for s in scales:
        if abs(s) > amax:
            amax, smax = abs(s), s
    if amax < EPS:
        return np.zeros(210, np.uint8)
    iscale = f(f(-128) / smax)
    d = np.float16(f(f(1) / iscale))
    sc = [min(127, _nearest(f(iscale * s))) for s in scales]
    for j in range(16):
        dj = f(f(d) * f(sc[j]))
        if not dj:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, _nearest(f(x[16 * j + i] / dj)))) + 32
    ql = np.zeros(128, np.uint8)
    qh = np.zeros(64, np.uint8)
    for h in range(2):
        base = 128 * h
        for r in range(32):
            q = [L[base + r + 32 * k] for k in range(4)]
            ql[64 * h + r] = (q[0] & 0xF) | ((q[2] & 0xF) << 4)
            ql[64 * h + r + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4)
            qh[32 * h + r] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
    return np.concatenate([ql, qh, np.array(sc, np.int8).view(np.uint8), np.array([d], np.float16).view(np.uint8)])
