"""`llmtune.finetune(...)`: the library call behind `llmtune finetune`."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.backends import get_backend
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import check_output_path, write_gguf
from llmtune.model.loaded import Model, load_model
from llmtune.train.config import FinetuneConfig, make_config
from llmtune.train.data import WindowDataset, load_documents, tokenize_documents
from llmtune.train.optim import LRSchedule
from llmtune.train.trainer import RunningStats, Trainer


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


Callback = Callable[[str, dict], None]


def available_memory(backend) -> Optional[int]:
    """Bytes the run may use: the device's free memory, or MemAvailable on the host."""
    probe = getattr(backend, "available_memory", None)
    if probe is not None:
        return probe()
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    """--metrics: one JSON record per line (NaN written as null, which JSON has), flushed as it goes."""

    def __init__(self, path: Optional[str]):
        self.fh = open(path, "w", encoding="utf-8") if path else None

    def __enter__(self) -> "_MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.fh:
            self.fh.close()

    def write(self, record: dict) -> None:
        if self.fh:
            clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}
            self.fh.write(json.dumps(clean) + "\n")
            self.fh.flush()


def _per_second(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


@dataclass
class _Run:
    """A finetune run once every check has passed, trained as llama_opt_epoch does: each epoch
    one optimizer step per batch of shuffled training windows, then a validation pass."""

    cfg: FinetuneConfig
    dataset: WindowDataset
    trainer: Trainer
    schedule: LRSchedule
    steps_per_epoch: int
    result: FinetuneResult
    step: int = 0  # optimizer steps done, over all epochs

    def start_info(self) -> dict:
        """The "start" event: what will train, on what, and the memory it takes."""
        tr, ds, res = self.trainer, self.dataset, self.result
        return {"config": self.cfg, "memory": res.memory, "n_tokens": res.n_tokens, "n_train": ds.n_train,
                "n_val": ds.n_val, "steps_per_epoch": self.steps_per_epoch, "n_trainable": tr.n_trainable,
                "n_params": tr.model.n_params(), "trainable": tr.trainable, "backend": tr.backend.name}

    def train(self, emit: Callback, log: _MetricsLog) -> None:
        """Every epoch, each step and epoch reported to `emit` (the CLI) and `log` (--metrics)."""
        for epoch in range(self.cfg.epochs):
            er = self._train_epoch(epoch, emit, log)
            if self.dataset.n_val:
                self._validate(er, log)
            self.result.epochs.append(er)
            log.write({"type": "epoch", **asdict(er)})
            emit("epoch", asdict(er))

    def _train_epoch(self, epoch: int, emit: Callback, log: _MetricsLog) -> EpochResult:
        stats = RunningStats()
        order = self.dataset.train_order(epoch, self.cfg.seed, self.cfg.shuffle)
        t0 = time.perf_counter()
        for s in range(self.steps_per_epoch):
            info = self._train_step(epoch, s, order, stats)
            elapsed = time.perf_counter() - t0
            info["tokens_per_s"] = _per_second(stats.tokens, elapsed)
            log.write({"type": "train_step", **info, "elapsed_s": elapsed})
            emit("step", info)
        seconds = time.perf_counter() - t0
        return EpochResult(epoch + 1, stats.loss, stats.loss_err, stats.accuracy, stats.accuracy_err,
                           tokens_per_s=_per_second(stats.tokens, seconds), seconds=seconds)

    def _train_step(self, epoch: int, s: int, order: np.ndarray, stats: RunningStats) -> dict:
        """Optimizer step `s` of the epoch over the next batch of windows in `order`."""
        lr = self.schedule.lr(epoch + s / self.steps_per_epoch, self.step)
        seqs = self.cfg.batch // self.cfg.ctx
        x, y = self.dataset.gather(order[s * seqs : (s + 1) * seqs])
        loss = self.trainer.train_step(x, y, lr, stats)
        if self.step == 0:
            self.result.first_loss = loss
        self.step += 1
        return {"epoch": epoch + 1, "step": s + 1, "steps": self.steps_per_epoch, "global_step": self.step,
                "loss": loss, "running_loss": stats.loss, "accuracy": stats.accuracy, "lr": lr}

    def _validate(self, er: EpochResult, log: _MetricsLog) -> None:
        """Loss and accuracy over the held-out windows, into `er` and the log."""
        val = RunningStats()
        x, y = self.dataset.gather(self.dataset.val_indices())
        self.trainer.evaluate(x, y, val)
        er.val_loss, er.val_loss_err, er.val_accuracy, er.val_accuracy_err = val.loss, val.loss_err, val.accuracy, val.accuracy_err
        log.write({"type": "validation", "epoch": er.epoch, "global_step": self.step, "loss": val.loss,
                   "loss_err": val.loss_err, "accuracy": val.accuracy, "accuracy_err": val.accuracy_err})


def finetune(model_path, data_path, out_path, *, config_file=None, callback: Optional[Callback] = None,
             **settings) -> FinetuneResult:
    """Train `model_path` on `data_path` and write the result to `out_path` (llama.cpp's
    examples/training/finetune.cpp, with validation, batching and schedules as flags).

    settings: any FinetuneConfig field (ctx, batch, ubatch, epochs, lr, lr_min, decay_epochs,
    warmup, wd, optimizer, val_split, params, seed, shuffle, backend, precision, metrics); None means
    "take it from config_file or the default". callback(event, info) receives "start", "step",
    "epoch" and "saved" events (the CLI renders them)."""
    cfg = make_config(config_file, **settings)
    emit = callback or (lambda event, info: None)
    run = _prepare(model_path, data_path, out_path, cfg)
    emit("start", run.start_info())
    with _MetricsLog(cfg.metrics) as log:
        run.train(emit, log)
    out_path = run.result.output
    _write_output(run.trainer, out_path, inputs=[model_path, data_path])
    emit("saved", {"path": str(out_path), "bytes": os.path.getsize(out_path)})
    return run.result


def _prepare(model_path, data_path, out_path, cfg: FinetuneConfig) -> _Run:
    """Every check and allocation before the first step, cheapest (and likeliest to fail) first."""
    out_path = check_output_path(out_path, model_path, data_path)
    if cfg.metrics:
        check_output_path(cfg.metrics, model_path, data_path)
    model = load_model(model_path)
    tokens = tokenize_documents(model.tokenizer, *load_documents(data_path))
    dataset = WindowDataset.build(tokens, cfg.ctx, cfg.val_split, source=str(data_path))
    steps_per_epoch = _steps_per_epoch(dataset, cfg, data_path)
    trainer = Trainer(model, get_backend(cfg.backend, precision=cfg.precision), n_ctx=cfg.ctx, n_batch=cfg.batch,
                      n_ubatch=cfg.ubatch, trainable=model.select(cfg.params), optimizer=cfg.optimizer, wd=cfg.wd)
    memory = _checked_memory(trainer, model_path)
    schedule = LRSchedule(cfg.lr, cfg.lr_min, cfg.decay_epochs, cfg.epochs, cfg.warmup)
    result = FinetuneResult(out_path, cfg, n_tokens=len(tokens), n_train_windows=dataset.n_train,
                            n_val_windows=dataset.n_val, memory=memory)
    return _Run(cfg, dataset, trainer, schedule, steps_per_epoch, result)


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
    """The bytes the run needs, by kind; refused up front when more than is available."""
    memory = trainer.memory_bytes()
    need, avail = sum(memory.values()), available_memory(trainer.backend)
    if avail is not None and need > avail:
        raise LlmtuneError(
            f"{model_path}: the run needs {need / 2**20:.0f} MiB ({', '.join(f'{k} {v / 2**20:.0f}' for k, v in memory.items())}) "
            f"but only {avail / 2**20:.0f} MiB is available (lower --ubatch or --ctx, or train fewer tensors with --params)"
        )
    return memory


def _write_output(trainer: Trainer, out_path: Path, inputs: list) -> None:
    """The input GGUF with the trained tensors replaced, written atomically."""
    model = trainer.model
    write_gguf(out_path, model.gguf.arch, model.gguf.meta, _encode_for_output(model, trainer.trained_weights()),
               inputs=inputs)
