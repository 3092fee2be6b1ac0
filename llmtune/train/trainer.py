"""The trainer: one training graph per micro-batch shape, gradients accumulated over
micro-batches into one flat buffer, a fused optimizer step per batch (llama_opt_epoch's shape:
n_ctx tokens per sequence, n_batch tokens per optimizer step, n_ubatch tokens per pass)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

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
                 trainable: list[str], optimizer: str = "adamw", wd: float = 0.0):
        if n_batch % n_ctx or n_ubatch % n_ctx or n_batch % n_ubatch:
            raise LlmtuneError(
                f"--batch {n_batch} / --ubatch {n_ubatch}: both must be multiples of --ctx {n_ctx}, and ubatch must divide batch"
            )
        self.model, self.backend = model, backend
        self.n_ctx, self.n_batch, self.n_ubatch = n_ctx, n_batch, n_ubatch
        self.seqs_per_ubatch = n_ubatch // n_ctx
        self.ubatches_per_step = n_batch // n_ubatch
        self.trainable = list(trainable)
        self._init_buffers()
        self.optimizer = Optimizer(optimizer, backend, self.n_trainable, wd=wd)
        self._train_prog = self._build_train_program()
        self._eval_progs: dict[int, Program] = {}

    # ------------------------------------------------------------------ setup
    def _init_buffers(self) -> None:
        """Trainable tensors live as views of one flat buffer (so the optimizer is one fused
        update); frozen tensors are separate arrays and carry no gradient or optimizer state."""
        be, weights = self.backend, self.model.weights
        self.n_trainable = sum(weights[n].size for n in self.trainable)
        self.flat_w = be.zeros((self.n_trainable,))
        self.flat_g = be.zeros((self.n_trainable,))
        self.values, self.grads = {}, {}
        offset = 0
        for name in self.trainable:
            w = weights[name]
            view = self.flat_w[offset : offset + w.size].reshape(w.shape)
            view[...] = be.asarray(w.astype(be.dtype, copy=False))
            self.values[name] = view
            self.grads[name] = self.flat_g[offset : offset + w.size].reshape(w.shape)
            offset += w.size
        for name, w in weights.items():
            if name not in self.values:
                self.values[name] = be.asarray(w.astype(be.dtype, copy=False))

    def _bind(self, nodes):
        return {nodes[name]: self.values[name] for name in nodes}

    def _build_train_program(self) -> Program:
        batch, nodes, logits = self.model.build(self.seqs_per_ubatch, self.n_ctx, trainable=self.trainable)
        targets = ops.input((self.n_ubatch,), "i32", name="targets")
        loss_scale = ops.input((), name="loss_scale")
        loss = ops.cross_entropy(logits, targets)
        correct = ops.count_correct(logits, targets)
        grads = grad(loss, [nodes[n] for n in self.trainable], seed=loss_scale)
        sinks = {grads[nodes[n]]: self.grads[n] for n in self.trainable if nodes[n] in grads}
        # a trainable tensor the loss does not reach keeps a zero gradient (flat_g starts zeroed)
        return Program([loss, correct], self.backend, params=self._bind(nodes), accumulate=sinks)

    def _eval_program(self, n_seq: int) -> Program:
        prog = self._eval_progs.get(n_seq)
        if prog is None:
            batch, nodes, logits = self.model.build(n_seq, self.n_ctx)
            targets = ops.input((n_seq * self.n_ctx,), "i32", name="targets")
            outs = [ops.cross_entropy(logits, targets), ops.count_correct(logits, targets)]
            prog = self._eval_progs[n_seq] = Program(outs, self.backend, params=self._bind(nodes))
        return prog

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> dict[str, int]:
        itemsize = np.dtype(self.backend.dtype).itemsize
        return {
            "parameters": sum(w.size for w in self.model.weights.values()) * itemsize,
            "gradients": self.n_trainable * itemsize,
            "optimizer": self.optimizer.state_bytes,
            "activations": self._train_prog.memory.planned_bytes,
        }

    # ------------------------------------------------------------------ steps
    def _feed(self, inputs: np.ndarray, targets: np.ndarray) -> dict:
        be = self.backend
        return {
            "tokens": be.asarray(np.ascontiguousarray(inputs, dtype=np.int32)),
            "pos": be.asarray(np.arange(self.n_ctx, dtype=np.int32)),
            "targets": be.asarray(np.ascontiguousarray(targets, dtype=np.int32).reshape(-1)),
        }

    def train_step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, stats: RunningStats) -> float:
        """One optimizer step over n_batch tokens (inputs/targets: [n_batch/n_ctx, n_ctx]).
        Returns the step's mean loss."""
        be = self.backend
        scale = be.asarray(np.asarray(1.0 / self.ubatches_per_step, dtype=be.dtype))
        step_losses = []
        k = self.seqs_per_ubatch
        for u in range(self.ubatches_per_step):
            feed = self._feed(inputs[u * k : (u + 1) * k], targets[u * k : (u + 1) * k])
            # the first pass assigns the gradients, later ones add to them
            loss, correct = self._train_prog.run(loss_scale=scale, assign=u == 0, **feed)
            loss_v = float(be.to_numpy(loss))
            stats.add(loss_v, int(be.to_numpy(correct)), self.n_ubatch)
            step_losses.append(loss_v)
        self.optimizer.step(self.flat_w, self.flat_g, lr)
        return float(np.mean(step_losses))

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray, stats: RunningStats) -> None:
        """Loss/accuracy without gradients, in passes of at most n_ubatch tokens."""
        k = self.seqs_per_ubatch
        for start in range(0, len(inputs), k):
            x, y = inputs[start : start + k], targets[start : start + k]
            loss, correct = self._eval_program(len(x)).run(**self._feed(x, y))
            stats.add(float(self.backend.to_numpy(loss)), int(self.backend.to_numpy(correct)), y.size)

    def trained_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of the trainable tensors."""
        return {n: np.asarray(self.backend.to_numpy(self.values[n]), dtype=np.float32) for n in self.trainable}
