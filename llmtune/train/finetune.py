"""`llmtune.finetune(...)`: the library call behind `llmtune finetune`."""

from __future__ import annotations

import collections
import json
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.backends import get_backend
from llmtune.errors import Interrupted, LlmtuneError, TrainingStopped
from llmtune.gguf.file import check_output_path, write_gguf
from llmtune.model.loaded import Model, load_model
from llmtune.resources import available_memory, check_disk_space, check_writable_folder, process_rss
from llmtune.train import checkpoint as ckpts
from llmtune.train.config import FinetuneConfig, make_config, resume_config
from llmtune.train.chat import build_dataset, data_info
from llmtune.train.data import WindowDataset
from llmtune.train.optim import LRSchedule
from llmtune.train.signals import StopRequest, signal_name
from llmtune.train.trainer import Diverged, RunningStats, Trainer
from llmtune.backends.dist import world
from llmtune.train.distributed import agree_ranks

DIVERGENCE_FACTOR = 10.0  # a step's loss above 10 x ln(n_vocab) (uniform guessing scores 1 x) stops the run
SPIKE_FACTOR, SPIKE_GAP, SPIKE_WINDOW = 3.0, 2.0, 20  # a loss 3 x (and 2 nats) above the mean of the last 20 steps warns


@dataclass
class EpochResult:
    epoch: int
    train_loss: float
    train_loss_err: float
    train_accuracy: float
    train_accuracy_err: float
    val_loss: float = float("nan")
    val_loss_err: float = float("nan")
    val_accuracy: float = float("nan")
    val_accuracy_err: float = float("nan")
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    bench_accuracy: float = float("nan")  # --eval-benchmark: accuracy with the weights at the epoch's end
    bench_accuracy_err: float = float("nan")


@dataclass
class FinetuneResult:
    output: Path
    config: FinetuneConfig
    epochs: list[EpochResult] = field(default_factory=list)
    first_loss: float = float("nan")
    n_tokens: int = 0
    n_train_windows: int = 0
    n_val_windows: int = 0
    memory: dict = field(default_factory=dict)
    bench_before: float = float("nan")  # --eval-benchmark: accuracy of the model before training


Callback = Callable[[str, dict], None]


def _encode_for_output(model: Model, trained: dict[str, np.ndarray]):
    """Every tensor of the input file in its order: trained ones re-encoded in their original
    type, untouched ones copied byte for byte."""
    from llmtune.quant import blocks as quants

    for name, info in model.gguf.tensors.items():
        if name in trained:
            try:
                data = quants.quantize(trained[name], info.type)
            except (NotImplementedError, ValueError) as exc:
                raise LlmtuneError(f"{model.path}: cannot re-encode {name} as {info.type.name} ({exc})") from None
            yield name, data, info.type
        else:
            yield name, np.asarray(info.raw), info.type


class _MetricsLog:
    """--metrics: one JSON record per line (NaN written as null, which JSON has), flushed as it goes.

    A file that fails (disk full, removed folder) is reported once through `warn` and dropped: it
    never costs the run or its model. `keep_lines` (a resumed run): the file's first lines, those
    written up to the checkpoint, stay and the rest are replaced. `lines`: records in the file."""

    def __init__(self, path: Optional[str], warn: Callable[[str], None], keep_lines: Optional[int] = None):
        self.path, self.warn, self.fh, self.lines = path, warn, None, 0
        if not path:
            return
        try:
            kept = []
            if keep_lines is not None and os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    kept = [line for _, line in zip(range(keep_lines), fh)]
            self.fh = open(path, "w", encoding="utf-8")
            self.fh.writelines(kept)
            self.lines = len(kept)
        except (OSError, UnicodeDecodeError) as exc:
            self._fail(exc)

    def __enter__(self) -> "_MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.fh:
            try:
                self.fh.close()
            except OSError as err:
                self.fh = None
                self._fail(err)

    def _fail(self, exc: Exception) -> None:
        self.warn(f"--metrics {self.path}: cannot write ({getattr(exc, 'strerror', None) or exc}); "
                  f"training goes on without it")
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass
        self.fh = None

    def write(self, record: dict) -> None:
        if self.fh:
            clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}
            try:
                self.fh.write(json.dumps(clean) + "\n")
                self.fh.flush()
                self.lines += 1
            except OSError as exc:
                self._fail(exc)


