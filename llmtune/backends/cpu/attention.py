"""The numpy backend's attention family (cpu.py takes its kernels into the table): rope with its
cos/sin tables, the causal and masked softmax with their masks, blockwise (flash) attention
forward and backward, the KV cache write's companion softmax gradient; and the binds of the ops
whose compiled step pays on a training pass (rope, the causal softmax)."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cpu.native import kernels as native, program as native_program
from llmtune.graph.ops import rope_inv_freq


class _RopeCache:
    """cos/sin tables per (positions, n_rot, base, freq_scale, freq factors, dtype): the same few
    every run."""

    def __init__(self):
        self._tables = {}
        self._expanded = {}

    def get(self, pos, n_rot, base, freq_scale, dtype, freq_factors=None):
        half = n_rot // 2
        ff = None if freq_factors is None else np.asarray(freq_factors).reshape(-1)[:half]
        key = (pos.tobytes(), n_rot, base, freq_scale, np.dtype(dtype).str, None if ff is None else ff.tobytes())
        tab = self._tables.get(key)
        if tab is None:
            inv_freq = rope_inv_freq(n_rot, base, ff)
            theta = freq_scale * pos.astype(np.float64)[:, None] * inv_freq[None, :]
            cos, sin = np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)
            # interleaved for norm-mode rope of whole heads (_rope_pairs): cos of each pair twice,
            # and (-sin, sin) per pair (its negation for the inverse)
            sin2 = np.stack([-sin, sin], axis=-1).reshape(len(pos), -1)
            tab = (cos, sin, np.repeat(cos, 2, axis=-1), sin2, -sin2)
            if len(self._tables) > 64:
                self._tables.clear()
            self._tables[key] = tab
        return tab

    def expanded(self, cos2, sin2, n_head: int):
        """cos2 and sin2 [T, d] (tables of get) repeated over n_head heads as contiguous
        [T, n_head, d]; the few asked for last are kept (a step's layers ask for the same q and k
        ones)."""
        key = (id(cos2), id(sin2), n_head)
        hit = self._expanded.get(key)
        if hit is None or hit[0] is not cos2 or hit[1] is not sin2:  # ids are reused once freed
            if len(self._expanded) >= 8:
                self._expanded.clear()
            tabs = tuple(np.ascontiguousarray(np.broadcast_to(t[:, None, :], (t.shape[0], n_head, t.shape[1])))
                         for t in (cos2, sin2))
            hit = self._expanded[key] = (cos2, sin2, tabs)
        return hit[2]


class _MaskCache:
    """Additive causal masks per (rows, n_kv, n_q, n_past, window, dtype): key k is visible to
    query position p when k <= p and, with a sliding window, p - k < window."""

    def __init__(self):
        self._masks = {}

    def get(self, rows, n_kv, n_q, n_past, window, dtype):
        key = (rows, n_kv, n_q, n_past, window, np.dtype(dtype).str)
        m = self._masks.get(key)
        if m is None:
            qpos = (n_past + (np.arange(rows) % n_q))[:, None]
            kpos = np.arange(n_kv)[None, :]
            visible = kpos <= qpos
            if window > 0:
                visible &= qpos - kpos < window
            m = np.where(visible, 0.0, -np.inf).astype(dtype)
            if len(self._masks) > 64:
                self._masks.clear()
            self._masks[key] = m
        return m


# Head size up to which norm-mode rope multiplies by tables expanded over the heads: broadcasting a
# [T, 1, d] table runs numpy's inner loop d elements at a time (stories260K's d = 8: 2.4x slower).
_ROPE_EXPAND_MAX_D = 32

# Pure functions of their keys, so one per process serves every backend and thread (a lost race
# only computes a table twice).
_ROPE_TABLES = _RopeCache()
_CAUSAL_MASKS = _MaskCache()


def _pairs_contiguous(a) -> bool:
    """Whether `a`'s adjacent pairs view as one 64-bit word each (contiguous last axis; the
    gradient reaching rope is a permuted view whose other strides are whole pairs)."""
    pair = 2 * a.itemsize
    return a.strides[-1] == a.itemsize and all(st % pair == 0 for st in a.strides[:-1])


def _rope_pairs(out, x, cos2, sin2):
    """Norm-mode rope of float32 pairs (x0, x1) as out = x * (cos, cos) + (x1, x0) * (-sin, sin):
    the same products and sums as the strided form below, so the same bits, in contiguous passes.
    The swapped pairs come from rotating each pair's 64-bit word by 32 bits; `out` is scratch."""
    u, scratch = x.view(np.uint64), out.view(np.uint64)
    swapped = np.left_shift(u, np.uint64(32))
    np.right_shift(u, np.uint64(32), out=scratch)
    swapped |= scratch
    swapped = swapped.view(np.float32)
    swapped *= sin2
    np.multiply(x, cos2, out=out)
    out += swapped
    return out


