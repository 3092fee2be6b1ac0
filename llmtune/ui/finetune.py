"""Rich rendering of finetune events: live progress per epoch, a summary table at the end."""

from __future__ import annotations

import math

from rich.markup import escape
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
        self.bench = None  # --eval-benchmark's score before training ("benchmark" event)

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
        lora = info.get("lora")
        what = (f"training {info['n_trainable']:,} of {info['n_params']:,} parameters ({len(info['trainable'])} tensors)"
                if not lora else
                f"training a LoRA adapter (rank {'/'.join(map(str, lora['rank']))}, alpha {lora['alpha']:g}, "
                f"{lora['n_targets']} matrices, {info['n_trainable']:,} parameters) on a frozen base of "
                f"{info['n_params']:,}")
        self.err.print(
            f"[bold]finetune[/] on {info['backend']}: {info['n_tokens']:,} tokens -> {info['n_train']} train / "
            f"{info['n_val']} validation windows of {cfg.ctx}; {info['steps_per_epoch']} steps/epoch "
            f"(batch {cfg.batch}, ubatch {cfg.ubatch}); {what} with {cfg.optimizer}"
        )
        types = info.get("base_types") or {}
        parts = [f"{k} {mib(v)}" for k, v in mem.items()]
        if "base" in mem and set(types) - {"F32", "F64"}:  # a base kept in its file types: say what each costs
            parts[list(mem).index("base")] += " (" + ", ".join(f"{t} {mib(v)}" for t, v in types.items()) + ")"
        self.err.print("memory: " + ", ".join(parts) + f"; total {mib(sum(mem.values()))}")
        data = info.get("data")
        if data:
            self.err.print(data_line(data), highlight=False)

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
        bench = ""
        if not math.isnan(info.get("bench_accuracy", math.nan)):
            bench = f" | {self._bench_name()} acc {_with_err(info, 'bench_accuracy')}"
        self.err.print(f"epoch {info['epoch']}: train loss {train_loss}, acc {train_acc} | val loss {val_loss}, acc {val_acc}{bench}")

    def _on_benchmark(self, info):
        self.bench = info
        self.err.print(f"--eval-benchmark ({info['kind']}, {info['n_tasks']} tasks) before training: "
                       f"acc {plus_minus(info['accuracy'], info['accuracy_err'])}", highlight=False)

    def _bench_name(self) -> str:
        return self.bench["kind"] if self.bench else "benchmark"

    def _on_sample(self, info):
        from rich.markup import escape

        sep = " -> " if info.get("chat") else ""  # chat: the user turn, then the model's answer
        self.err.print(f"[bold]sample[/] (epoch {info['epoch']}, step {info['global_step']}) "
                       f"[dim]{escape(info['prompt'])}{sep}[/]{escape(info['text'])}", soft_wrap=True)

    def _on_saved(self, info):
        self.err.print(f"wrote {info['path']} ({mib(info['bytes'])})", highlight=False, soft_wrap=True)

    def _on_warning(self, info):
        self.err.print(f"[yellow]warning:[/] {escape(info['message'])}", highlight=False, soft_wrap=True)

    def _on_checkpoint(self, info):
        self.err.print(f"checkpoint {info['path']} (step {info['step']}; {info['where']})", highlight=False, soft_wrap=True)

    def _on_resumed(self, info):
        self.err.print(f"resuming {info['path']} at step {info['step']} ({info['where']})", highlight=False, soft_wrap=True)

    def _on_stopping(self, info):
        self.err.print(f"{info['signal']}: finishing step {info['step'] + 1}, then writing a checkpoint "
                       f"(press Ctrl-C again to abort at once)", highlight=False, soft_wrap=True)

    def _summary(self) -> Table:
        table = Table(title="finetune summary")
        bench = self.bench is not None or any(not math.isnan(e.get("bench_accuracy", math.nan)) for e in self.epochs)
        for col in ("epoch", "train loss", "train acc", "val loss", "val acc", "tok/s", "time"):
            table.add_column(col, justify="right")
        if bench:  # --eval-benchmark: a row for the model before training, a column for each epoch
            table.add_column(f"{self._bench_name()} acc", justify="right")
            if self.bench is not None:
                table.add_row("before", *["-"] * 6, plus_minus(self.bench["accuracy"], self.bench["accuracy_err"]))
        for e in self.epochs:
            table.add_row(str(e["epoch"]), *(_with_err(e, key) for key in _EPOCH_STATS),
                          f"{e['tokens_per_s']:,.0f}", f"{e['seconds']:.1f}s",
                          *([_with_err(e, "bench_accuracy")] if bench else []))
        return table


def data_line(data: dict) -> str:
    """The start report's line on the data (train/chat.py data_info)."""
    per_epoch = f"{data['loss_tokens_per_epoch']:,} tokens carry loss per epoch"
    if data["format"] == "text":
        return f"data: text, every token of each window carries loss; {per_epoch}"
    notes = []
    if data["truncated"]:
        notes.append(f"{data['truncated']} truncated to --ctx")
    if data["dropped"]:
        notes.append(f"{data['dropped']} dropped (no answer token left within --ctx)")
    if data.get("packed"):
        layout = (f"packed into {data['windows']:,} windows ({data['per_window']:.1f} examples per window, "
                  f"{data['padding']:.0%} of the training windows padding)")
    else:
        layout = f"one per window ({data['padding']:.0%} of the training windows padding; --pack packs them)"
    return (f"data: {data['examples']:,} {data['format']} examples, {layout}; prompts masked unless "
            f"--train-on-prompt{'; ' + ', '.join(notes) if notes else ''}; {per_epoch}")