class _LossWatch:
    """Warns (once per excursion) when a step's loss is far above its running average: more than
    SPIKE_FACTOR times the mean of the last SPIKE_WINDOW steps and SPIKE_GAP nats above it."""

    def __init__(self):
        self.recent: collections.deque = collections.deque(maxlen=SPIKE_WINDOW)
        self.high = False

    def check(self, loss: float) -> Optional[str]:
        message = None
        if len(self.recent) >= 5:
            avg = sum(self.recent) / len(self.recent)
            spike = loss > SPIKE_FACTOR * avg and loss > avg + SPIKE_GAP
            if spike and not self.high:
                message = (f"the loss {loss:.4f} is {loss / avg:.1f} x its running average {avg:.4f} "
                           f"(is the learning rate too high?)")
            self.high = spike
        self.recent.append(loss)
        return message


def _lora_info(model: Model) -> Optional[dict]:
    """What the "start" event says about the adapter being trained (None for a full finetune)."""
    if not model.adapters:
        return None
    a = model.adapters[0]
    return {"rank": sorted(a.ranks), "alpha": a.alpha, "n_targets": len(a.pairs), "init": str(a.path) if a.path else None}


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


@dataclass
class _Run:
    """A finetune run once every check has passed, trained as llama_opt_epoch does: each epoch
    one optimizer step per batch of shuffled training windows, then a validation pass.

    Its position (step, epoch, epoch_step, the epoch's window order and running statistics) is
    what a checkpoint stores beside the trainer's buffers; restore() continues from one exactly."""

    cfg: FinetuneConfig
    dataset: WindowDataset
    trainer: Trainer
    schedule: LRSchedule
    steps_per_epoch: int
    result: FinetuneResult
    inputs: dict = field(default_factory=dict)  # "model", "data" (and "lora_init") -> path
    run_id: str = ""  # the same across resumes: which checkpoints are this run's
    step: int = 0  # optimizer steps done, over all epochs
    epoch: int = 0  # the epoch in progress (0-based; == epochs when training is done)
    epoch_step: int = 0  # steps done in it
    order: Optional[np.ndarray] = None  # its window order
    stats: RunningStats = field(default_factory=RunningStats)
    last_checkpoint: Optional[Path] = None
    watch: _LossWatch = field(default_factory=_LossWatch)
    _fingerprint: Optional[dict] = None
    _epoch_time: tuple = (0.0, 0)  # seconds and tokens trained in this epoch by this process
    benchmark: object = None  # --eval-benchmark's tasks, tokenized once (eval/benchmarks.py Benchmark)
    sampler: object = None  # --sample-prompt's generator on the live weights (eval/generate.py), made when first used

    def start_info(self) -> dict:
        """The "start" event: what will train, on what, and the memory it takes."""
        tr, ds, res = self.trainer, self.dataset, self.result
        return {"config": self.cfg, "memory": res.memory, "n_tokens": res.n_tokens, "n_train": ds.n_train,
                "n_val": ds.n_val, "steps_per_epoch": self.steps_per_epoch, "n_trainable": tr.n_trainable,
                "n_params": tr.model.n_params(), "trainable": tr.trainable, "backend": tr.backend.name,
                "lora": _lora_info(tr.model), "step": self.step, "base_types": tr.base_types(),
                "data": data_info(ds, self.steps_per_epoch * (self.cfg.batch // self.cfg.ctx))}

    # ------------------------------------------------------------------ training
    def train(self, emit: Callback, log: _MetricsLog, stop: StopRequest) -> None:
        """Every epoch from the current position, each step and epoch reported to `emit` (the CLI)
        and `log` (--metrics); a checkpoint at each epoch end and every cfg.checkpoint_every steps.
        A stop request (signal) ends the run after the current step with a checkpoint (Interrupted)."""
        if self.benchmark is not None and self.step == 0:  # --eval-benchmark's baseline
            res = self._score_benchmark(log, 0)
            self.result.bench_before = res.accuracy
            emit("benchmark", {"epoch": 0, "kind": res.kind, "accuracy": res.accuracy, "accuracy_err": res.accuracy_err,
                               "n_tasks": res.n_tasks})
        while self.epoch < self.cfg.epochs:
            self._train_epoch(emit, log, stop)
            er = self._end_epoch(log)
            emit("epoch", asdict(er))
            if self.cfg.sample_prompt is not None and not self.cfg.sample_every:
                self._sample(emit)
            self.epoch, self.epoch_step, self.stats = self.epoch + 1, 0, RunningStats()
            self.order = self._order(self.epoch)
            saved = self.save_checkpoint(emit, log)
            if self.trainer.comm.any(stop.requested, "a stop request"):  # every rank stops at the same step
                raise self._stopped(stop.signum, saved)

    def _order(self, epoch: int) -> Optional[np.ndarray]:
        if epoch >= self.cfg.epochs:
            return None
        return self.dataset.train_order(epoch, self.cfg.seed, self.cfg.shuffle)

    def _train_epoch(self, emit: Callback, log: _MetricsLog, stop: StopRequest) -> None:
        if self.order is None:
            self.order = self._order(self.epoch)
        # tokens/s counts the tokens run (batch per step), padding and masked prompts included
        t0, first, every = time.perf_counter(), self.epoch_step, self.cfg.checkpoint_every
        for s in range(self.epoch_step, self.steps_per_epoch):
            info = self._train_step(self.epoch, s, self.order, self.stats)
            self.epoch_step = s + 1
            elapsed = time.perf_counter() - t0
            info["tokens_per_s"] = _per_second((s + 1 - first) * self.cfg.batch, elapsed)
            log.write({"type": "train_step", **info, "elapsed_s": elapsed})
            emit("step", info)
            if self.cfg.sample_every and self.step % self.cfg.sample_every == 0:
                self._sample(emit)
            spike = self.watch.check(info["loss"])
            if spike:
                emit("warning", {"message": f"step {self.step}: {spike}"})
            if s + 1 < self.steps_per_epoch:  # the epoch's last step checkpoints after validation
                if self.trainer.comm.any(stop.requested, "a stop request"):  # every rank stops at the same step
                    raise self._stopped(stop.signum, self.save_checkpoint(emit, log))
                if every and self.step % every == 0:
                    self.save_checkpoint(emit, log)
        self._epoch_time = (time.perf_counter() - t0, (self.steps_per_epoch - first) * self.cfg.batch)

    def _end_epoch(self, log: _MetricsLog) -> EpochResult:
        stats, (seconds, tokens) = self.stats, self._epoch_time
        er = EpochResult(self.epoch + 1, stats.loss, stats.loss_err, stats.accuracy, stats.accuracy_err,
                         tokens_per_s=_per_second(tokens, seconds), seconds=seconds)
        if self.dataset.n_val:
            self._validate(er, log)
        if self.benchmark is not None:
            res = self._score_benchmark(log, er.epoch)
            er.bench_accuracy, er.bench_accuracy_err = res.accuracy, res.accuracy_err
        self.result.epochs.append(er)
        log.write({"type": "epoch", **asdict(er)})
        return er

    def _train_step(self, epoch: int, s: int, order: np.ndarray, stats: RunningStats) -> dict:
        """Optimizer step `s` of the epoch over the next batch of windows in `order`."""
        lr = self.schedule.lr(epoch + s / self.steps_per_epoch, self.step)
        seqs = self.cfg.batch // self.cfg.ctx
        x, y, *segments = self.dataset.gather(order[s * seqs : (s + 1) * seqs])  # packed: + segments
        with np.errstate(over="ignore", invalid="ignore"):  # a diverging step is reported by the guard, not by numpy
            loss = self.trainer.train_step(x, y, lr, stats, *segments)
        if self.step == 0:
            self.result.first_loss = loss
        self.step += 1
        return {"epoch": epoch + 1, "step": s + 1, "steps": self.steps_per_epoch, "global_step": self.step,
                "loss": loss, "running_loss": stats.loss, "accuracy": stats.accuracy, "lr": lr}

    def _sample(self, emit: Callback) -> None:
        """--sample-prompt: a short greedy continuation with the weights as they are now."""
        if not self.trainer.comm.is_root:
            return
        if self.sampler is None:
            from llmtune.eval.generate import TrainingSampler

            self.sampler = TrainingSampler(self.trainer, self.cfg.sample_prompt, getattr(self.dataset, "template", None))
        emit("sample", {"epoch": self.epoch + 1, "global_step": self.step, "prompt": self.cfg.sample_prompt,
                        "chat": getattr(self.dataset, "template", None) is not None, "text": self.sampler.sample()})

    def _validate(self, er: EpochResult, log: _MetricsLog) -> None:
        """Loss and accuracy over the held-out windows, into `er` and the log."""
        val = RunningStats()
        x, y, *segments = self.dataset.gather(self.dataset.val_indices())  # packed: + segments
        self.trainer.evaluate(x, y, val, *segments)
        er.val_loss, er.val_loss_err, er.val_accuracy, er.val_accuracy_err = val.loss, val.loss_err, val.accuracy, val.accuracy_err
        log.write({"type": "validation", "epoch": er.epoch, "global_step": self.step, "loss": val.loss,
                   "loss_err": val.loss_err, "accuracy": val.accuracy, "accuracy_err": val.accuracy_err})

    def _score_benchmark(self, log: _MetricsLog, epoch: int):
        """--eval-benchmark: the benchmark scored with the weights as they are now."""
        from llmtune.eval.benchmarks import score_benchmark

        res = score_benchmark(_current_model(self.trainer), self.benchmark, backend=self.trainer.backend)
        log.write({"type": "benchmark", "epoch": epoch, "global_step": self.step, "kind": res.kind,
                   "accuracy": res.accuracy, "accuracy_err": res.accuracy_err, "n_tasks": res.n_tasks})
        return res

    def _where(self) -> str:
        if self.epoch >= self.cfg.epochs:
            return f"all {self.cfg.epochs} epochs done"
        return f"epoch {self.epoch + 1}, {self.epoch_step} of {self.steps_per_epoch} steps done"

    # ------------------------------------------------------------------ checkpoints
    @property
    def fingerprint(self) -> dict:
        """sha256 of the inputs and of the weight-shaping settings (computed once, when first needed)."""
        if self._fingerprint is None:
            fp = {key: ckpts.file_sha256(path) for key, path in self.inputs.items()}
            self._fingerprint = {**fp, "settings": ckpts.settings_sha256(self.cfg)}
        return self._fingerprint

    def save_checkpoint(self, emit: Callback, log: _MetricsLog) -> Optional[Path]:
        """Write the current position atomically and drop this run's older checkpoints beyond
        --keep-checkpoints. A failed write warns and training goes on (the last one stays)."""
        bad = self.trainer.nonfinite(self.trainer.flat_w)
        if bad:  # never a NaN checkpoint: the step that did this stops the run
            raise Diverged(self.step, f"the weights of {bad[0]} are no longer finite")
        tr, res = self.trainer, self.result
        if not tr.comm.is_root:  # rank 0 alone writes checkpoints (every rank holds the same state)
            return None
        meta = {
            "step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step, "steps_per_epoch": self.steps_per_epoch,
            "config": asdict(self.cfg), "fingerprint": self.fingerprint, "run_id": self.run_id,
            "inputs": {k: str(v) for k, v in self.inputs.items()}, "output": str(res.output),
            "trainable": tr.trainable, "n_trainable": tr.n_trainable, "workers": tr.n_workers, "ranks": tr.comm.size,
            "backend": tr.backend.name, "optimizer": {"kind": tr.optimizer.kind, "t": tr.optimizer.t},
            "rng": {"order": "numpy default_rng([seed, epoch])", "dropout": "(seed, step)", "seed": self.cfg.seed},
            "stats": {"losses": self.stats.losses, "correct": self.stats.correct, "tokens": self.stats.tokens},
            "first_loss": res.first_loss, "epochs": [asdict(e) for e in res.epochs], "metrics_lines": log.lines,
        }
        order = np.zeros(0, np.int64) if self.order is None else np.asarray(self.order, dtype=np.int64)
        path = ckpts.checkpoint_path(res.output, self.step)
        try:
            ckpts.write_checkpoint(path, {**tr.state_arrays(), "order": order}, meta)
        except LlmtuneError as exc:
            emit("warning", {"message": f"{exc}; training goes on"
                                        + (f" (the last checkpoint is {self.last_checkpoint})" if self.last_checkpoint else "")})
            return None
        self.last_checkpoint = path
        self._remove_checkpoints(keep=self.cfg.keep_checkpoints or 1)
        emit("checkpoint", {"path": str(path), "step": self.step, "where": self._where()})
        return path

    def _lineage(self) -> list[Path]:
        """This run's checkpoints beside the output (same run id), oldest first."""
        mine = []
        for _, path in ckpts.checkpoints_of(self.result.output):
            try:
                if ckpts.read_meta(path).get("run_id") == self.run_id:
                    mine.append(path)
            except Exception:  # noqa: BLE001 - someone else's or a damaged file: not ours to touch
                continue
        return mine

    def _remove_checkpoints(self, keep: int = 0) -> None:
        mine = self._lineage()
        for path in mine[: max(len(mine) - keep, 0)]:
            try:
                path.unlink()
            except OSError:
                pass

    def restore(self, ckpt: "ckpts.Checkpoint", emit: Callback) -> None:
        """Continue from `ckpt` after checking it belongs to these inputs and settings."""
        meta, where = ckpt.meta, f"--resume {ckpt.path}"
        names = {"model": f"the model {self.inputs['model']}", "data": f"the data {self.inputs['data']}",
                 "lora_init": f"--lora-init {self.inputs.get('lora_init')}", "settings": "the run's settings"}
        ckpts.check_fingerprint(ckpt, self.fingerprint, names)
        if meta["trainable"] != self.trainer.trainable or meta["steps_per_epoch"] != self.steps_per_epoch:
            raise LlmtuneError(f"{where}: the checkpoint trains other tensors or steps than this run")
        order = ckpt.arrays["order"]
        if meta["epoch"] < self.cfg.epochs and sorted(order.tolist()) != list(range(self.dataset.n_train)):
            raise LlmtuneError(f"{where}: damaged checkpoint (its window order does not fit the data)")
        try:
            self.trainer.load_state(ckpt.arrays, meta["step"])
        except LlmtuneError as exc:
            raise LlmtuneError(f"{where}: {exc}") from None
        self.step, self.epoch, self.epoch_step = meta["step"], meta["epoch"], meta["epoch_step"]
        self.order = order.astype(np.int64) if meta["epoch"] < self.cfg.epochs else None
        st = meta.get("stats") or {}
        self.stats = RunningStats(list(st.get("losses", [])), int(st.get("correct", 0)), int(st.get("tokens", 0)))
        self.result.first_loss = meta.get("first_loss", math.nan)
        self.result.epochs = [EpochResult(**e) for e in meta.get("epochs", [])]
        self.run_id, self.last_checkpoint = meta.get("run_id") or uuid.uuid4().hex, ckpt.path
        ranks, now = meta.get("ranks", 1), self.trainer.comm.size  # a checkpoint resumes on any number of ranks
        if meta.get("workers") != self.trainer.n_workers or meta.get("backend") != self.trainer.backend.name or ranks != now:
            emit("warning", {"message": f"{where}: written on {meta.get('backend')} with {meta.get('workers')} worker(s) x {ranks} rank(s), "
                                        f"continued on {self.trainer.backend.name} with {self.trainer.n_workers} x {now}: the result "
                                        f"may differ from an uninterrupted run in float rounding"})
        emit("resumed", {"path": str(ckpt.path), "step": self.step, "where": self._where()})

    # ------------------------------------------------------------------ ending
    def _stopped(self, signum: int, saved: Optional[Path]) -> Interrupted:
        head = f"{signal_name(signum)}: stopped after step {self.step} ({self._where()})"
        if saved is not None:
            return Interrupted(signum, f"{head}; checkpoint written to {saved}", saved)
        tail = f"; the last one is {self.last_checkpoint}" if self.last_checkpoint else ""
        return Interrupted(signum, f"{head}, but no checkpoint could be written{tail}", self.last_checkpoint)

    def diverged(self, exc: Diverged) -> TrainingStopped:
        msg = f"training diverged at {exc} ({self._where()}); no model written (lower --lr?)"
        if self.last_checkpoint is not None:
            msg += f"; the last good checkpoint is {self.last_checkpoint}"
        return TrainingStopped(msg, self.last_checkpoint)

    def write_output(self, emit: Callback) -> None:
        """The trained model (LoRA: the adapter); then, unless --keep-checkpoints, this run's
        checkpoints go (the model holds the weights). A failed write keeps them and says so."""
        out = self.result.output
        bad = self.trainer.nonfinite(self.trainer.flat_w)
        if bad:
            raise self.diverged(Diverged(self.step, f"the weights of {bad[0]} are no longer finite"))
        if not self.trainer.comm.is_root:  # rank 0 alone writes the model
            return
        try:
            _write_output(self.trainer, out, inputs=list(self.inputs.values()))
        except LlmtuneError as exc:
            if self.last_checkpoint is None:
                raise
            raise TrainingStopped(f"{exc}; training up to step {self.step} is kept in {self.last_checkpoint}: "
                                  f"free some space and resume it to write the model", self.last_checkpoint,
                                  resumable=True) from None
        emit("saved", {"path": str(out), "bytes": os.path.getsize(out)})
        if self.cfg.keep_checkpoints is None:
            self._remove_checkpoints()


def finetune(model_path, data_path, out_path, *, config_file=None, callback: Optional[Callback] = None,
             resume=None, **settings) -> FinetuneResult:
    """Train `model_path` on `data_path` and write the result to `out_path` (llama.cpp's
    examples/training/finetune.cpp, with validation, batching and schedules as flags).

    settings: any FinetuneConfig field (ctx, batch, ubatch, epochs, lr, lr_min, decay_epochs,
    warmup, wd, optimizer, val_split, params, seed, shuffle, backend, precision, grad_checkpoint, metrics, lora_rank,
    lora_alpha, lora_targets, lora_dropout, lora_init, checkpoint_every, keep_checkpoints); None
    means "take it from config_file or the default". callback(event, info) receives "start",
    "step", "epoch", "checkpoint", "warning", "stopping", "resumed", "benchmark" and "saved" events (the CLI
    renders them).

    LoRA (lora_rank or lora_init): the base stays frozen, only the adapter's A/B train, and
    `out_path` receives llama.cpp's adapter GGUF (load it with llama.cpp's --lora).

    Checkpoints (train/checkpoint.py) go beside `out_path` at every epoch end and every
    checkpoint_every steps; `resume` (a checkpoint path) continues one with its own settings and
    writes the same bytes an uninterrupted run would. SIGINT/SIGTERM (main thread) finish the
    current step, write a checkpoint and raise Interrupted; a second signal aborts at once. A
    non-finite or runaway loss raises TrainingStopped before the step's update; no model is written."""
    emit = callback or (lambda event, info: None)

    def setup():
        ckpt = ckpts.read_checkpoint(resume) if resume is not None else None
        if ckpt is None:
            cfg = make_config(config_file, **settings)
        else:
            cfg = resume_config(ckpt.meta["config"], ckpt.path, config_file, **settings)
        return ckpt, cfg, _prepare(model_path, data_path, out_path, cfg, ckpt, emit)

    # under an MPI launcher (backends/dist.py) every rank sets up; an error on any stops all alike
    ckpt, cfg, run = world().together(setup)
    agree_ranks(run)  # same files, settings and versions on every rank
    emit("start", run.start_info())
    on_signal = lambda signum: emit("stopping", {"signal": signal_name(signum), "step": run.step})  # noqa: E731
    keep_lines = ckpt.meta.get("metrics_lines") if ckpt is not None and ckpt.meta["config"].get("metrics") == cfg.metrics else None
    warn = lambda message: emit("warning", {"message": message})  # noqa: E731
    metrics = cfg.metrics if run.trainer.comm.is_root else None  # rank 0 alone writes them
    with StopRequest(on_signal) as stop, _MetricsLog(metrics, warn, keep_lines) as log:
        try:
            run.train(emit, log, stop)
            run.write_output(emit)
        except Diverged as exc:
            raise run.diverged(exc) from None
        except Interrupted as exc:
            if exc.checkpoint is None and run.last_checkpoint is not None:  # a second signal aborted the run
                exc.checkpoint = run.last_checkpoint
                exc.message += f"; the last checkpoint is {run.last_checkpoint}"
            raise
    return run.result


def _prepare(model_path, data_path, out_path, cfg: FinetuneConfig, ckpt=None, emit: Callback = lambda e, i: None) -> _Run:
    """Every check and allocation before the first step, cheapest (and likeliest to fail) first:
    output paths (writable, not inputs), memory, disk space for the output and checkpoints."""
    inputs = {"model": model_path, "data": data_path, **({"lora_init": cfg.lora_init} if cfg.lora_init else {})}
    paths = [*inputs.values(), *([ckpt.path] if ckpt is not None else [])]
    out_path = check_output_path(out_path, *paths)
    _report_leftovers(out_path, ckpt, emit)
    check_writable_folder(out_path, "-o")
    if cfg.metrics:
        metrics = check_output_path(cfg.metrics, *paths, flag="--metrics")
        if metrics.resolve() == out_path.resolve():
            raise LlmtuneError(f"--metrics {cfg.metrics}: is the -o file too; choose another --metrics path")
        check_writable_folder(metrics, "--metrics")
    model = load_model(model_path)
    model, trainable = _with_adapter(model, cfg) if cfg.lora else (model, model.select(cfg.params))
    bench = _eval_benchmark(model, cfg.eval_benchmark) if cfg.eval_benchmark else None
    if cfg.ctx > model.hp.n_ctx_train:
        emit("warning", {"message": f"--ctx {cfg.ctx} is more than the {model.hp.n_ctx_train} tokens {model_path} was "
                                    f"trained on ({model.hp.arch}.context_length): positions past it are untrained"})
    # plain text / {"text"}: overlapping windows; prompt-completion / chat: one masked example per window
    dataset, n_tokens = build_dataset(model, data_path, cfg.ctx, cfg.val_split, cfg.format, cfg.chat_template,
                                      cfg.train_on_prompt, cfg.pack)
    steps_per_epoch = _steps_per_epoch(dataset, cfg, data_path)
    trainer = Trainer(model, get_backend(cfg.backend, precision=cfg.precision), n_ctx=cfg.ctx, n_batch=cfg.batch,
                      n_ubatch=cfg.ubatch, trainable=trainable, optimizer=cfg.optimizer, wd=cfg.wd,
                      lora_dropout=cfg.lora_dropout, seed=cfg.seed, grad_checkpoint=cfg.grad_checkpoint,
                      workers=ckpt.meta.get("workers") if ckpt is not None else None, packed=cfg.pack)
    trainer.max_loss = DIVERGENCE_FACTOR * math.log(max(model.hp.n_vocab, 2))
    memory = _checked_memory(trainer, model_path)
    _check_disk(out_path, trainer, model_path, cfg, dataset)
    schedule = LRSchedule(cfg.lr, cfg.lr_min, cfg.decay_epochs, cfg.epochs, cfg.warmup)
    result = FinetuneResult(out_path, cfg, n_tokens=n_tokens, n_train_windows=dataset.n_train,
                            n_val_windows=dataset.n_val, memory=memory)
    run = _Run(cfg, dataset, trainer, schedule, steps_per_epoch, result, inputs=inputs, run_id=uuid.uuid4().hex,
               benchmark=bench)
    if ckpt is not None:
        run.restore(ckpt, emit)
    return run


def _report_leftovers(out: Path, ckpt, emit: Callback) -> None:
    """Temp files of a killed run to the same output, and (for a new run) checkpoints of an earlier
    one: reported, never deleted (another run may still be writing them, or the user wants them)."""
    for tmp in ckpts.stale_temp_files(out):
        try:
            size = tmp.stat().st_size
        except FileNotFoundError:  # its writer finished meanwhile: not a leftover
            continue
        emit("warning", {"message": f"{tmp}: a temp file left by an interrupted run ({size / 2**20:,.1f} MiB); "
                                    f"llmtune does not delete it: remove it unless another run is writing {out}"})
    found = ckpts.checkpoints_of(out)
    if ckpt is None and found:
        emit("warning", {"message": f"{found[-1][1]}: a checkpoint of an earlier run to {out} ({len(found)} in all) is "
                                    f"kept; to continue that run instead, add --resume {found[-1][1]}"})


def _check_disk(out: Path, trainer: Trainer, model_path, cfg: FinetuneConfig, dataset: WindowDataset) -> None:
    """Room for the output and the checkpoints (the kept ones plus the one being written) before
    the first step."""
    n = trainer.n_trainable
    per_checkpoint = n * 4 * (3 if trainer.optimizer.m is not None else 1) + dataset.n_train * 8 + (1 << 16)
    out_bytes = n * 4 + (1 << 20) if trainer.model.adapters else os.path.getsize(model_path)
    keep = (cfg.keep_checkpoints or 1) + 1
    check_disk_space(out.parent, out_bytes + keep * per_checkpoint,
                     f"the output ({out_bytes / 2**20:,.1f} MiB) and {keep} checkpoints ({per_checkpoint / 2**20:,.1f} MiB each)",
                     "free some space, choose another -o folder, or lower --keep-checkpoints")


def _eval_benchmark(model: Model, path):
    """--eval-benchmark's tasks read and tokenized before training (a bad file fails first)."""
    from llmtune.eval.benchmarks import prepare_benchmark

    return prepare_benchmark(model, path)


def _current_model(trainer: Trainer) -> Model:
    """The model with the weights (or the adapter) as trained so far, for --eval-benchmark."""
    import dataclasses

    model, trained = trainer.model, trainer.trained_weights()
    if model.adapters:
        return dataclasses.replace(model, adapters=[model.adapters[0].with_tensors(trained)])
    return dataclasses.replace(model, weights={**model.weights, **trained})


def _with_adapter(model: Model, cfg: FinetuneConfig) -> tuple[Model, list[str]]:
    """The model with the adapter to train (new, or --lora-init's) and the adapter's tensor keys."""
    from llmtune.model.adapter import attach, init_adapter, load_adapter

    if cfg.lora_init is not None:
        adapter = load_adapter(cfg.lora_init, model, flag="--lora-init")
        if cfg.lora_rank is not None and adapter.ranks != {cfg.lora_rank}:
            raise LlmtuneError(f"--lora-rank: {cfg.lora_rank} differs from --lora-init {cfg.lora_init}'s rank "
                               f"{', '.join(map(str, sorted(adapter.ranks)))}")
        if cfg.lora_alpha is not None:
            adapter.alpha = float(cfg.lora_alpha)
    else:
        adapter = init_adapter(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.seed)
    return attach(model, [adapter]), list(adapter.tensors())


def _steps_per_epoch(dataset: WindowDataset, cfg: FinetuneConfig, data_path) -> int:
    """Optimizer steps per epoch (the windows that do not fill a last batch wait for the next epoch)."""
    seqs_per_step = cfg.batch // cfg.ctx
    steps = dataset.n_train // seqs_per_step if seqs_per_step else 0
    if steps < 1:
        raise LlmtuneError(
            f"{data_path}: {dataset.n_train} training window(s) of {cfg.ctx} tokens cannot fill one batch of "
            f"{cfg.batch} tokens (lower --batch or --ctx)"
        )
    return steps


def _checked_memory(trainer: Trainer, model_path) -> dict[str, int]:
    """The bytes the run needs, by kind; refused up front when more than is available. On the cpu
    the total is the process's peak: "runtime" is what the process holds already besides the
    trained weights (interpreter, libraries, tokenizer, data), measured, not guessed."""
    memory = trainer.memory_bytes()
    need, avail = sum(memory.values()), available_memory(trainer.backend)
    if avail is not None and need > avail:
        raise LlmtuneError(
            f"{model_path}: the run needs {need / 2**20:.0f} MiB ({', '.join(f'{k} {v / 2**20:.0f}' for k, v in memory.items())}) "
            f"but only {avail / 2**20:.0f} MiB is available (lower --ubatch or --ctx, train fewer tensors with --params, "
            f"or use --grad-checkpoint)"
        )
    rss = process_rss() if trainer.backend.name == "cpu" else None
    if rss is not None:  # the trained weights, written already, are resident and counted in "base"
        memory["runtime"] = max(0, rss - trainer.n_trainable * np.dtype(trainer.backend.dtype).itemsize)
    return memory


def _write_output(trainer: Trainer, out_path: Path, inputs: list) -> None:
    """The input GGUF with the trained tensors replaced (LoRA: the trained adapter), written atomically."""
    model = trainer.model
    if model.adapters:
        from llmtune.model.adapter import write_adapter

        write_adapter(out_path, model.adapters[0].with_tensors(trainer.trained_weights()), inputs=inputs)
        return
    write_gguf(out_path, model.gguf.arch, model.gguf.meta, _encode_for_output(model, trainer.trained_weights()),
               inputs=inputs)
