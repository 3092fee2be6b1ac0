"""The trainer: one training graph per micro-batch shape, gradients accumulated over
micro-batches into one flat buffer, a fused optimizer step per batch (llama_opt_epoch's shape:
n_ctx tokens per sequence, n_batch tokens per optimizer step, n_ubatch tokens per pass).

Its parts: train/programs.py (the compiled passes and the loss they end in), train/memory.py (the
estimate and the frozen matrices' copies), the micro-batch runner and the step here."""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from llmtune.arch.packing import packing_inputs
from llmtune.backends.cpu import FloatCopies, blas_threads
from llmtune.backends.dist import Communicator, DistributedError, run_split, world
from llmtune.errors import LlmtuneError
from llmtune.graph.planner import ProgramCache
from llmtune.model.loaded import Model
from llmtune.quant.qtensor import QTensor, shape_only
from llmtune.resources import available_memory
from llmtune.train import flops, guard, memory
from llmtune.train.microbatches import MicroBatches
from llmtune.train.optim import Optimizer
from llmtune.train.programs import NextTokenLoss, StepPrograms


@dataclass
class RunningStats:
    """Loss and next-token accuracy with error bars, as ggml_opt_result reports them:
    loss = mean of per-pass mean losses (uncertainty from their spread), accuracy = correct/tokens."""

    losses: list = field(default_factory=list)
    correct: int = 0
    tokens: int = 0

    def add(self, loss: float, correct: int, tokens: int) -> None:
        self.add_many([loss], correct, tokens)

    def add_many(self, losses, correct: int, tokens: int) -> None:
        """Several losses (each a unit of the mean: a pass, a preference pair) and their counts."""
        self.losses.extend(float(v) for v in losses)
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
                 trainable: list[str], optimizer: str = "adamw", wd: float = 0.0, workers: int | None = None,
                 lora_dropout: float = 0.0, seed: int = 0, comm: Communicator | None = None,
                 grad_checkpoint: bool = False, packed: bool = False, grad_clip: float = 0.0,
                 lr_factors: dict[str, float] | None = None, loss=NextTokenLoss, layout_inputs: Callable | None = None,
                 forward_pass: bool = False):
        """trainable: names in model.tensors() (base weights, or a LoRA adapter's A/B keys: the
        base then stays frozen). workers: micro-batches computed at once (cpu: by default one per
        core when a step has several, each with single-threaded BLAS). lora_dropout: PEFT's
        dropout on the adapters' inputs in training passes, masks drawn per sequence from `seed`
        (adapter.dropout_masks). grad_checkpoint: the backward recomputes each layer's activations
        (autodiff.grad's checkpoint): same gradients, less memory. packed: each window holds
        several examples (arch/packing.py), laid out by layout_inputs(hp, segments) (default
        packing_inputs); train_step and evaluate then take the windows' segments. lr_factors: a
        learning-rate factor per trainable tensor (torch's parameter groups; LoRA+), tensors laid
        out by factor, so each group is one contiguous optimizer step. loss: what a pass ends in
        (programs.NextTokenLoss or WeightedTokenNLL); forward_pass: also keep a forward program
        of one micro-batch (`forward`, planned before the copies' budget), for losses computed
        from the model's log-probabilities (train/preference.py)."""
        if n_batch % n_ctx or n_ubatch % n_ctx or n_batch % n_ubatch:
            raise LlmtuneError(
                f"--batch {n_batch} / --ubatch {n_ubatch}: both must be multiples of --ctx {n_ctx}, and ubatch "
                "must divide batch"
            )
        self.model, self.backend = model, backend
        self.n_ctx, self.n_batch, self.n_ubatch = n_ctx, n_batch, n_ubatch
        self.seqs_per_ubatch = n_ubatch // n_ctx
        self.ubatches_per_step = n_batch // n_ubatch
        factors = lr_factors or {}
        self.trainable = sorted(trainable, key=lambda n: factors.get(n, 1.0)) if factors else list(trainable)
        self.tensors = model.tensors()
        # a trainable matrix stored quantized trains as float32 master weights (re-quantized on
        # save): its graphs see a float tensor of its shape; frozen ones stay in their file type
        dense = {n: shape_only(w) for n, w in model.weights.items() if isinstance(w, QTensor) and n in set(trainable)}
        if dense:
            self.model = model = dataclasses.replace(model, weights={**model.weights, **dense})
        self.lora_dropout, self.seed, self.steps_done = float(lora_dropout), seed, 0
        self.grad_checkpoint, self.packed = bool(grad_checkpoint), bool(packed)
        self.layout_inputs = layout_inputs or packing_inputs
        self.grad_clip = float(grad_clip)  # > 0: the step's gradient is clipped to this global L2 norm
        self.grad_norm = math.nan  # the last step's global gradient norm, before clipping
        self.peak_flops = None  # the backend's float32 product peak, measured (finetune sets it: train/flops.py)
        self.limits = guard.Limits()  # what stops training besides non-finite values (Diverged); finetune sets them
        # named metrics of the last step and validation pass beyond loss and accuracy (train/preference.py)
        self.step_metrics: dict = {}
        self.eval_metrics: dict = {}
        self._requested_workers = workers
        # data-parallel ranks (backends/dist.py; default: this process's world): rank r takes the
        # step's micro-batches r, r + size, ...; one all-reduce of flat_g per step sums them
        self.comm = (world() if comm is None else comm).for_backend(backend)
        if self.comm.size > self.ubatches_per_step:
            raise DistributedError(f"--batch {n_batch} / --ubatch {n_ubatch}: {self.ubatches_per_step} "
                                   "micro-batch(es) per step "
                                   f"for {self.comm.size} ranks; each rank needs one (raise --batch or lower --ubatch)")
        self.my_ubatches = range(self.comm.rank, self.ubatches_per_step, self.comm.size)
        self.n_workers = backend.workers(workers, len(self.my_ubatches))
        try:
            self._init_buffers()
            self.optimizer = Optimizer(optimizer, backend, self.n_trainable, wd=wd, lr_factors=factors,
                                       tensors=[(n, self.tensors[n].size) for n in self.trainable])
            self.batches = MicroBatches(self, self.n_workers)
        except MemoryError:
            raise self._does_not_fit(f"its weights, gradients and optimizer state "
                                     f"({self.n_trainable:,} trained values)") from None
        # the activations' arenas are planned before they are allocated: a run they do not fit is refused
        self.programs = StepPrograms(self, loss, available_memory(backend), self._does_not_fit)
        for w in range(self.n_workers):
            self.programs.add_worker(self.batches.grad_views(w))
        # dropout-mask inputs of the training graph (name -> shape), fed per micro-batch
        self.masks = {n: node.shape for n, node in self.programs.train[0].inputs.items() if n.endswith(".dropout")}
        self.forward = self.programs.eval_program(self.seqs_per_ubatch) if forward_pass else None
        self._packed_bytes, self._packed_names = memory.plan_copies(self)
        # the block each step's micro-batches run in (cpu, one at a time: OpenBLAS's thread count by
        # timing; with packed base products OpenBLAS single-threaded: the compiled products take the
        # cores on their own pool, and OpenBLAS's threads, spinning ~0.1 s after each of the step's
        # small products (attention, LoRA's rank-r ones), would take a core from it)
        self.packed_products = (self.float_copies is not None and self.float_copies.packing()
                                and self.float_copies.budget > 0 and self.n_workers == 1)
        self.blas_tuner = self.batches.tuner = (functools.partial(blas_threads, 1) if self.packed_products
                                                else backend.step_tuner(self.n_workers))

    # ------------------------------------------------------------------ setup
    def _init_buffers(self) -> None:
        """Trainable tensors live as views of one flat buffer (so the optimizer is one fused
        update); frozen tensors are separate arrays and carry no gradient or optimizer state."""
        be, weights = self.backend, self.tensors
        self.n_trainable = sum(weights[n].size for n in self.trainable)
        self.flat_w = be.zeros((self.n_trainable,))
        self.flat_g = be.zeros((self.n_trainable,))
        self.values = {}
        for name, view in self._flat_views(self.flat_w).items():
            view[...] = be.asarray(weights[name].astype(be.dtype, copy=False))
            self.values[name] = view
        self.grads = self._flat_views(self.flat_g)
        frozen = {name: w for name, w in weights.items() if name not in self.values}
        # a QTensor's bytes as they are, with float32 copies kept within a budget set once the
        # run's other memory is planned (memory.plan_copies; the cpu: other backends keep none)
        bound = be.bind(frozen, float_copies=FloatCopies(0, pack=True))
        self.values.update(bound)
        self.float_copies, self.frozen = bound.float_copies, frozen
        gguf = getattr(self.model, "gguf", None)
        if self.trainable and gguf is not None:
            gguf.drop_pages()  # the trained tensors now live in flat_w; frozen ones fault back in
        if self.float_copies is not None and gguf is not None:
            self.float_copies.releases.append(gguf.drop_pages)  # a packed frozen matrix: its pages too

    def _flat_views(self, flat) -> dict:
        """Per-tensor views of a flat buffer laid out in trainable order."""
        views, offset = {}, 0
        for name in self.trainable:
            w = self.tensors[name]
            views[name] = flat[offset : offset + w.size].reshape(w.shape)
            offset += w.size
        return views

    def _does_not_fit(self, what: str, available: int | None = None) -> LlmtuneError:
        return memory.does_not_fit(self.model.path, self.backend, what, available)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes by part (train/memory.py memory_bytes): the run's estimate."""
        return memory.memory_bytes(self)

    def base_types(self) -> dict[str, int]:
        """Bytes of the base weights by how they are held (train/memory.py base_types)."""
        return memory.base_types(self)

    @functools.cached_property
    def flops_per_step(self) -> int:
        """The products' FLOPs of one optimizer step on this rank (train/flops.py): its micro-batches'
        full training pass each."""
        return flops.program_flops(self.programs.train[0].order) * len(self.my_ubatches)

    def mfu(self, seconds_per_step: float) -> float:
        """Model FLOP utilisation of steps taking `seconds_per_step` (NaN without a measured peak)."""
        return flops.mfu(self.flops_per_step, seconds_per_step, self.peak_flops)

    def base_products(self) -> str:
        """"packed" or "blas": the frozen matrices' product (train/memory.py base_products)."""
        return memory.base_products(self)

    def out_rows(self, n_counted: int, n_rows: int | None = None) -> int:
        """Rows a pass computes logits for (train/programs.py StepPrograms.out_rows)."""
        return self.programs.out_rows(n_counted, n_rows)

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, stats: RunningStats,
                   segments: np.ndarray | None = None) -> float:
        """One optimizer step over n_batch tokens (inputs/targets: [n_batch/n_ctx, n_ctx]; packed:
        segments of the same shape). Returns the step's mean loss."""
        be = self.backend
        # each pass's mean is weighted by its share of the step's loss-carrying tokens, so the
        # step's loss and gradient are the mean over all of them (1 / n_ub each without masking)
        counts = self.batches.counts(targets)
        total = max(int(counts.sum()), 1)
        scales = [be.asarray(np.asarray(c / total, dtype=be.dtype)) for c in counts]
        results = self.batches.run(inputs, targets, segments, counts, lambda u: {"loss_scale": scales[u]},
                                  lambda u, out: (float(be.to_numpy(out[0])), int(be.to_numpy(out[1]))))
        if self.comm.size > 1:
            results = self._reduce_step(results)
        if (counts == counts[0]).all():
            loss = float(np.mean([r[0] for r in results]))
        else:  # masked targets: the mean over the step's loss-carrying tokens
            loss = float(sum(r[0] * c for r, c in zip(results, counts)) / total)
        sum_squares = guard.check_step(self, loss)  # before the update: a bad step leaves the weights as they were
        for (loss_v, correct), c in zip(results, counts):
            stats.add(loss_v, correct, int(c))
        self.update(lr, sum_squares)
        return loss

    def update(self, lr: float, sum_squares: float) -> None:
        """The optimizer step on the accumulated gradient, clipped first (clip_gradients)."""
        self.grad_norm = self.clip_gradients(sum_squares)
        self.optimizer.step(self.flat_w, self.flat_g, lr)
        self.steps_done += 1

    def clip_gradients(self, sum_squares: float | None = None) -> float:
        """The global L2 norm of the step's gradient (accumulated over the micro-batches and, under
        data parallel, all-reduced: every rank sees the same) before clipping; with grad_clip > 0
        the gradient is then scaled as torch.nn.utils.clip_grad_norm_ scales it, by
        grad_clip / (norm + 1e-6) when that is below 1. sum_squares: the gradient's, when the
        caller has it already (guard.check_step: one read of the buffer for both)."""
        g = self.flat_g
        if self.n_trainable == 0:
            return 0.0
        norm = math.sqrt(self.backend.sum_squares(g) if sum_squares is None else sum_squares)
        if self.grad_clip > 0:
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                g *= g.dtype.type(coef)
        return norm

    def _reduce_step(self, results: list) -> list:
        """The step's all-reduce: flat_g summed over the ranks (one collective over the flat buffer),
        and every micro-batch's (loss, correct) given to every rank (exact: each is added to zeros)."""
        step = self.steps_done + 1
        self.comm.allreduce(self.flat_g, f"the all-reduce of step {step}'s gradients")
        mine = np.zeros((2, len(results)))
        for u in self.my_ubatches:
            mine[:, u] = results[u]
        every = self.comm.allreduce_host(mine, f"the all-reduce of step {step}'s losses")
        return [(float(loss), int(correct)) for loss, correct in every.T]

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray, stats: RunningStats,
                 segments: np.ndarray | None = None) -> None:
        """Loss/accuracy without gradients, in passes of at most n_ubatch tokens (one pass per
        core at once on the cpu), at least two when there are two windows: the loss's standard
        error is its passes' spread (a packed validation set is often a few windows); packed
        windows with their segments."""
        k = min(self.seqs_per_ubatch, max(1, -(-len(inputs) // 2)))
        starts = list(range(0, len(inputs), k))
        n_w = self.backend.workers(self._requested_workers, len(starts))

        def score(progs: ProgramCache, start: int):
            x, y = inputs[start : start + k], targets[start : start + k]
            seg = None if segments is None else segments[start : start + k]
            n_counted = int((y >= 0).sum())
            n_out = self.out_rows(n_counted, y.size)  # the loss-carrying rows only, as a training pass
            loss, correct = progs.get((len(x), n_out)).run(**self.batches.feed(x, y, segments=seg, n_out=n_out))
            return float(self.backend.to_numpy(loss)), int(self.backend.to_numpy(correct)), n_counted

        caches: queue.SimpleQueue = queue.SimpleQueue()  # each worker takes its own cache
        for cache in self.programs.eval_caches_for(n_w):
            caches.put(cache)
        for loss_v, correct, n in run_split(score, caches.get, starts, n_w, self.comm):  # passes split across ranks
            stats.add(loss_v, correct, n)

    def trained_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of the trainable tensors."""
        return {n: np.asarray(self.backend.to_numpy(self.values[n]), dtype=np.float32) for n in self.trainable}

    # ------------------------------------------------------------------ checkpoints
    def state_arrays(self) -> dict[str, np.ndarray]:
        """The trainable buffer (host float32) and the optimizer's state (Optimizer.state_arrays):
        a checkpoint's arrays; the buffers themselves on a float32 cpu backend, so writing a
        checkpoint costs no second copy of the state (peak memory); valid until the next step."""
        return {"weights": np.asarray(self.backend.to_numpy(self.flat_w), dtype=np.float32),
                **self.optimizer.state_arrays()}

    def load_state(self, arrays: dict, steps_done: int) -> None:
        """Continue from state_arrays() taken after `steps_done` optimizer steps."""
        src = arrays.get("weights")
        if src is None or src.shape != (self.n_trainable,):
            raise LlmtuneError(f"checkpoint: weights has {None if src is None else src.shape}, "
                               f"this run trains {self.n_trainable} values")
        self.flat_w[...] = self.backend.asarray(np.asarray(src, dtype=np.float32).astype(self.backend.dtype,
                                                                                          copy=False))
        self.optimizer.load_state(arrays)
        self.optimizer.t = self.steps_done = steps_done
