"""numpy backend: float32 (or float64 for gradient checks); matmuls through BLAS.

Kernels write into planned `out` buffers and avoid temporaries where numpy allows it.
"""

from __future__ import annotations

import threading

import numpy as np

from llmtune.backends.base import Backend


def _sigmoid_into(out, x):
    np.negative(x, out=out)
    np.exp(out, out=out)
    out += 1.0
    np.reciprocal(out, out=out)
    return out


def k_add(out, a, b):
    return np.add(a, b, out=out)


def k_mul(out, a, b):
    return np.multiply(a, b, out=out)


def k_scale(out, a, s):
    return np.multiply(a, a.dtype.type(s), out=out)


def k_sum_to(out, x, shape):
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1)
    out[...] = x.sum(axis=axes).reshape(shape)
    return out


def k_broadcast_to(out, x, shape):
    return np.broadcast_to(x, shape)


def k_silu(out, x):
    _sigmoid_into(out, x)
    return np.multiply(out, x, out=out)


def k_silu_back(out, x, g):
    s = _sigmoid_into(np.empty_like(x), x)
    # d silu = s * (1 + x * (1 - s))
    np.subtract(1.0, s, out=out)
    out *= x
    out += 1.0
    out *= s
    out *= g
    return out


def k_swiglu(out, gate, up):
    _sigmoid_into(out, gate)
    out *= gate
    out *= up
    return out


def k_swiglu_back(out, gate, up, g, wrt):
    s = _sigmoid_into(np.empty_like(gate), gate)
    if wrt == 1:  # d/d up = silu(gate) * g
        np.multiply(s, gate, out=out)
        out *= g
        return out
    np.subtract(1.0, s, out=out)
    out *= gate
    out += 1.0
    out *= s
    out *= up
    out *= g
    return out


def k_matmul(out, a, b, ta, tb):
    if ta:
        a = np.swapaxes(a, -1, -2)
    if tb:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b, out=out)


def k_reshape(out, x, shape):
    return x.reshape(shape)


def k_permute(out, x, axes):
    return x.transpose(axes)


def k_cont(out, x):
    np.copyto(out, x)
    return out


