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

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.backends.threads import blas_threads, n_cores, run_in_order
from llmtune.errors import LlmtuneError
from llmtune.tokenizer import read_text

DEFAULT_BATCH_TOKENS = {"cpu": 1024}  # tokens per forward pass (one per core) when --batch is not given
DEFAULT_BATCH_TOKENS_OTHER = 8192  # accelerators amortise launches over bigger batches
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
    n_text_tokens: int = 0  # tokens in the whole text (BOS included)
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
        return math.exp(math.fsum(self.chunk_nll) / self.count)

    def running_ppl(self, per_chunk: int) -> list[float]:
        cum = np.cumsum(np.asarray(self.chunk_nll, dtype=np.float64))
        return np.exp(cum / (per_chunk * np.arange(1, cum.size + 1))).tolist()

    def estimate(self) -> tuple[float, float]:
        mean, err = mean_and_uncertainty(math.fsum(self.chunk_nll), self.nll_sq, self.count)
        ppl = math.exp(mean)
        return ppl, err * ppl


EXP_SAFE = 60.0  # |row max| below this: exp needs no shift (32000 * e^60 is far from float32 overflow)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, float64. logits [..., V] float32 is overwritten.

    One exp pass over the logits in float32 (rows are shifted by their max only when some max is
    outside +-EXP_SAFE), float32 pairwise row sums (relative error ~1e-7), the rest in float64.
    """
    target_logit = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(np.float64)
    row_max = logits.max(axis=-1, keepdims=True)
    shift = np.zeros_like(row_max)
    if np.abs(row_max).max() > EXP_SAFE:
        shift = row_max
        np.subtract(logits, shift, out=logits)
    np.exp(logits, out=logits)
    lse = np.log(logits.sum(axis=-1).astype(np.float64)) + shift[..., 0]
    return lse - target_logit


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float32 (a new array)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1))[..., None]
    return z


def kl_rows(base_logp: np.ndarray, model_logp: np.ndarray) -> np.ndarray:
    """KL(base || model) per row in float64 from float32 log-probabilities."""
    diff = base_logp - model_logp
    diff *= np.exp(base_logp)
    return diff.sum(axis=-1, dtype=np.float64)


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


# ------------------------------------------------------------------------------------ forward passes
class ChunkScorer:
    """Logits of the scored positions of n_seq chunks per forward pass, for one model.

    One compiled Program per number of sequences (the full batch, and a smaller one for the
    last partial batch). `weights` (name -> backend array) lets several scorers share one copy.
    """

    def __init__(self, model, backend, ctx: int, weights: Optional[dict] = None):
        self.model, self.backend, self.ctx = model, backend, ctx
        self.first = ctx // 2  # llama.cpp: logits from position n_ctx/2 on
        if weights is None:
            weights = {name: backend.asarray(w) for name, w in model.weights.items()}
        self.weights = weights
        self.pos = backend.asarray(np.arange(ctx, dtype=np.int32))
        self._programs: dict[int, object] = {}

    def _program(self, n_seq: int):
        prog = self._programs.get(n_seq)
        if prog is None:
            from llmtune.graph.planner import Program

            self._programs.clear()  # at most one shape alive: the partial batch comes last
            _, nodes, logits = self.model.build(n_seq, self.ctx, logits_start=self.first)
            prog = Program([logits], self.backend, params={nodes[n]: a for n, a in self.weights.items()})
            self._programs[n_seq] = prog
        return prog

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """tokens int32 [n_seq, ctx] -> float32 host array [n_seq, ctx - first, n_vocab].

        The array may be the program's own output buffer: valid (and writable) until the next call.
        """
        (out,) = self._program(tokens.shape[0]).run(tokens=self.backend.asarray(tokens), pos=self.pos)
        host = self.backend.to_numpy(out)
        return host.reshape(tokens.shape[0], self.ctx - self.first, -1)


# ------------------------------------------------------------------------------------ cpu workers
MAX_CPU_WORKERS = 4  # each worker holds its own activations and logits


def cpu_workers(backend, requested: Optional[int], n_batches: int) -> int:
    """How many forward passes run at once: one per core on the cpu backend, else one.

    numpy runs elementwise kernels on one core, and OpenBLAS's own threads stall whenever the
    machine is busy; one single-threaded pass per core keeps every core on useful work.
    """
    if requested is not None and requested < 1:
        raise LlmtuneError(f"workers: must be positive (got {requested})")
    if backend.name != "cpu" or (requested or 0) == 1 or not blas_threads.available():
        return 1
    n = requested or min(n_cores(), MAX_CPU_WORKERS)
    return max(1, min(n, n_batches))


# ------------------------------------------------------------------------------------ inputs
def add_bos_of(model) -> tuple[bool, int]:
    """Whether the model's tokenizer adds BOS (then every chunk starts with it), and the BOS id."""
    tok = model.tokenizer
    if tok.add_bos and tok.bos_id is None:
        raise LlmtuneError(f"{model.path}: the tokenizer adds BOS but the file names no BOS token")
    return bool(tok.add_bos), -1 if tok.bos_id is None else int(tok.bos_id)


