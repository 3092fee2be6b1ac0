"""The CPU backend: numpy kernels in float32 (or float64 for gradient checks), matmuls through
BLAS, the compiled kernels of native/ where they are built (each tested against the numpy kernel it
stands in for), the products of stored matrices in products.py and the attention family in
attention.py.

Kernels write into planned `out` buffers and avoid temporaries where numpy allows it.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from llmtune.backends import vocab_chunks
from llmtune.backends.base import Backend, kernel_table
from llmtune.backends.cpu import attention, optim, pages, probes, products
from llmtune.backends.cpu.native import kernels as native, program as native_program
from llmtune.backends.cpu.threads import BlasTuner, blas_threads, cpu_workers
from llmtune.quant.qtensor import QTensor, evaluation_budget
from llmtune.resources import process_rss


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
    if native.swiglu(out, gate, up):  # one compiled pass (float32; numpy's passes below are the reference)
        return out
    _sigmoid_into(out, gate)
    out *= gate
    out *= up
    return out


def k_swiglu_back(out, gate, up, g, wrt):
    if native.swiglu_back(out, gate, up, g, wrt):
        return out
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


_GELU_C = float(np.sqrt(2.0 / np.pi))  # sqrt(2/pi)
_GELU_A = 0.044715


def _gelu_into(out, x):
    """0.5 x (1 + tanh(c x (1 + a x^2))) into out (out must not alias x)."""
    t = x.dtype.type
    np.multiply(x, x, out=out)
    out *= t(_GELU_A * _GELU_C)
    out += t(_GELU_C)
    out *= x
    np.tanh(out, out=out)
    out += t(1.0)
    out *= x
    out *= t(0.5)
    return out


def _gelu_grad_into(out, x):
    """d gelu / dx = 0.5 (1 + th) (1 + x (1 - th) c (1 + 3 a x^2)), th = tanh(c x (1 + a x^2));
    one temporary."""
    t = x.dtype.type
    th = np.multiply(x, x)
    th *= t(_GELU_A * _GELU_C)
    th += t(_GELU_C)
    th *= x
    np.tanh(th, out=th)
    np.subtract(t(1.0), th, out=th)  # 1 - th
    np.multiply(x, x, out=out)
    out *= t(3.0 * _GELU_A * _GELU_C)
    out += t(_GELU_C)
    out *= x
    out *= th
    out += t(1.0)
    np.subtract(t(2.0), th, out=th)  # 1 + th
    out *= th
    out *= t(0.5)
    return out


def k_gelu(out, x):
    return _gelu_into(out, x)


def k_gelu_back(out, x, g):
    _gelu_grad_into(out, x)
    out *= g
    return out


def k_geglu(out, gate, up):
    _gelu_into(out, gate)
    out *= up
    return out


def k_geglu_back(out, gate, up, g, wrt):
    if wrt == 1:  # d/d up = gelu(gate) * g
        _gelu_into(out, gate)
    else:  # d/d gate = gelu'(gate) * up * g
        _gelu_grad_into(out, gate)
        out *= up
    out *= g
    return out


def k_softcap(out, x, cap):
    """cap * tanh(x / cap); `out` may be `x`."""
    np.multiply(x, x.dtype.type(1.0 / cap), out=out)
    np.tanh(out, out=out)
    out *= out.dtype.type(cap)
    return out


def k_softcap_back(out, y, g, cap):
    """g * (1 - (y / cap)^2); `out` may be `y`."""
    np.multiply(y, y.dtype.type(1.0 / cap), out=out)
    np.square(out, out=out)
    np.subtract(out.dtype.type(1.0), out, out=out)
    out *= g
    return out


def _weight_product(a, b, ta, tb) -> bool:
    return tb and not ta and b.ndim == 2 and b.flags.c_contiguous and a.dtype == b.dtype


def _native_rows(out, a):
    """(out, a) as [rows, features] views for the compiled product, or None (a copy would be made)."""
    if a.flags.c_contiguous and out.flags.c_contiguous:
        return out.reshape(-1, out.shape[-1]), a.reshape(-1, a.shape[-1])
    return None


def _frozen_input_gradient(a, b, ta, tb):
    """The FloatCopies of W when this is g @ W for a 2-D weight registered as frozen (a training
    pass's backward through its base), else None."""
    if ta or tb or b.ndim != 2 or a.dtype != b.dtype:
        return None
    return products.frozen_copies(b)


def k_matmul(out, a, b, ta, tb):
    copies = _frozen_input_gradient(a, b, ta, tb)
    if copies is not None:
        rows = _native_rows(out, a)
        if rows is not None and products.packed_product(*rows, b, copies, transposed=True):
            return out
    if _weight_product(a, b, ta, tb):
        # a few rows times a weight matrix (a KV-cached decode step, a short prompt): the compiled
        # product over the cores (llmtune/native); one row without it: einsum, which streams W's
        # rows once, about twice OpenBLAS's sgemv_t when W is not in cache
        rows = _native_rows(out, a)
        if rows is not None and (native.f32_linear(*rows, b)
                                 or products.packed_product(*rows, b, products.frozen_copies(b))):
            return out  # (more rows: a training pass's frozen base through its packed copy, where kept)
        if a.size == a.shape[-1]:
            np.einsum("nk,k->n", b, a.reshape(-1), out=out.reshape(-1))
            return out
    if ta:
        a = np.swapaxes(a, -1, -2)
    if tb:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b, out=out)


