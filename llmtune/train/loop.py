"""The training loop, as llama_opt_epoch runs it: each epoch one optimizer step per batch of
shuffled training windows, then a validation pass; a checkpoint at each epoch end and every
cfg.checkpoint_every steps.

A workflow adds behaviour through `Hook`s (--sample-prompt, --eval-benchmark live in eval/ and
are handed in): the loop itself knows only the trainer, the data, and its position."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from llmtune.errors import Interrupted, TrainingStopped
from llmtune.train import events as ev
from llmtune.train.checkpoint import save_checkpoint
from llmtune.train.config import FinetuneConfig
from llmtune.train.data import WindowDataset
from llmtune.train.guard import Diverged
from llmtune.train.metrics import LossWatch, MetricsLog
from llmtune.train.optim import LRSchedule
from llmtune.train.selection import Selection
from llmtune.train.signals import StopRequest, signal_name
from llmtune.train.trainer import RunningStats, Trainer


class Hook:
    """Behaviour a workflow adds at the loop's points; every method does nothing by default.
    A hook may write to `run.log` and `run.emit`, and fill fields of the epoch's result."""

    def before_training(self, run: "Run") -> None:
        """Once, before the first step of a run that starts at step 0 (not on resume)."""

    def on_step(self, run: "Run", step: ev.Step) -> None:
        """After each optimizer step has been logged and reported."""

    def on_validation(self, run: "Run", evaluation: ev.Evaluation) -> None:
        """After each validation pass (every epoch end, and every --eval-every steps), before
        --early-stop / --save-best read it (add scores here: --eval-benchmark's)."""

    def on_eval(self, run: "Run", result: ev.EpochResult) -> None:
        """After the epoch's validation pass, before the epoch is recorded (add scores here)."""

    def on_epoch(self, run: "Run", result: ev.EpochResult) -> None:
        """After the epoch has been recorded and reported, before its checkpoint."""

    def on_stop(self, run: "Run", reason: str) -> None:
        """Training ended: "done", "interrupted" or "diverged"."""

    def on_record(self, run: "Run", record: dict) -> None:
        """Each record as the --metrics file gets it (train_step, validation, benchmark, epoch; NaN
        as None), on every rank, with or without --metrics."""


@dataclass
class Run:
    """A finetune run once every check has passed, and its position: step, epoch, epoch_step, the
    epoch's window order and running statistics are what a checkpoint stores beside the trainer's
    buffers (train/checkpoint.py save/restore continue from one exactly)."""

    cfg: FinetuneConfig
    dataset: WindowDataset
    trainer: Trainer
    schedule: LRSchedule
    steps_per_epoch: int
    result: ev.FinetuneResult
    inputs: dict = field(default_factory=dict)  # "model", "data" (and "lora_init") -> path
    run_id: str = ""  # the same across resumes: which checkpoints are this run's
    hooks: list = field(default_factory=list)
    emit: ev.Callback = ev.ignore
    log: MetricsLog = field(default_factory=lambda: MetricsLog(None, print))
    step: int = 0  # optimizer steps done, over all epochs
    epoch: int = 0  # the epoch in progress (0-based; == epochs when training is done)
    epoch_step: int = 0  # steps done in it
    order: Optional[np.ndarray] = None  # its window order
    stats: RunningStats = field(default_factory=RunningStats)
    last_checkpoint: Optional[Path] = None
    watch: LossWatch = field(default_factory=LossWatch)
    fingerprint_cache: Optional[dict] = None
    epoch_time: tuple = (0.0, 0)  # seconds and tokens trained in this epoch by this process
    seconds_before: float = 0.0  # training seconds of the run before the epoch in progress (resumes included)
    epoch_t0: Optional[float] = None  # perf_counter() when this process started the epoch in progress
    selection: Selection = field(default_factory=Selection)  # --early-stop / --save-best (checkpoints keep it)
    evaluation: Optional[ev.Evaluation] = None  # the last validation pass of this process

    def elapsed(self) -> float:
        """Training seconds of the whole run so far, across epochs and resumes (checkpoints keep it)."""
        running = time.perf_counter() - self.epoch_t0 if self.epoch_t0 is not None else 0.0
        return self.seconds_before + running

    def warn(self, message: str) -> None:
        self.emit(ev.Warning(message))

    def where(self) -> str:
        if self.selection.stopped_at:
            return f"stopped early at step {self.selection.stopped_at}"
        if self.epoch >= self.cfg.epochs:
            return "all epochs done" if self.cfg.epochs > 1 else "the epoch done"
        return f"epoch {self.epoch + 1}, {self.epoch_step} of {self.steps_per_epoch} steps done"

    def epoch_order(self, epoch: int) -> Optional[np.ndarray]:
        if epoch >= self.cfg.epochs:
            return None
        return self.dataset.train_order(epoch, self.cfg.seed, self.cfg.shuffle)

    def call_hooks(self, point: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, point)(self, *args)

    # ------------------------------------------------------------------ how a run ends
    def stopped(self, signum: int, saved: Optional[Path]) -> Interrupted:
        head = f"{signal_name(signum)}: stopped after step {self.step} ({self.where()})"
        if saved is not None:
            return Interrupted(signum, f"{head}; checkpoint written to {saved}", saved)
        tail = f"; the last one is {self.last_checkpoint}" if self.last_checkpoint else ""
        return Interrupted(signum, f"{head}, but no checkpoint could be written{tail}", self.last_checkpoint)

    def diverged(self, exc: Diverged) -> TrainingStopped:
        msg = f"training diverged at {exc} ({self.where()}); no model written (lower --lr?)"
        if self.last_checkpoint is not None:
            msg += f"; the last good checkpoint is {self.last_checkpoint}"
        return TrainingStopped(msg, self.last_checkpoint)


