"""Rich rendering of finetune events: live progress per epoch, a summary table at the end."""

from __future__ import annotations

import math

from rich.progress import TextColumn, TimeRemainingColumn
from rich.table import Table

from llmtune.ui.format import mib, plus_minus
from llmtune.ui.progress import progress_bar


# EpochResult fields reported with their standard error (`<name>_err`), in column order
_EPOCH_STATS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy")


def _with_err(info: dict, key: str) -> str:
    return plus_minus(info[key], info[key + "_err"])


class FinetuneReporter:
    """Callable passed to llmtune.finetune(callback=...)."""

    def __init__(self, out, err):
        self.out, self.err = out, err
        self.progress = progress_bar(
            err,
            TextColumn("loss {task.fields[loss]:.4f}  acc {task.fields[acc]:.3f}  lr {task.fields[lr]:.2e}  "
                       "{task.fields[tps]:,.0f} tok/s"),
            TimeRemainingColumn(), transient=False, disable=not err.is_terminal,  # one finished bar per epoch stays
        )
        self.tasks = {}
        self.epochs = []

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        if self.epochs:
            self.out.print(self._summary())
        return False

    def __call__(self, event: str, info: dict) -> None:
        getattr(self, "_on_" + event)(info)

    def _on_start(self, info):
        mem = info["memory"]
        cfg = info["config"]
        self.err.print(
            f"[bold]finetune[/] on {info['backend']}: {info['n_tokens']:,} tokens -> {info['n_train']} train / "
            f"{info['n_val']} validation windows of {cfg.ctx}; {info['steps_per_epoch']} steps/epoch "
            f"(batch {cfg.batch}, ubatch {cfg.ubatch}); training {info['n_trainable']:,} of {info['n_params']:,} "
            f"parameters ({len(info['trainable'])} tensors) with {cfg.optimizer}"
        )
        self.err.print(
            "memory: " + ", ".join(f"{k} {mib(v)}" for k, v in mem.items()) + f"; total {mib(sum(mem.values()))}"
        )

    def _task(self, epoch: int, steps: int):
        if epoch not in self.tasks:
            self.tasks[epoch] = self.progress.add_task(f"epoch {epoch}", total=steps, loss=math.nan, acc=math.nan,
                                                       lr=0.0, tps=0.0)
        return self.tasks[epoch]

    def _on_step(self, info):
        task = self._task(info["epoch"], info["steps"])
        self.progress.update(task, completed=info["step"], loss=info["running_loss"], acc=info["accuracy"],
                             lr=info["lr"], tps=info["tokens_per_s"])

    def _on_epoch(self, info):
        self.epochs.append(info)
        train_loss, train_acc, val_loss, val_acc = (_with_err(info, key) for key in _EPOCH_STATS)
        self.err.print(f"epoch {info['epoch']}: train loss {train_loss}, acc {train_acc} | val loss {val_loss}, acc {val_acc}")

    def _on_saved(self, info):
        self.err.print(f"wrote {info['path']} ({mib(info['bytes'])})")

    def _summary(self) -> Table:
        table = Table(title="finetune summary")
        for col in ("epoch", "train loss", "train acc", "val loss", "val acc", "tok/s", "time"):
            table.add_column(col, justify="right")
        for e in self.epochs:
            table.add_row(str(e["epoch"]), *(_with_err(e, key) for key in _EPOCH_STATS),
                          f"{e['tokens_per_s']:,.0f}", f"{e['seconds']:.1f}s")
        return table
