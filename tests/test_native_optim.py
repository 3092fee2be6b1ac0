"""The compiled AdamW update (native/optim.c lt_adamw) against numpy's blocked update
(backends/cpu/optim.py adamw_range, its reference): the same weights and moments bit for bit, with and
without weight decay, over vector tails and a buffer split across the cores. Skips where the
compiled layer is not built."""

from __future__ import annotations

import numpy as np
import pytest

from llmtune.backends.cpu import backend as cpu, threads
from llmtune.backends.cpu.native import kernels
from llmtune.backends.cpu.threads import PARALLEL_MIN

needs_optim = pytest.mark.skipif(kernels._load_optim() is None,
                                 reason=f"no compiled kernels: {kernels.reason() or 'optim.c did not build'}")
HP = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def _state(n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n, dtype=np.float32)
    m = 0.1 * rng.standard_normal(n, dtype=np.float32)
    v = 0.01 * np.abs(rng.standard_normal(n, dtype=np.float32))
    v[:3] = 0.0  # a moment that is still zero: sqrt(0) + eps
    return w, m, v


def _numpy_update(monkeypatch, *args, **hp):
    with monkeypatch.context() as p:
        p.setattr(kernels, "adamw", lambda *a, **k: False)
        cpu.CPUBackend().adamw_step(*args, **hp)


@needs_optim
@pytest.mark.parametrize("n", [1, 15, 16, 1000, 2 * PARALLEL_MIN + 37])  # the last: split over the cores
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_is_numpy_s_bit_for_bit(n, wd, monkeypatch):
    compiled, reference = _state(n, n), _state(n, n)
    rng = np.random.default_rng(1)
    calls = []
    real = kernels.adamw
    monkeypatch.setattr(kernels, "adamw", lambda *a, **k: calls.append(1) or real(*a, **k))
    for t in (1, 2, 3):
        g = rng.standard_normal(n, dtype=np.float32)
        g[-1:] = 0.0
        w, m, v = compiled
        cpu.CPUBackend().adamw_step(w, g, m, v, t=t, wd=wd, **HP)
        w, m, v = reference
        _numpy_update(monkeypatch, w, g, m, v, t=t, wd=wd, **HP)
    assert calls
    for a, b in zip(compiled, reference):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(compiled[0], _state(n, n)[0])  # it did move the weights


def test_declines_what_it_does_not_take():
    w64 = np.zeros(8)
    assert not kernels.adamw(w64, w64, w64, w64, t=1, wd=0.0, **HP)
    w = np.zeros(8, np.float32)
    assert not kernels.adamw(w, np.zeros(7, np.float32), w.copy(), w.copy(), t=1, wd=0.0, **HP)  # sizes differ
    assert not kernels.adamw(np.zeros(16, np.float32)[::2], w, w.copy(), w.copy(), t=1, wd=0.0, **HP)  # strided


@pytest.mark.determinism
@pytest.mark.parametrize("compiled", [True, False])
def test_sum_squares_in_float64_and_the_same_bits_on_any_core_count(compiled, monkeypatch):
    """The step's gradient norm squared: float64 (the compiled pass and numpy's agree to ~1e-15),
    finite for large float32 values, not finite for a NaN or inf, and the same bits however
    many parts the buffer is split into."""

    if compiled and kernels._load_optim() is None:
        pytest.skip("no compiled kernels")
    if not compiled:
        monkeypatch.setattr(kernels, "sum_squares", lambda *a: None)
    rng = np.random.default_rng(4)
    g = rng.standard_normal(3 * PARALLEL_MIN + 1001, dtype=np.float32)
    be = cpu.CPUBackend()
    exact = float(np.dot(g.astype(np.float64), g.astype(np.float64)))
    got = be.sum_squares(g)
    assert got == pytest.approx(exact, rel=1e-13)
    monkeypatch.setattr(threads, "n_cores", lambda: 1)  # one part, not one per core
    assert be.sum_squares(g) == got
    big = np.full(1000, 3e38, np.float32)  # squares far past float32's range
    assert be.sum_squares(big) == pytest.approx(1000 * float(big[0]) ** 2)
    for bad in (np.nan, np.inf, -np.inf):
        g2 = g.copy()
        g2[PARALLEL_MIN + 5] = bad
        assert not np.isfinite(be.sum_squares(g2))
