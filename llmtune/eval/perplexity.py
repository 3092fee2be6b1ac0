"""Perplexity and KL-divergence exactly as llama.cpp's llama-perplexity computes them.

The algorithm (tools/perplexity/perplexity.cpp):
- tokenize the whole text once (BOS first when the model adds one);
- cut it into n_chunk = n_tokens // n_ctx chunks of n_ctx tokens, each evaluated from an empty
  context, its first token replaced by BOS when the model adds BOS;
- score only the second half: positions n_ctx/2 .. n_ctx-2 each predict the next token, so every
  scored token has at least n_ctx/2 tokens of context;
- perplexity = exp(mean negative log-likelihood), uncertainty = ppl * sqrt(var(nll) / (count-1)).

With a base model (`kl_base`), both models run on the same chunks and each scored position adds
KL(base || model) and whether both put their highest logit on the same token
(llama-perplexity --kl-divergence, computed here from exact log-probabilities rather than the
16-bit quantized ones llama.cpp stores in its logits file).

Several chunks are evaluated per forward pass (`batch` tokens, a multiple of ctx); the graph
computes logits only for positions n_ctx/2.. of each chunk, which skips half of the output head.
On the cpu backend one pass runs per core (threads, OpenBLAS single-threaded meanwhile); passes
are merged in chunk order, so the numbers never depend on the number of workers.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, Optional

import numpy as np

from llmtune.backends.dist import run_split
from llmtune.errors import Interrupted, LlmtuneError, plural
from llmtune.eval.scoring import (
    ChunkScorer,
    add_bos_of,
    as_backend,
    as_model,
    batch_tokens,
    check_evaluation_memory,
    kl_rows,
    load_models,
    log_softmax,
    pass_bytes,
    scorer_factory,
    token_nll,
    warn_past_training,
)
from llmtune.model.adapter import attach
from llmtune.tokenizer import read_text, require_text

MIN_CTX = 3  # n_ctx/2 .. n_ctx-2 must hold at least one scored position


# ------------------------------------------------------------------------------------ results
@dataclass
class PerplexityResult:
    chunks: list[float]  # running perplexity after each chunk (llama.cpp's [i]ppl values)
    ppl: float
    ppl_err: float  # llama.cpp's uncertainty of the final estimate
    n_tokens: int  # tokens run through the model: n_chunks * ctx
    tokens_per_s: float  # n_tokens over the evaluation time (forward passes and scoring)
    ctx: int = 0
    n_scored: int = 0  # tokens whose likelihood entered the estimate
    n_text_tokens: int = 0  # tokens read from the text (BOS included): all, or with --chunks at least theirs
    seconds: float = 0.0
    # with kl_base: KL(base || model) per scored token, and top-token agreement
    kl: Optional[float] = None
    kl_err: Optional[float] = None
    kl_median: Optional[float] = None
    kl_max: Optional[float] = None
    same_top: Optional[float] = None  # fraction of positions where both argmaxes agree
    same_top_err: Optional[float] = None
    ppl_base: Optional[float] = None
    ppl_base_err: Optional[float] = None
    partial: bool = False  # stopped (Ctrl-C / SIGTERM) after len(chunks) of n_chunks_planned chunks
    n_chunks_planned: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.kl is None:
            d = {k: v for k, v in d.items() if not (k.startswith("kl") or "base" in k or "same_top" in k)}
        return d


@dataclass(frozen=True)
class PerplexityProgress:
    """Passed to the `progress` callback after every forward pass."""

    chunks_done: int
    n_chunks: int
    tokens_done: int
    n_tokens: int
    ppl: float  # running estimate
    seconds: float
    running: tuple = ()  # the running perplexity after each chunk this pass finished (llama.cpp's [i] values)


# ------------------------------------------------------------------------------------ statistics
def mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """Mean and its standard error as llama.cpp computes them (0 when undefined)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0


