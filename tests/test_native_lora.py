"""The compiled adapter term (native/qdot.c lt_lora and lt_lora_back, ops.lora's float32 forward
and gradients) against numpy's products (backends/cpu.py k_lora / k_lora_back, the reference) and
float64: within float32 summation order, the same bits whatever the thread count, declining what
it does not take, and a LoRA run's adapters as numpy's. Skips without the compiled layer."""

from __future__ import annotations

import numpy as np
import pytest

from llmtune.backends.cpu import CPUBackend, backend as cpu
from llmtune.backends.cpu.native import kernels
from llmtune.backends.cpu.threads import blas_threads
from llmtune.model import adapter as lora
from llmtune.model.loaded import load_model
from llmtune.train.trainer import RunningStats, Trainer

needs_native = pytest.mark.skipif(not kernels.available(), reason=f"no compiled layer: {kernels.reason()}")

# (rows, n_in, n_out, rank): SmolLM2's shapes at a training pass, tails past the 16 lanes on every
# side, ranks below, at and past a group of 8, one row, the largest rank taken
CASES = [(128, 576, 1536, 8), (128, 1536, 576, 16), (37, 50, 70, 3), (5, 16, 16, 20), (1, 100, 37, 1),
         (9, 33, 19, 9), (6, 40, 24, kernels.LORA_MAX_RANK)]


def _arrays(rows, n_in, n_out, rank, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32)
            for shape in ((rows, n_out), (rows, n_in), (rank, n_in), (n_out, rank), (rows, n_out))]


def _both(fn, monkeypatch, *args):
    """fn(*args) compiled, then as numpy's products (the compiled calls declining)."""
    compiled = fn(*args)
    with monkeypatch.context() as m:
        m.setattr(kernels, "lora", lambda *a, **k: False)
        m.setattr(kernels, "lora_back", lambda *a, **k: False)
        return compiled, fn(*args)


def _forward(y, x, a, b, s):
    return cpu.k_lora(np.full_like(y, np.nan), y, x, a, b, s)


def _gradients(x, a, b, g, s, dx=True):
    return cpu.k_lora_back(np.full((x.size if dx else 0) + a.size + b.size, np.nan, np.float32), x, a, b, g, s, dx)


@needs_native
@pytest.mark.parametrize("rows, n_in, n_out, rank", CASES)
def test_matches_numpy_and_float64(rows, n_in, n_out, rank, monkeypatch):
    y, x, a, b, g = _arrays(rows, n_in, n_out, rank)
    s = 0.37
    x64, a64, b64, g64 = (v.astype(np.float64) for v in (x, a, b, g))
    t, u = s * (x64 @ a64.T), s * (g64 @ b64)
    exact = [y + t @ b64.T, np.concatenate([(u @ a64).ravel(), (u.T @ x64).ravel(), (g64.T @ t).ravel()])]
    for fn, args, want in ((_forward, (y, x, a, b, s), exact[0]), (_gradients, (x, a, b, g, s), exact[1])):
        compiled, numpy_ = _both(fn, monkeypatch, *args)
        scale = np.abs(want).max()
        assert np.abs(compiled - want).max() < 2e-6 * scale * np.sqrt(max(n_in, n_out) / 64)
        np.testing.assert_allclose(compiled, numpy_, rtol=0, atol=4e-6 * scale * np.sqrt(max(n_in, n_out) / 64))


@needs_native
def test_without_dx_and_in_place():
    """No dx slot when x has no gradient (the same dA, dB bits); the output over y's own buffer."""
    y, x, a, b, g = _arrays(24, 64, 48, 4)
    full, no_dx = _gradients(x, a, b, g, 0.5), _gradients(x, a, b, g, 0.5, dx=False)
    assert full[x.size:].tobytes() == no_dx.tobytes()
    into_y = y.copy()
    assert cpu.k_lora(into_y, into_y, x, a, b, 0.5) is into_y
    assert into_y.tobytes() == _forward(y, x, a, b, 0.5).tobytes()


@pytest.mark.determinism
@needs_native
def test_same_bits_whatever_the_threads():
    """Each output is one task's sum in one order: one thread and all of them write the same bits."""
    y, x, a, b, g = _arrays(128, 576, 192, 8, seed=2)
    results = []
    with blas_threads(1):  # OpenBLAS single-threaded: the kernels take the compiled count
        for compiled_threads in (1, max(2, kernels.threads())):
            kernels.library().lt_set_gemm_threads(compiled_threads)
            results.append([_forward(y, x, a, b, 0.25).tobytes(), _gradients(x, a, b, g, 0.25).tobytes()])
    kernels.library().lt_set_gemm_threads(kernels.threads())
    assert results[0] == results[1]


@needs_native
def test_declines_what_it_does_not_take():
    """float64, strided rows and ranks past the largest go to numpy's products."""
    y, x, a, b, _ = _arrays(8, 32, 16, 4)
    assert kernels.lora(np.empty_like(y), y, x, a, b, s=1.0)
    assert not kernels.lora(np.empty_like(y, dtype=np.float64), y.astype(np.float64), x.astype(np.float64),
                            a.astype(np.float64), b.astype(np.float64), s=1.0)
    wide = np.zeros((8, 64), np.float32)
    assert not kernels.lora(np.empty_like(y), y, wide[:, ::2], a, b, s=1.0)
    big = kernels.LORA_MAX_RANK + 1
    assert not kernels.lora(np.empty_like(y), y, x, np.zeros((big, 32), np.float32), np.zeros((16, big), np.float32),
                            s=1.0)
    assert not kernels.lora(np.empty_like(y), y, x, a, b[:8], s=1.0)  # B's rows are not y's columns
    assert not kernels.lora_back(None, np.empty_like(a), np.empty((16, 4), np.float32), x, a, b, y[:4], s=1.0)
    assert kernels.bind_lora(np.empty_like(y), y, x, a, b, 1.0) is not None


@needs_native
def test_lora_training_is_numpy_s(stories_path, wikitext_ids, monkeypatch):
    """Three LoRA steps on stories260K, micro-batched (replayed passes): the compiled terms give
    numpy's losses and adapters within float32 summation order."""

    def run(steps=3):
        model = load_model(stories_path)
        adapter = lora.init_adapter(model, 8, 16.0, seed=0)
        tr = Trainer(lora.attach(model, [adapter]), CPUBackend(), n_ctx=24, n_batch=96, n_ubatch=24,
                     trainable=list(adapter.tensors()), optimizer="sgd", seed=5, workers=1)
        losses = []
        for s in range(steps):
            x = wikitext_ids[100 * s : 100 * s + 100].reshape(4, 25)
            stats = RunningStats()
            tr.train_step(x[:, :-1], x[:, 1:], 0.1, stats)
            losses.append(stats.loss)
        return losses, np.concatenate([w.ravel() for w in tr.trained_weights().values()])

    calls = []
    real = kernels.bind_lora_back
    monkeypatch.setattr(kernels, "bind_lora_back", lambda *a: calls.append(1) or real(*a))
    losses_c, w_c = run()
    assert calls
    monkeypatch.setattr(kernels, "bind_lora", lambda *a: None)
    monkeypatch.setattr(kernels, "bind_lora_back", lambda *a: None)
    losses_n, w_n = run()
    moved = np.abs(w_n - run(steps=0)[1]).max()
    assert moved > 1e-2
    np.testing.assert_allclose(losses_c, losses_n, rtol=1e-5)
    np.testing.assert_allclose(w_c, w_n, rtol=0, atol=1e-5 * moved)

