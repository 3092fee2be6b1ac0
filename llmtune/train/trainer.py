"""The trainer: one training graph per micro-batch shape, gradients accumulated over
micro-batches into one flat buffer, a fused optimizer step per batch (llama_opt_epoch's shape:
n_ctx tokens per sequence, n_batch tokens per optimizer step, n_ubatch tokens per pass)."""

from __future__ import annotations

import math
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from llmtune.backends.threads import blas_threads, cpu_workers, run_in_order
from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import Program
from llmtune.model.loaded import Model
from llmtune.train.optim import Optimizer


@dataclass
class RunningStats:
    """Loss and next-token accuracy with error bars, as ggml_opt_result reports them:
    loss = mean of per-pass mean losses (uncertainty from their spread), accuracy = correct/tokens."""

    losses: list = field(default_factory=list)
    correct: int = 0
    tokens: int = 0

    def add(self, loss: float, correct: int, tokens: int) -> None:
        self.losses.append(loss)
        self.correct += correct
        self.tokens += tokens

    @property
    def loss(self) -> float:
        return float(np.mean(self.losses)) if self.losses else math.nan

    @property
    def loss_err(self) -> float:
        n = len(self.losses)
        return float(np.std(self.losses) / math.sqrt(n - 1)) if n > 1 else math.nan

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens if self.tokens else math.nan

    @property
    def accuracy_err(self) -> float:
        p, n = self.accuracy, self.tokens
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else math.nan


