"""The loss of a vocabulary projection computed a chunk of vocabulary rows at a time (ops.vocab_stats,
ops.linear_cross_entropy and its backward), shared by every backend: Cut Cross-Entropy (Wijmans et
al. 2024) and Liger Kernel's fused linear cross-entropy, written over the backend's own products.

A window's logits [T, V] never exist whole: the forward computes each chunk's logits x W_c^T into a
[T, chunk] buffer and folds it into an online logsumexp (flash attention's running max and sum), the
target's logit and the running argmax; the backward recomputes each chunk's logits, forms
(softmax - onehot) * g for that chunk and accumulates dx += G_c W_c, and dW_c = G_c^T x when the
matrix trains. A backend hands in its Kit: its array module and its own kernels, so each chunk's
row passes are the compiled ones the whole logits use (logsumexp, token_nll_back, softcap).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Kit(NamedTuple):
    """A backend's pieces the chunked loss runs on: `xp` its array module (numpy, or cupy);
    product(out, x, rows) = x rows^T and product_back(out, g, rows) = g rows for a block of W's rows
    in W's storage (float, or kept in its file type: a block type's rows are whole rows of blocks,
    so a row range is a view); matmul(out, a, b, ta, tb); and its kernels of ops.logsumexp,
    ops.token_nll_back, ops.softcap and ops.softcap_back, called as the graph calls them."""

    xp: Any
    product: Callable
    product_back: Callable
    matmul: Callable
    logsumexp: Callable
    token_nll_back: Callable
    softcap: Callable
    softcap_back: Callable


def _chunks(n_vocab: int, chunk: int):
    for v0 in range(0, n_vocab, chunk):
        yield v0, min(n_vocab, v0 + chunk)


def _logits(kit: Kit, x, w, v0: int, v1: int, cap: float, buf):
    """Chunk [v0, v1)'s logits (softcapped when cap > 0) in the front of the flat buffer `buf`."""
    out = buf[: x.shape[0] * (v1 - v0)].reshape(x.shape[0], v1 - v0)
    kit.product(out, x, w[v0:v1])
    if cap:
        kit.softcap(out, out, cap=cap)
    return out


def logit_stats(kit: Kit, out, x, w, targets, chunk: int, cap: float):
    """out [3, T]: each row's logsumexp, its target's logit (0 where masked) and 1 where the argmax
    is the target (the first maximum, as argmax over the whole row picks)."""
    xp, n, n_vocab = kit.xp, x.shape[0], w.shape[0]
    t = targets.reshape(-1)
    lse, part = xp.full(n, -xp.inf, dtype=out.dtype), xp.empty(n, dtype=out.dtype)
    tgt = xp.zeros(n, dtype=out.dtype)
    best = xp.full(n, -xp.inf, dtype=out.dtype)
    arg = xp.full(n, -1, dtype=t.dtype)
    buf = xp.empty(n * min(chunk, n_vocab), dtype=out.dtype)
    rows = xp.arange(n)
    for v0, v1 in _chunks(n_vocab, chunk):
        logits = _logits(kit, x, w, v0, v1, cap, buf)
        kit.logsumexp(part, logits)
        xp.logaddexp(lse, part, out=lse)
        inside = (t >= v0) & (t < v1)
        tgt = xp.where(inside, logits[rows, xp.clip(t - v0, 0, v1 - v0 - 1)], tgt)
        am = logits.argmax(axis=1)
        cmax = logits[rows, am]
        better = cmax > best  # strictly: an earlier chunk's equal maximum stays the argmax
        arg = xp.where(better, am + v0, arg)
        best = xp.where(better, cmax, best)
    out[0] = lse
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


def _grad_chunks(kit: Kit, x, w, targets, stats, gw, chunk: int, cap: float):
    """Each chunk's (v0, v1, G_c): (softmax - onehot) * gw[row] through the softcap, [T, v1 - v0],
    by the backend's token_nll_back with the targets of other chunks pointed at column 0, whose
    value for those rows is then computed again without the onehot: adding gw back to (p - 1) gw
    would lose p gw's digits to cancellation, and AdamW's first steps magnify that column's error
    (a masked row's weight is 0, so its row is 0 either way)."""
    xp, n, n_vocab = kit.xp, x.shape[0], w.shape[0]
    t = targets.reshape(-1)
    lse = xp.ascontiguousarray(stats[0])
    size = n * min(chunk, n_vocab)
    buf, gbuf = xp.empty(size, dtype=x.dtype), xp.empty(size, dtype=x.dtype)
    for v0, v1 in _chunks(n_vocab, chunk):
        logits = _logits(kit, x, w, v0, v1, cap, buf)
        gc = gbuf[: logits.size].reshape(logits.shape)
        inside = (t >= v0) & (t < v1)
        kit.token_nll_back(gc, logits, xp.where(inside, t - v0, 0).astype(t.dtype), lse, gw)
        gc[:, 0] = xp.where(inside, gc[:, 0], xp.exp(logits[:, 0] - lse) * gw)
        if cap:  # d(cap tanh(z / cap))/dz = 1 - (y / cap)^2, y the capped logits (the kernel writes over y)
            gc = kit.softcap_back(logits, logits, gc, cap=cap)
        yield v0, v1, gc


def grads(kit: Kit, out, x, w, targets, stats, gw, chunk: int, cap: float, dx: bool, dw: bool):
    """out: dx [T, d] (when dx) = sum over chunks of G_c W_c, then dW [V, d] (when dw), whose rows
    v0..v1 are G_c^T x, packed flat in that order (ops.linear_cross_entropy_back)."""
    n_dx = x.size if dx else 0
    gx = out[:n_dx].reshape(x.shape) if dx else None
    gwt = out[n_dx:].reshape(w.shape[0], x.shape[1]) if dw else None
    part = kit.xp.empty(x.shape, dtype=out.dtype) if dx else None
    if dx:
        gx[...] = 0
    for v0, v1, gc in _grad_chunks(kit, x, w, targets, stats, gw, chunk, cap):
        if dx:
            kit.product_back(part, gc, w[v0:v1])
            gx += part
        if dw:
            kit.matmul(gwt[v0:v1], gc, x, True, False)
    return out
