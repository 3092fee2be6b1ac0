"""The trainer: one training graph per micro-batch shape, gradients accumulated over
micro-batches into one flat buffer, a fused optimizer step per batch (llama_opt_epoch's shape:
n_ctx tokens per sequence, n_batch tokens per optimizer step, n_ubatch tokens per pass)."""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from llmtune.backends.dist import Communicator, DistributedError, run_split, world
from llmtune.backends.threads import blas_threads
from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import ArenaTooLarge, Program, ProgramCache, Replay
from llmtune.model.loaded import Model
from llmtune.quant.matmul import FloatCopies
from llmtune.quant.qtensor import QTensor, shape_only, training_budget
from llmtune.resources import available_memory
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


class Diverged(LlmtuneError):
    """A training step whose loss or gradients are not finite, or whose loss is past the trainer's
    `max_loss`; raised before that step's update, so the weights stay those of the step before."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason


class Trainer:
    def __init__(self, model: Model, backend, *, n_ctx: int, n_batch: int, n_ubatch: int,
                 trainable: list[str], optimizer: str = "adamw", wd: float = 0.0, workers: int | None = None,
                 lora_dropout: float = 0.0, seed: int = 0, comm: Communicator | None = None,
                 grad_checkpoint: bool = False, packed: bool = False, grad_clip: float = 0.0,
                 lr_factors: dict[str, float] | None = None):
        """trainable: names in model.tensors() (base weights, or a LoRA adapter's A/B keys: the
        base then stays frozen). workers: micro-batches computed at once (cpu: by default one per
        core when a step has several, each with single-threaded BLAS). The result does not depend
        on it beyond float rounding. lora_dropout: PEFT's dropout on the adapters' inputs in
        training passes, masks drawn per sequence from `seed` (adapter.dropout_masks).
        grad_checkpoint: the backward recomputes each layer's activations (autodiff.grad's
        checkpoint) instead of keeping them from the forward: same gradients, less memory.
        packed: each window holds several examples (arch/packing.py); train_step and evaluate then
        take the windows' segment numbers, which give the positions and attention masks.
        lr_factors: a learning-rate factor per trainable tensor (torch's parameter groups; LoRA+);
        tensors are then laid out by factor, so each group is one contiguous optimizer step."""
        if n_batch % n_ctx or n_ubatch % n_ctx or n_batch % n_ubatch:
            raise LlmtuneError(
                f"--batch {n_batch} / --ubatch {n_ubatch}: both must be multiples of --ctx {n_ctx}, and ubatch must divide batch"
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
        self.grad_clip = float(grad_clip)  # > 0: the step's gradient is clipped to this global L2 norm
        self.grad_norm = math.nan  # the last step's global gradient norm, before clipping
        self.max_loss = math.inf  # a step's mean loss above it stops training (Diverged)
        # named metrics of the last step and validation pass beyond loss and accuracy (train/preference.py)
        self.step_metrics: dict = {}
        self.eval_metrics: dict = {}
        self._requested_workers = workers
        # data-parallel ranks (backends/dist.py; default: this process's world): rank r takes the
        # step's micro-batches r, r + size, ...; one all-reduce of flat_g per step sums them
        self.comm = (world() if comm is None else comm).for_backend(backend)
        if self.comm.size > self.ubatches_per_step:
            raise DistributedError(f"--batch {n_batch} / --ubatch {n_ubatch}: {self.ubatches_per_step} micro-batch(es) per step "
                                   f"for {self.comm.size} ranks; each rank needs one (raise --batch or lower --ubatch)")
        self.my_ubatches = range(self.comm.rank, self.ubatches_per_step, self.comm.size)
        self.n_workers = backend.workers(workers, len(self.my_ubatches))
        try:
            self._init_buffers()
            self.optimizer = Optimizer(optimizer, backend, self.n_trainable, wd=wd, lr_factors=factors,
                                       tensors=[(n, self.tensors[n].size) for n in self.trainable])
            # worker 0 accumulates into flat_g, the others into buffers of their own, summed per step
            self._worker_flat_g = [self.flat_g] + [backend.zeros((self.n_trainable,)) for _ in range(self.n_workers - 1)]
        except MemoryError:
            raise self._does_not_fit(f"its weights, gradients and optimizer state ({self.n_trainable:,} trained values)") from None
        # the activations' arenas are planned before they are allocated: a run they do not fit is refused
        self._arena_budget = available_memory(backend)
        self._train_progs = [self._build_train_program(self._flat_views(g)) for g in self._worker_flat_g]
        # dropout-mask inputs of the training graph (name -> shape), fed per micro-batch
        self._masks = {n: node.shape for n, node in self._train_progs[0].inputs.items() if n.endswith(".dropout")}
        self._budget_float_copies()
        # compiled eval programs by sequence count, one cache per concurrent worker (grown on demand)
        self._eval_caches: list[ProgramCache] = []
        self._pos = backend.asarray(np.arange(n_ctx, dtype=np.int32))
        # each worker's training inputs live in fixed buffers (each pass writes its values into
        # them), so on a backend that replays its program runs as pre-bound kernel calls (planner.Replay)
        self._train_inputs = [self._input_buffers(p) for p in self._train_progs]
        self._replays: list[dict[bool, Replay]] = [{} for _ in self._train_progs]  # by assign mode
        # passes that score fewer rows than the micro-batch holds (its loss-carrying targets, in
        # out_rows' buckets): (worker, rows) -> (program, input buffers, replays by assign),
        # compiled at first use into the worker's arena (the full pass's plan is the largest)
        self._out_passes: dict[tuple[int, int], tuple[Program, dict, dict]] = {}
        # the block each step's micro-batches run in (cpu, one at a time: OpenBLAS's thread count by
        # timing; with packed base products OpenBLAS single-threaded: the compiled products take the
        # cores on their own pool, and OpenBLAS's threads, spinning ~0.1 s after each of the step's
        # small products (attention, LoRA's rank-r ones), would take a core from it)
        self._packed_products = (self.float_copies is not None and self.float_copies.packing()
                                 and self.float_copies.budget > 0 and self.n_workers == 1)
        self._blas_tuner = (functools.partial(blas_threads, 1) if self._packed_products
                            else backend.step_tuner(self.n_workers))
        self._pool = ThreadPoolExecutor(self.n_workers, thread_name_prefix="llmtune-train") if self.n_workers > 1 else None

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
        # run's other memory is planned (_budget_float_copies; the cpu: other backends keep none)
        bound = be.bind(frozen, float_copies=FloatCopies(0, pack=True))
        self.values.update(bound)
        self.float_copies, self._frozen = bound.float_copies, frozen
        gguf = getattr(self.model, "gguf", None)
        if self.trainable and gguf is not None:
            gguf.drop_pages()  # the trained tensors now live in flat_w; frozen ones fault back in
        if self.float_copies is not None and gguf is not None:
            self.float_copies.releases.append(gguf.drop_pages)  # a packed frozen matrix: its pages too

    def _budget_float_copies(self) -> None:
        """Where the compiled product is built: packed copies of every frozen matrix multiplied
        (a stored one's decode, in place of its float copy: FloatCopies.stored_pack), all of
        them or none, since a step with some products packed would run the others on a
        single-threaded OpenBLAS (see __init__). Otherwise the frozen quantized matrices' float32
        copies: as many as fit (qtensor.training_budget), made at their first product; those only
        looked up (a token table) keep none. Float32 passes only (the copies are float32)."""
        self._packed_bytes, self._packed_names = 0, set()
        if self.float_copies is None or np.dtype(self.backend.dtype) != np.float32:
            if self.float_copies is not None:
                self.float_copies.pack = False
            return
        order = self._train_progs[0].order
        multiplied = {n.inputs[1].name for n in order if n.op in ("qlinear", "qlinear_back")}
        quantized = {n: w for n, w in self._frozen.items() if n in multiplied}
        # packed copies for the compiled products (forward and backward) of the frozen matrices
        # multiplied, stored (in place of their float copies) or float32
        weights = {n.inputs[1].name for n in order if n.op in ("qlinear", "matmul")}
        packs = {n: w for n, w in self._frozen.items() if n in weights and (n in quantized or w.dtype == np.float32)}
        packed = sum(self.float_copies.packed_bytes(w.shape) for w in packs.values())
        need, available = sum(self.memory_bytes().values()), available_memory(self.backend)
        packing = self.float_copies.packing() and packed > 0
        budget = training_budget({}, need, available, packed) if packing else 0
        if not packing or budget < packed:  # none, or not all of them: the float copies then, as they fit
            self.float_copies.pack = False
            budget = training_budget(quantized, need, available)
        self.float_copies.budget, self._packed_bytes = budget, packed
        if self.float_copies.pack and self.float_copies.releases:  # once packed, their file pages go back
            self._packed_names = set(packs)

    def base_products(self) -> str:
        """Which product multiplies the frozen matrices: "packed" (the compiled product over their
        packed copies, when all of them fit the memory budget) or "blas" (numpy's, on float32
        weights or copies). The two round differently, so a checkpoint records it (a resume
        with the other says its result may differ)."""
        fc = self.float_copies
        return "packed" if fc is not None and fc.pack and self._packed_bytes and fc.budget >= self._packed_bytes else "blas"

    def _flat_views(self, flat) -> dict:
        """Per-tensor views of a flat buffer laid out in trainable order."""
        views, offset = {}, 0
        for name in self.trainable:
            w = self.tensors[name]
            views[name] = flat[offset : offset + w.size].reshape(w.shape)
            offset += w.size
        return views

    def _bind(self, nodes):
        return {nodes[name]: self.values[name] for name in nodes}

    def _build_graph(self, n_seq: int, **kwargs):
        """The model's graph of n_seq windows, as every training program builds it: round_x=False,
        a quantized base multiplies the activations as they are (QLoRA's dequantized product;
        evaluation keeps llama.cpp's rounding to report its numbers)."""
        return self.model.build(n_seq, self.n_ctx, round_x=False, plain_attention_max=self.backend.plain_attention_max,
                                **kwargs)

    def _build_train_program(self, grad_views: dict, n_out: int | None = None, arena=None) -> Program:
        """A training pass; n_out: only that many rows, picked by the input "out_ids", produce
        logits and loss (targets then [n_out]), planned into `arena` where it fits."""
        batch, nodes, logits = self._build_graph(self.seqs_per_ubatch, trainable=self.trainable,
                                                 lora_dropout=self.lora_dropout, packed=self.packed, n_out=n_out)
        targets = ops.input((logits.shape[0],), "i32", name="targets")
        loss_scale = ops.input((), name="loss_scale")
        loss = ops.cross_entropy(logits, targets)
        correct = ops.count_correct(logits, targets)
        grads = grad(loss, [nodes[n] for n in self.trainable], seed=loss_scale, checkpoint=self.grad_checkpoint)
        # a trainable tensor the loss does not reach keeps a zero gradient (buffers start zeroed)
        sinks = {grads[nodes[n]]: grad_views[n] for n in self.trainable if nodes[n] in grads}
        return self._program([loss, correct], nodes, accumulate=sinks, arena=arena)

    # a micro-batch whose loss-carrying targets fill less of it scores only their rows (rounded up
    # to a multiple of this share of the micro-batch, so a few shapes serve every count)
    OUT_ROW_BUCKETS = 16

    def out_rows(self, n_counted: int, n_rows: int | None = None) -> int:
        """Rows a pass of n_rows (default n_ubatch) computes logits for, given its loss-carrying
        targets: n_counted rounded up to a bucket; n_rows (every row, no selection) when that is
        all of them. Masked data (chat turns, prompts) then skips the vocabulary projection, its
        backward and the cross-entropy of rows that carry no loss, as llama.cpp's inp_out_ids
        skips them."""
        n_rows = self.n_ubatch if n_rows is None else n_rows
        step = max(8, -(-n_rows // self.OUT_ROW_BUCKETS))
        return min(n_rows, max(step, -(-n_counted // step) * step))

    def _pass(self, w: int, n_out: int | None = None) -> tuple[Program, dict, dict]:
        """Worker w's training pass scoring n_out rows (None or n_ubatch: every row, the pass
        built at setup; fewer: compiled at first use, in the worker's arena) as (program, input
        buffers, replays by assign mode)."""
        if n_out is None or n_out == self.n_ubatch:
            return self._train_progs[w], self._train_inputs[w], self._replays[w]
        entry = self._out_passes.get((w, n_out))
        if entry is None:
            prog = self._build_train_program(self._flat_views(self._worker_flat_g[w]), n_out,
                                             arena=self._train_progs[w].arena)
            entry = self._out_passes[(w, n_out)] = (prog, self._input_buffers(prog), {})
        return entry

    def _input_buffers(self, prog: Program) -> dict:
        """One backend array per input of a training program (positions: the shared, fixed ones)."""
        be = self.backend
        return {name: self._pos if name == "pos" and not self.packed else be.zeros(node.shape, np.int32 if node.dtype == "i32" else None)
                for name, node in prog.inputs.items()}

    def _run_train(self, w: int, assign: bool, n_out: int | None = None) -> list:
        """Worker w's training program (n_out: its pass scoring that many rows) on its input
        buffers: replayed where the backend replays (the cpu, where Python work per kernel is a
        visible part of a small model's step)."""
        prog, feed, replays = self._pass(w, n_out)
        if not self.backend.replays:
            return prog.run(assign=assign, **feed)
        replay = replays.get(assign)
        if replay is None:
            replay = replays[assign] = Replay(prog, feed, assign=assign)
        return replay.run()

    def _make_eval_program(self, n_seq: int, n_out: int | None = None, arena=None) -> Program:
        """A validation pass of n_seq windows; n_out: only that many rows (input "out_ids")
        produce logits, planned into `arena` where it fits."""
        batch, nodes, logits = self._build_graph(n_seq, packed=self.packed, n_out=n_out)
        targets = ops.input((logits.shape[0],), "i32", name="targets")
        outs = [ops.cross_entropy(logits, targets), ops.count_correct(logits, targets)]
        return self._program(outs, nodes, arena=arena)

    def _eval_cache(self) -> ProgramCache:
        """One worker's validation programs by (windows, scored rows); a pass scoring fewer rows
        than it holds shares the arena of the pass scoring all of them."""
        cache = ProgramCache(None)

        def make(key):
            n_seq, n_out = key
            if n_out == n_seq * self.n_ctx:
                return self._make_eval_program(n_seq)
            return self._make_eval_program(n_seq, n_out, arena=cache.get((n_seq, n_seq * self.n_ctx)).arena)

        cache.make = make
        return cache

    def _program(self, outputs, nodes, accumulate=None, arena=None) -> Program:
        """A compiled program whose arena must fit what is left of the memory budget (or `arena`,
        another program's, which it then shares)."""
        try:
            prog = Program(outputs, self.backend, params=self._bind(nodes), accumulate=accumulate,
                           max_bytes=self._arena_budget, arena=arena)
        except ArenaTooLarge as exc:
            raise self._does_not_fit(f"{exc.needed / 2**20:,.0f} MiB of activations for one pass of "
                                     f"{self.n_ubatch:,} tokens", exc.limit) from None
        except MemoryError:
            raise self._does_not_fit(f"the activations of one pass of {self.n_ubatch:,} tokens") from None
        if self._arena_budget is not None and prog.owns_arena:
            self._arena_budget -= prog.memory.planned_bytes
        return prog

    def _does_not_fit(self, what: str, available: int | None = None) -> LlmtuneError:
        """The one-line refusal of a run whose memory cannot be had."""
        available = available_memory(self.backend) if available is None else available
        have = f"; {available / 2**20:,.0f} MiB is available" if available is not None else ""
        return LlmtuneError(f"{self.model.path}: the run does not fit in memory: it needs {what}{have} (lower --ubatch "
                            f"or --ctx, use --grad-checkpoint, or train fewer tensors with --params or LoRA)")

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> dict[str, int]:
        """Bytes by part: the base weights (frozen or trained), the adapters (LoRA), gradients
        (one buffer per worker), optimizer state, activations (the planned arenas) and, with
        LoRA dropout, the masks fed per micro-batch; DoRA, the merged matrices its output is written from."""
        itemsize = np.dtype(self.backend.dtype).itemsize
        n_base = sum(w.size for w in self.model.weights.values())
        memory = {"base": sum(self.base_types().values())}
        if self.model.adapters:
            memory["adapters"] = (sum(w.size for w in self.tensors.values()) - n_base) * itemsize
        memory.update({
            "gradients": self.n_trainable * itemsize * self.n_workers,
            "optimizer": self.optimizer.state_bytes,
            "activations": sum(p.memory.planned_bytes for p in self._train_progs),
        })
        if self._masks:
            memory["dropout masks"] = sum(int(np.prod(s)) for s in self._masks.values()) * itemsize * self.n_workers
        copies = self.float_copies
        if copies is not None and copies.budget:  # at most: they are made while they fit it
            packed = self._packed_bytes if copies.pack else 0  # all or none: within the budget whole
            if copies.budget > packed:
                memory["float copies"] = copies.budget - packed
            if packed:
                memory["packed copies"] = packed
        if self.model.adapters and self.model.adapters[0].magnitudes:  # DoRA's output: its merged matrices, F32
            memory["merged output"] = sum(self.model.weights[n].size for n in self.model.adapters[0].pairs) * 4
        return memory

    def base_types(self) -> dict[str, int]:
        """Bytes of the base weights by how they are held: frozen matrices in their file type
        ("Q4_K", "F16", ...), everything else (trained or float) in the backend's float type;
        not those multiplied through packed copies, whose file pages are given back once packed
        (they are the estimate's "packed copies")."""
        itemsize = np.dtype(self.backend.dtype).itemsize
        trained, packed = set(self.trainable), self._packed_names  # (_budget_float_copies runs first)
        out: dict[str, int] = {}
        for name in self.model.weights:  # adapters' tensors are not the base
            if name in packed:
                continue
            w = self.tensors[name]
            if isinstance(w, QTensor) and name not in trained:
                key, nbytes = w.qtype, w.nbytes
            else:
                key, nbytes = ("F32" if itemsize == 4 else "F64"), w.size * itemsize
            out[key] = out.get(key, 0) + nbytes
        return out

    # ------------------------------------------------------------------ steps
    def _feed(self, inputs: np.ndarray, targets: np.ndarray, seqs: range | None = None, segments=None,
              n_out: int | None = None) -> dict:
        """Inputs of one pass; `seqs` (training passes): the micro-batch's sequence indices within
        the step, which pick its dropout masks; `segments` (packed windows): their positions and
        masks; n_out (a pass scoring fewer rows, out_rows): the rows whose targets carry loss,
        padded with the last row and target -1 (no loss, no gradient) to n_out."""
        be = self.backend
        flat = np.ascontiguousarray(targets, dtype=np.int32).reshape(-1)
        feed = {"tokens": be.asarray(np.ascontiguousarray(inputs, dtype=np.int32)), "pos": self._pos}
        if n_out is not None and n_out < flat.size:
            rows = np.full(n_out, flat.size - 1, dtype=np.int32)
            counted = np.flatnonzero(flat >= 0)
            rows[: counted.size] = counted
            picked = np.full(n_out, -1, dtype=np.int32)
            picked[: counted.size] = flat[counted]
            feed["out_ids"], flat = be.asarray(rows), picked
        feed["targets"] = be.asarray(flat)
        if self.packed:
            if segments is None:
                raise ValueError("a packed trainer's passes need the windows' segments")
            for name, value in self._layout_inputs(segments).items():  # masks in the backend's float type
                feed[name] = be.asarray(value if value.dtype == np.int32 else value.astype(be.dtype, copy=False))
        if seqs is not None and self._masks:
            from llmtune.model.adapter import dropout_masks

            masks = dropout_masks(self._masks, self.lora_dropout, self.seed, self.steps_done, seqs)
            feed.update({n: be.asarray(m.astype(be.dtype, copy=False)) for n, m in masks.items()})
        return feed

    def _layout_inputs(self, segments) -> dict:
        """Positions and masks of packed windows (a subclass lays its windows out otherwise)."""
        from llmtune.arch.packing import packing_inputs

        return packing_inputs(self.model.hp, segments)

    def train_step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, stats: RunningStats,
                   segments: np.ndarray | None = None) -> float:
        """One optimizer step over n_batch tokens (inputs/targets: [n_batch/n_ctx, n_ctx]; packed:
        segments of the same shape). Returns the step's mean loss."""
        be = self.backend
        k, n_ub, n_w = self.seqs_per_ubatch, self.ubatches_per_step, self.n_workers
        # tokens carrying loss per micro-batch (a target of -1, a masked prompt or padding token,
        # carries none): each pass's mean is weighted by its share of the step's tokens, so the
        # step's loss and gradient are the mean over all of them (1 / n_ub each without masking)
        counts = (np.asarray(targets).reshape(n_ub, -1) >= 0).sum(axis=1)
        total = max(int(counts.sum()), 1)
        scales = [be.asarray(np.asarray(c / total, dtype=be.dtype)) for c in counts]
        results: list = [None] * n_ub

        def work(w: int) -> None:  # worker w takes this rank's micro-batches w, w + n_w, ...
            for j, u in enumerate(self.my_ubatches[w::n_w]):
                part = slice(u * k, (u + 1) * k)
                n_out = self.out_rows(int(counts[u]))
                feed = self._feed(inputs[part], targets[part], range(u * k, (u + 1) * k),
                                  None if segments is None else segments[part], n_out)
                feed["loss_scale"] = scales[u]
                bufs = self._pass(w, n_out)[1]
                for name, value in feed.items():
                    if bufs[name] is not value:
                        bufs[name][...] = value
                # a worker's first pass assigns its gradients, later ones add to them
                loss, correct = self._run_train(w, assign=j == 0, n_out=n_out)
                results[u] = (float(be.to_numpy(loss)), int(be.to_numpy(correct)))

        if n_w == 1:
            with self._blas_tuner():
                work(0)
        else:
            with blas_threads(1, compiled=True):
                list(self._pool.map(work, range(n_w)))
            for extra in self._worker_flat_g[1:]:
                be.accumulate(self.flat_g, extra)
        if self.comm.size > 1:
            results = self._reduce_step(results)
        if (counts == counts[0]).all():
            loss = float(np.mean([r[0] for r in results]))
        else:  # masked targets: the mean over the step's loss-carrying tokens
            loss = float(sum(r[0] * c for r, c in zip(results, counts)) / total)
        sum_squares = self._check_step(loss)  # before the update: a bad step leaves the weights as they were
        for (loss_v, correct), c in zip(results, counts):
            stats.add(loss_v, correct, int(c))
        self.grad_norm = self.clip_gradients(sum_squares)
        self.optimizer.step(self.flat_w, self.flat_g, lr)
        self.steps_done += 1
        return loss

    def clip_gradients(self, sum_squares: float | None = None) -> float:
        """The global L2 norm of the step's gradient (accumulated over the micro-batches and, under
        data parallel, all-reduced: every rank sees the same) before clipping; with grad_clip > 0
        the gradient is then scaled as torch.nn.utils.clip_grad_norm_ scales it, by
        grad_clip / (norm + 1e-6) when that is below 1. sum_squares: the gradient's, when the
        caller has it already (_check_step: one read of the buffer for both)."""
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
        core at once on the cpu); packed windows with their segments."""
        k = self.seqs_per_ubatch
        starts = list(range(0, len(inputs), k))
        n_w = self.backend.workers(self._requested_workers, len(starts))

        def score(progs: ProgramCache, start: int):
            x, y = inputs[start : start + k], targets[start : start + k]
            seg = None if segments is None else segments[start : start + k]
            n_counted = int((y >= 0).sum())
            n_out = self.out_rows(n_counted, y.size)  # the loss-carrying rows only, as a training pass
            loss, correct = progs.get((len(x), n_out)).run(**self._feed(x, y, segments=seg, n_out=n_out))
            return float(self.backend.to_numpy(loss)), int(self.backend.to_numpy(correct)), n_counted

        self._eval_caches += [self._eval_cache() for _ in range(n_w - len(self._eval_caches))]
        caches: queue.SimpleQueue = queue.SimpleQueue()  # each worker takes its own cache
        for cache in self._eval_caches[:n_w]:
            caches.put(cache)
        for loss_v, correct, n in run_split(score, caches.get, starts, n_w, self.comm):  # passes split across ranks
            stats.add(loss_v, correct, n)

    def trained_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of the trainable tensors."""
        return {n: np.asarray(self.backend.to_numpy(self.values[n]), dtype=np.float32) for n in self.trainable}

    # ------------------------------------------------------------------ divergence guard
    def _check_step(self, loss: float) -> float:
        """Raise Diverged for a loss or gradient that is not finite, or a loss above max_loss;
        else return the gradient's sum of squares (its norm, squared: the same read tells both)."""
        step = self.steps_done + 1
        sum_squares = self.backend.sum_squares(self.flat_g) if self.n_trainable else 0.0
        bad = [] if math.isfinite(sum_squares) else self.nonfinite(self.flat_g)
        if not math.isfinite(loss) or bad:
            what = f"the loss is {loss}" if not math.isfinite(loss) else f"the loss is {loss:.4g}"
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                what += f"; the gradient of {bad[0]}{more} is not finite"
            raise Diverged(step, what)
        if loss > self.max_loss:
            name, rms = self.largest_gradient()
            raise Diverged(step, f"the loss is {loss:.6g}, above the divergence limit {self.max_loss:.4g}; "
                                 f"largest gradient: {name} (rms {rms:.3g})")
        return sum_squares

    def check_finite(self, step: int) -> None:
        """Raise Diverged when a trained weight is no longer finite (before a checkpoint or the
        output is written from them)."""
        bad = self.nonfinite(self.flat_w)
        if bad:
            raise Diverged(step, f"the weights of {bad[0]} are no longer finite")

    def nonfinite(self, flat) -> list[str]:
        """Trainable tensors (in file order) whose part of `flat` (flat_w or flat_g) holds NaN or
        inf. One reduction when all is well; per tensor only when the sum is not finite."""
        if self.n_trainable == 0 or math.isfinite(float(self.backend.to_numpy(flat.sum()))):
            return []
        return [name for name, view in self._flat_views(flat).items()
                if not np.isfinite(self.backend.to_numpy(view)).all()]

    def largest_gradient(self) -> tuple[str, float]:
        """The trainable tensor with the largest gradient (root mean square) in flat_g."""
        rms = {name: float(np.sqrt(np.mean(np.square(self.backend.to_numpy(v), dtype=np.float64))))
               for name, v in self._flat_views(self.flat_g).items()}
        name = max(rms, key=rms.get) if rms else "-"
        return name, rms.get(name, 0.0)

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
        self.flat_w[...] = self.backend.asarray(np.asarray(src, dtype=np.float32).astype(self.backend.dtype, copy=False))
        self.optimizer.load_state(arrays)
        self.optimizer.t = self.steps_done = steps_done
