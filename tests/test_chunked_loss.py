"""The loss over vocabulary chunks (ops.linear_cross_entropy, backends/vocab_chunks.py: Cut
Cross-Entropy) equals the loss of the whole logits within float32 rounding, gradients included,
on every backend; and a training step that chunks is the step that does not."""

import numpy as np
import pytest

import test_grpo
from llmtune.backends.cpu import CPUBackend
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.gradcheck import check_gradients
from llmtune.graph.node import topo_order
from llmtune.graph.planner import Program
from llmtune.model.loaded import load_model
from llmtune.train import flops, programs
from llmtune.train.trainer import RunningStats, Trainer
from test_backends import BACKEND_NAMES, assert_close, backend_for, randn, stored_matrix


@pytest.fixture(params=BACKEND_NAMES)
def name(request):
    """cpu, the CUDA kernels' emulator, and cuda where there is a device (test_backends.py's)."""
    backend_for(request.param)  # skip early when absent
    return request.param


N, D, V = 9, 16, 53
# float32 rounding: each path is ~1e-6 of its largest value off a float64 run (the chunks sum their
# logsumexp in another order, and dx chunk by chunk)
RTOL = 5e-6
TARGETS = np.array([4, -1, 52, 0, 17, -1, 30, 51, 7], dtype=np.int32)  # two masked rows


def _run(backend, x, w, targets, g, chunk, cap, mean):
    """(loss, dx, dW, hits) of the chunked op (chunk > 0) or of the whole logits (chunk 0)."""
    xn, wn = ops.param(x.shape, name="x"), ops.param(w.shape, name="w")
    tn = ops.input(targets.shape, "i32", name="t")
    seed = ops.input(g.shape, name="g")
    if chunk:
        loss = ops.linear_cross_entropy(xn, wn, tn, chunk, cap, mean)
        hits = ops.vocab_hits(loss.inputs[3])
    else:
        logits = ops.linear(xn, wn)
        logits = ops.softcap(logits, cap) if cap else logits
        loss = ops.cross_entropy(logits, tn) if mean else ops.token_nll(logits, tn)
        hits = ops.count_correct(logits, tn)
    grads = grad(loss, [xn, wn], seed=seed)
    values = {xn: backend.asarray(x.astype(np.float32)), wn: backend.asarray(w.astype(np.float32))}
    prog = Program([loss, grads[xn], grads[wn], hits], backend, params=values)
    out = prog.run(t=backend.asarray(targets), g=backend.asarray(g.astype(np.float32)))
    return [backend.to_numpy(o).astype(np.float64) for o in out]


@pytest.mark.parametrize("chunk", [7, 16, 53, 100])  # 7 and 16 do not divide 53; 100: one chunk
@pytest.mark.parametrize("cap,mean", [(0.0, True), (0.0, False), (3.0, True)])
def test_chunked_equals_whole_logits(name, chunk, cap, mean):
    be = backend_for(name)
    x, w = randn(N, D), randn(V, D)
    targets = TARGETS.copy()
    targets[3] = int(np.argmax(x[3] @ w.T))  # at least one hit
    g = np.array(0.75) if mean else randn(N)
    want = _run(be, x, w, targets, g, 0, cap, mean)
    got = _run(be, x, w, targets, g, chunk, cap, mean)
    for a, b in zip(got, want):
        assert_close(a, b, RTOL)
    assert got[3] >= 1
    assert np.all(got[1][targets < 0] == 0) or not mean  # masked rows: no gradient through the mean


def test_all_rows_masked_is_zero(name):
    be = backend_for(name)
    x, w = randn(4, D), randn(V, D)
    none = np.full(4, -1, np.int32)
    loss, dx, dw, hits = _run(be, x, w, none, np.array(1.0), 8, 0.0, True)
    assert loss == 0 and not dx.any() and not dw.any() and hits == 0


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_stored_output_matrix(name, qtype):
    """A frozen output matrix kept in its file type (QLoRA): chunks are row ranges of its blocks;
    the gradient wrt x equals that of the whole logits of the same stored matrix."""
    be = backend_for(name)
    x, w = randn(N, 256), randn(V, 256)
    raw, _ = stored_matrix(w, qtype)
    results = []
    for chunk in (0, 12):
        xn, wn = ops.param(x.shape, name="x"), ops.qweight(w.shape, qtype, name="w")
        tn = ops.input((N,), "i32", name="t")
        loss = (ops.linear_cross_entropy(xn, wn, tn, chunk) if chunk
                else ops.cross_entropy(ops.linear(xn, wn, round_x=False), tn))
        dx = grad(loss, [xn], seed=ops.input((), name="g"))[xn]
        prog = Program([loss, dx], be, params={xn: be.asarray(x.astype(np.float32)), wn: be.asarray(raw)})
        out = prog.run(t=be.asarray(TARGETS), g=be.asarray(np.array(1.0, np.float32)))
        results.append([be.to_numpy(o).astype(np.float64) for o in out])
    for a, b in zip(*results):
        assert_close(a, b, RTOL)


@pytest.mark.parametrize("mean,cap", [(True, 0.0), (False, 2.5)])
def test_gradients_by_finite_differences(mean, cap):
    be = backend_for("cpu", np.float64)
    errs = check_gradients(lambda x, w, t: ops.linear_cross_entropy(x, w, t, 5, cap, mean),
                           {"x": randn(N, 6), "w": randn(13, 6)}, be,
                           int_inputs={"t": np.array([1, -1, 12, 0, 5, 6, -1, 9, 3], np.int32)})
    assert max(errs.values()) < 1e-6, errs