def _as_model(model_or_path):
    from llmtune.model.loaded import Model, load_model

    return model_or_path if isinstance(model_or_path, Model) else load_model(model_or_path)


def _as_backend(backend, precision: str = "f32"):
    from llmtune.backends.base import Backend, get_backend

    return backend if isinstance(backend, Backend) else get_backend(backend, precision=precision)


def check_same_vocab(model, base) -> None:
    """KL-divergence compares distributions token by token: both vocabularies must be identical."""
    a, b = model.gguf.get("tokenizer.ggml.tokens"), base.gguf.get("tokenizer.ggml.tokens")
    if model.hp.n_vocab != base.hp.n_vocab or (a is not None and b is not None and a != b):
        raise LlmtuneError(
            f"{base.path}: vocabulary differs from {model.path.name} "
            f"({base.hp.n_vocab} vs {model.hp.n_vocab} tokens); --kl-base needs the same vocabulary"
        )


def _seqs_per_pass(batch: Optional[int], ctx: int, backend_name: str, n_chunk: int) -> int:
    if batch is None:
        batch = DEFAULT_BATCH_TOKENS.get(backend_name, DEFAULT_BATCH_TOKENS_OTHER)
    if batch < 1:
        raise LlmtuneError(f"--batch: must be positive (got {batch})")
    return max(1, min(batch // ctx, n_chunk))  # a batch below ctx still evaluates whole chunks


def _check_args(ids: np.ndarray, ctx: int, chunks: Optional[int], source: str) -> int:
    if ctx < MIN_CTX:
        raise LlmtuneError(f"--ctx: must be at least {MIN_CTX} (got {ctx})")
    if chunks is not None and chunks < 1:
        raise LlmtuneError(f"--chunks: must be positive (got {chunks})")
    if ids.size < 2 * ctx:
        raise LlmtuneError(
            f"{source or 'text'}: tokenizes to only {ids.size} tokens; --ctx {ctx} needs at least {2 * ctx}"
        )
    n_chunk = ids.size // ctx
    return n_chunk if chunks is None else min(chunks, n_chunk)


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
) -> PerplexityResult:
    """Perplexity of `model` (Model or GGUF path) over pre-tokenized `ids` (BOS first if the model adds one).

    `kl_base` (Model or path) adds KL(base || model) and top-token agreement on the same chunks.
    `source` names the text in error messages. `workers`: forward passes run at once on the cpu
    backend (default: one per core, up to 4); the numbers do not depend on it.
    """
    model = _as_model(model)
    base = _as_model(kl_base) if kl_base is not None else None
    if base is not None:
        check_same_vocab(model, base)
    ids = np.asarray(ids).astype(np.int32, copy=False).ravel()
    n_chunk = _check_args(ids, ctx, chunks, source)
    if ids.min() < 0 or ids.max() >= model.hp.n_vocab:
        raise LlmtuneError(f"{source or 'ids'}: token ids outside the vocabulary of {model.path.name}")
    backend = _as_backend(backend, precision)
    n_seq = _seqs_per_pass(batch, ctx, backend.name, n_chunk)
    add_bos, bos = add_bos_of(model)
    first = ctx // 2
    n_scored = ctx - 1 - first
    weights = [{n: backend.asarray(w) for n, w in m.weights.items()} for m in (model, base) if m is not None]

    def make_scorers():
        return [ChunkScorer(m, backend, ctx, w) for m, w in zip((model, base), weights)]

    def score(scorers, c0: int) -> _BatchScores:
        n = min(n_seq, n_chunk - c0)
        window = ids[c0 * ctx:(c0 + n) * ctx].reshape(n, ctx)
        targets = window[:, first + 1:]  # position j predicts token j + 1
        tokens = window.copy()
        if add_bos:
            tokens[:, 0] = bos
        logits = scorers[0].logits(tokens)[:, :n_scored]
        if len(scorers) == 1:
            return _BatchScores(token_nll(logits, targets))
        base_logits = scorers[1].logits(tokens)[:, :n_scored]
        return score_against_base(base_logits, logits, targets, token_nll(logits.copy(), targets))

    n_workers = cpu_workers(backend, workers, -(-n_chunk // n_seq))
    sums, kl_sums = _NllSums(), (_KlSums() if base else None)
    t0 = time.perf_counter()
    for c0, scores in zip(range(0, n_chunk, n_seq), run_in_order(score, make_scorers, range(0, n_chunk, n_seq), n_workers)):
        sums.add(scores.nll)
        if kl_sums is not None:
            kl_sums.add(scores)
        if progress is not None:
            done = min(c0 + n_seq, n_chunk)
            progress(PerplexityProgress(done, n_chunk, done * ctx, n_chunk * ctx, sums.current_ppl(),
                                        time.perf_counter() - t0))
    seconds = time.perf_counter() - t0
    ppl, ppl_err = sums.estimate()
    res = PerplexityResult(
        chunks=sums.running_ppl(n_scored), ppl=ppl, ppl_err=ppl_err, n_tokens=n_chunk * ctx,
        tokens_per_s=n_chunk * ctx / seconds if seconds > 0 else float("inf"), ctx=ctx,
        n_scored=sums.count, n_text_tokens=int(ids.size), seconds=seconds,
    )
    if kl_sums is not None:
        kl_sums.fill(res)
    return res


def tokenize(model, text: str) -> np.ndarray:
    """Token ids of a whole text with the model's tokenizer (BOS per the model's flags)."""
    return np.asarray(model.tokenizer.encode(text, add_special=True), dtype=np.int32)


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
) -> PerplexityResult:
    """llama-perplexity over a text file: see the module docstring and `perplexity_from_ids`."""
    text = read_text(text_path)  # a missing text fails before the (slower) model load
    model = _as_model(model_path)
    ids = tokenize(model, text)
    return perplexity_from_ids(model, ids, ctx=ctx, batch=batch, chunks=chunks, backend=backend,
                               kl_base=kl_base, progress=progress, precision=precision, source=str(text_path))


def write_json(result: PerplexityResult, path, *inputs) -> Path:
    """Write the result as JSON atomically; never over an input file."""
    from llmtune.gguf.file import check_output_path

    path = check_output_path(path, *inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(result.to_dict(), fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def format_report(res: PerplexityResult) -> str:
    """llama-perplexity's output: running values, the final estimate, KL statistics when present."""
    lines = ["".join(f"[{i}]{v:.4f}," for i, v in enumerate(res.chunks, 1)),
             f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}"]
    if res.kl is not None:
        lines += [
            f"Mean PPL(base): {res.ppl_base:.4f} +/- {res.ppl_base_err:.5f}",
            f"Mean    KLD: {res.kl:10.6f} +/- {res.kl_err:10.6f}",
            f"Maximum KLD: {res.kl_max:10.6f}",
            f"Median  KLD: {res.kl_median:10.6f}",
            f"Same top p: {100 * res.same_top:7.3f} +/- {100 * res.same_top_err:5.3f} %",
        ]
    lines.append(f"{res.n_tokens} tokens in {res.seconds:.2f} s: {res.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)
