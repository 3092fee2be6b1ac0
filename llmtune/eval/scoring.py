"""What the evaluation commands share (perplexity, benchmarks through continuations): the
forward passes of a model over batches of sequences (ChunkScorer, its weights bound once for all
workers), the models and backend of a call, and the per-token statistics of logits (nll, log-probs,
KL)."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import numpy as np

from llmtune.backends import Backend, get_backend
from llmtune.backends.cpu import logsumexp_rows
from llmtune.errors import LlmtuneError, LlmtuneWarning
from llmtune.graph.planner import Program, ProgramCache
from llmtune.model.adapter import attach
from llmtune.model.loaded import Model, load_model, past_training
from llmtune.resources import check_memory


class ChunkScorer:
    """Logits of the scored positions of n_seq chunks per forward pass, for one model.

    One compiled Program per input shape (sequences, tokens per sequence, first position with
    logits); the `keep` most recently used stay compiled (perplexity: 1, the full batch until the
    partial last one; benchmarks, whose passes change shape, keep a few). `weights` (name ->
    backend array, Backend.bind) lets several scorers share one copy.
    """

    def __init__(self, model, backend, ctx: int, weights: Optional[dict] = None, keep: int = 1):
        self.model, self.backend, self.ctx = model, backend, ctx
        self.first = ctx // 2  # llama.cpp: logits from position n_ctx/2 on
        self.weights = backend.bind(model) if weights is None else weights
        self.pos = backend.asarray(np.arange(ctx, dtype=np.int32))
        self._programs = ProgramCache(self._compile, keep=keep)
        self._positions = {ctx: self.pos}

    def _compile(self, key: tuple) -> Program:
        n_seq, n_tok, first, prefix = key
        _, nodes, logits = self.model.build(n_seq, n_tok, logits_start=first, prefix=prefix,
                                            plain_attention_max=self.backend.plain_attention_max)
        return Program([logits], self.backend, params={nodes[n]: a for n, a in self.weights.items()})

    def _program(self, n_seq: int, n_tok: int, first: int, prefix=None) -> Program:
        return self._programs.get((n_seq, n_tok, first, prefix))

    def prefix_logits(self, tokens: np.ndarray, shape, inputs: dict) -> np.ndarray:
        """Logits [n_branch * branch_len, n_vocab] of the branch rows of a shared-prefix pass
        (arch/prefix.py): tokens int32 [n_tok] in its flat layout, inputs from prefix_inputs.
        The array may be the program's own output buffer, as in logits()."""
        prog = self._program(1, shape.n_tok, shape.branch_start, shape)
        feed = {name: self.backend.asarray(a) for name, a in inputs.items()}
        (out,) = prog.run(tokens=self.backend.asarray(tokens.reshape(1, -1)), **feed)
        return self.backend.to_numpy(out).reshape(shape.n_tok - shape.branch_start, -1)

    def logits(self, tokens: np.ndarray, first: Optional[int] = None) -> np.ndarray:
        """tokens int32 [n_seq, n_tok] (n_tok: ctx for perplexity) -> float32 host array
        [n_seq, n_tok - first, n_vocab]: the logits of positions first.. (default ctx // 2).

        The array may be the program's own output buffer: valid (and writable) until the next call.
        """
        n_seq, n_tok = tokens.shape
        first = self.first if first is None else first
        pos = self._positions.get(n_tok)
        if pos is None:
            pos = self._positions[n_tok] = self.backend.asarray(np.arange(n_tok, dtype=np.int32))
        (out,) = self._program(n_seq, n_tok, first).run(tokens=self.backend.asarray(tokens), pos=pos)
        host = self.backend.to_numpy(out)
        return host.reshape(n_seq, n_tok - first, -1)


def scorer_factory(models: list, backend, ctx: int, keep: int = 1,
                   float_copies: bool = False) -> Callable[[], list[ChunkScorer]]:
    """Makes each worker its own scorers (compiled programs, buffers) over one shared upload of the
    weights. float_copies: an evaluation command's frozen weights, whose quantized matrices the
    backend may keep float copies of (Backend.bind), one budget for all the models."""
    weights, copies = [], float_copies
    for m in models:
        weights.append(backend.bind(m, float_copies=copies))
        copies = weights[-1].float_copies or copies
    return lambda: [ChunkScorer(m, backend, ctx, w, keep) for m, w in zip(models, weights)]


