"""Whole-model checks of the graph engine on the real stories260K, plus the attention
composition (GQA, partial rope, both rope modes) under finite differences."""

import numpy as np
import pytest

from llmtune.arch import get_family
from llmtune.arch.context import Batch, BuildContext
from llmtune.backends.cpu import CPUBackend
from llmtune.graph import ops
from llmtune.graph.autodiff import checkpoint_segments
from llmtune.graph.gradcheck import check_gradients
from llmtune.graph.node import topo_order
from llmtune.graph.planner import Program
from llmtune.model.loaded import load_model
from llmtune.train.trainer import RunningStats, Trainer

REFERENCE_FIRST_WINDOW_LOSS = 5.326544  # shared/README.md: PyTorch and llama.cpp agree


@pytest.fixture(scope="module")
def stories(stories_path):
    return load_model(stories_path)


def _loss_program(model, backend, n_seq, n_tok):
    batch, nodes, logits = model.build(n_seq, n_tok)
    targets = ops.input((n_seq * n_tok,), "i32", name="targets")
    loss = ops.cross_entropy(logits, targets)
    params = {nodes[k]: backend.asarray(v.astype(backend.dtype)) for k, v in model.weights.items()}
    return Program([loss, logits], backend, params=params)


def test_first_window_loss_matches_reference(stories, wikitext_ids):
    be = CPUBackend()
    prog = _loss_program(stories, be, 1, 256)
    loss, _ = prog.run(tokens=wikitext_ids[None, :256], pos=np.arange(256, dtype=np.int32), targets=wikitext_ids[1:257])
    assert abs(float(loss) - REFERENCE_FIRST_WINDOW_LOSS) < 1e-4


def test_batched_sequences_match_single(stories, wikitext_ids):
    """Sequences in one pass do not see each other: logits equal those of separate passes."""
    be = CPUBackend()
    x = np.stack([wikitext_ids[0:64], wikitext_ids[500:564], wikitext_ids[999:1063]])
    y = np.stack([wikitext_ids[1:65], wikitext_ids[501:565], wikitext_ids[1000:1064]])
    pos = np.arange(64, dtype=np.int32)
    _, together = _loss_program(stories, be, 3, 64).run(tokens=x, pos=pos, targets=y.reshape(-1))
    together = together.copy().reshape(3, 64, -1)
    single = _loss_program(stories, be, 1, 64)
    for i in range(3):
        _, alone = single.run(tokens=x[i : i + 1], pos=pos, targets=y[i])
        np.testing.assert_allclose(together[i], alone, rtol=1e-4, atol=1e-4)


def test_logits_start_only_skips_work(stories, wikitext_ids):
    be = CPUBackend()
    batch, nodes, full = stories.build(2, 32)
    batch2, nodes2, tail = stories.build(2, 32, logits_start=20)
    bind = lambda nd: {nd[k]: v for k, v in stories.weights.items()}  # noqa: E731
    x = np.stack([wikitext_ids[:32], wikitext_ids[40:72]])
    pos = np.arange(32, dtype=np.int32)
    a = Program([full], be, params=bind(nodes)).run(tokens=x, pos=pos)[0].reshape(2, 32, -1)
    b = Program([tail], be, params=bind(nodes2)).run(tokens=x, pos=pos)[0].reshape(2, 12, -1)
    np.testing.assert_allclose(a[:, 20:], b, rtol=1e-5, atol=1e-5)


def test_planner_reuses_memory_on_training_graph(stories):
    """Training graph of stories260K at ctx 256: planned buffers far below the sum of intermediates."""
    tr = Trainer(stories, CPUBackend(), n_ctx=256, n_batch=256, n_ubatch=256, trainable=list(stories.weights))
    mem = tr.programs.train[0].memory
    assert mem.planned_bytes < 0.5 * mem.naive_bytes, mem


def test_planner_inplace_and_views_keep_values_correct():
    """A graph where views alias buffers and elementwise ops run in place gives numpy's answer."""
    be = CPUBackend(np.float64)
    a = ops.param((4, 6), name="a")
    b = ops.param((6,), name="b")
    t = ops.add(ops.mul(a, b), a)  # mul may write in place; a stays alive for the add
    v = ops.reshape(ops.permute(ops.reshape(t, (2, 2, 6)), (1, 0, 2)), (4, 6))
    out = ops.scale(ops.add(v, ops.silu(t)), 0.5)
    rng = np.random.default_rng(0)
    av, bv = rng.standard_normal((4, 6)), rng.standard_normal(6)
    got = Program([out, t], be, params={a: av, b: bv}).run()
    tt = av * bv + av
    vv = tt.reshape(2, 2, 6).transpose(1, 0, 2).reshape(4, 6)
    np.testing.assert_allclose(got[0], 0.5 * (vv + tt / (1 + np.exp(-tt))))
    np.testing.assert_allclose(got[1], tt)


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim,n_rot", [(4, 2, 6, 4), (3, 3, 4, 4), (6, 2, 8, 6)])
def test_attention_block_gradients(mode, n_head, n_head_kv, head_dim, n_rot):
    """Finite differences through a whole attention block: projections, rope (both modes, partial
    n_rot), grouped-query attention, causal softmax, output projection (float64)."""
    n_seq, n_tok, n_embd = 2, 5, 7
    hp = get_family("llama").make_hparams(n_vocab=1, n_ctx_train=16, n_embd=n_embd, n_layer=1, n_head=n_head,
                                          n_head_kv=n_head_kv, n_ff=1, n_rot=n_rot, head_dim_kq=head_dim,
                                          rope_mode=mode)
    rng = np.random.default_rng(n_head * 10 + n_rot)

    def build(x, wq, wk, wv, wo, tokens, pos):
        weights = {"blk.0.attn_q.weight": wq, "blk.0.attn_k.weight": wk, "blk.0.attn_v.weight": wv,
                   "blk.0.attn_output.weight": wo}
        return BuildContext(hp, weights, Batch(tokens, pos)).attn(x, 0)

    arrays = {
        "x": rng.standard_normal((n_seq * n_tok, n_embd)),
        "wq": rng.standard_normal((n_head * head_dim, n_embd)) * 0.5,
        "wk": rng.standard_normal((n_head_kv * head_dim, n_embd)) * 0.5,
        "wv": rng.standard_normal((n_head_kv * head_dim, n_embd)) * 0.5,
        "wo": rng.standard_normal((n_embd, n_head * head_dim)) * 0.5,
    }
    ints = {"tokens": np.zeros((n_seq, n_tok), np.int32), "pos": np.array([0, 1, 2, 5, 9], np.int32)}
    errors = check_gradients(build, arrays, CPUBackend(np.float64), int_inputs=ints)
    assert max(errors.values()) < 1e-6, errors


