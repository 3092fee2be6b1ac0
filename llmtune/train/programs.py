"""The compiled passes of a training run: a training pass per worker (and, for a micro-batch whose
loss-carrying rows are few, passes that score only those), validation passes by shape, and what
they end in (a PassLoss), each planned into an arena within the run's memory budget.

A pass's loss is pluggable: NextTokenLoss (the mean cross-entropy, seeded by the pass's share of
the step's tokens) for next-token training, WeightedTokenNLL (every token's NLL, seeded per token
by weights the host computes from a forward pass) for losses of sequence log-probabilities: the
preference methods (train/preference.py), and any other such loss, through the same step.

A pass whose logits [rows, vocab] would take more than CHUNKED_LOGITS_BYTES (a 152k vocabulary's
2048-token window), or more than LIMITED_LOGITS_BYTES under a memory limit, computes its loss over
vocabulary chunks instead (ops.linear_cross_entropy: Cut Cross-Entropy), so the logits never exist
whole; LLMTUNE_VOCAB_CHUNK=N forces chunks of N rows (0: never). The memory plan
(train/preflight.py) measures the passes as built, chunks included.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import ArenaTooLarge, Program, ProgramCache, Replay
from llmtune.resources import memory_limit

VOCAB_CHUNK_ENV = "LLMTUNE_VOCAB_CHUNK"
# whole logits above this: chunked. The chunks cost time (each chunk's logits recomputed in the
# backward; a frozen quantized output decoded per chunk, without its packed copy: SmolLM2 QLoRA at
# 2048 tokens a pass, 384 MiB of logits, measured 1.13x slower chunked), so by default only where
# the logits are a big term; under a memory limit the user chose memory over speed
CHUNKED_LOGITS_BYTES = 1 << 30
LIMITED_LOGITS_BYTES = 256 << 20
CHUNK_BYTES = 32 << 20  # a chunk's logits (the forward's and the backward's buffer)


def vocab_chunk(n_rows: int, n_vocab: int) -> int:
    """Vocabulary rows a chunk of the loss holds (0: the logits whole): LLMTUNE_VOCAB_CHUNK when
    set, else chunks of about CHUNK_BYTES once the whole logits pass CHUNKED_LOGITS_BYTES
    (LIMITED_LOGITS_BYTES under --memory-limit / LLMTUNE_MEMORY_LIMIT)."""
    forced = os.environ.get(VOCAB_CHUNK_ENV, "").strip()
    if forced:
        if not forced.isdigit():
            raise LlmtuneError(f"{VOCAB_CHUNK_ENV}={forced!r}: expected a number of vocabulary rows (0: never chunk)")
        return int(forced)
    if n_rows * n_vocab * 4 <= (CHUNKED_LOGITS_BYTES if memory_limit() is None else LIMITED_LOGITS_BYTES):
        return 0
    return max(256, CHUNK_BYTES // (4 * max(n_rows, 1)) // 256 * 256)


def output_product(logits):
    """(x, W, cap) where logits = x W^T, softcapped by cap > 0 (ArchContext.output's product with
    the output matrix or the tied token_embd, in any storage), or None for anything else (an
    adapted output: lora adds to the product)."""
    node, cap = logits, 0.0
    if node.op == "softcap":
        node, cap = node.inputs[0], node.attrs["cap"]
    plain = node.op == "matmul" and node.attrs["tb"] and not node.attrs["ta"]
    if not (plain or (node.op == "qlinear" and not node.attrs["round_x"])):
        return None
    x, w = node.inputs
    return (x, w, cap) if len(x.shape) == 2 and len(w.shape) == 2 else None



class NextTokenLoss:
    """Next-token training: the mean cross-entropy and the count of correct argmaxes of the rows
    that carry loss; the backward seeded by the input "loss_scale" (the pass's share of the
    step's loss-carrying tokens). A pass may score only its loss-carrying rows (out_rows)."""

    selects_rows = True

    @staticmethod
    def train(logits, targets) -> tuple[list, object, object]:
        """(outputs, the node the backward starts from, its seed)."""
        loss = ops.cross_entropy(logits, targets)
        return [loss, ops.count_correct(logits, targets)], loss, ops.input((), name="loss_scale")

    @staticmethod
    def train_chunked(x, w, targets, chunk: int, cap: float) -> tuple[list, object, object]:
        """train's outputs over vocabulary chunks (ops.linear_cross_entropy)."""
        loss = ops.linear_cross_entropy(x, w, targets, chunk, cap)
        return [loss, ops.vocab_hits(loss.inputs[3])], loss, ops.input((), name="loss_scale")

    @staticmethod
    def evaluate(logits, targets) -> list:
        return [ops.cross_entropy(logits, targets), ops.count_correct(logits, targets)]


class WeightedTokenNLL:
    """Every token's NLL (ops.token_nll); the backward seeded by the input "token_weights", one per
    token: the gradient of a loss of sequence log-probabilities wrt each token's NLL, computed on
    the host from a forward pass (Objective.token_weights), so the gradients are the loss's own."""

    selects_rows = False

    @staticmethod
    def train(logits, targets) -> tuple[list, object, object]:
        nll = ops.token_nll(logits, targets)
        return [nll], nll, ops.input((targets.shape[0],), name="token_weights")

    @staticmethod
    def train_chunked(x, w, targets, chunk: int, cap: float) -> tuple[list, object, object]:
        nll = ops.linear_cross_entropy(x, w, targets, chunk, cap, mean=False)
        return [nll], nll, ops.input((targets.shape[0],), name="token_weights")

    @staticmethod
    def evaluate(logits, targets) -> list:
        return [ops.token_nll(logits, targets)]


class StepPrograms:
    """The passes of one trainer: built from the model's graph (trainable tensors as params, the
    rest bound as the backend holds them), compiled into arenas while they fit `arena_budget`
    (bytes; None: unknown), refused in one line (`does_not_fit(what, limit)`) when they do not."""

    # a micro-batch whose loss-carrying targets fill less of it scores only their rows (rounded up
    # to a multiple of this share of the micro-batch, so a few shapes serve every count)
    OUT_ROW_BUCKETS = 16

    def __init__(self, trainer, loss, arena_budget: int | None, does_not_fit: Callable):
        t = self.trainer = trainer
        self.loss, self.arena_budget, self.does_not_fit = loss, arena_budget, does_not_fit
        self.n_ubatch = t.n_ubatch
        self.train: list[Program] = []  # one full training pass per worker
        self.inputs: list[dict] = []  # their input buffers
        self.replays: list[dict[bool, Replay]] = []  # by assign mode
        # passes that score fewer rows than the micro-batch holds: (worker, rows) -> (program,
        # input buffers, replays by assign), compiled at first use into the worker's arena
        self.out_passes: dict[tuple[int, int], tuple[Program, dict, dict]] = {}
        self.eval_caches: list[ProgramCache] = []  # validation programs by shape, one per worker
        self.pos = t.backend.asarray(np.arange(t.n_ctx, dtype=np.int32))
        # a chunked loss's buffers outside the arena, per worker: a chunk's logits and their
        # gradient, and a [rows, d] part of dx (backends/vocab_chunks.py)
        self.chunk_scratch = 0

    # ------------------------------------------------------------------ building
    def graph(self, n_seq: int, **kwargs):
        """The model's graph of n_seq windows, as every training program builds it: round_x=False,
        a quantized base multiplies the activations as they are (QLoRA's dequantized product;
        evaluation keeps llama.cpp's rounding to report its numbers)."""
        t = self.trainer
        return t.model.build(n_seq, t.n_ctx, round_x=False, plain_attention_max=t.backend.plain_attention_max, **kwargs)

    def add_worker(self, grad_views: dict) -> None:
        """A worker's full training pass, its gradients accumulated into grad_views."""
        prog = self.train_program(grad_views)
        if self.arena_budget is not None:
            self.arena_budget -= self.chunk_scratch
        self.train.append(prog)
        self.inputs.append(self.input_buffers(prog))
        self.replays.append({})

    def train_program(self, grad_views: dict, n_out: int | None = None, arena=None) -> Program:
        """A training pass; n_out: only that many rows, picked by the input "out_ids", produce
        logits and loss (targets then [n_out]), planned into `arena` where it fits."""
        t = self.trainer
        _, nodes, logits = self.graph(t.seqs_per_ubatch, trainable=t.trainable, lora_dropout=t.lora_dropout,
                                      packed=t.packed, n_out=n_out)
        targets = ops.input((logits.shape[0],), "i32", name="targets")
        outputs, loss, seed = self.loss_of(logits, targets)
        grads = grad(loss, [nodes[n] for n in t.trainable], seed=seed, checkpoint=t.grad_checkpoint)
        # a trainable tensor the loss does not reach keeps a zero gradient (buffers start zeroed)
        sinks = {grads[nodes[n]]: grad_views[n] for n in t.trainable if nodes[n] in grads}
        return self.compile(outputs, nodes, accumulate=sinks, arena=arena)

    def eval_program(self, n_seq: int, n_out: int | None = None, arena=None) -> Program:
        """A pass without gradients over n_seq windows; n_out: only that many rows (input
        "out_ids") produce logits, planned into `arena` where it fits."""
        _, nodes, logits = self.graph(n_seq, packed=self.trainer.packed, n_out=n_out)
        targets = ops.input((logits.shape[0],), "i32", name="targets")
        chunked = self.loss_of(logits, targets, chunked_only=True)
        outputs = chunked[0] if chunked else self.loss.evaluate(logits, targets)
        return self.compile(outputs, nodes, arena=arena)

    def loss_of(self, logits, targets, chunked_only: bool = False):
        """The pass's loss as (outputs, the node the backward starts from, its seed): over
        vocabulary chunks where the logits are a plain product too large to hold (vocab_chunk) and
        the loss has a chunked form (train_chunked: the same outputs, or None where it has none for
        these logits), else over the whole logits (None with chunked_only; a validation pass then
        takes the loss's evaluate)."""
        product = output_product(logits)
        chunk = vocab_chunk(*logits.shape) if product is not None and hasattr(self.loss, "train_chunked") else 0
        chunked = self.loss.train_chunked(*product[:2], targets, chunk, product[2]) if chunk else None
        if chunked is not None:
            (rows, d), size = product[0].shape, np.dtype(self.trainer.backend.dtype).itemsize
            need = (2 * rows * min(chunk, product[1].shape[0]) + rows * d) * size
            self.chunk_scratch = max(self.chunk_scratch, need)
            return chunked
        return None if chunked_only else self.loss.train(logits, targets)

    def compile(self, outputs, nodes, accumulate=None, arena=None) -> Program:
        """A compiled program whose arena must fit what is left of the memory budget (or `arena`,
        another program's, which it then shares)."""
        t = self.trainer
        try:
            prog = Program(outputs, t.backend, params={nodes[n]: t.values[n] for n in nodes}, accumulate=accumulate,
                           max_bytes=self.arena_budget, arena=arena)
        except ArenaTooLarge as exc:
            raise self.does_not_fit(f"{exc.needed / 2**20:,.0f} MiB of activations for one pass of "
                                    f"{self.n_ubatch:,} tokens", exc.limit) from None
        except MemoryError:
            raise self.does_not_fit(f"the activations of one pass of {self.n_ubatch:,} tokens") from None
        if self.arena_budget is not None and prog.owns_arena:
            self.arena_budget -= prog.memory.planned_bytes
        return prog

    def input_buffers(self, prog: Program) -> dict:
        """One backend array per input of a training program (positions: the shared, fixed ones)."""
        be = self.trainer.backend
        return {name: self.pos if name == "pos" and not self.trainer.packed
                else be.zeros(node.shape, np.int32 if node.dtype == "i32" else None)
                for name, node in prog.inputs.items()}

    # ------------------------------------------------------------------ running
    def out_rows(self, n_counted: int, n_rows: int | None = None) -> int:
        """Rows a pass of n_rows (default n_ubatch) computes logits for, given its loss-carrying
        targets: n_counted rounded up to a bucket; n_rows (every row, no selection) when that is
        all of them, or where the loss reads every row (WeightedTokenNLL). Masked data (chat
        turns, prompts) then skips the vocabulary projection, its backward and the cross-entropy
        of rows that carry no loss, as llama.cpp's inp_out_ids skips them."""
        n_rows = self.n_ubatch if n_rows is None else n_rows
        if not self.loss.selects_rows:
            return n_rows
        step = max(8, -(-n_rows // self.OUT_ROW_BUCKETS))
        return min(n_rows, max(step, -(-n_counted // step) * step))

    def worker_pass(self, w: int, grad_views: Callable, n_out: int | None = None) -> tuple[Program, dict, dict]:
        """Worker w's training pass scoring n_out rows (None or n_ubatch: every row, the pass
        built at setup; fewer: compiled at first use, in the worker's arena, its gradients into
        grad_views(w)) as (program, input buffers, replays by assign mode)."""
        if n_out is None or n_out == self.n_ubatch:
            return self.train[w], self.inputs[w], self.replays[w]
        entry = self.out_passes.get((w, n_out))
        if entry is None:
            prog = self.train_program(grad_views(w), n_out, arena=self.train[w].arena)
            entry = self.out_passes[(w, n_out)] = (prog, self.input_buffers(prog), {})
        return entry

    def run(self, w: int, assign: bool, grad_views: Callable, n_out: int | None = None) -> list:
        """Worker w's training pass on its input buffers: replayed where the backend replays (the
        cpu, where Python work per kernel is a visible part of a small model's step)."""
        prog, feed, replays = self.worker_pass(w, grad_views, n_out)
        if not self.trainer.backend.replays:
            return prog.run(assign=assign, **feed)
        replay = replays.get(assign)
        if replay is None:
            replay = replays[assign] = Replay(prog, feed, assign=assign)
        return replay.run()

    def eval_caches_for(self, n_workers: int) -> list[ProgramCache]:
        """n_workers validation caches (grown on demand): each worker's programs by (windows,
        scored rows); a pass scoring fewer rows than it holds shares the arena of the pass
        scoring all of them."""
        n_ctx = self.trainer.n_ctx
        while len(self.eval_caches) < n_workers:
            cache = ProgramCache(None)

            def make(key, cache=cache):
                n_seq, n_out = key
                if n_out == n_seq * n_ctx:
                    return self.eval_program(n_seq)
                return self.eval_program(n_seq, n_out, arena=cache.get((n_seq, n_seq * n_ctx)).arena)

            cache.make = make
            self.eval_caches.append(cache)
        return self.eval_caches[:n_workers]

    def planned_bytes(self) -> int:
        """The training passes' arenas and chunked losses' buffers (what every worker holds at once)."""
        return sum(p.memory.planned_bytes for p in self.train) + self.chunk_scratch * len(self.train)
