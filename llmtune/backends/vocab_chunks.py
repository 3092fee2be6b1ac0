"""The loss of a vocabulary projection computed a chunk of vocabulary rows at a time (ops.vocab_stats,
ops.linear_cross_entropy and its backward), shared by every backend: Cut Cross-Entropy (Wijmans et
al. 2024) and Liger Kernel's fused linear cross-entropy, written over the backend's own products.

A window's logits [T, V] never exist whole: the forward computes each chunk's logits x W_c^T into a
[T, chunk] buffer and folds it into an online logsumexp (flash attention's running max and sum), the
target's logit and the running argmax; the backward recomputes each chunk's logits, forms
(softmax - onehot) * g for that chunk and accumulates dx += G_c W_c, and dW_c = G_c^T x when the
matrix trains. `xp` is the array module of the backend (numpy, or cupy), `product(out, x, rows)` its
x rows^T and `product_back(out, g, rows)` its g rows for a block of W's rows in W's storage (float
or kept in its file type: a block type's rows are whole rows of blocks, so a row range is a view).
"""

from __future__ import annotations


def _chunks(n_vocab: int, chunk: int):
    for v0 in range(0, n_vocab, chunk):
        yield v0, min(n_vocab, v0 + chunk)


def _logits(xp, product, x, w, v0: int, v1: int, cap: float, buf):
    """Chunk [v0, v1)'s logits (softcapped when cap > 0) in the front of the flat buffer `buf`."""
    out = buf[: x.shape[0] * (v1 - v0)].reshape(x.shape[0], v1 - v0)
    product(out, x, w[v0:v1])
    if cap:
        xp.multiply(out, 1.0 / cap, out=out)
        xp.tanh(out, out=out)
        xp.multiply(out, cap, out=out)
    return out


def logit_stats(xp, product, out, x, w, targets, chunk: int, cap: float):
    """out [3, T]: each row's logsumexp, its target's logit (0 where masked) and 1 where the argmax
    is the target (the first maximum, as argmax over the whole row picks)."""
    n, n_vocab = x.shape[0], w.shape[0]
    t = targets.reshape(-1)
    m = xp.full(n, -xp.inf, dtype=out.dtype)
    s = xp.zeros(n, dtype=out.dtype)
    tgt = xp.zeros(n, dtype=out.dtype)
    best = xp.full(n, -xp.inf, dtype=out.dtype)
    arg = xp.full(n, -1, dtype=t.dtype)
    buf = xp.empty(n * min(chunk, n_vocab), dtype=out.dtype)
    rows = xp.arange(n)
    for v0, v1 in _chunks(n_vocab, chunk):
        logits = _logits(xp, product, x, w, v0, v1, cap, buf)
        cmax = logits.max(axis=1)
        new = xp.maximum(m, cmax)
        s = s * xp.exp(m - new) + xp.exp(logits - new[:, None]).sum(axis=1)
        m = new
        inside = (t >= v0) & (t < v1)
        tgt = xp.where(inside, logits[rows, xp.clip(t - v0, 0, v1 - v0 - 1)], tgt)
        better = cmax > best  # strictly: an earlier chunk's equal maximum stays the argmax
        arg = xp.where(better, logits.argmax(axis=1) + v0, arg)
        best = xp.where(better, cmax, best)
    out[0] = m + xp.log(s)
    out[1] = tgt
    out[2] = arg == t
    return out


def row_weights(xp, targets, g, mean: bool, dtype):
    """Each row's seed of the backward: g / counted rows (the mean's) or g[row], 0 where masked."""
    t = targets.reshape(-1)
    keep = t >= 0
    if mean:
        n = int(keep.sum()) or t.size
        return xp.where(keep, g.reshape(()) / n, 0).astype(dtype)
    return xp.where(keep, g.reshape(-1), 0).astype(dtype)


def _grad_chunks(xp, product, x, w, targets, stats, gw, chunk: int, cap: float):
    """Each chunk's (v0, v1, G_c): (softmax - onehot) * gw[row] through the softcap, [T, v1 - v0]."""
    n, n_vocab = x.shape[0], w.shape[0]
    t = targets.reshape(-1)
    lse = stats[0][:, None]
    rows = xp.arange(n)
    buf = xp.empty(n * min(chunk, n_vocab), dtype=x.dtype)
    for v0, v1 in _chunks(n_vocab, chunk):
        logits = _logits(xp, product, x, w, v0, v1, cap, buf)
        capped = logits.copy() if cap else None
        xp.subtract(logits, lse, out=logits)
        xp.exp(logits, out=logits)
        inside = (t >= v0) & (t < v1)
        cols = xp.clip(t - v0, 0, v1 - v0 - 1)
        logits[rows, cols] -= inside.astype(logits.dtype)
        logits *= gw[:, None]
        if cap:  # d(cap tanh(z / cap))/dz = 1 - (y / cap)^2
            logits *= 1.0 - (capped / cap) ** 2
        yield v0, v1, logits


def grad_x(xp, product, product_back, out, x, w, targets, stats, gw, chunk: int, cap: float):
    """out [T, d] = sum over chunks of G_c W_c."""
    out[...] = 0
    part = xp.empty(out.shape, dtype=out.dtype)
    for v0, v1, gc in _grad_chunks(xp, product, x, w, targets, stats, gw, chunk, cap):
        product_back(part, gc, w[v0:v1])
        out += part
    return out


def grad_w(xp, product, matmul, out, x, w, targets, stats, gw, chunk: int, cap: float):
    """out [V, d]: rows v0..v1 = G_c^T x, chunk by chunk (`matmul(out, a, b, ta, tb)`)."""
    for v0, v1, gc in _grad_chunks(xp, product, x, w, targets, stats, gw, chunk, cap):
        matmul(out[v0:v1], gc, x, True, False)
    return out
