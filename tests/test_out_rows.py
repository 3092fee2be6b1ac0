"""Training passes that score only their loss-carrying rows (Trainer.out_rows, Batch.out_ids: llama.cpp's
inp_out_ids): the same loss and gradients as the pass over every row, in fewer products."""

import numpy as np
import pytest

from llmtune.backends.cpu import CPUBackend
from llmtune.model.adapter import attach, init_adapter
from llmtune.model.loaded import load_model
from llmtune.train.programs import NextTokenLoss, StepPrograms, WeightedTokenNLL
from llmtune.train.trainer import RunningStats, Trainer

CTX = 32


def _trainer(path, kind: str, **kw) -> Trainer:
    model = load_model(path)
    if kind == "lora":
        adapter = init_adapter(model, 4, alpha=8.0, seed=0)
        model, names = attach(model, [adapter]), list(adapter.tensors())
    else:
        names = list(model.tensors())
    return Trainer(model, CPUBackend(), n_ctx=CTX, n_batch=2 * CTX, n_ubatch=CTX, trainable=names, workers=1, **kw)


def _every_row(tr: Trainer) -> Trainer:
    tr.out_rows = lambda n_counted, n_rows=None: n_rows or tr.n_ubatch  # every row, as before out_rows
    return tr


def _masked_batch(n_vocab: int):
    rng = np.random.default_rng(0)
    x = rng.integers(0, n_vocab, (2, CTX)).astype(np.int32)
    y = rng.integers(0, n_vocab, (2, CTX)).astype(np.int32)
    y[0, :20] = -1  # a prompt
    y[1, :5] = -1
    y[1, 12:] = -1  # padding
    return x, y


@pytest.mark.parametrize("kind,kw", [("full", {}), ("lora", {}), ("lora", {"grad_checkpoint": True})])
def test_scored_rows_give_the_gradient_of_every_row(stories_path, kind, kw):
    a, b = _trainer(stories_path, kind, **kw), _every_row(_trainer(stories_path, kind, **kw))
    x, y = _masked_batch(a.model.hp.n_vocab)
    sa, sb = RunningStats(), RunningStats()
    la, lb = a.train_step(x, y, 0.0, sa), b.train_step(x, y, 0.0, sb)
    assert sorted(a.programs.out_passes) == [(0, 8), (0, 16)]  # 12 and 7 counted targets, in buckets of 8
    assert not b.programs.out_passes
    assert la == pytest.approx(lb, rel=1e-6)
    assert (sa.correct, sa.tokens) == (sb.correct, sb.tokens)
    ga, gb = np.asarray(a.flat_g), np.asarray(b.flat_g)
    assert np.abs(ga - gb).max() <= 1e-5 * np.abs(gb).max()  # float32 summation order only


def test_out_row_passes_share_the_arena_and_the_estimate(stories_path):
    tr = _trainer(stories_path, "lora")
    before = tr.memory_bytes()
    tr.train_step(*_masked_batch(tr.model.hp.n_vocab), 1e-3, RunningStats())
    for prog, _, _ in tr.programs.out_passes.values():
        assert not prog.owns_arena and prog.arena is tr.programs.train[0].arena
        assert prog.memory.planned_bytes < tr.programs.train[0].memory.planned_bytes
    assert tr.memory_bytes() == before


def test_out_rows_buckets():

    progs = StepPrograms.__new__(StepPrograms)
    progs.loss, progs.n_ubatch = NextTokenLoss, 512
    assert [progs.out_rows(n) for n in (0, 1, 32, 33, 480, 481, 512)] == [32, 32, 32, 64, 480, 512, 512]
    progs.n_ubatch = 32
    assert [progs.out_rows(n) for n in (0, 9, 25, 32)] == [8, 16, 32, 32]
    progs.loss = WeightedTokenNLL  # a loss of every token's NLL reads every row
    assert [progs.out_rows(n) for n in (0, 9, 32)] == [32, 32, 32]


def test_fully_counted_windows_run_the_plain_pass(stories_path):
    """Unmasked text: every row carries loss, so no row selection (and no out_ids input) at all."""
    tr = _trainer(stories_path, "full")
    rng = np.random.default_rng(1)
    x, y = (rng.integers(0, tr.model.hp.n_vocab, (2, CTX)).astype(np.int32) for _ in range(2))
    tr.train_step(x, y, 1e-3, RunningStats())
    assert not tr.programs.out_passes and "out_ids" not in tr.programs.train[0].inputs


def test_validation_scores_only_loss_carrying_rows(stories_path):
    """evaluate(): the same loss and accuracy as the pass over every row, in a pass that shares
    the arena of that pass; a short last batch gets its own shapes."""
    a, b = _trainer(stories_path, "lora"), _every_row(_trainer(stories_path, "lora"))
    x, y = _masked_batch(a.model.hp.n_vocab)
    x, y = np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]])  # 3 windows: passes of 1, 1, 1
    sa, sb = RunningStats(), RunningStats()
    a.evaluate(x, y, sa)
    b.evaluate(x, y, sb)
    assert (sa.correct, sa.tokens) == (sb.correct, sb.tokens) and sa.tokens == int((y >= 0).sum())
    np.testing.assert_allclose(sa.losses, sb.losses, rtol=1e-6)
    keys = {k for c in a.programs.eval_caches for k in c._programs}
    assert keys == {(1, 16), (1, 8), (1, CTX)}  # 12 and 7 counted targets; the full pass lends its arena
    for cache in a.programs.eval_caches:
        progs = cache._programs
        for (n_seq, n_out), prog in progs.items():
            if n_out < n_seq * CTX:
                assert not prog.owns_arena and prog.arena is progs[(n_seq, n_seq * CTX)].arena