def _lora_rows(out, y, x):
    x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    return out2, y.reshape(out2.shape), x2


def k_lora(out, y, x, a, b, s):
    """y + ((s x A^T) B^T) over x's rows (ops.lora); float32 in one compiled call (native.lora),
    this its reference."""
    out2, y2, x2 = _lora_rows(out, y, x)
    if native.lora(out2, y2, x2, a, b, s=s):
        return out
    t = x2 @ a.T
    t *= t.dtype.type(s)
    return np.add(y, (t @ b.T).reshape(out.shape), out=out)


def _lora_grads(out, x, a, b, g, dx):
    """ops.lora_back's packed buffer as (dx or None, dA, dB), and x, g as rows."""
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    n_dx = x.size if dx else 0
    d_x = out[:n_dx].reshape(x2.shape) if dx else None
    return (d_x, out[n_dx : n_dx + a.size].reshape(a.shape), out[n_dx + a.size :].reshape(b.shape)), x2, g2


def k_lora_back(out, x, a, b, g, s, dx):
    """[dx | dA | dB] of ops.lora (ops.lora_back): u = s (g B), t = s (x A^T), dx = u A,
    dA = u^T x, dB = g^T t; float32 in one compiled call (native.lora_back), this its reference."""
    (d_x, d_a, d_b), x2, g2 = _lora_grads(out, x, a, b, g, dx)
    if native.lora_back(d_x, d_a, d_b, x2, a, b, g2, s=s):
        return out
    scale = x.dtype.type(s)
    u = g2 @ b
    u *= scale
    t = x2 @ a.T
    t *= scale
    if dx:
        np.matmul(u, a, out=d_x)
    np.matmul(u.T, x2, out=d_a)
    np.matmul(g2.T, t, out=d_b)
    return out




def _bind_lora_back(out, x, a, b, g, s, dx):
    grads, x2, g2 = _lora_grads(out, x, a, b, g, dx)
    return native.bind_lora_back(*grads, x2, a, b, g2, s)




# a stored matrix is bound as its block bytes, or (an evaluation's weights, CPUBackend.bind) as
# products.WithCopies: the bytes and the float copies its products may keep
def _raw(w):
    return w.raw if type(w) is products.WithCopies else w


def _bind_matmul(out, a, b, ta, tb):
    """A replayed product of a few rows with a weight (or of a training pass's rows with a frozen
    weight, or its gradient through one, that has a packed copy) as one pre-bound compiled call
    (graph/planner.py Replay)."""
    copies = _frozen_input_gradient(a, b, ta, tb)
    if copies is not None:
        rows = _native_rows(out, a)
        return None if rows is None else products.bind_packed_product(*rows, b, copies, transposed=True)
    rows = _native_rows(out, a) if _weight_product(a, b, ta, tb) else None
    if rows is None:
        return None
    return native.bind_f32_linear(*rows, b) or products.bind_packed_product(*rows, b, products.frozen_copies(b))