@dataclass
class _NllSums:
    chunk_nll: list[float] = field(default_factory=list)  # summed nll of each chunk, in order
    nll_sq: float = 0.0
    count: int = 0

    def add(self, nll: np.ndarray) -> None:
        """nll: float64 [n_seq, n_scored] for consecutive chunks."""
        self.chunk_nll.extend(nll.sum(axis=1).tolist())
        self.nll_sq += float(np.einsum("ij,ij->", nll, nll))
        self.count += nll.size

    def current_ppl(self) -> float:
        return _exp(math.fsum(self.chunk_nll) / self.count)

    def running_ppl(self, per_chunk: int) -> list[float]:
        cum = np.cumsum(np.asarray(self.chunk_nll, dtype=np.float64))
        with np.errstate(over="ignore"):  # a wildly wrong model's perplexity is inf, not an error
            return np.exp(cum / (per_chunk * np.arange(1, cum.size + 1))).tolist()

    def estimate(self) -> tuple[float, float]:
        mean, err = mean_and_uncertainty(math.fsum(self.chunk_nll), self.nll_sq, self.count)
        ppl = _exp(mean)
        return ppl, err * ppl


def _exp(x: float) -> float:
    """exp that says inf past float64's range (a diverged model's mean nll can be in the thousands)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def check_finite_nll(nll: np.ndarray, model, c0: int) -> np.ndarray:
    """`nll` unchanged, or a one-line error when the model's logits held NaN or inf (damaged
    weights, e.g. a finetune that diverged) for the chunks from c0 on."""
    if not np.isfinite(nll).all():
        chunk = c0 + int(np.argwhere(~np.isfinite(nll))[0][0]) + 1
        raise LlmtuneError(f"{model.path}: the model's logits are not finite (NaN or inf) in chunk {chunk}: "
                           f"its weights are damaged (a finetune that diverged?)")
    return nll


@dataclass
class _BatchScores:
    """What one forward pass over consecutive chunks contributes, merged in chunk order."""

    nll: np.ndarray  # float64 [n_chunks, n_scored]
    kl: Optional[np.ndarray] = None  # float64 [n_chunks, n_scored]: KL(base || model)
    same_top: int = 0
    base_nll: Optional[np.ndarray] = None


def score_against_base(base_logits: np.ndarray, model_logits: np.ndarray, targets: np.ndarray,
                       model_nll: np.ndarray) -> _BatchScores:
    """KL(base || model), top-token agreement and the base's nll; base_logits is overwritten."""
    base_logp, model_logp = log_softmax(base_logits), log_softmax(model_logits)
    same_top = int(np.count_nonzero(base_logp.argmax(axis=-1) == model_logp.argmax(axis=-1)))
    kl = kl_rows(base_logp, model_logp)
    base_nll = token_nll(base_logits, targets)  # the model's own formula: equal models, equal ppl
    return _BatchScores(model_nll, kl, same_top, base_nll)


@dataclass
class _KlSums:
    kl: list[np.ndarray] = field(default_factory=list)  # float32 per scored token, for median/max
    kl_sum: float = 0.0
    kl_sq: float = 0.0
    same_top: int = 0
    count: int = 0
    base: _NllSums = field(default_factory=_NllSums)

    def add(self, scores: _BatchScores) -> None:
        kl = scores.kl
        self.kl.append(kl.astype(np.float32).ravel())
        self.kl_sum += float(kl.sum())
        self.kl_sq += float(np.einsum("ij,ij->", kl, kl))
        self.same_top += scores.same_top
        self.count += kl.size
        self.base.add(scores.base_nll)

    def fill(self, res: PerplexityResult) -> None:
        res.kl, res.kl_err = mean_and_uncertainty(self.kl_sum, self.kl_sq, self.count)
        values = np.concatenate(self.kl)
        res.kl_median, res.kl_max = float(np.median(values)), float(values.max())
        p = self.same_top / self.count
        res.same_top = p
        res.same_top_err = math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0
        res.ppl_base, res.ppl_base_err = self.base.estimate()


# ------------------------------------------------------------------------------------ inputs
def _checked_ids(model, ids, ctx: int, chunks: Optional[int], source: str) -> tuple[np.ndarray, int]:
    """The ids as flat int32 and the number of chunks to evaluate; one-line errors for bad arguments."""
    ids = np.asarray(ids).astype(np.int32, copy=False).ravel()
    if ctx < MIN_CTX:
        raise LlmtuneError(f"--ctx: must be at least {MIN_CTX} (got {ctx})")
    if chunks is not None and chunks < 1:
        raise LlmtuneError(f"--chunks: must be positive (got {chunks})")
    if ids.size < 2 * ctx:
        raise LlmtuneError(
            f"{source or 'text'}: tokenizes to only {plural(ids.size, 'token')}; --ctx {ctx} needs at least {2 * ctx}"
        )
    if ids.min() < 0 or ids.max() >= model.hp.n_vocab:
        raise LlmtuneError(f"{source or 'ids'}: token ids outside the vocabulary of {model.path.name}")
    n_chunk = ids.size // ctx
    return ids, n_chunk if chunks is None else min(chunks, n_chunk)


