"""The compiled blockwise causal attention (native/qdot.c lt_flash_attn and lt_flash_attn_back,
ops.flash_attn's float32 forward and backward without a softcap) against numpy's block walk
(backends/cpu_attention.py k_flash_attn / k_flash_attn_back, the reference) and float64: within float32
summation order and the vector exp, the same bits whatever the thread count, and a model's logits
and gradients past PLAIN_ATTENTION_MAX_T as numpy's. Skips where this build has no compiled
attention (no compiler, no AVX-512)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmtune.arch.context import PLAIN_ATTENTION_MAX_T
from llmtune.backends.cpu import CPUBackend, attention as cpu
from llmtune.backends.cpu.native import kernels
from llmtune.backends.cpu.threads import blas_threads
from llmtune.eval.perplexity import perplexity_from_ids
from llmtune.model.loaded import load_model
from llmtune.train.trainer import RunningStats, Trainer


def _inputs(B, T, H, Hkv, d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for shape in ((B, T, H, d), (B, T, Hkv, d), (B, T, Hkv, d))]


def _compiled(q, k, v, scale, window):
    out = np.full(q.size + q.shape[0] * q.shape[2] * q.shape[1], np.nan, np.float32)
    o, lse = cpu._fa_split(out, q, k)
    return kernels.flash_attn(o, lse, q, k, v, scale, window), o, lse


def _numpy(q, k, v, scale, window, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(kernels, "flash_attn", lambda *a: False)
        out = np.zeros(q.size + q.shape[0] * q.shape[2] * q.shape[1], np.float32)
        cpu.k_flash_attn(out, q, k, v, scale=scale, softcap=0.0, window=window)
    return cpu._fa_split(out, q, k)


def _exact(q, k, v, scale, window):
    """O and logsumexp in float64 from the whole [T, T] score matrix."""
    B, T, H, d = q.shape
    G = H // k.shape[2]
    kk, vv = (np.repeat(a.astype(np.float64), G, axis=2) for a in (k, v))
    s = np.einsum("bthd,bshd->bhts", q.astype(np.float64), kk) * scale
    t, p = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (p <= t) & ((t - p < window) if window else True)
    s = np.where(visible, s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    o = np.einsum("bhts,bshd->bthd", np.exp(s - lse[..., None]), vv)
    return o, lse.reshape(B, k.shape[2], G, T)


_built = _compiled(*_inputs(1, 2, 1, 1, 16), 0.25, 0)[0]
needs_attention = pytest.mark.skipif(not _built, reason=f"no compiled attention: {kernels.reason() or 'no AVX-512'}")

# (B, T, H, Hkv, d, window): SmolLM2's heads at a perplexity length; partial query (32) and key (64)
# blocks, head sizes that are not multiples of the 8-row tiles, windows inside and across blocks,
# one query head per KV head, one position
CASES = [(2, 300, 9, 3, 64, 0), (1, 97, 4, 2, 40, 0), (1, 130, 2, 1, 3, 0), (2, 77, 6, 2, 72, 5),
         (1, 200, 4, 4, 16, 70), (1, 65, 2, 2, 8, 1), (1, 1, 3, 1, 16, 0)]


@needs_attention
@pytest.mark.parametrize("B,T,H,Hkv,d,window", CASES)
def test_matches_numpy_and_float64(B, T, H, Hkv, d, window, monkeypatch):
    q, k, v = _inputs(B, T, H, Hkv, d, seed=T * 7 + d)
    scale = 1 / math.sqrt(d)
    ok, o, lse = _compiled(q, k, v, scale, window)
    assert ok
    ref_o, ref_lse = _numpy(q, k, v, scale, window, monkeypatch)
    exact_o, exact_lse = _exact(q, k, v, scale, window)
    v_max = float(np.abs(v).max())  # O is a convex combination of V's rows
    for got in (ref_o, o):
        assert np.abs(got - exact_o).max() < 2e-6 * v_max
    for got in (ref_lse, lse):
        assert np.abs(got - exact_lse).max() < 2e-6 * max(1.0, float(np.abs(exact_lse).max()))
    assert np.abs(o - ref_o).max() < 4e-6 * v_max


def _exact_grads(q, k, v, g, scale, window):
    """dq, dk, dv of sum(O * g) in float64 from the whole [T, T] score matrix."""
    B, T, H, d = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q64, g64 = q.astype(np.float64), g.astype(np.float64)
    kk, vv = (np.repeat(a.astype(np.float64), G, axis=2) for a in (k, v))
    s = np.einsum("bthd,bshd->bhts", q64, kk) * scale
    t, p = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (p <= t) & ((t - p < window) if window else True)
    s = np.where(visible, s, -np.inf)
    prob = np.exp(s - np.logaddexp.reduce(s, axis=-1)[..., None])
    dprob = np.einsum("bthd,bshd->bhts", g64, vv)
    ds = prob * (dprob - (prob * dprob).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhts,bshd->bthd", ds, kk)
    dk = np.einsum("bhts,bthd->bshd", ds, q64).reshape(B, T, Hkv, G, d).sum(3)
    dv = np.einsum("bhts,bthd->bshd", prob, g64).reshape(B, T, Hkv, G, d).sum(3)
    return dq, dk, dv


@needs_attention
@pytest.mark.parametrize("B,T,H,Hkv,d,window", CASES)
def test_gradients_match_numpy_and_float64(B, T, H, Hkv, d, window, monkeypatch):
    """The compiled backward (two passes: dK, dV per key block; dQ per query block) against numpy's
    block walk and float64, from the same forward."""
    q, k, v = _inputs(B, T, H, Hkv, d, seed=T * 5 + d)
    g = np.random.default_rng(T).standard_normal(q.shape, dtype=np.float32)
    scale = 1 / math.sqrt(d)
    packed = np.zeros(q.size + B * H * T, np.float32)
    cpu.k_flash_attn(packed, q, k, v, scale=scale, softcap=0.0, window=window)
    n = q.size + 2 * k.size
    got = np.full(n, np.nan, np.float32)
    calls = []
    real = kernels.flash_attn_back
    monkeypatch.setattr(kernels, "flash_attn_back", lambda *a: calls.append(1) or real(*a))
    cpu.k_flash_attn_back(got, q, k, v, packed, g, scale=scale, softcap=0.0, window=window)
    assert calls
    monkeypatch.setattr(kernels, "flash_attn_back", lambda *a: False)
    ref = np.zeros(n, np.float32)
    cpu.k_flash_attn_back(ref, q, k, v, packed, g, scale=scale, softcap=0.0, window=window)
    exact = np.concatenate([a.reshape(-1) for a in _exact_grads(q, k, v, g, scale, window)])
    size = float(np.abs(exact).max())
    assert np.abs(ref - exact).max() < 2e-6 * size * max(1.0, math.log2(T))
    assert np.abs(got - exact).max() < 2e-6 * size * max(1.0, math.log2(T))


@pytest.mark.determinism
@needs_attention
def test_same_bits_whatever_the_threads():
    """Each output is one task's, in one order: one thread and all of them write the same bits,
    forward and backward."""
    q, k, v = _inputs(2, 257, 9, 3, 64, seed=3)
    g = np.random.default_rng(4).standard_normal(q.shape, dtype=np.float32)
    results = []
    with blas_threads(1):  # OpenBLAS single-threaded: the kernels take the compiled count
        for compiled_threads in (1, max(2, kernels.threads())):
            kernels.library().lt_set_gemm_threads(compiled_threads)
            ok, o, lse = _compiled(q, k, v, 0.125, 0)
            grads = [np.empty_like(a) for a in (q, k, v)]
            assert ok and kernels.flash_attn_back(*grads, q, k, v, o, lse, g, 0.125, 0)
            results.append([a.tobytes() for a in [o, lse] + grads])
    kernels.library().lt_set_gemm_threads(kernels.threads())
    assert results[0] == results[1]


@needs_attention
def test_strided_inputs_are_taken():
    """q, k, v as views (rope's outputs may be): copied to contiguous rows first, the same result."""
    q, k, v = _inputs(1, 100, 4, 2, 32, seed=5)
    wide = np.concatenate([q, q], axis=-1)[..., 32:]
    assert not wide.flags.c_contiguous
    ok, o, lse = _compiled(wide, k, v, 0.2, 0)
    ok2, o2, lse2 = _compiled(q, k, v, 0.2, 0)
    assert ok and ok2 and o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes()


def test_declines_what_it_does_not_compute(monkeypatch):
    """float64 (gradient checks) and a softcap (Gemma 2) stay on numpy's path: the kernel is not
    called, and the numpy result is the exact one."""
    calls, back_calls = [], []
    monkeypatch.setattr(kernels, "flash_attn", lambda *a: calls.append(a) or False)
    monkeypatch.setattr(kernels, "flash_attn_back", lambda *a: back_calls.append(a) or False)
    q, k, v = (a.astype(np.float64) for a in _inputs(1, 40, 2, 1, 8, seed=9))
    out = np.zeros(q.size + 2 * 40)
    cpu.k_flash_attn(out, q, k, v, scale=0.3, softcap=0.0, window=0)
    assert len(calls) == 1  # asked, declined (float64)
    q32, k32, v32 = _inputs(1, 40, 2, 1, 8, seed=9)
    packed = np.zeros(q32.size + 80, np.float32)
    cpu.k_flash_attn(packed, q32, k32, v32, scale=0.3, softcap=1.5, window=0)
    cpu.k_flash_attn_back(np.zeros(q32.size + 2 * k32.size, np.float32), q32, k32, v32, packed, q32, scale=0.3,
                          softcap=1.5, window=0)
    assert len(calls) == 1 and not back_calls  # a softcap: not asked
    exact_o, _ = _exact(q, k, v, 0.3, 0)
    assert np.abs(cpu._fa_split(out, q, k)[0] - exact_o).max() < 1e-12
    if _built:
        assert not kernels.flash_attn(*cpu._fa_split(out, q, k), q, k, v, 0.3, 0)


def _numpy_attention(monkeypatch):
    monkeypatch.setattr(kernels, "flash_attn", lambda *a: False)


@needs_attention
def test_perplexity_past_plain_attention_is_numpy_s(stories_path, wikitext_ids, monkeypatch):
    """Perplexity at ctx 512 (blockwise attention): the compiled forward's estimate is numpy's."""

    assert PLAIN_ATTENTION_MAX_T < 512
    model = load_model(stories_path)
    calls = []
    real = kernels.flash_attn
    monkeypatch.setattr(kernels, "flash_attn", lambda *a: calls.append(1) or real(*a))
    compiled = perplexity_from_ids(model, wikitext_ids, ctx=512, chunks=3)
    assert calls  # the compiled kernel ran
    _numpy_attention(monkeypatch)
    reference = perplexity_from_ids(model, wikitext_ids, ctx=512, chunks=3)
    assert compiled.ppl == pytest.approx(reference.ppl, rel=1e-6)
    np.testing.assert_allclose(compiled.chunks, reference.chunks, rtol=1e-6)


@needs_attention
def test_training_past_plain_attention_is_numpy_s(stories_path, monkeypatch):
    """Full training steps at 300 positions: numpy's backward from the compiled forward's O and
    logsumexp gives numpy's losses and weights within float32 summation order."""

    def run():
        model = load_model(stories_path)
        tr = Trainer(model, CPUBackend(), n_ctx=300, n_batch=300, n_ubatch=300, trainable=list(model.tensors()),
                     optimizer="sgd")  # (AdamW would turn float noise in near-zero gradients into whole steps)
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(2):
            x = rng.integers(0, 500, (1, 300), dtype=np.int32)
            stats = RunningStats()
            tr.train_step(x, np.roll(x, -1, axis=1), 0.1, stats)
            losses.append(stats.loss)
        return losses, tr.flat_w.copy()

    calls = []
    real = kernels.flash_attn
    monkeypatch.setattr(kernels, "flash_attn", lambda *a: calls.append(1) or real(*a))
    losses_c, w_c = run()
    assert calls
    _numpy_attention(monkeypatch)
    losses_n, w_n = run()
    np.testing.assert_allclose(losses_c, losses_n, rtol=1e-5)
    np.testing.assert_allclose(w_c, w_n, rtol=1e-5, atol=1e-6)


def test_kernels_between_products_leave_openblas_s_threads_the_cores():
    """With OpenBLAS multi-threaded (a step tuned to its threads) attention and rope run on the
    calling thread only; with OpenBLAS at one thread they take the compiled pool's count."""
    if not blas_threads.available():
        pytest.skip("no OpenBLAS found to set")
    with blas_threads(2):
        assert kernels._pool_threads() == 1
    with blas_threads(1):
        assert kernels._pool_threads() == 0