def k_qlinear(out, x, w, qtype, round_x):
    if type(w) is products.WithCopies:
        if round_x and x.size <= native.MAX_ROWS * x.shape[-1] and x.flags.c_contiguous and out.flags.c_contiguous:
            # a few rows (a prompt, a decode step): the packed product where there is one, the
            # weight packed at its first product (as llama.cpp repacks at load)
            packed = w.packed(qtype)
            if packed is not None and native.qlinear_packed(out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]),
                                                            packed, w.raw, qtype):
                return out
        return products.qlinear(out, x, w.raw, qtype, round_x, w.copies)
    return products.qlinear(out, x, w, qtype, round_x)


def _bind_qlinear(out, x, w, qtype, round_x):
    """A replayed few-row product over stored blocks as one pre-bound compiled call; a training
    pass's product (activations unrounded) through its float copy's packed form likewise; or None."""
    if type(w) is products.WithCopies and not round_x:
        return _bind_packed_copy(out, x, w, qtype, transposed=False)
    return products.bind_qlinear(out, x, _raw(w), qtype, round_x)


def _bind_packed_copy(out, x, w, qtype, transposed: bool):
    """x @ W^T (transposed: the input gradient x @ W) over the packed form of W's decode, as
    qlinear / qlinear_back compute it when it is kept (FloatCopies.stored_pack), pre-bound; None
    otherwise."""
    rows = _native_rows(out, x)
    if rows is None:
        return None
    n_in = (out if transposed else x).shape[-1]
    return products.stored_packed_product(*rows, w.raw, qtype, n_in, w.copies, transposed, bind=True)




def k_qlinear_back(out, g, w, qtype):
    if type(w) is products.WithCopies:
        return products.qlinear_back(out, g, w.raw, qtype, w.copies)
    return products.qlinear_back(out, g, w, qtype)


def _bind_qlinear_back(out, g, w, qtype):
    return _bind_packed_copy(out, g, w, qtype, transposed=True) if type(w) is products.WithCopies else None


def k_qget_rows(out, w, ids, qtype):
    return products.qget_rows(out, _raw(w), ids, qtype)


def k_dequantize(out, w, qtype):
    return products.dequantize(out, _raw(w), qtype)


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
    if native.rms_norm(out, x, eps):  # float32: ggml's double sums, the rows over the cores
        return out
    ms = np.einsum("...i,...i->...", x, x)[..., None]
    ms /= x.shape[-1]
    ms += eps
    np.sqrt(ms, out=ms)
    return np.divide(x, ms, out=out)




def k_row_rnorm(out, x):
    ss = np.einsum("...i,...i->...", x, x)
    np.sqrt(ss, out=ss)
    return np.divide(1.0, ss, out=out)


def k_rms_norm_back(out, x, g, eps):
    # y = x r, r = 1/sqrt(mean(x^2)+eps);  dx = r (g - y mean(g y))
    if native.rms_norm_back(out, x, g, eps):  # float32 in one compiled pass over the cores
        return out
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


def k_layer_norm(out, x, eps):
    n = x.shape[-1]
    mean = x.sum(axis=-1, keepdims=True)
    mean /= n
    np.subtract(x, mean, out=out)
    var = np.einsum("...i,...i->...", out, out)[..., None]
    var /= n
    var += eps
    np.sqrt(var, out=var)
    out /= var
    return out


def k_layer_norm_back(out, x, g, eps):
    # xc = x - mean, r = 1/sqrt(mean(xc^2) + eps), y = xc r;  dx = r (g - mean(g) - y mean(g y))
    n = x.shape[-1]
    mean = x.sum(axis=-1, keepdims=True)
    mean /= n
    np.subtract(x, mean, out=out)  # xc
    r = np.einsum("...i,...i->...", out, out)[..., None]
    r /= n
    r += eps
    np.sqrt(r, out=r)
    np.reciprocal(r, out=r)
    coef = np.einsum("...i,...i->...", g, out)[..., None]
    coef *= r * r / n  # y mean(g y) = xc r^2 mean(g xc)
    mg = g.sum(axis=-1, keepdims=True)
    mg /= n
    out *= coef
    np.subtract(g, out, out=out)
    out -= mg
    out *= r
    return out


def k_after(out, x, dep):
    return x