# ------------------------------------------------------------------------------------ evaluation
@dataclass(frozen=True)
class _Chunks:
    """How the token stream is cut (perplexity.cpp's loop over chunks): n_chunk chunks of ctx
    tokens, n_seq of them per forward pass, the first token of each replaced by BOS."""

    ids: np.ndarray
    ctx: int
    n_chunk: int
    n_seq: int
    add_bos: bool
    bos: int

    @property
    def first(self) -> int:
        return self.ctx // 2  # llama.cpp scores from position n_ctx/2 on

    @property
    def n_scored(self) -> int:
        return self.ctx - 1 - self.first  # positions first .. ctx-2 each predict the next token

    @property
    def pass_starts(self) -> range:
        """The first chunk of each forward pass."""
        return range(0, self.n_chunk, self.n_seq)

    def pass_tokens(self, c0: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs [n, ctx] and targets [n, n_scored] of the pass starting at chunk c0."""
        n = min(self.n_seq, self.n_chunk - c0)
        window = self.ids[c0 * self.ctx:(c0 + n) * self.ctx].reshape(n, self.ctx)
        tokens = window.copy()
        if self.add_bos:
            tokens[:, 0] = self.bos
        return tokens, window[:, self.first + 1:]


def _plan_chunks(model, ids: np.ndarray, ctx: int, n_chunk: int, batch: Optional[int], backend) -> _Chunks:
    n_seq = max(1, min(batch_tokens(batch, backend) // ctx, n_chunk))  # a batch below ctx still evaluates whole chunks
    return _Chunks(ids, ctx, n_chunk, n_seq, *add_bos_of(model))


def _score_pass(chunks: _Chunks, scorers: list[ChunkScorer], c0: int) -> _BatchScores:
    """The nll (and, with a base scorer, the KL statistics) of the chunks of one forward pass."""
    tokens, targets = chunks.pass_tokens(c0)
    logits = scorers[0].logits(tokens)[:, :chunks.n_scored]
    if len(scorers) == 1:
        return _BatchScores(check_finite_nll(token_nll(logits, targets), scorers[0].model, c0))
    base_logits = scorers[1].logits(tokens)[:, :chunks.n_scored]
    nll = check_finite_nll(token_nll(logits.copy(), targets), scorers[0].model, c0)
    scores = score_against_base(base_logits, logits, targets, nll)
    check_finite_nll(scores.base_nll, scorers[1].model, c0)
    return scores


def _accumulate(chunks: _Chunks, passes, with_kl: bool,
                progress: Optional[Callable[[PerplexityProgress], None]]) -> PerplexityResult:
    """Merge the passes' scores in chunk order, reporting progress after each pass. Stopped by a
    signal, the Interrupted exception carries the result over the chunks done (`partial`)."""
    sums, kl_sums = _NllSums(), (_KlSums() if with_kl else None)
    t0 = time.perf_counter()
    try:
        for c0, scores in zip(chunks.pass_starts, passes):
            sums.add(scores.nll)
            if kl_sums is not None:
                kl_sums.add(scores)
            if progress is not None:
                done = min(c0 + chunks.n_seq, chunks.n_chunk)
                running = tuple(sums.running_ppl(chunks.n_scored)[c0:done])
                progress(PerplexityProgress(done, chunks.n_chunk, done * chunks.ctx, chunks.n_chunk * chunks.ctx,
                                            sums.current_ppl(), time.perf_counter() - t0, running))
    except Interrupted as exc:
        if sums.count:
            exc.partial = _result(chunks, sums, time.perf_counter() - t0, kl_sums)
        raise
    return _result(chunks, sums, time.perf_counter() - t0, kl_sums)


def _result(chunks: _Chunks, sums: _NllSums, seconds: float, kl_sums: Optional[_KlSums] = None) -> PerplexityResult:
    """The result over the chunks scored so far (all of them, or fewer: a partial result)."""
    n_done = len(sums.chunk_nll)
    n_tokens = n_done * chunks.ctx
    ppl, ppl_err = sums.estimate()
    res = PerplexityResult(
        chunks=sums.running_ppl(chunks.n_scored), ppl=ppl, ppl_err=ppl_err, n_tokens=n_tokens,
        tokens_per_s=n_tokens / seconds if seconds > 0 else float("inf"), ctx=chunks.ctx,
        n_scored=sums.count, n_text_tokens=int(chunks.ids.size), seconds=seconds,
        partial=n_done < chunks.n_chunk, n_chunks_planned=chunks.n_chunk,
    )
    if kl_sums is not None:
        kl_sums.fill(res)
    return res


# ------------------------------------------------------------------------------------ entry points
def perplexity_from_ids(
    model,
    ids,
    *,
    ctx: int = 512,
    batch: Optional[int] = None,
    chunks: Optional[int] = None,
    backend="cpu",
    kl_base=None,
    progress: Optional[Callable[[PerplexityProgress], None]] = None,
    precision: str = "f32",
    source: str = "",
    workers: Optional[int] = None,
    lora=None,
    lora_scale=None,
) -> PerplexityResult:
    """Perplexity of `model` (Model or GGUF path) over pre-tokenized `ids` (BOS first if the model adds one),
    as perplexity.cpp's `perplexity()` (and, with `kl_base`, `kl_divergence()`) compute it.

    `lora`: LoRA adapter GGUF path(s) applied to the model (llama.cpp's --lora), `lora_scale` one
    scale for all or one per adapter (llama.cpp's --lora-scaled; default 1).
    `kl_base` (Model or path) adds KL(base || model) and top-token agreement on the same chunks.
    `source` names the text in error messages. `workers`: forward passes run at once on the cpu
    backend (default: one per core, up to 4); the numbers do not depend on it.
    """
    models = load_models(model, kl_base, lora, lora_scale)
    ids, n_chunk = _checked_ids(models[0], ids, ctx, chunks, source)
    warn_past_training(models[0], ctx)
    backend = as_backend(backend, precision)
    plan = _plan_chunks(models[0], ids, ctx, n_chunk, batch, backend)
    n_workers = backend.workers(workers, len(plan.pass_starts))
    check_evaluation_memory(models, backend, pass_bytes(models[0], backend, plan.n_seq, ctx, plan.first), n_workers,
                            f"{models[0].path}: perplexity with --ctx {ctx} ({plan.n_seq * ctx:,} tokens per pass, "
                            f"{plural(n_workers, 'pass', 'passes')} at once)")
    # under an MPI launcher each rank scores its share of the passes (backends/dist.py); all get every result
    make = scorer_factory(models, backend, ctx, float_copies=True)
    passes = run_split(partial(_score_pass, plan), make, plan.pass_starts, n_workers)
    return _accumulate(plan, passes, with_kl=kl_base is not None, progress=progress)


def tokenize(model, text: str, max_tokens: Optional[int] = None) -> np.ndarray:
    """Token ids of a whole text with the model's tokenizer (BOS per the model's flags); with
    max_tokens, possibly only its first ids (at least max_tokens when the text has them)."""
    return np.asarray(model.tokenizer.encode(text, add_special=True, max_tokens=max_tokens), dtype=np.int32)


def perplexity(
    model_path,
    text_path,
    *,
    ctx: int = 512,
    batch: Optional[int] = None,
    chunks: Optional[int] = None,
    backend="cpu",
    kl_base=None,
    progress: Optional[Callable[[PerplexityProgress], None]] = None,
    precision: str = "f32",
    lora=None,
    lora_scale=None,
) -> PerplexityResult:
    """llama-perplexity over a text file: see the module docstring and `perplexity_from_ids`."""

    text = require_text(read_text(text_path), text_path)  # a missing or empty text fails before the model load
    model = attach(as_model(model_path), lora, lora_scale)  # bad adapters fail before tokenizing
    # with --chunks only the first chunks' tokens count (at least two chunks: the shortest text)
    ids = tokenize(model, text, None if chunks is None or chunks < 1 else max(chunks, 2) * ctx)
    return perplexity_from_ids(model, ids, ctx=ctx, batch=batch, chunks=chunks, backend=backend,
                               kl_base=kl_base, progress=progress, precision=precision, source=str(text_path))