def test_chunk_choice(monkeypatch):
    monkeypatch.delenv(programs.VOCAB_CHUNK_ENV, raising=False)
    monkeypatch.delenv("LLMTUNE_MEMORY_LIMIT", raising=False)
    assert programs.vocab_chunk(512, 32000) == 0  # 62.5 MiB of logits: whole
    assert programs.vocab_chunk(2048, 49152) == 0  # 384 MiB (SmolLM2): whole, for speed
    chunk = programs.vocab_chunk(2048, 151936)  # 1.2 GiB of logits: chunks of about 32 MiB
    assert chunk % 256 == 0 and 2048 * chunk * 4 <= programs.CHUNK_BYTES
    monkeypatch.setenv("LLMTUNE_MEMORY_LIMIT", "16G")  # a limit: memory over speed from 256 MiB
    assert programs.vocab_chunk(2048, 49152) > 0 and programs.vocab_chunk(512, 32000) == 0
    monkeypatch.setenv(programs.VOCAB_CHUNK_ENV, "0")
    assert programs.vocab_chunk(2048, 151936) == 0
    monkeypatch.setenv(programs.VOCAB_CHUNK_ENV, "100")
    assert programs.vocab_chunk(8, 512) == 100
    monkeypatch.setenv(programs.VOCAB_CHUNK_ENV, "lots")
    with pytest.raises(programs.LlmtuneError, match=programs.VOCAB_CHUNK_ENV):
        programs.vocab_chunk(8, 512)


def _steps(stories_path, trainable, monkeypatch, chunk: str):
    monkeypatch.setenv(programs.VOCAB_CHUNK_ENV, chunk)
    model = load_model(stories_path)
    tr = Trainer(model, CPUBackend(), n_ctx=32, n_batch=64, n_ubatch=32, trainable=model.select(trainable))
    ops_used = {n.op for n in tr.programs.train[0].order}
    ids = np.random.default_rng(0).integers(0, model.hp.n_vocab, size=(2, 33))
    ids[1, :10] = -1  # masked targets
    stats, losses = RunningStats(), []
    x, y = np.maximum(ids[:, :-1], 0), ids[:, 1:]
    for _ in range(2):
        losses.append(tr.train_step(x, y, 1e-3, stats))
    val = RunningStats()
    tr.evaluate(x, y, val)  # the validation pass chunks too
    ops_used |= {n.op for cache in tr.programs.eval_caches for p in cache.programs() for n in p.order}
    scratch = tr.programs.chunk_scratch  # a chunk's logits and their gradient, and dx's part, float32
    assert scratch == (0 if chunk == "0" else (2 * 32 * 100 + 32 * 64) * 4)
    arenas = sum(p.memory.planned_bytes for p in tr.programs.train)
    assert tr.memory_bytes()["activations"] == arenas + scratch * len(tr.programs.train)  # one set per worker
    return losses + [val.loss], tr.trained_weights(), (stats.correct, val.correct), ops_used


@pytest.mark.parametrize("trainable", [None, "output"])
def test_a_finetune_step_that_chunks_is_the_step_that_does_not(stories_path, monkeypatch, trainable):
    """stories260K (vocabulary 512), full finetune (the tied or own output matrix trains) and only
    the output: two steps with chunks of 100 rows equal the steps over the whole logits."""
    want = _steps(stories_path, trainable, monkeypatch, "0")
    got = _steps(stories_path, trainable, monkeypatch, "100")
    assert_close(got[0], want[0], 1e-5)
    assert got[2] == want[2]
    assert "linear_cross_entropy_back" in got[3] and "cross_entropy" not in got[3]
    assert "cross_entropy" in want[3] and "vocab_stats" not in want[3]
    # float32 summation order only (the chunks' sums of exp, dx summed chunk by chunk), which AdamW's
    # normalised step turns into up to ~1% of a near-zero gradient's update: the bound
    # test_finetune.test_ubatch_does_not_change_the_result allows for another summation order
    for n, w in want[1].items():
        assert_close(got[1][n], w, 5e-5)


@pytest.mark.parametrize("trains", [False, True])
def test_flops_count_the_recomputed_chunks(trains):
    """The whole logits' step multiplies by W twice for a frozen output matrix (logits, dx), three
    times for a trained one (and dW); the chunked step once more: each chunk's logits recomputed
    once, for dx and dW together."""
    x, t = ops.param((N, D), name="x"), ops.input((N,), "i32")
    w = ops.param((V, D), name="w", requires_grad=trains)
    wanted = [x, w] if trains else [x]
    count = []
    for loss in (ops.cross_entropy(ops.linear(x, w), t), ops.linear_cross_entropy(x, w, t, 7)):
        g = grad(loss, wanted)
        count.append(flops.program_flops(topo_order([loss] + [g[n] for n in wanted])) // (N * V * D))
    assert count == ([6, 8] if trains else [4, 6])


def test_grpo_tempered_logits_over_chunks(stories_path, monkeypatch):
    """GRPO's logits / temperature chunk as (x / T) W^T: its training pass's gradient still matches
    finite differences of TRL's loss (test_grpo's check, every pass chunked)."""
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("mean", args[5] if len(args) > 5 else True))
        return real(*args, **kw)

    real = ops.linear_cross_entropy
    monkeypatch.setattr(ops, "linear_cross_entropy", spy)
    monkeypatch.setenv(programs.VOCAB_CHUNK_ENV, "100")
    test_grpo.test_gradient_matches_finite_differences(stories_path)
    assert calls and not any(calls)  # per-token NLLs (mean=False), chunked