def k_cache_write(out, cache, x, pos):
    """cache[:, :, pos[t]] = x[:, t] in place (pos [B, T]: cache[b, :, pos[b, t]] = x[b, t]);
    returns the cache (a view op)."""
    pos = np.asarray(pos)
    if pos.ndim == 2:  # positions per sequence (a batched decode)
        if pos.shape[1] == 1:
            cache[np.arange(pos.shape[0]), :, pos[:, 0]] = x[:, 0]
        else:
            for b in range(pos.shape[0]):
                cache[b][:, pos[b]] = x[b].transpose(1, 0, 2)
        return cache
    pos = pos.reshape(-1)
    if pos.size == 1:  # a decode step: basic indexing, no gather
        cache[:, :, int(pos[0])] = x[:, 0]
    else:
        cache[:, :, pos] = x.transpose(0, 2, 1, 3)
    return cache


_LSE_BLOCK = 1 << 16  # elements of exp temporary per block of rows: stays in L2


def logsumexp_rows(logits: np.ndarray) -> np.ndarray | None:
    """Row logsumexps (float64 [...]) of float32 logits [..., V] by the compiled kernel, a contiguous
    [rows, V] block at a time (eval/scoring.py token_nll); None (nothing computed) where it does not
    take them."""
    if logits.dtype != np.float32 or logits.ndim not in (2, 3) or not native.available():
        return None
    out = np.empty(logits.shape[:-1], np.float32)
    blocks = zip(out, logits) if logits.ndim == 3 else [(out, logits)]
    if not all(native.logsumexp(dst, block) for dst, block in blocks):
        return None
    return out.astype(np.float64)


