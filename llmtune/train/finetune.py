"""`llmtune.finetune(...)`: the library call behind `llmtune finetune`."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.backends.base import get_backend
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
    def __init__(self, path: Optional[str]):
        self.fh = open(path, "w", encoding="utf-8") if path else None

    def write(self, record: dict) -> None:
        if self.fh:
            clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}
            self.fh.write(json.dumps(clean) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh:
            self.fh.close()


def finetune(model_path, data_path, out_path, *, config_file=None, callback: Optional[Callback] = None,
             **settings) -> FinetuneResult:
    """Train `model_path` on `data_path` and write the result to `out_path`.

    settings: any FinetuneConfig field (ctx, batch, ubatch, epochs, lr, lr_min, decay_epochs,
    warmup, wd, optimizer, val_split, params, seed, shuffle, backend, precision, metrics); None means
    "take it from config_file or the default". callback(event, info) receives "start", "step",
    "epoch" and "saved" events (the CLI renders them)."""
    cfg = make_config(config_file, **settings)
    emit = callback or (lambda event, info: None)
    out_path = check_output_path(out_path, model_path, data_path)
    if cfg.metrics:
        check_output_path(cfg.metrics, model_path, data_path)

    model = load_model(model_path)
    docs, jsonl = load_documents(data_path)
    tokens = tokenize_documents(model.tokenizer, docs, jsonl)
    dataset = WindowDataset.build(tokens, cfg.ctx, cfg.val_split, source=str(data_path))
    seqs_per_step = cfg.batch // cfg.ctx
    steps_per_epoch = dataset.n_train // seqs_per_step if seqs_per_step else 0
    if steps_per_epoch < 1:
        raise LlmtuneError(
            f"{data_path}: {dataset.n_train} training window(s) of {cfg.ctx} tokens cannot fill one batch of "
            f"{cfg.batch} tokens (lower --batch or --ctx)"
        )
    backend = get_backend(cfg.backend, precision=cfg.precision)
    trainable = model.select(cfg.params)
    trainer = Trainer(model, backend, n_ctx=cfg.ctx, n_batch=cfg.batch, n_ubatch=cfg.ubatch,
                      trainable=trainable, optimizer=cfg.optimizer, wd=cfg.wd)
    memory = trainer.memory_bytes()
    need, avail = sum(memory.values()), available_memory(backend)
    if avail is not None and need > avail:
        raise LlmtuneError(
            f"{model_path}: the run needs {need / 2**20:.0f} MiB ({', '.join(f'{k} {v / 2**20:.0f}' for k, v in memory.items())}) "
            f"but only {avail / 2**20:.0f} MiB is available (lower --ubatch or --ctx, or train fewer tensors with --params)"
        )
    schedule = LRSchedule(cfg.lr, cfg.lr_min, cfg.decay_epochs, cfg.epochs, cfg.warmup)
    result = FinetuneResult(out_path, cfg, n_tokens=len(tokens), n_train_windows=dataset.n_train,
                            n_val_windows=dataset.n_val, memory=memory)
    emit("start", {"config": cfg, "memory": memory, "n_tokens": len(tokens), "n_train": dataset.n_train,
                   "n_val": dataset.n_val, "steps_per_epoch": steps_per_epoch, "n_trainable": trainer.n_trainable,
                   "n_params": model.n_params(), "trainable": trainable, "backend": backend.name})
    log = _MetricsLog(cfg.metrics)
    try:
        _train_loop(trainer, dataset, cfg, schedule, steps_per_epoch, result, emit, log)
    finally:
        log.close()
    trained = trainer.trained_weights()
    write_gguf(out_path, model.gguf.arch, model.gguf.meta, _encode_for_output(model, trained),
               inputs=[model_path, data_path])
    emit("saved", {"path": str(out_path), "bytes": os.path.getsize(out_path)})
    return result


def _train_loop(trainer, dataset, cfg, schedule, steps_per_epoch, result, emit, log) -> None:
    seqs = cfg.batch // cfg.ctx
    step = 0
    for epoch in range(cfg.epochs):
        stats = RunningStats()
        order = dataset.train_order(epoch, cfg.seed, cfg.shuffle)
        t0 = time.perf_counter()
        for s in range(steps_per_epoch):
            lr = schedule.lr(epoch + s / steps_per_epoch, step)
            x, y = dataset.gather(order[s * seqs : (s + 1) * seqs])
            loss = trainer.train_step(x, y, lr, stats)
            if step == 0:
                result.first_loss = loss
            step += 1
            elapsed = time.perf_counter() - t0
            info = {"epoch": epoch + 1, "step": s + 1, "steps": steps_per_epoch, "global_step": step,
                    "loss": loss, "running_loss": stats.loss, "accuracy": stats.accuracy, "lr": lr,
                    "tokens_per_s": stats.tokens / elapsed if elapsed > 0 else 0.0}
            log.write({"type": "train_step", **info, "elapsed_s": elapsed})
            emit("step", info)
        seconds = time.perf_counter() - t0
        er = EpochResult(epoch + 1, stats.loss, stats.loss_err, stats.accuracy, stats.accuracy_err,
                         tokens_per_s=stats.tokens / seconds if seconds > 0 else 0.0, seconds=seconds)
        if dataset.n_val:
            val = RunningStats()
            x, y = dataset.gather(dataset.val_indices())
            trainer.evaluate(x, y, val)
            er.val_loss, er.val_loss_err, er.val_accuracy, er.val_accuracy_err = val.loss, val.loss_err, val.accuracy, val.accuracy_err
            log.write({"type": "validation", "epoch": epoch + 1, "global_step": step, "loss": val.loss,
                       "loss_err": val.loss_err, "accuracy": val.accuracy, "accuracy_err": val.accuracy_err})
        result.epochs.append(er)
        log.write({"type": "epoch", **asdict(er)})
        emit("epoch", asdict(er))