class Trainer:
    def __init__(self, model: Model, backend, *, n_ctx: int, n_batch: int, n_ubatch: int,
                 trainable: list[str], optimizer: str = "adamw", wd: float = 0.0, workers: int | None = None):
        """workers: micro-batches computed at once (cpu: by default one per core when a step
        has several, each with single-threaded BLAS). The result does not depend on it beyond
        float rounding."""
        if n_batch % n_ctx or n_ubatch % n_ctx or n_batch % n_ubatch:
            raise LlmtuneError(
                f"--batch {n_batch} / --ubatch {n_ubatch}: both must be multiples of --ctx {n_ctx}, and ubatch must divide batch"
            )
        self.model, self.backend = model, backend
        self.n_ctx, self.n_batch, self.n_ubatch = n_ctx, n_batch, n_ubatch
        self.seqs_per_ubatch = n_ubatch // n_ctx
        self.ubatches_per_step = n_batch // n_ubatch
        self.trainable = list(trainable)
        self._requested_workers = workers
        self.n_workers = cpu_workers(backend.name, workers, self.ubatches_per_step)
        self._init_buffers()
        self.optimizer = Optimizer(optimizer, backend, self.n_trainable, wd=wd)
        # worker 0 accumulates into flat_g, the others into buffers of their own, summed per step
        self._worker_flat_g = [self.flat_g] + [backend.zeros((self.n_trainable,)) for _ in range(self.n_workers - 1)]
        self._train_progs = [self._build_train_program(self._flat_views(g)) for g in self._worker_flat_g]
        # compiled eval programs by sequence count, one cache per concurrent worker (grown on demand)
        self._eval_caches: list[dict[int, Program]] = []
        self._pos = backend.asarray(np.arange(n_ctx, dtype=np.int32))
        self._pool = ThreadPoolExecutor(self.n_workers, thread_name_prefix="llmtune-train") if self.n_workers > 1 else None

    # ------------------------------------------------------------------ setup
    def _init_buffers(self) -> None:
        """Trainable tensors live as views of one flat buffer (so the optimizer is one fused
        update); frozen tensors are separate arrays and carry no gradient or optimizer state."""
        be, weights = self.backend, self.model.weights
        self.n_trainable = sum(weights[n].size for n in self.trainable)
        self.flat_w = be.zeros((self.n_trainable,))
        self.flat_g = be.zeros((self.n_trainable,))
        self.values = {}
        for name, view in self._flat_views(self.flat_w).items():
            view[...] = be.asarray(weights[name].astype(be.dtype, copy=False))
            self.values[name] = view
        self.grads = self._flat_views(self.flat_g)
        for name, w in weights.items():
            if name not in self.values:
                self.values[name] = be.asarray(w.astype(be.dtype, copy=False))

    def _flat_views(self, flat) -> dict:
        """Per-tensor views of a flat buffer laid out in trainable order."""
        views, offset = {}, 0
        for name in self.trainable:
            w = self.model.weights[name]
            views[name] = flat[offset : offset + w.size].reshape(w.shape)
            offset += w.size
        return views

    def _bind(self, nodes):
        return {nodes[name]: self.values[name] for name in nodes}

    def _build_train_program(self, grad_views: dict) -> Program:
        batch, nodes, logits = self.model.build(self.seqs_per_ubatch, self.n_ctx, trainable=self.trainable)
        targets = ops.input((self.n_ubatch,), "i32", name="targets")
        loss_scale = ops.input((), name="loss_scale")
        loss = ops.cross_entropy(logits, targets)
        correct = ops.count_correct(logits, targets)
        grads = grad(loss, [nodes[n] for n in self.trainable], seed=loss_scale)
        # a trainable tensor the loss does not reach keeps a zero gradient (buffers start zeroed)
        sinks = {grads[nodes[n]]: grad_views[n] for n in self.trainable if nodes[n] in grads}
        return Program([loss, correct], self.backend, params=self._bind(nodes), accumulate=sinks)

    def _make_eval_program(self, n_seq: int) -> Program:
        batch, nodes, logits = self.model.build(n_seq, self.n_ctx)
        targets = ops.input((n_seq * self.n_ctx,), "i32", name="targets")
        outs = [ops.cross_entropy(logits, targets), ops.count_correct(logits, targets)]
        return Program(outs, self.backend, params=self._bind(nodes))

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> dict[str, int]:
        itemsize = np.dtype(self.backend.dtype).itemsize
        return {
            "parameters": sum(w.size for w in self.model.weights.values()) * itemsize,
            "gradients": self.n_trainable * itemsize * self.n_workers,
            "optimizer": self.optimizer.state_bytes,
            "activations": sum(p.memory.planned_bytes for p in self._train_progs),
        }

    # ------------------------------------------------------------------ steps
    def _feed(self, inputs: np.ndarray, targets: np.ndarray) -> dict:
        be = self.backend
        return {
            "tokens": be.asarray(np.ascontiguousarray(inputs, dtype=np.int32)),
            "pos": self._pos,
            "targets": be.asarray(np.ascontiguousarray(targets, dtype=np.int32).reshape(-1)),
        }

    def train_step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, stats: RunningStats) -> float:
        """One optimizer step over n_batch tokens (inputs/targets: [n_batch/n_ctx, n_ctx]).
        Returns the step's mean loss."""
        be = self.backend
        scale = be.asarray(np.asarray(1.0 / self.ubatches_per_step, dtype=be.dtype))
        k, n_ub, n_w = self.seqs_per_ubatch, self.ubatches_per_step, self.n_workers
        results: list = [None] * n_ub

        def work(w: int) -> None:  # worker w takes micro-batches w, w + n_w, ...
            prog = self._train_progs[w]
            for j, u in enumerate(range(w, n_ub, n_w)):
                feed = self._feed(inputs[u * k : (u + 1) * k], targets[u * k : (u + 1) * k])
                # a worker's first pass assigns its gradients, later ones add to them
                loss, correct = prog.run(loss_scale=scale, assign=j == 0, **feed)
                results[u] = (float(be.to_numpy(loss)), int(be.to_numpy(correct)))

        if n_w == 1:
            work(0)
        else:
            with blas_threads(1):
                list(self._pool.map(work, range(n_w)))
            for extra in self._worker_flat_g[1:]:
                be.accumulate(self.flat_g, extra)
        for loss_v, correct in results:
            stats.add(loss_v, correct, self.n_ubatch)
        self.optimizer.step(self.flat_w, self.flat_g, lr)
        return float(np.mean([r[0] for r in results]))

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray, stats: RunningStats) -> None:
        """Loss/accuracy without gradients, in passes of at most n_ubatch tokens (one pass per
        core at once on the cpu)."""
        k = self.seqs_per_ubatch
        starts = list(range(0, len(inputs), k))
        n_w = cpu_workers(self.backend.name, self._requested_workers, len(starts))

        def score(progs: dict, start: int):
            x, y = inputs[start : start + k], targets[start : start + k]
            prog = progs.get(len(x))
            if prog is None:
                prog = progs[len(x)] = self._make_eval_program(len(x))
            loss, correct = prog.run(**self._feed(x, y))
            return float(self.backend.to_numpy(loss)), int(self.backend.to_numpy(correct)), y.size

        self._eval_caches += [{} for _ in range(n_w - len(self._eval_caches))]
        caches: queue.SimpleQueue = queue.SimpleQueue()  # each worker takes its own cache
        for cache in self._eval_caches[:n_w]:
            caches.put(cache)
        for loss_v, correct, n in run_in_order(score, caches.get, starts, n_w):
            stats.add(loss_v, correct, n)

    def trained_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of the trainable tensors."""
        return {n: np.asarray(self.backend.to_numpy(self.values[n]), dtype=np.float32) for n in self.trainable}