def k_logsumexp(out, x):
    """max + log(sum(exp(x - max))) over the last axis, a block of rows at a time: the exp
    temporary stays in cache, where a whole [rows, vocab] one costs more in page faults than
    the exp itself."""
    x2 = x.reshape(-1, x.shape[-1])
    o1 = out.reshape(-1)
    if native.logsumexp(o1, x2):  # float32: one compiled pass a row over the cores
        return out
    rows = max(1, _LSE_BLOCK // max(x2.shape[1], 1))
    tmp = np.empty((min(rows, x2.shape[0]), x2.shape[1]), x2.dtype)
    for s in range(0, x2.shape[0], rows):
        xs, dst = x2[s : s + rows], o1[s : s + rows]
        ts = tmp[: xs.shape[0]]
        mx = xs.max(axis=-1, keepdims=True)
        np.subtract(xs, mx, out=ts)
        np.exp(ts, out=ts)
        np.log(ts.sum(axis=-1), out=dst)
        dst += mx[:, 0]
    return out


def _counted_rows(t):
    """Rows whose target counts (>= 0; None: all of them) and the divisor of the mean: their
    number, or when every row is masked the row count (loss 0; no rows at all: NaN, as numpy)."""
    if t.size == 0 or t.min() >= 0:
        return None, t.size
    rows = np.flatnonzero(t >= 0)
    return rows, rows.size or t.size


def k_cross_entropy(out, logits, targets, lse):
    logits2 = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    rows, n = _counted_rows(t)
    if rows is None:
        out[...] = np.mean(lse.reshape(-1) - logits2[np.arange(t.size), t])
    else:
        out[...] = np.sum(lse.reshape(-1)[rows] - logits2[rows, t[rows]]) / n
    return out


def k_cross_entropy_back(out, logits, targets, lse, g):
    """(softmax - onehot(target)) * g / counted rows, softmax = exp(logits - lse), zero on rows
    with a negative (masked) target; `out` may be `logits`."""
    o2 = out.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    rows, n = _counted_rows(t)
    if native.loss_back(o2, logits.reshape(o2.shape), lse.reshape(-1), t, None, g / n):  # float32: one pass a row
        return out
    np.subtract(logits.reshape(o2.shape), lse.reshape(-1, 1), out=o2)
    np.exp(o2, out=o2)
    if rows is None:
        o2[np.arange(t.size), t] -= 1.0
    else:
        o2[rows, t[rows]] -= 1.0
        o2[t < 0] = 0.0
    o2 *= g / n
    return out


def k_token_nll(out, logits, targets, lse):
    """lse - logits[target] per row, 0 where the target is negative (masked)."""
    logits2 = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    keep = t >= 0
    o = out.reshape(-1)
    o[...] = 0.0
    o[keep] = lse.reshape(-1)[keep] - logits2[np.flatnonzero(keep), t[keep]]
    return out


def k_token_nll_back(out, logits, targets, lse, g):
    """(softmax - onehot(target)) * g[row], zero on masked rows; `out` may be `logits`."""
    o2 = out.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    if native.loss_back(o2, logits.reshape(o2.shape), lse.reshape(-1), t, g.reshape(-1)):  # float32: one pass a row
        return out
    keep = t >= 0
    np.subtract(logits.reshape(o2.shape), lse.reshape(-1, 1), out=o2)
    np.exp(o2, out=o2)
    o2[np.flatnonzero(keep), t[keep]] -= 1.0
    o2[~keep] = 0.0
    o2 *= g.reshape(-1, 1)
    return out


def k_count_correct(out, logits, targets):
    out[...] = np.count_nonzero(logits.argmax(axis=-1) == targets)
    return out


def _vocab_kit(w, qtype):
    """W's storage as backends/vocab_chunks.py reads it, and the Kit of this backend's kernels."""
    if qtype:
        w = _raw(w)
        product = lambda o, x, rows: products.qlinear(o, x, rows, qtype, False)  # noqa: E731
        product_back = lambda o, g, rows: products.qlinear_back(o, g, rows, qtype)  # noqa: E731
    else:
        product = lambda o, x, rows: k_matmul(o, x, rows, False, True)  # noqa: E731
        product_back = lambda o, g, rows: k_matmul(o, g, rows, False, False)  # noqa: E731
    return w, vocab_chunks.Kit(np, product, product_back, k_matmul, k_logsumexp, k_token_nll_back, k_softcap,
                               k_softcap_back)


def k_vocab_stats(out, x, w, targets, chunk, cap, qtype):
    w, kit = _vocab_kit(w, qtype)
    return vocab_chunks.logit_stats(kit, out, x, w, targets, chunk, cap)


def k_linear_cross_entropy(out, x, w, targets, stats, chunk, cap, qtype, mean):
    """The mean (or per-row) of lse - target logit over the rows that count, from vocab_stats."""
    nll = np.where(targets.reshape(-1) >= 0, stats[0] - stats[1], 0).astype(out.dtype)
    if mean:
        rows, n = _counted_rows(targets.reshape(-1))
        out[...] = nll.sum() / n
    else:
        out.reshape(-1)[...] = nll
    return out


def k_linear_cross_entropy_back(out, x, w, targets, stats, g, chunk, cap, qtype, mean, dx, dw):
    w, kit = _vocab_kit(w, qtype)
    gw = vocab_chunks.row_weights(np, targets, g, mean, out.dtype)
    return vocab_chunks.grads(kit, out, x, w, targets, stats, gw, chunk, cap, dx, dw)


def k_vocab_hits(out, stats):
    out[...] = np.count_nonzero(stats[2])
    return out


# a kernel's call for fixed buffers (planner.Replay): one compiled call where there is one. Rope
# over contiguous rows and the causal softmax are their compiled steps bound once; k_softmax_causal
# runs the same step when called directly, so a program's first run and its replays compute the
# same bits (rope's compiled op is numpy's bit for bit)
_BIND = {
    "lora": lambda out, y, x, a, b, s: native.bind_lora(*_lora_rows(out, y, x), a, b, s),
    "lora_back": _bind_lora_back,
    "matmul": _bind_matmul,
    "qlinear": _bind_qlinear,
    "qlinear_back": _bind_qlinear_back,
    "rms_norm": native.bind_rms_norm,  # a replayed decode step: one compiled call per norm
    "rope": attention.bind_rope,
    "softmax_causal": functools.partial(attention.compiled_alone, native_program.softmax_causal),
}

# each kernel's step of a compiled program (native/program.py), which a replayed decode step runs
# as one call (graph/planner.py Replay); stored matrices unwrapped to their bytes
_ENCODE = {
    **{op: getattr(native_program, op) for op in ("add", "mul", "scale", "rms_norm", "swiglu", "matmul", "rope",
                                                  "cache_write", "softmax_causal", "get_rows")},
    "qlinear": lambda out, x, w, qtype, round_x: native_program.qlinear(
        out, x, _raw(w), qtype, round_x, w.packed(qtype) if type(w) is products.WithCopies else None),
    "qget_rows": lambda out, w, ids, qtype: native_program.qget_rows(out, _raw(w), ids, qtype),
}

# op name -> Kernel: every k_<op> above and in cpu_attention.py (base.kernel_table's convention),
# with its bind and encode
KERNELS = kernel_table((sys.modules[__name__], attention), "k_", bind=_BIND, encode=_ENCODE)


class CPUBackend(Backend):
    name = "cpu"
    maps_host_arrays = True
    replays = True  # Python work per kernel is a visible part of a small model's pass
    default_batch_tokens = 1024  # one pass per core (workers)

    def __init__(self, dtype=np.float32):
        super().__init__(dtype)
        self.kernels = dict(KERNELS)

    # -- policies (backends/base.py) -------------------------------------------------------
    def workers(self, requested, n_items):
        """One work item per core, OpenBLAS single-threaded meanwhile (threads.cpu_workers)."""
        return cpu_workers(requested, n_items)

    def decode_context(self):
        """BLAS single-threaded while decoding: a step's products are matrix-vector ones (einsum)
        and tiny attention matmuls, where OpenBLAS threads only spin against each other."""
        return blas_threads(1)

    def release_zeros(self, buf):
        pages.release_zeros(buf)

    def compile_steps(self, steps, names, sole):
        """A replayed decode step's compiled kernels as one call (native/program.py)."""
        return native_program.compile_steps(steps, names, sole)

    def compiles_steps(self):
        return native.available()

    def step_tuner(self, n_workers):
        """One micro-batch at a time: OpenBLAS's thread count chosen by timing (threads.BlasTuner)."""
        return BlasTuner(enabled=n_workers == 1)

    def resident_bytes(self):
        return process_rss()

    def peak_flops(self):
        return probes.gemm_peak()

    def decode_cost(self, qtype):
        return probes.decode_cost(qtype)

    def bind(self, model, *, float_copies=False):
        """As Backend.bind; float_copies: quantized matrices bound with a FloatCopies, so their
        products (and a training run's input gradients) keep float32 copies: True, a new one with
        the evaluation budget (qtensor.evaluation_budget, none bound when it is 0); or the
        FloatCopies given, whatever its budget (models evaluated together share one; a trainer
        sets its budget once it knows what the rest of the run takes)."""
        bound = super().bind(model)
        if float_copies is False or float_copies is None:
            return bound
        tensors = model.tensors() if hasattr(model, "tensors") else model
        if isinstance(float_copies, products.FloatCopies):
            copies = float_copies
        else:
            copies = products.FloatCopies(evaluation_budget(tensors, native.dequantize_available()))
            copies = copies if copies.budget > 0 else None
        # wrapped even without float copies: the wrapper also holds the weight's packed form, which
        # an evaluation's few-row products (decode) use where the compiled layer has it
        for name, w in tensors.items():
            if isinstance(w, QTensor):
                bound[name] = products.WithCopies(bound[name], copies)
            elif copies is not None and copies.pack and bound[name].dtype == np.float32 and bound[name].ndim == 2:
                products.register_frozen(bound[name], copies)  # its products may keep a packed copy
        if copies is not None:
            bound.float_copies = copies
        return bound

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

    @property
    def plain_attention_max(self):
        """0 where the compiled blockwise attention is built: it runs every length faster than the
        plain composition (a SmolLM2 LoRA step at ctx 128 ~4 %, stories260K's 18 %; BENCHMARKS)."""
        return 0 if native.attention_available() else None

    def sum_squares(self, flat):
        return optim.sum_squares(flat)

    def adamw_step(self, w, g, m, v, *, lr, beta1, beta2, eps, wd, t):
        optim.adamw_step(w, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd, t=t)

    def adamw8bit_step(self, w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v, *, lr, beta1, beta2, eps, wd, t):
        optim.adamw8bit_step(w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v, lr=lr, beta1=beta1,
                             beta2=beta2, eps=eps, wd=wd, t=t)

    def sgd_step(self, w, g, *, lr, wd):
        if wd:
            w *= 1.0 - lr * wd
        w -= lr * g
