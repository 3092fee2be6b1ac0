"""Log-probabilities of chosen tokens of many token sequences: the engine under the benchmarks.

Each `Row` is one token sequence (BOS first when the model adds one) with the positions whose
logits score a token and the token each scores. Rows of one `group` (a task's answers) begin with
the same tokens: as llama.cpp evaluates a task's choices as sequences sharing the question in one
KV cache, the group's common beginning (its trunk: up to the first scored position) is computed
once and each row's rest (a branch) attends to it (arch/prefix.py). The numbers are those of each
row alone: attention is causal, so a row's tokens see exactly its own prefix.

Passes are planned for throughput: rows (or groups) sorted by length (then by their first scored
position) are put together up to `batch` tokens per forward pass, padded at the end to a common
length rounded up to one of a few sizes per octave; the graph computes logits only from the pass's
first scored position on (or for the branches only), and only the needed rows are log-softmaxed.
On the cpu backend one pass runs per core (backends/threads.py); the results do not depend on the
grouping or on the number of workers beyond float rounding.

With a base model, both run the same passes and each scored position also gets the base's
log-probability and KL(base || model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import numpy as np

from llmtune.arch.prefix import PrefixShape, prefix_inputs
from llmtune.backends.dist import run_split
from llmtune.errors import LlmtuneError
from llmtune.eval.scoring import (
    batch_tokens,
    check_evaluation_memory,
    kl_rows,
    log_softmax,
    pass_bytes,
    scorer_factory,
    token_nll,
)

PROGRAMS_PER_WORKER = 4  # compiled pass shapes kept per worker (passes come sorted, so shapes repeat)
PAD_TOKEN = 0  # fills rows past their end; causal attention keeps it out of every scored position


@dataclass
class Row:
    tokens: np.ndarray  # int32 [n]
    positions: np.ndarray  # int64 [k]: logits at these positions score...
    targets: np.ndarray  # int32 [k]: ...these tokens
    group: int = -1  # rows of one group >= 0 share their beginning (computed once); -1: alone

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int32)
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self.targets = np.asarray(self.targets, dtype=np.int32)


@dataclass
class RowScores:
    logprob: list[np.ndarray]  # float64 per row and scored position
    base_logprob: Optional[list[np.ndarray]] = None  # with a base model
    kl: Optional[list[np.ndarray]] = None  # KL(base || model) per row and scored position
    n_passes: int = 0
    n_tokens: int = 0  # tokens of the rows (padding not counted)
    n_computed: int = 0  # tokens run through the model: a group's shared trunk once (padding not counted)
    seconds: float = 0.0


@dataclass(frozen=True)
class ScoreProgress:
    """Passed to the `progress` callback after every forward pass."""

    rows: tuple  # the rows this pass finished
    rows_done: int
    n_rows: int
    tokens_done: int
    n_tokens: int
    seconds: float
    scores: Optional["RowScores"] = None  # filled so far: every row of `rows` (and of earlier passes) is in


@dataclass(frozen=True)
class _Pass:
    rows: tuple  # row indices
    n_tok: int  # padded sequence length
    first: int  # first position with logits


@dataclass(frozen=True)
class _Group:
    """Rows sharing their first `trunk` tokens, which hold no scored position."""

    rows: tuple  # row indices
    trunk: int  # tokens of the shared trunk
    branch_max: int  # tokens of the longest branch (a row's tokens from `trunk` on)


@dataclass(frozen=True)
class _PrefixPass:
    groups: tuple  # of _Group
    shape: PrefixShape

    @property
    def rows(self) -> tuple:
        return tuple(j for g in self.groups for j in g.rows)


def _round_up(n: int) -> int:
    """n rounded up to a multiple of a power of two at most n/8 (at least 16): under 12.5 %
    padding, and few distinct lengths so the compiled programs repeat."""
    step = max(16, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // step) * step


def _computed_tokens(rows: list[Row], p) -> int:
    """Tokens a pass runs through the model, padding not counted."""
    if isinstance(p, _PrefixPass):
        return sum(g.trunk + sum(rows[j].tokens.size - g.trunk for j in g.rows) for g in p.groups)
    return sum(rows[j].tokens.size for j in p.rows)


def _first_scored(r: Row) -> int:
    return int(r.positions.min()) if r.positions.size else r.tokens.size - 1


def common_prefix(seqs: list[np.ndarray]) -> int:
    """Tokens all sequences share at the start (bounded by the shortest)."""
    n = min(s.size for s in seqs)
    same = np.ones(n, dtype=bool)
    for s in seqs[1:]:
        same &= s[:n] == seqs[0][:n]
    diff = np.flatnonzero(~same)
    return int(diff[0]) if diff.size else n


def _groups(rows: list[Row]) -> tuple[list[int], list[_Group]]:
    """Rows scored alone, and the groups worth sharing (two rows or more, a trunk of 2 tokens or
    more: the trunk ends at the group's first scored position, so every branch holds a token)."""
    members: dict[int, list[int]] = {}
    alone = []
    for j, r in enumerate(rows):
        (members.setdefault(r.group, []) if r.group >= 0 else alone).append(j)
    groups = []
    for idx in members.values():
        trunk = min(common_prefix([rows[j].tokens for j in idx]), min(_first_scored(rows[j]) for j in idx))
        if len(idx) < 2 or trunk < 2:
            alone += idx
            continue
        groups.append(_Group(tuple(idx), trunk, max(rows[j].tokens.size for j in idx) - trunk))
    return sorted(alone), groups


def plan_passes(rows: list[Row], batch_tokens: int, max_positions: int | None = None) -> list:
    """Rows put into forward passes of about `batch_tokens` tokens (a longer row gets a pass of
    its own): longest first, so the biggest pass comes first; within a length, by first scored
    position, so a pass's logits start late. Groups go into passes of their own (_PrefixPass).
    max_positions: see _plan_prefix_passes."""
    alone, groups = _groups(rows)
    lengths = {j: rows[j].tokens.size for j in alone}
    firsts = {j: _first_scored(rows[j]) for j in alone}
    order = sorted(alone, key=lambda j: (-_round_up(lengths[j]), -firsts[j], j))
    passes, i = [], 0
    while i < len(order):
        n_tok = _round_up(lengths[order[i]])
        group = order[i:i + max(1, batch_tokens // n_tok)]
        first = min(firsts[j] for j in group)
        first -= first % 8  # fewer distinct shapes
        passes.append(_Pass(tuple(group), n_tok, first))
        i += len(group)
    return passes + _plan_prefix_passes(groups, batch_tokens, max_positions)


def _plan_prefix_passes(groups: list[_Group], batch_tokens: int, max_positions: int | None = None) -> list[_PrefixPass]:
    """Groups by trunk length, then branch length (rounded, so shapes repeat); every trunk gets as
    many branch rows as the largest group has rows (the missing ones are padding), so a pass's
    shape depends on its lengths and its number of groups only. max_positions: a model's learned
    positions; a pass whose rounded lengths would pass them keeps its exact lengths, and if the
    longest trunk and the longest branch of different groups still do, each group is its own pass
    (then trunk + branch is a real sequence's length)."""
    if not groups:
        return []
    width = max(len(g.rows) for g in groups)
    order = sorted(groups, key=lambda g: (-_round_up(g.trunk), -_round_up(g.branch_max), g.rows))
    passes, i = [], 0
    while i < len(order):
        trunk_len, branch_len = _round_up(order[i].trunk), _round_up(order[i].branch_max)
        n = max(1, batch_tokens // (trunk_len + width * branch_len))
        chunk = order[i:i + n]
        branch_len = max(_round_up(g.branch_max) for g in chunk)
        if max_positions is not None and trunk_len + branch_len > max_positions:
            trunk_len, branch_len = max(g.trunk for g in chunk), max(g.branch_max for g in chunk)
            if trunk_len + branch_len > max_positions:
                chunk = chunk[:1]
                trunk_len, branch_len = chunk[0].trunk, chunk[0].branch_max
        passes.append(_PrefixPass(tuple(chunk), PrefixShape(len(chunk), trunk_len, len(chunk) * width, branch_len)))
        i += len(chunk)
    return passes


def _plain_pass(rows: list[Row], p: _Pass):
    """Per row of a plain pass, its scored logits' (sequence, position) in the output, and the
    function running the pass for a scorer."""
    tokens = np.full((len(p.rows), p.n_tok), PAD_TOKEN, dtype=np.int32)
    picks = []
    for s, j in enumerate(p.rows):
        r = rows[j]
        tokens[s, :r.tokens.size] = r.tokens
        picks.append((np.full(r.positions.size, s), r.positions - p.first))
    return picks, lambda scorer: scorer.logits(tokens, p.first)


def _prefix_pass(rows: list[Row], p: _PrefixPass):
    """A shared-prefix pass (flat tokens: trunks, then branches; arch/prefix.py): per row, its
    scored logits' (0, branch row) in the output, and the function running the pass for a scorer."""
    s = p.shape
    width = s.n_branch // s.n_trunk
    trunks = np.full((s.n_trunk, s.trunk_len), PAD_TOKEN, dtype=np.int32)
    branches = np.full((s.n_branch, s.branch_len), PAD_TOKEN, dtype=np.int32)
    trunk_of = np.repeat(np.arange(s.n_trunk), width)
    picks = {}
    for t, g in enumerate(p.groups):
        trunks[t, :g.trunk] = rows[g.rows[0]].tokens[:g.trunk]
        for k, j in enumerate(g.rows):
            b, rest = t * width + k, rows[j].tokens[g.trunk:]
            branches[b, :rest.size] = rest
            picks[j] = (np.zeros(rows[j].positions.size, np.int64), b * s.branch_len + rows[j].positions - g.trunk)
    tokens = np.concatenate([trunks.reshape(-1), branches.reshape(-1)])
    trunk_lens = np.array([g.trunk for g in p.groups])
    inputs: dict = {}  # by sliding window: a base model of the same kind reuses the model's masks

    def logits(scorer):
        hp = scorer.model.hp
        key = hp.sliding_window if hp.has_swa else 0
        if key not in inputs:
            inputs[key] = prefix_inputs(hp, s, trunk_lens, trunk_of)
        return scorer.prefix_logits(tokens, s, inputs[key])[None]

    return [picks[j] for j in p.rows], logits


def _score_pass(rows: list[Row], with_base: bool, scorers, p):
    """(logprob, base logprob, kl) per row of the pass, each split by row."""
    picks, logits_of = (_prefix_pass if isinstance(p, _PrefixPass) else _plain_pass)(rows, p)
    pick = (np.concatenate([a for a, _ in picks]), np.concatenate([b for _, b in picks]))
    targets = np.concatenate([rows[j].targets for j in p.rows])
    split = np.cumsum([rows[j].positions.size for j in p.rows])[:-1]
    logits = logits_of(scorers[0])[pick]  # [k, V] copy of the needed rows
    if not np.isfinite(logits).all():
        raise LlmtuneError(f"{scorers[0].model.path}: the model's logits are not finite (NaN or inf): its weights "
                           f"are damaged (a finetune that diverged?)")
    if not with_base:
        return np.split(-token_nll(logits, targets), split), None, None
    base_logits = logits_of(scorers[1])[pick]
    base_lp, model_lp = log_softmax(base_logits), log_softmax(logits)
    kl = kl_rows(base_lp, model_lp)
    take = targets[:, None]
    lp = np.take_along_axis(model_lp, take, axis=-1)[:, 0].astype(np.float64)
    blp = np.take_along_axis(base_lp, take, axis=-1)[:, 0].astype(np.float64)
    return np.split(lp, split), np.split(blp, split), np.split(kl, split)


def _shape(p) -> tuple:
    """(n_seq, n_tok, first, prefix) of a pass's program."""
    if isinstance(p, _PrefixPass):
        return 1, p.shape.n_tok, p.shape.branch_start, p.shape
    return len(p.rows), p.n_tok, p.first, None


def _check_memory(models, backend, passes, n_workers: int) -> None:
    """Refuse the run before any allocation when the weights and the arenas its workers keep (up
    to PROGRAMS_PER_WORKER compiled shapes each, counted at the biggest pass's) do not fit."""
    if not passes:
        return
    shapes = {_shape(p) for p in passes}
    biggest = max(passes, key=lambda p: _shape(p)[0] * _shape(p)[1])
    n_seq, n_tok, first, prefix = _shape(biggest)
    arena = pass_bytes(models[0], backend, n_seq, n_tok, first, prefix)
    check_evaluation_memory(models, backend, arena, n_workers * min(PROGRAMS_PER_WORKER, len(shapes)),
                            f"{models[0].path}: a benchmark pass of {n_seq * n_tok:,} tokens "
                            f"({n_workers} at once, {min(PROGRAMS_PER_WORKER, len(shapes))} shapes kept each)")


def score_rows(
    models: list,
    rows: list[Row],
    *,
    backend,
    batch: Optional[int] = None,
    workers: Optional[int] = None,
    progress: Optional[Callable[[ScoreProgress], None]] = None,
    float_copies: bool = False,
) -> RowScores:
    """log p(target | tokens before position + 1) for every scored position of every row, under
    models[0] (and models[1], the base, when given). `batch`: tokens per forward pass (default as
    perplexity: the backend's default_batch_tokens). float_copies: the weights are an evaluation
    command's frozen ones (scoring.scorer_factory)."""
    batch = batch_tokens(batch, backend)
    n_vocab = models[0].hp.n_vocab
    for r in rows:
        if r.tokens.size and (r.tokens.min() < 0 or r.tokens.max() >= n_vocab):
            raise LlmtuneError(f"token ids outside the vocabulary of {models[0].path.name}")
    limits = [m.max_positions for m in models if m.max_positions is not None]
    passes = plan_passes(rows, batch, min(limits, default=None))
    n_workers = backend.workers(workers, len(passes))
    max_len = max((p.shape.seq_len if isinstance(p, _PrefixPass) else p.n_tok for p in passes), default=1)
    _check_memory(models, backend, passes, n_workers)
    make = scorer_factory(models, backend, max_len, keep=PROGRAMS_PER_WORKER, float_copies=float_copies)
    with_base = len(models) > 1
    out = RowScores([None] * len(rows), [None] * len(rows) if with_base else None,
                    [None] * len(rows) if with_base else None, n_passes=len(passes))
    n_tokens = sum(r.tokens.size for r in rows)
    done = tokens_done = 0
    t0 = time.perf_counter()
    results = run_split(partial(_score_pass, rows, with_base), make, passes, n_workers)  # passes split across MPI ranks
    for p, (lp, blp, kl) in zip(passes, results):
        for k, j in enumerate(p.rows):
            out.logprob[j] = lp[k]
            if with_base:
                out.base_logprob[j], out.kl[j] = blp[k], kl[k]
            tokens_done += rows[j].tokens.size
        done += len(p.rows)
        if progress is not None:
            progress(ScoreProgress(p.rows, done, len(rows), tokens_done, n_tokens, time.perf_counter() - t0, out))
    out.n_tokens, out.seconds = n_tokens, time.perf_counter() - t0
    out.n_computed = sum(_computed_tokens(rows, p) for p in passes)
    return out