def k_rope(out, x, pos, freq_factors=None, *, n_rot, base, freq_scale, mode, inverse):
    cos, sin, cos2, sin2, sin2_inv = _ROPE_TABLES.get(pos, n_rot, base, freq_scale, x.dtype, freq_factors)
    if mode == "norm" and n_rot == x.shape[-1] and x.dtype == np.float32 and _pairs_contiguous(x) \
            and _pairs_contiguous(out):
        sin2 = sin2_inv if inverse else sin2
        heads_first = x.transpose(0, 2, 1, 3) if x.ndim == 4 else None
        if heads_first is not None and heads_first.flags.c_contiguous and not x.flags.c_contiguous:
            # the gradient arrives as a permuted view of [B, H, T, d]: rotate it in its own order,
            # where the tables broadcast over whole [T, d] planes, then lay it out as out's
            rotated = _rope_pairs(np.empty_like(heads_first), heads_first, cos2, sin2)
            out.transpose(0, 2, 1, 3)[...] = rotated
            return out
        if native.rope_pairs(out, x, cos2, sin2):  # contiguous float32: one compiled pass, the same bits
            return out
        if x.shape[-1] <= _ROPE_EXPAND_MAX_D and x.ndim == 4:  # small heads: whole [T, H, d] tables
            return _rope_pairs(out, x, *_ROPE_TABLES.expanded(cos2, sin2, x.shape[2]))
        return _rope_pairs(out, x, cos2[:, None, :], sin2[:, None, :])
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


_LAST_POSITION_MASK: list = [None, None]  # (key, mask): every layer of a decode step asks for the same one


def _position_mask(pos, rows, n_kv, n_q, window, dtype):
    """The additive mask of softmax_causal for run-time query positions pos[n_q] (row r is
    position pos[r % n_q]): built once per step (positions change every decode step). pos
    [B, n_q] (positions per sequence): a mask [B, rows, n_kv]."""
    key = (pos.tobytes(), pos.shape, rows, n_kv, n_q, window, dtype.str)
    last_key, mask = _LAST_POSITION_MASK
    if key == last_key:
        return mask
    qpos = np.asarray(pos, dtype=np.int64)[..., np.arange(rows) % n_q][..., None]
    kpos = np.arange(n_kv)
    visible = kpos <= qpos
    if window > 0:
        visible &= qpos - kpos < window
    mask = np.where(visible, dtype.type(0), dtype.type(-np.inf))
    _LAST_POSITION_MASK[:] = [key, mask]
    return mask


def k_softmax_causal(out, x, pos=None, *, scale, n_q, n_past, window=0):
    compiled = compiled_alone(native_program.softmax_causal, out, x, pos, scale=scale, n_q=n_q, n_past=n_past,
                               window=window)
    if compiled is not None:  # only the visible scores exponentiated (exp within ~1 ulp of numpy's)
        compiled()
        return out
    if pos is None:
        mask = _CAUSAL_MASKS.get(x.shape[-2], x.shape[-1], n_q, n_past, window, x.dtype)
    else:
        mask = _position_mask(pos, x.shape[-2], x.shape[-1], n_q, window, x.dtype)
        if mask.ndim == 3:  # per sequence: [B, rows, n_kv] over x [B, ..., rows, n_kv]
            mask = mask.reshape(mask.shape[:1] + (1,) * (x.ndim - 3) + mask.shape[1:])
    np.multiply(x, x.dtype.type(scale), out=out)
    out += mask
    return _softmax_in_place(out)


def k_softmax_masked(out, x, mask, *, scale):
    B, n_q, n_kv = mask.shape
    np.multiply(x, x.dtype.type(scale), out=out)
    rows = out.reshape(B, -1, n_q, n_kv)  # a view: outputs are contiguous
    rows += mask[:, None]
    return _softmax_in_place(out)


def _softmax_in_place(out):
    """softmax over the last axis of the masked, scaled scores in `out`."""
    out -= out.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    return out


# Query and key positions per block of flash_attn: a block's scores [B, H, 128, 128] stay in L2,
# and the Python loop runs (T / 128)^2 / 2 times per call.
_FA_BLOCK = 128