def train(run: Run, stop: StopRequest) -> None:
    """Every epoch from the run's position. A stop request (signal) ends the run after the current
    step with a checkpoint (Interrupted); a diverging step raises Diverged before its update."""
    if run.step == 0:
        run.call_hooks("before_training")
    while run.epoch < run.cfg.epochs:
        _train_epoch(run, stop)
        result = _end_epoch(run)
        run.emit(ev.EpochEnd(result))
        run.call_hooks("on_epoch", result)
        cut = run.epoch_step < run.steps_per_epoch  # --early-stop ended the epoch before its last step
        run.epoch, run.epoch_step, run.stats = run.epoch + 1, 0, RunningStats()
        if run.selection.should_stop and (cut or run.epoch < run.cfg.epochs):  # --early-stop: no more epochs
            run.selection.stopped_at, run.epoch = run.step, run.cfg.epochs
        run.order = run.epoch_order(run.epoch)
        _checkpoint_or_stop(run, stop, due=True)
    _select(run)


def _train_epoch(run: Run, stop: StopRequest) -> None:
    if run.order is None:
        run.order = run.epoch_order(run.epoch)
    # tokens/s counts the tokens run (batch per step), padding and masked prompts included
    t0, first, every = time.perf_counter(), run.epoch_step, run.cfg.checkpoint_every
    run.epoch_t0 = t0
    for s in range(run.epoch_step, run.steps_per_epoch):
        loss, lr = _train_step(run, s)
        elapsed = time.perf_counter() - t0
        step = ev.Step(epoch=run.epoch + 1, step=s + 1, steps=run.steps_per_epoch, global_step=run.step, loss=loss,
                       running_loss=run.stats.loss, accuracy=run.stats.accuracy, lr=lr,
                       tokens_per_s=(s + 1 - first) * run.cfg.batch / elapsed if elapsed > 0 else 0.0,
                       grad_norm=run.trainer.grad_norm, metrics=dict(run.trainer.step_metrics),
                       mfu=run.trainer.mfu(elapsed / (s + 1 - first)))
        run.epoch_step = s + 1
        # elapsed_s: the run's training seconds so far, across epochs and resumes; method: what the loss is
        run.log.write({"type": "train_step", **step.as_record(), "elapsed_s": run.elapsed(), "method": run.cfg.method})
        run.emit(step)
        run.call_hooks("on_step", step)
        spike = run.watch.check(step.loss)
        if spike:
            run.warn(f"step {run.step}: {spike}")
        if s + 1 < run.steps_per_epoch:  # the epoch's last step validates and checkpoints in _end_epoch
            if run.cfg.eval_every and run.step % run.cfg.eval_every == 0:
                _evaluate(run, epoch_end=False)
                if run.selection.should_stop:  # --early-stop: the epoch ends here
                    break
            _checkpoint_or_stop(run, stop, due=bool(every) and run.step % every == 0)
    run.epoch_time = (time.perf_counter() - t0, (run.epoch_step - first) * run.cfg.batch)
    run.seconds_before, run.epoch_t0 = run.elapsed(), None