def add_bos_of(model) -> tuple[bool, int]:
    """Whether the model's tokenizer adds BOS (then every chunk starts with it), and the BOS id."""
    tok = model.tokenizer
    if tok.add_bos and tok.bos_id is None:
        raise LlmtuneError(f"{model.path}: the tokenizer adds BOS but the file names no BOS token")
    return bool(tok.add_bos), -1 if tok.bos_id is None else int(tok.bos_id)


def as_model(model_or_path):

    return model_or_path if isinstance(model_or_path, Model) else load_model(model_or_path)


def as_backend(backend, precision: str = "f32"):

    return backend if isinstance(backend, Backend) else get_backend(backend, precision=precision)


def check_same_vocab(model, base) -> None:
    """KL-divergence compares distributions token by token: both vocabularies must be identical."""
    a, b = model.gguf.get("tokenizer.ggml.tokens"), base.gguf.get("tokenizer.ggml.tokens")
    if model.hp.n_vocab != base.hp.n_vocab or (a is not None and b is not None and a != b):
        raise LlmtuneError(
            f"{base.path}: vocabulary differs from {model.path.name} "
            f"({base.hp.n_vocab} vs {model.hp.n_vocab} tokens); --kl-base needs the same vocabulary"
        )


def load_models(model, kl_base, lora=None, lora_scale=None) -> list:
    """[model] or [model, base]: Models from Models or GGUF paths, vocabularies checked; the
    adapters in `lora` (paths or LoraAdapters, llama.cpp's --lora) applied to the model only."""

    models = [attach(as_model(model), lora, lora_scale)]
    if kl_base is not None:
        models.append(as_model(kl_base))
        check_same_vocab(*models)
    return models


def batch_tokens(batch: Optional[int], backend) -> int:
    """Tokens per forward pass: `batch` (--batch), else the backend's default_batch_tokens."""
    if batch is None:
        batch = backend.default_batch_tokens
    if batch < 1:
        raise LlmtuneError(f"--batch: must be positive (got {batch})")
    return batch


# ------------------------------------------------------------------------------------ statistics of logits
EXP_SAFE = 60.0  # |row max| below this: exp needs no shift (32000 * e^60 is far from float32 overflow)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, float64. logits [..., V] float32 may be overwritten.

    The compiled logsumexp where it takes the rows (each [rows, V] block of the leading index
    contiguous: a pass's logits, or their scored rows): one pass a row, its max and then the
    vector exp summed in double lanes (as perplexity.cpp sums in a double). Else one exp pass over the logits in
    float32 (rows are shifted
    by their max only when some max is outside +-EXP_SAFE), float32 pairwise row sums (relative
    error ~1e-7), the rest in float64.
    """
    target_logit = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(np.float64)
    lse = logsumexp_rows(logits)
    if lse is not None:
        return lse - target_logit
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




# ------------------------------------------------------------------------------------ memory
def pass_bytes(model, backend, n_seq: int, n_tok: int, first: int, prefix=None) -> int:
    """The arena one forward pass of this shape needs (planned, not allocated)."""

    _, nodes, logits = model.build(n_seq, n_tok, logits_start=first, prefix=prefix,
                                   plain_attention_max=backend.plain_attention_max)
    return Program([logits], backend, params={n: None for n in nodes.values()}, allocate=False).memory.planned_bytes


def weight_copy_bytes(models, backend) -> int:
    """What binding the models' weights allocates: where the backend's arrays are host memory
    (the cpu) only float tensors of another dtype (file-typed and float32 tensors stay
    memory-mapped), on a device every byte."""
    itemsize = np.dtype(backend.dtype).itemsize
    total = 0
    for m in models:
        for w in m.tensors().values():
            raw = getattr(w, "raw", None)
            if raw is not None:  # a QTensor, bound in its file type
                total += 0 if backend.maps_host_arrays else raw.nbytes
            elif not backend.maps_host_arrays or np.asarray(w).dtype != backend.dtype:
                total += w.size * itemsize
    return total


def check_evaluation_memory(models, backend, arenas: int, n_programs: int, what: str) -> None:
    """Refuse, before anything is allocated, an evaluation whose weights and `n_programs` planned
    arenas of `arenas` bytes each (per model: the workers' programs) need more than is available."""

    need = weight_copy_bytes(models, backend) + arenas * n_programs * len(models)
    check_memory(need, what, "--batch or --ctx", backend)


def warn_past_training(model, ctx: int) -> None:
    """A LlmtuneWarning when ctx is beyond the model's training context (model/loaded.py
    past_training; llama.cpp warns too: "possible training context overflow")."""

    message = past_training(model, ctx)
    if message:
        warnings.warn(message, LlmtuneWarning, stacklevel=3)