def _axis_slice(ndim, axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


def k_slice(out, x, axis, start, stop):
    return x[_axis_slice(x.ndim, axis, start, stop)]


def k_pad(out, x, axis, start):
    out.fill(0)
    out[_axis_slice(x.ndim, axis, start, start + x.shape[axis])] = x
    return out


def k_get_rows(out, w, ids):
    return np.take(w, ids, axis=0, out=out)


def k_add_rows(out, g, ids, n_rows):
    """out = zeros; out[ids[i]] += g[i]: sort once, reduce runs of equal ids (no np.add.at)."""
    flat = ids.reshape(-1)
    rows = g.reshape(flat.size, -1)
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    out.fill(0)
    out[sorted_ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
    return out


def k_rms_norm(out, x, eps):
    ms = np.einsum("...i,...i->...", x, x)[..., None]
    ms /= x.shape[-1]
    ms += eps
    np.sqrt(ms, out=ms)
    return np.divide(x, ms, out=out)


def k_rms_norm_back(out, x, g, eps):
    # y = x r, r = 1/sqrt(mean(x^2)+eps);  dx = r (g - y mean(g y))
    n = x.shape[-1]
    r = np.einsum("...i,...i->...", x, x)[..., None]
    r /= n
    r += eps
    np.sqrt(r, out=r)
    np.reciprocal(r, out=r)
    gx = np.einsum("...i,...i->...", g, x)[..., None]
    gx *= r * r / n  # mean(g y) / r
    np.multiply(x, gx, out=out)
    np.subtract(g, out, out=out)
    out *= r
    return out


class _RopeCache:
    def __init__(self):
        self._tables = {}

    def get(self, pos, n_rot, base, freq_scale, dtype):
        key = (pos.tobytes(), n_rot, base, freq_scale, np.dtype(dtype).str)
        tab = self._tables.get(key)
        if tab is None:
            inv_freq = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
            theta = freq_scale * pos.astype(np.float64)[:, None] * inv_freq[None, :]
            tab = (np.cos(theta).astype(dtype), np.sin(theta).astype(dtype))
            if len(self._tables) > 64:
                self._tables.clear()
            self._tables[key] = tab
        return tab


def _rope_kernel(cache):
    def k_rope(out, x, pos, n_rot, base, freq_scale, mode, inverse):
        cos, sin = cache.get(pos, n_rot, base, freq_scale, x.dtype)
        if inverse:
            sin = -sin
        # x[B, T, H, d]; tables [T, n_rot/2] broadcast over batch and heads
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        half = n_rot // 2
        if mode == "norm":
            x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            o0, o1 = out[..., 0:n_rot:2], out[..., 1:n_rot:2]
        else:
            x0, x1 = x[..., :half], x[..., half:n_rot]
            o0, o1 = out[..., :half], out[..., half:n_rot]
        t = x1 * sin
        np.multiply(x0, cos, out=o0)
        o0 -= t
        np.multiply(x0, sin, out=t)
        np.multiply(x1, cos, out=o1)
        o1 += t
        if n_rot < x.shape[-1]:
            out[..., n_rot:] = x[..., n_rot:]
        return out

    return k_rope


class _MaskCache:
    def __init__(self):
        self._masks = {}

    def get(self, rows, n_kv, n_q, n_past, dtype):
        key = (rows, n_kv, n_q, n_past, np.dtype(dtype).str)
        m = self._masks.get(key)
        if m is None:
            qpos = n_past + (np.arange(rows) % n_q)
            m = np.where(np.arange(n_kv)[None, :] <= qpos[:, None], 0.0, -np.inf).astype(dtype)
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[key] = m
        return m


def _softmax_kernel(cache):
    def k_softmax_causal(out, x, scale, n_q, n_past):
        mask = cache.get(x.shape[-2], x.shape[-1], n_q, n_past, x.dtype)
        np.multiply(x, x.dtype.type(scale), out=out)
        out += mask
        out -= out.max(axis=-1, keepdims=True)
        np.exp(out, out=out)
        out /= out.sum(axis=-1, keepdims=True)
        return out

    return k_softmax_causal


def k_softmax_back(out, y, g, scale):
    dot = np.einsum("...i,...i->...", g, y)[..., None]
    np.subtract(g, dot, out=out)
    out *= y
    out *= y.dtype.type(scale)
    return out


class _CrossEntropy:
    """Fused softmax + cross-entropy. The forward leaves softmax(logits) in a reused scratch
    buffer (a fresh [rows, vocab] temporary costs more in page faults than the exp itself) and
    the backward of the same logits consumes it instead of recomputing four passes.
    State is per thread: programs may run concurrently on one backend (one per core)."""

    def __init__(self):
        self._local = threading.local()

    @property
    def scratch(self):
        local = self._local
        if not hasattr(local, "scratch"):
            local.scratch = _Scratch()
        return local.scratch

    @property
    def probs_of(self):  # (address, shape) of the logits whose softmax the scratch holds
        return getattr(self._local, "probs_of", None)

    @probs_of.setter
    def probs_of(self, key):
        self._local.probs_of = key

    def forward(self, out, logits, targets):
        logits2 = logits.reshape(-1, logits.shape[-1])
        t = targets.reshape(-1)
        probs = self.scratch.get(logits2.shape, logits2.dtype)
        mx = logits2.max(axis=-1, keepdims=True)
        np.subtract(logits2, mx, out=probs)
        np.exp(probs, out=probs)
        total = probs.sum(axis=-1, keepdims=True)
        probs /= total
        lse = np.log(total[:, 0]) + mx[:, 0]
        out[...] = np.mean(lse - logits2[np.arange(t.size), t])
        self.probs_of = (logits.__array_interface__["data"][0], logits.shape)
        return out

    def backward(self, out, logits, targets, g):
        logits2 = logits.reshape(-1, logits.shape[-1])
        o2 = out.reshape(logits2.shape)
        t = targets.reshape(-1)
        if self.probs_of == (logits.__array_interface__["data"][0], logits.shape):
            np.copyto(o2, self.scratch.get(logits2.shape, logits2.dtype))
            self.probs_of = None
        else:
            np.subtract(logits2, logits2.max(axis=-1, keepdims=True), out=o2)
            np.exp(o2, out=o2)
            o2 /= o2.sum(axis=-1, keepdims=True)
        o2[np.arange(t.size), t] -= 1.0
        o2 *= g / t.size
        return out


class _Scratch:
    """One reusable buffer per (shape, dtype) for kernels that need a temporary."""

    def __init__(self):
        self._bufs = {}

    def get(self, shape, dtype):
        key = (tuple(shape), np.dtype(dtype).str)
        buf = self._bufs.get(key)
        if buf is None:
            if len(self._bufs) > 8:
                self._bufs.clear()
            buf = self._bufs[key] = np.empty(shape, dtype)
        return buf


def k_count_correct(out, logits, targets):
    out[...] = np.count_nonzero(logits.argmax(axis=-1) == targets)
    return out


class CPUBackend(Backend):
    name = "cpu"

    def __init__(self, dtype=np.float32):
        super().__init__(dtype)
        self.kernels = {
            name[2:]: fn for name, fn in globals().items() if name.startswith("k_") and callable(fn)
        }
        self.kernels["rope"] = _rope_kernel(_RopeCache())
        self.kernels["softmax_causal"] = _softmax_kernel(_MaskCache())
        ce = _CrossEntropy()
        self.kernels["cross_entropy"] = ce.forward
        self.kernels["cross_entropy_back"] = ce.backward

    def asarray(self, host, dtype=None):
        host = np.asarray(host)
        return np.require(host, dtype=dtype or host.dtype, requirements="C")

    def to_numpy(self, arr):
        return np.asarray(arr)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype or self.dtype)

    def arena(self, nbytes):
        raw = np.empty(max(int(nbytes), 1) + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64  # 64-byte (cache line / AVX-512) alignment for every planned view
        return raw[start : start + max(int(nbytes), 1)]

    def view(self, arena, shape, dtype, offset=0):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return arena[offset : offset + n].view(dtype).reshape(shape)

    def accumulate(self, dst, src):
        np.add(dst, src, out=dst)

    def adamw_step(self, w, g, m, v, *, lr, beta1, beta2, eps, wd, t):
        # ggml_opt_step_adamw: decoupled decay, bias-corrected moments, eps after the sqrt.
        # Blocked so every temporary stays in cache: one trip through memory, not ten.
        c1, c2 = 1.0 / (1.0 - beta1**t), 1.0 / (1.0 - beta2**t)
        keep = 1.0 - lr * wd
        n, blk = w.size, 1 << 15
        tmp = np.empty(blk, dtype=w.dtype)
        for s in range(0, n, blk):
            ws, gs, ms, vs = w[s : s + blk], g[s : s + blk], m[s : s + blk], v[s : s + blk]
            tt = tmp[: ws.size]
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

    def sgd_step(self, w, g, *, lr, wd):
        if wd:
            w *= 1.0 - lr * wd
        w -= lr * g