class _FlashBlocks:
    """The block walk shared by flash_attn's forward and backward (FlashAttention-2's tiling):
    head-major copies of q/k/v ([B, Hkv, G, T, d], [B, Hkv, T, d]), the visible key blocks of each
    query block (causal: none right of the diagonal; window: none left of it) and each block's
    scores, softcapped and masked, as [B, Hkv, G, bq, bk]."""

    def __init__(self, q, k, v, scale, softcap, window):
        B, T, H, d = q.shape
        self.Hkv = k.shape[2]
        self.G, self.T = H // self.Hkv, T
        self.scale, self.softcap, self.window = scale, softcap, window
        self.qh = np.ascontiguousarray(q.reshape(B, T, self.Hkv, self.G, d).transpose(0, 2, 3, 1, 4))
        self.kh = np.ascontiguousarray(k.transpose(0, 2, 1, 3))
        self.vh = np.ascontiguousarray(v.transpose(0, 2, 1, 3))

    def query_blocks(self):
        for t0 in range(0, self.T, _FA_BLOCK):
            yield t0, min(self.T, t0 + _FA_BLOCK)

    def key_blocks(self, t0, t1):
        """Key blocks [s0, s1) holding a key some query of t0..t1-1 sees."""
        first = max(0, t0 - self.window + 1) if self.window else 0
        for s0 in range(first - first % _FA_BLOCK, t1, _FA_BLOCK):
            yield s0, min(t1, s0 + _FA_BLOCK)

    def q_rows(self, t0, t1):
        """Queries of positions t0..t1-1, every head of each KV group: [B, Hkv, G * bq, d]."""
        B, d = self.qh.shape[0], self.qh.shape[-1]
        return self.qh[:, :, :, t0:t1].reshape(B, self.Hkv, self.G * (t1 - t0), d)

    def scores(self, qb, t0, t1, s0, s1):
        """Scores of query rows qb (positions t0..) against keys s0..s1-1, [B, Hkv, G, bq, bk],
        -inf where masked; with softcap also the tanh (the backward's chain-rule factor)."""
        s = np.matmul(qb, self.kh[:, :, s0:s1].swapaxes(-1, -2))
        s = s.reshape(s.shape[:2] + (self.G, t1 - t0, s1 - s0))
        th = None
        if self.softcap:
            th = np.multiply(s, s.dtype.type(self.scale / self.softcap), out=s)
            np.tanh(th, out=th)
            s = th * s.dtype.type(self.softcap)
        else:
            s *= s.dtype.type(self.scale)
        if s1 - 1 > t0 or (self.window and t1 - 1 - s0 >= self.window):  # some key masked
            s += _CAUSAL_MASKS.get(t1 - t0, s1 - s0, t1 - t0, t0 - s0, self.window, s.dtype)
        return s, th


