"""Log-probabilities of chosen tokens of many token sequences: the engine under the benchmarks.

Each `Row` is one token sequence (BOS first when the model adds one) with the positions whose
logits score a token and the token each scores. llama.cpp evaluates a task's choices as sequences
sharing the task's prefix in one KV cache; here every choice is its own row of the forward graph
(the same numbers: attention is causal, so a row's tokens see exactly its own prefix).

Passes are planned for throughput: rows sorted by length (then by their first scored position)
are grouped up to `batch` tokens per forward pass, padded at the end to a common length rounded
up to one of a few sizes per octave; the graph computes logits only from the pass's first scored
position on (ChunkScorer, perplexity's model runner), and only the needed rows are
log-softmaxed. On the cpu backend one pass runs per core (backends/threads.py); the results do not
depend on the grouping or on the number of workers beyond float rounding.

With a base model, both run the same passes and each scored position also gets the base's
log-probability and KL(base || model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import numpy as np

from llmtune.backends.dist import run_split
from llmtune.backends.threads import cpu_workers
from llmtune.eval.perplexity import (DEFAULT_BATCH_TOKENS, DEFAULT_BATCH_TOKENS_OTHER, _scorer_factory, kl_rows,
                                     log_softmax, token_nll)
from llmtune.errors import LlmtuneError

PROGRAMS_PER_WORKER = 4  # compiled pass shapes kept per worker (passes come sorted, so shapes repeat)
PAD_TOKEN = 0  # fills rows past their end; causal attention keeps it out of every scored position


@dataclass
class Row:
    tokens: np.ndarray  # int32 [n]
    positions: np.ndarray  # int64 [k]: logits at these positions score...
    targets: np.ndarray  # int32 [k]: ...these tokens

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


@dataclass(frozen=True)
class _Pass:
    rows: tuple  # row indices
    n_tok: int  # padded sequence length
    first: int  # first position with logits


def _round_up(n: int) -> int:
    """n rounded up to a multiple of a power of two at most n/8 (at least 16): under 12.5 %
    padding, and few distinct lengths so the compiled programs repeat."""
    step = max(16, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // step) * step


def plan_passes(rows: list[Row], batch_tokens: int) -> list[_Pass]:
    """Rows grouped into forward passes of about `batch_tokens` tokens (a longer row gets a pass of
    its own): longest first, so the biggest pass comes first; within a length, by first scored
    position, so a pass's logits start late."""
    lengths = [r.tokens.size for r in rows]
    firsts = [int(r.positions.min()) if r.positions.size else lengths[i] - 1 for i, r in enumerate(rows)]
    order = sorted(range(len(rows)), key=lambda i: (-_round_up(lengths[i]), -firsts[i], i))
    passes, i = [], 0
    while i < len(order):
        n_tok = _round_up(lengths[order[i]])
        group = order[i:i + max(1, batch_tokens // n_tok)]
        first = min(firsts[j] for j in group)
        first -= first % 8  # fewer distinct shapes
        passes.append(_Pass(tuple(group), n_tok, first))
        i += len(group)
    return passes


def _score_pass(rows: list[Row], with_base: bool, scorers, p: _Pass):
    """(logprob, base logprob, kl) per row of the pass, each split by row."""
    tokens = np.full((len(p.rows), p.n_tok), PAD_TOKEN, dtype=np.int32)
    pick_seq, pick_pos, targets, sizes = [], [], [], []
    for s, j in enumerate(p.rows):
        r = rows[j]
        tokens[s, :r.tokens.size] = r.tokens
        pick_seq.append(np.full(r.positions.size, s))
        pick_pos.append(r.positions - p.first)
        targets.append(r.targets)
        sizes.append(r.positions.size)
    pick = (np.concatenate(pick_seq), np.concatenate(pick_pos))
    targets = np.concatenate(targets)
    split = np.cumsum(sizes)[:-1]
    logits = scorers[0].logits(tokens, p.first)[pick]  # [k, V] copy of the needed rows
    if not np.isfinite(logits).all():
        raise LlmtuneError(f"{scorers[0].model.path}: the model's logits are not finite (NaN or inf): its weights "
                           f"are damaged (a finetune that diverged?)")
    if not with_base:
        return np.split(-token_nll(logits, targets), split), None, None
    base_logits = scorers[1].logits(tokens, p.first)[pick]
    base_lp, model_lp = log_softmax(base_logits), log_softmax(logits)
    kl = kl_rows(base_lp, model_lp)
    take = targets[:, None]
    lp = np.take_along_axis(model_lp, take, axis=-1)[:, 0].astype(np.float64)
    blp = np.take_along_axis(base_lp, take, axis=-1)[:, 0].astype(np.float64)
    return np.split(lp, split), np.split(blp, split), np.split(kl, split)


def score_rows(
    models: list,
    rows: list[Row],
    *,
    backend,
    batch: Optional[int] = None,
    workers: Optional[int] = None,
    progress: Optional[Callable[[ScoreProgress], None]] = None,
) -> RowScores:
    """log p(target | tokens before position + 1) for every scored position of every row, under
    models[0] (and models[1], the base, when given). `batch`: tokens per forward pass (default as
    perplexity: 1024 on cpu, one pass per core; 8192 elsewhere)."""
    if batch is None:
        batch = DEFAULT_BATCH_TOKENS.get(backend.name, DEFAULT_BATCH_TOKENS_OTHER)
    if batch < 1:
        raise LlmtuneError(f"--batch: must be positive (got {batch})")
    n_vocab = models[0].hp.n_vocab
    for r in rows:
        if r.tokens.size and (r.tokens.min() < 0 or r.tokens.max() >= n_vocab):
            raise LlmtuneError(f"token ids outside the vocabulary of {models[0].path.name}")
    passes = plan_passes(rows, batch)
    n_workers = cpu_workers(backend.name, workers, len(passes))
    max_len = max((p.n_tok for p in passes), default=1)
    make = _scorer_factory(models, backend, max_len, keep=PROGRAMS_PER_WORKER)
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
            progress(ScoreProgress(p.rows, done, len(rows), tokens_done, n_tokens, time.perf_counter() - t0))
    out.n_tokens, out.seconds = n_tokens, time.perf_counter() - t0
    return out
