"""The small-model step's plumbing: the contiguous rope gives the strided form's bits, a replayed
program gives Program.run's values (gradient sinks included), and the BLAS thread tuner keeps
the faster count while still probing the other."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmtune.backends.cpu import CPUBackend, threads
from llmtune.backends.cpu.attention import _ROPE_TABLES, k_rope
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import Program, Replay
from llmtune.model.loaded import load_model


def _strided_rope(x, pos, n_rot, inverse):
    """The norm-mode rope as pairs of strided views (the general path's arithmetic)."""
    cos, sin = _ROPE_TABLES.get(pos, n_rot, 10000.0, 1.0, x.dtype)[:2]
    cos, sin = cos[:, None, :], (-sin if inverse else sin)[:, None, :]
    out = np.empty(x.shape, x.dtype)
    x0, x1, o0, o1 = x[..., 0::2], x[..., 1::2], out[..., 0::2], out[..., 1::2]
    t = x1 * sin
    np.multiply(x0, cos, out=o0)
    o0 -= t
    np.multiply(x0, sin, out=t)
    np.multiply(x1, cos, out=o1)
    o1 += t
    return out


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("permuted", [False, True])
def test_contiguous_rope_is_bit_exact(inverse, permuted):
    """Whole-head norm rope on float32 (also on the permuted gradient view) equals the strided form bit for bit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 40, 3, 16)).astype(np.float32)
    if permuted:
        x = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    pos = np.arange(40, dtype=np.int32)
    got = k_rope(np.empty(x.shape, np.float32), x, pos, n_rot=16, base=10000.0, freq_scale=1.0, mode="norm",
                 inverse=inverse)
    assert got.tobytes() == _strided_rope(x, pos, 16, inverse).tobytes()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_replay_matches_run(stories_path, checkpoint):
    """A training program replayed (assign, then accumulate) writes the same gradients and
    returns the same loss as Program.run, bit for bit, and follows new values in its input buffers;
    with gradient checkpointing too (its ops.after views must not end the replay)."""
    model = load_model(stories_path)
    be = CPUBackend()
    names = ["blk.0.attn_q.weight", "output_norm.weight"]
    _, nodes, logits = model.build(1, 32, trainable=names)
    targets = ops.input((32,), "i32", name="targets")
    loss = ops.cross_entropy(logits, targets)
    grads = grad(loss, [nodes[n] for n in names], checkpoint=checkpoint)
    params = {nodes[k]: be.asarray(v) for k, v in model.weights.items()}

    def run(replayed: bool):
        sinks = {n: np.zeros(model.weights[n].shape, np.float32) for n in names}
        prog = Program([loss], be, params=params, accumulate={grads[nodes[n]]: sinks[n] for n in names})
        feed = {"tokens": np.zeros((1, 32), np.int32), "pos": np.arange(32, dtype=np.int32),
                "targets": np.zeros(32, np.int32)}
        replays = {a: Replay(prog, feed, assign=a) for a in (True, False)}
        losses = []
        for step, assign in enumerate([True, False, True, False]):
            rng = np.random.default_rng(step)
            feed["tokens"][...] = rng.integers(0, 512, (1, 32))
            feed["targets"][...] = rng.integers(0, 512, 32)
            out = replays[assign].run() if replayed else prog.run(assign=assign, **feed)
            losses.append(float(out[0]))
        assert not replayed or all(r.fixed for r in replays.values())
        return losses, sinks

    (l1, g1), (l2, g2) = run(False), run(True)
    assert l1 == l2 and len(set(l1)) == 4
    for n in names:
        assert g1[n].tobytes() == g2[n].tobytes()


def test_replay_accumulates_gradients_that_are_views():
    """ops.lora's A and B gradients are views of one packed buffer (no kernel of their own): a
    replay still adds each run's into its sink, as Program.run does."""
    be = CPUBackend()
    x, w = ops.input((6, 8), name="x"), ops.param((5, 8), name="w", requires_grad=False)
    a, b = ops.param((2, 8), name="a"), ops.param((5, 2), name="b")
    loss = ops.cross_entropy(ops.lora(ops.linear(x, w), x, a, b, 0.5), ops.input((6,), "i32", name="targets"))
    grads = grad(loss, [a, b])
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(n.shape).astype(np.float32) for n in (w, a, b)}

    def run(replayed: bool):
        sinks = {n: np.zeros(n.shape, np.float32) for n in (a, b)}
        prog = Program([loss], be, params=params, accumulate={grads[n]: sinks[n] for n in (a, b)})
        feed = {"x": np.zeros((6, 8), np.float32), "targets": np.zeros(6, np.int32)}
        replays = {assign: Replay(prog, feed, assign=assign) for assign in (True, False)}
        for step, assign in enumerate([True, False, False, True, False]):
            feed["x"][...] = np.random.default_rng(step).standard_normal((6, 8))
            feed["targets"][...] = np.arange(step, step + 6) % 5
            replays[assign].run() if replayed else prog.run(assign=assign, **feed)
        return sinks

    plain, replayed = run(False), run(True)
    assert all(plain[n].any() and plain[n].tobytes() == replayed[n].tobytes() for n in (a, b))