def test_whole_model_gradients_tiny_llama():
    """Finite differences through a full 2-layer llama (embeddings, norms, GQA, SwiGLU, head, loss)."""
    llama = get_family("llama")
    hp = llama.make_hparams(n_vocab=11, n_ctx_train=16, n_embd=8, n_layer=2, n_head=4, n_head_kv=2, n_ff=12, n_rot=2,
                            norm_eps=1e-5)
    rng = np.random.default_rng(3)
    shapes = {spec.name: spec.shape for spec in llama.tensors(hp) if not spec.optional}
    arrays = {k.replace(".", "_"): rng.standard_normal(s) * (1.0 if "norm" in k else 0.4) for k, s in shapes.items()}

    def build(tokens, pos, targets, **w):
        named = {k: w[k.replace(".", "_")] for k in shapes}
        logits = llama.build(BuildContext(hp, named, Batch(tokens, pos)))
        return ops.cross_entropy(logits, targets)

    ints = {"tokens": rng.integers(0, 11, (2, 4)), "pos": np.arange(4), "targets": rng.integers(0, 11, 8)}
    errors = check_gradients(build, arrays, CPUBackend(np.float64), int_inputs=ints)
    assert max(errors.values()) < 1e-5, errors


# ------------------------------------------------------------------------------ gradient checkpointing
def _trainer(model, checkpoint, dtype=np.float32, n_ctx=128):
    return Trainer(model, CPUBackend(dtype), n_ctx=n_ctx, n_batch=2 * n_ctx, n_ubatch=2 * n_ctx,
                   trainable=list(model.weights), workers=1, grad_checkpoint=checkpoint)


def test_grad_checkpoint_gives_the_same_gradients(stories_path, wikitext_ids):
    """Recomputed activations are the very ops on the very inputs: float64 gradients agree to
    rounding (exactly, in practice), and the loss too."""

    model = load_model(stories_path, quantized=False)
    x = np.stack([wikitext_ids[:128], wikitext_ids[300:428]])
    y = np.stack([wikitext_ids[1:129], wikitext_ids[301:429]])
    grads, losses = [], []
    for checkpoint in (False, True):
        tr = _trainer(model, checkpoint, np.float64)
        losses.append(tr.train_step(x, y, 0.0, RunningStats()))
        grads.append(np.array(tr.flat_g))
    assert losses[0] == pytest.approx(losses[1], rel=1e-14)
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-12, atol=1e-15 * np.abs(grads[0]).max())


def test_grad_checkpoint_lowers_planned_memory(stories):
    """The planned activations with --grad-checkpoint: each layer's kept values are the residual
    stream only, so the arena shrinks (planner accounting, ctx 256, 5 layers)."""
    plain = _trainer(stories, False, n_ctx=256).memory_bytes()["activations"]
    ckpt = _trainer(stories, True, n_ctx=256).memory_bytes()["activations"]
    assert ckpt < 0.5 * plain, (ckpt, plain)


def test_checkpoint_segments_are_the_residual_stream(stories):
    """Cuts fall on the residual adds, two per layer (after attention, after the FFN)."""

    _, _, logits = stories.build(1, 16)
    loss = ops.cross_entropy(logits, ops.input((16,), "i32", name="targets"))
    ends = [n for n in topo_order([loss]) if n.id in checkpoint_segments(topo_order([loss]))]
    adds = [n for n in ends if n.op == "add"]
    assert len(adds) >= 2 * stories.hp.n_layer - 1


def test_weight_gradients_run_as_soon_as_their_inputs_exist(stories):
    """Accumulated weight gradients are scheduled right after their inputs (not after the whole
    backward, which kept every activation they read alive): a valid order, each node once."""
    prog = _trainer(stories, False).programs.train[0]
    pos = {n.id: i for i, n in enumerate(prog.order)}
    assert len(pos) == len(prog.order)
    assert all(pos[i.id] < pos[n.id] for n in prog.order for i in n.inputs if not i.is_leaf)  # leaves are bound
    delays = [pos[s.id] - max(pos[i.id] for i in s.inputs) for s in prog.accumulate]
    assert max(delays) <= 2, delays