def _fa_split(out, q, k):
    """Views of flash_attn's packed buffer: O [B, T, H, d] and the row logsumexp [B, Hkv, G, T]."""
    B, T, H, d = q.shape
    Hkv = k.shape[2]
    return out[: q.size].reshape(q.shape), out[q.size :].reshape(B, Hkv, H // Hkv, T)


def k_flash_attn(out, q, k, v, *, scale, softcap, window):
    """Forward of ops.flash_attn, one query block at a time over its visible key blocks with an
    online softmax (running max m and sum l, earlier partial sums rescaled by exp(m_old - m)).
    Without a softcap, float32 runs in one compiled call (native.flash_attn); this is its reference."""
    o, lse = _fa_split(out, q, k)
    if not softcap and native.flash_attn(o, lse, q, k, v, scale, window):
        return out
    fb = _FlashBlocks(q, k, v, scale, softcap, window)
    B, T, H, d = q.shape
    for t0, t1 in fb.query_blocks():
        qb = fb.q_rows(t0, t1)
        shape = qb.shape[:2] + (fb.G, t1 - t0)
        m = np.full(shape + (1,), -np.inf, q.dtype)
        denom = np.zeros(shape + (1,), q.dtype)
        acc = np.zeros(shape + (d,), q.dtype)
        for s0, s1 in fb.key_blocks(t0, t1):
            s, _ = fb.scores(qb, t0, t1, s0, s1)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_new[m_new == -np.inf] = 0  # a row with no visible key yet (window): keep exp finite
            alpha = np.exp(m - m_new)
            s -= m_new
            np.exp(s, out=s)
            denom *= alpha
            denom += s.sum(axis=-1, keepdims=True)
            acc *= alpha
            acc += np.matmul(s.reshape(qb.shape[:3] + (s1 - s0,)), fb.vh[:, :, s0:s1]).reshape(acc.shape)
            m = m_new
        acc /= denom
        # [B, Hkv, G, bq, d] -> rows t0..t1 of O [B, T, H, d]
        o[:, t0:t1] = acc.transpose(0, 3, 1, 2, 4).reshape(B, t1 - t0, H, d)
        lse[..., t0:t1] = (m + np.log(denom))[..., 0]
    return out


def k_flash_attn_back(out, q, k, v, packed, g, *, scale, softcap, window):
    """dq | dk | dv of ops.flash_attn (FlashAttention-2's backward): per block P = exp(S - lse),
    dV += P^T dO, dP = dO V^T, dS = P (dP - D) with D = rowsum(dO * O), then through the softcap
    (1 - tanh^2) and the scale, dQ += dS K, dK += dS^T Q. The rows of a block are every query head
    of a KV group, so dK and dV sum over the group by the products themselves. Without a softcap,
    float32 runs in one compiled call (native.flash_attn_back); this is its reference."""
    o, lse = _fa_split(packed, q, k)
    n_q, n_kv = q.size, k.size
    if not softcap and native.flash_attn_back(out[:n_q].reshape(q.shape), out[n_q : n_q + n_kv].reshape(k.shape),
                                              out[n_q + n_kv : n_q + 2 * n_kv].reshape(k.shape), q, k, v, o, lse, g,
                                              scale, window):
        return out
    fb = _FlashBlocks(q, k, v, scale, softcap, window)
    B, T, H, d = q.shape
    Hkv, G = fb.Hkv, fb.G
    gh = np.ascontiguousarray(g.reshape(B, T, Hkv, G, d).transpose(0, 2, 3, 1, 4))  # dO [B, Hkv, G, T, d]
    D = np.einsum("btkgd,btkgd->bkgt", o.reshape(B, T, Hkv, G, d), g.reshape(B, T, Hkv, G, d))
    dq = np.zeros_like(fb.qh)
    dk, dv = np.zeros_like(fb.kh), np.zeros_like(fb.vh)
    for t0, t1 in fb.query_blocks():
        qb = fb.q_rows(t0, t1)
        rows = qb.shape[2]
        gb = gh[:, :, :, t0:t1].reshape(B, Hkv, rows, d)
        lse_b, D_b = lse[..., t0:t1, None], D[..., t0:t1, None]
        dq_b = np.zeros_like(qb)
        for s0, s1 in fb.key_blocks(t0, t1):
            s, th = fb.scores(qb, t0, t1, s0, s1)
            s -= lse_b
            p = np.exp(s, out=s)  # [B, Hkv, G, bq, bk]; 0 where masked
            p2 = p.reshape(B, Hkv, rows, s1 - s0)
            dv[:, :, s0:s1] += np.matmul(p2.swapaxes(-1, -2), gb)
            dp = np.matmul(gb, fb.vh[:, :, s0:s1].swapaxes(-1, -2)).reshape(p.shape)
            dp -= D_b
            dp *= p  # dS with respect to the capped, scaled scores
            if th is not None:
                np.square(th, out=th)
                np.subtract(th.dtype.type(1), th, out=th)
                dp *= th
            dp *= dp.dtype.type(scale)
            ds = dp.reshape(B, Hkv, rows, s1 - s0)
            dq_b += np.matmul(ds, fb.kh[:, :, s0:s1])
            dk[:, :, s0:s1] += np.matmul(ds.swapaxes(-1, -2), qb)
        dq[:, :, :, t0:t1] = dq_b.reshape(B, Hkv, G, t1 - t0, d)
    out[:n_q].reshape(B, T, Hkv, G, d)[...] = dq.transpose(0, 3, 1, 2, 4)
    out[n_q : n_q + n_kv].reshape(k.shape)[...] = dk.transpose(0, 2, 1, 3)
    out[n_q + n_kv :].reshape(v.shape)[...] = dv.transpose(0, 2, 1, 3)
    return out


def k_softmax_back(out, y, g, scale):
    dot = np.einsum("...i,...i->...", g, y)[..., None]
    np.subtract(g, dot, out=out)
    out *= y
    out *= y.dtype.type(scale)
    return out


def compiled_alone(encode, out, *args, **attrs):
    """A kernel's compiled step run alone as one call (None where the compiled op does not take
    the case): the ops whose compiled form pays on a training pass's shapes."""
    step = encode(out, *args, **attrs)
    return native_program.compile_steps([step]) if step is not None else None


def bind_rope(out, x, pos, freq_factors=None, **attrs):
    """A replayed rope: k_rope itself where it runs the pooled pairs pass (norm mode over whole
    contiguous float32 heads: a training pass's q and k, ~2.5x the single-threaded compiled step,
    its tables looked up per run since positions change), else its compiled step bound once.
    Both are numpy's bits, so a program's first run and its replays agree."""
    if (attrs["mode"] == "norm" and attrs["n_rot"] == x.shape[-1] and x.ndim == 4 and x.dtype == np.float32
            and x.flags.c_contiguous and out.flags.c_contiguous and native.available()):
        return None
    return compiled_alone(native_program.rope, out, x, pos, freq_factors, **attrs)