@pytest.mark.determinism
def test_blas_tuner_keeps_the_faster_count(monkeypatch):
    """Trial runs alternate; the faster count runs; the other is probed after 8 runs, then 16 (on a
    machine where OpenBLAS's count does not change its bits: pinned, whatever this one's are)."""
    monkeypatch.setattr(threads.blas_threads, "_load", lambda: (lambda: 2, lambda n: None))
    monkeypatch.setattr(threads.blas_threads, "keeps_bits", lambda: True)
    tuner = threads.BlasTuner()
    cost = {2: 5.0, 1: 1.0}  # a busy machine: one thread is faster
    picks = []
    for _ in range(40):
        n = tuner._pick()
        picks.append(n)
        tuner._record(n, cost[n])
    assert picks[:5] == [2, 1, 2, 1, 2] and tuner.best == 1
    probes = [i for i, n in enumerate(picks) if i >= 5 and n == 2]
    assert probes == [13, 30]
    cost[2] = 0.5  # the machine went quiet: two probes that win switch back
    for _ in range(40):
        n = tuner._pick()
        tuner._record(n, cost[n])
    assert tuner.best == 2
    assert threads.BlasTuner(enabled=False).candidates == ()


@pytest.mark.determinism
def test_blas_tuner_settles_on_all_threads_for_long_runs(monkeypatch):
    """A warm-up run of SETTLE_SECONDS or more (a 7B-class step: big products) settles on all
    threads: no trial at one thread, whose step would take twice as long, and no later probes."""
    monkeypatch.setattr(threads.blas_threads, "_load", lambda: (lambda: 2, lambda n: None))
    monkeypatch.setattr(threads.blas_threads, "keeps_bits", lambda: True)
    tuner = threads.BlasTuner()
    picks = []
    for _ in range(40):
        n = tuner._pick()
        picks.append(n)
        tuner._record(n, threads.BlasTuner.SETTLE_SECONDS * (1 if n == 2 else 0.1))
    assert picks == [2] * 40 and tuner.settled
    short = threads.BlasTuner()
    short._record(short._pick(), threads.BlasTuner.SETTLE_SECONDS / 2)
    assert not short.settled and short._pick() == 1  # a short step: the trials go on


def test_blas_bits_probe_is_measured_once_per_machine(monkeypatch, tmp_path):
    """keeps_bits measures once per machine, library and thread count, then reads the cache
    folder; a damaged or unwritable cache only means measuring again."""
    monkeypatch.setenv("LLMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    probes = []

    def fresh(cores: int):
        monkeypatch.setattr(threads, "n_cores", lambda: cores)
        bt = threads._BlasThreads()
        funcs = (lambda: cores, lambda n: None)
        bt._load = lambda: funcs
        bt._probe_bits = lambda n: probes.append(n) or False
        return bt

    assert fresh(2).keeps_bits() is False and probes == [2]
    assert fresh(2).keeps_bits() is False and probes == [2]  # a new process: the cache answers
    assert fresh(3).keeps_bits() is False and probes == [2, 3]  # another thread count: measured
    cached = tmp_path / "cache" / "blas-bits.json"
    assert len(json.loads(cached.read_text())) == 2
    cached.write_text("{not json")
    assert fresh(2).keeps_bits() is False and probes == [2, 3, 2]
    assert json.loads(cached.read_text()) == {threads.ProbeCache("blas-bits", threads._blas_identity(2)).key: False}
    monkeypatch.setenv("LLMTUNE_CACHE_DIR", str(cached / "not-a-folder"))
    assert fresh(2).keeps_bits() is False and probes == [2, 3, 2, 2]


@pytest.mark.determinism
def test_blas_thread_count_does_not_change_products_where_the_tuner_runs():
    """The tuner's premise: OpenBLAS gives the same bits with one thread and with several, on
    the machines where it tunes (keeps_bits); elsewhere it keeps one count."""
    if not threads.blas_threads.available():
        pytest.skip("no OpenBLAS thread control")
    if not threads.blas_threads.keeps_bits():
        assert threads.BlasTuner().candidates == ()  # tests/test_reproducible.py: it then runs one thread
        pytest.skip("this OpenBLAS splits sums over its threads: the tuner keeps one thread count")
    rng = np.random.default_rng(0)
    for m, k, n in [(256, 64, 512), (256, 288, 768), (512, 288, 2048)]:
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
        with threads.blas_threads(1):
            one = a @ b.T
        with threads.blas_threads(2):
            two = a @ b.T
        assert one.tobytes() == two.tobytes()