def _checkpoint_or_stop(run: Run, stop: StopRequest, due: bool) -> None:
    """A checkpoint when one is due or a stop was requested; then the stop (every rank stops at
    the same step)."""

    stopping = run.trainer.comm.any(stop.requested, "a stop request")
    saved = save_checkpoint(run) if due or stopping else None
    if stopping:
        raise run.stopped(stop.signum, saved)


def _train_step(run: Run, s: int) -> tuple[float, float]:
    """Optimizer step `s` of the epoch over the next batch of windows in the epoch's order:
    (its mean loss, its learning rate)."""
    lr = run.schedule.lr(run.epoch + s / run.steps_per_epoch, run.step)
    seqs = run.cfg.batch // run.cfg.ctx
    x, y, *segments = run.dataset.gather(run.order[s * seqs : (s + 1) * seqs])  # packed: + segments
    with np.errstate(over="ignore", invalid="ignore"):  # a diverging step is reported by the guard, not by numpy
        loss = run.trainer.train_step(x, y, lr, run.stats, *segments)
    if run.step == 0:
        run.result.first_loss = loss
    run.step += 1
    return loss, lr


def _end_epoch(run: Run) -> ev.EpochResult:
    stats, (seconds, tokens) = run.stats, run.epoch_time
    result = ev.EpochResult(run.epoch + 1, stats.loss, stats.loss_err, stats.accuracy, stats.accuracy_err,
                            tokens_per_s=tokens / seconds if seconds > 0 else 0.0, seconds=seconds,
                            mfu=run.trainer.mfu(seconds / max(1, tokens // run.cfg.batch)))
    # a pass --eval-every made at this step (the one --early-stop ended the epoch on) is not redone
    done = run.evaluation if run.evaluation is not None and run.evaluation.global_step == run.step else None
    evaluation = done or _evaluate(run, epoch_end=True)
    for name in ("val_loss", "val_loss_err", "val_accuracy", "val_accuracy_err", "bench_accuracy", "bench_accuracy_err",
                 "val_metrics"):
        setattr(result, name, getattr(evaluation, name))
    run.call_hooks("on_eval", result)
    run.result.epochs.append(result)
    run.log.write({"type": "epoch", **asdict(result)})
    return result


def _evaluate(run: Run, epoch_end: bool) -> ev.Evaluation:
    """A validation pass (when there are validation windows) and the hooks' scores, counted by
    --early-stop / --save-best (an improvement's weights kept for --save-best)."""
    evaluation = ev.Evaluation(run.epoch + 1, run.step)
    if run.dataset.n_val:
        _validate(run, evaluation)
    run.call_hooks("on_validation", evaluation)
    improved = run.selection.update(evaluation)
    if improved and run.cfg.save_best:
        run.selection.keep(run.trainer)
    run.evaluation = evaluation
    run.emit(ev.Validation(evaluation, epoch_end, improved, run.selection.best_step))
    return evaluation


def _select(run: Run) -> None:
    """The run's end with --early-stop or --save-best: the best pass reported (and in --metrics);
    with --save-best its weights go back into the trainer, so -o is written from them."""
    sel, cfg = run.selection, run.cfg
    if not (cfg.early_stop or cfg.save_best):
        return
    saved = cfg.save_best and sel.load_best(run.trainer)
    res = run.result
    res.best_step, res.best_value, res.stopped_at = sel.best_step, sel.best_value, sel.stopped_at
    run.log.write({"type": "selected", "metric": sel.metric, "value": sel.best_value, "global_step": sel.best_step,
                   "epoch": sel.best_epoch, "saved": saved, "stopped_at": sel.stopped_at})
    run.emit(ev.Selected(sel.metric, sel.best_value, sel.best_step, sel.best_epoch, saved, sel.stopped_at,
                         sel.patience))


def _validate(run: Run, result: ev.Evaluation) -> None:
    """Loss and accuracy over the held-out windows, into `result` and the log."""
    val = RunningStats()
    x, y, *segments = run.dataset.gather(run.dataset.val_indices())  # packed: + segments
    run.trainer.evaluate(x, y, val, *segments)
    result.val_loss, result.val_loss_err, result.val_accuracy, result.val_accuracy_err = (
        val.loss, val.loss_err, val.accuracy, val.accuracy_err)
    result.val_metrics = dict(run.trainer.eval_metrics)
    run.log.write({"type": "validation", "epoch": result.epoch, "global_step": run.step, "loss": val.loss,
                   "loss_err": val.loss_err, "accuracy": val.accuracy, "accuracy_err": val.accuracy_err,
                   **result.val_metrics})
