"""Rich rendering of finetune events: live progress per epoch, a summary table at the end."""

from __future__ import annotations

import math
from dataclasses import asdict

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from llmtune.train import events as ev
from llmtune.ui.format import mib, percent, plus_minus, sparkline

# EpochResult fields reported with their standard error (`<name>_err`), in column order
_EPOCH_STATS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy")
STEP_LINES = 10  # off a terminal, a progress line about every tenth of an epoch


def _with_err(info: dict, key: str) -> str:
    return plus_minus(info[key], info[key + "_err"])


class FinetuneReporter:
    """Callable passed to llmtune.finetune(callback=...)."""

    def __init__(self, out, err):
        self.out, self.err = out, err
        # a bar that gives way first, so the step counter and the numbers keep their place at 80 columns
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=None), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f} acc {task.fields[acc]:.3f} {task.fields[pref]}lr "
                       "{task.fields[lr]:.1e} "
                       "{task.fields[tps]:,.0f} tok/s"),
            TimeRemainingColumn(), console=err, transient=False, expand=True,
            disable=not err.is_terminal,  # one finished bar per epoch stays
        )
        self.tasks = {}
        self.epochs = []
        self.bench = None  # --eval-benchmark's score before training ("benchmark" event)
        self.selected = None  # --early-stop / --save-best's best pass ("selected" event)
        self.losses = []  # (global step, loss) of every step this process ran: the summary's sparkline

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        if self.epochs:
            self._print_summary()
        if self.losses:
            self.out.print(loss_line(self.losses), highlight=False, soft_wrap=True)
        return False

    def __call__(self, event: ev.Event) -> None:
        getattr(self, "_on_" + event.kind)(event)

    def _on_start(self, e: ev.Start):
        mem, cfg, lora = e.memory, e.config, e.lora
        what = (f"training {e.n_trainable:,} of {e.n_params:,} parameters ({len(e.trainable)} tensors)"
                if not lora else
                f"training a LoRA adapter (rank {'/'.join(map(str, lora['rank']))}, alpha {lora['alpha']:g}, "
                + "".join(f"{v}, " for v in lora.get("variants", ())) +
                f"{lora['n_targets']} matrices, {e.n_trainable:,} parameters) on a frozen base of "
                f"{e.n_params:,}")
        drawn = f" (drawn with --seed {cfg.seed})" if cfg.val_pick == "random" and e.n_val else ""
        self.err.print(
            f"[bold]finetune[/] on {e.backend}: {e.n_tokens:,} tokens -> {e.n_train} train / "
            f"{e.n_val} validation windows{drawn} of {cfg.ctx}; {e.steps_per_epoch} steps/epoch "
            f"(batch {cfg.batch}, ubatch {cfg.ubatch}); {what} with {cfg.optimizer}"
        )
        types = e.base_types or {}
        parts = [f"{k} {mib(v)}" for k, v in mem.items()]
        if "base" in mem and e.base_mapped:  # a memory-mapped base: its size, and what of it the run holds
            parts[list(mem).index("base")] = f"base {mib(e.base_mapped)} mapped, {mib(mem['base'])} resident"
        if "base" in mem and set(types) - {"F32", "F64"}:  # a base kept in its file types: say what each costs
            parts[list(mem).index("base")] += " (" + ", ".join(f"{t} {mib(v)}" for t, v in types.items()) + ")"
        self.err.print("memory: " + ", ".join(parts) + f"; total {mib(sum(mem.values()))}")
        for line in e.plan:  # what a memory limit decided, and what it costs (train/preflight.py plan_lines)
            self.err.print(f"plan: {line}", highlight=False, soft_wrap=True)
        if e.data:
            self.err.print(data_line(e.data), highlight=False)

    def _task(self, epoch: int, steps: int):
        if epoch not in self.tasks:
            self.tasks[epoch] = self.progress.add_task(f"epoch {epoch}", total=steps, loss=math.nan, acc=math.nan,
                                                       pref="",
                                                       lr=0.0, tps=0.0)
        return self.tasks[epoch]

    def _on_step(self, e: ev.Step):
        self.losses.append((e.global_step, e.loss))
        if self.err.is_terminal:
            task = self._task(e.epoch, e.steps)
            self.progress.update(task, completed=e.step, loss=e.running_loss, acc=e.accuracy, lr=e.lr,
                                 pref=_preference_words(e.metrics),
                                 tps=e.tokens_per_s)
        elif e.step == 1 or e.step == e.steps or e.step % max(1, e.steps // STEP_LINES) == 0:
            # no bar off a terminal: a line about every tenth of an epoch, so a log shows the run moving
            acc = f"acc {e.accuracy:.3f}, " if e.accuracy == e.accuracy else ""  # GRPO has none
            self.err.print(f"epoch {e.epoch} step {e.step}/{e.steps}: loss {e.running_loss:.4f}, {acc}"
                           f"{_preference_words(e.metrics)}lr {e.lr:.2e}, {e.tokens_per_s:,.0f} tok/s{_mfu(e.mfu)}",
                           highlight=False)

    def _on_epoch(self, e: ev.EpochEnd):
        info = e.as_record()
        self.epochs.append(info)
        self._print_fields(self.err, self._epoch_fields(info))

    def _epoch_fields(self, info: dict, timing: bool = False) -> list[str]:
        """An epoch's results as fields that a narrow terminal may break between, never inside."""
        train_loss, train_acc, val_loss, val_acc = (_with_err(info, key) for key in _EPOCH_STATS)
        fields = [f"epoch {info['epoch']}:", f"train loss {train_loss}, acc {train_acc}",
                  f"| val loss {val_loss}, acc {val_acc}"]
        if info.get("val_metrics"):
            fields.append(f"| val {_preference_words(info['val_metrics']).rstrip(', ')}")
        if not math.isnan(info.get("bench_accuracy", math.nan)):
            fields.append(f"| {self._bench_name()} acc {percent(info['bench_accuracy'], info['bench_accuracy_err'])}")
        if timing:
            mfu = _mfu(info.get("mfu", math.nan))
            fields.append(f"| {info['tokens_per_s']:,.0f} tok/s{mfu}, {info['seconds']:.1f}s")
        return fields

    @staticmethod
    def _print_fields(console, fields: list[str]) -> None:
        """Fields on one line; on a terminal too narrow for it, one field per line (indented)."""
        line = " ".join(fields)
        if console.is_terminal and len(line) > console.width:
            line = fields[0] + "".join(f"\n  {f}" for f in fields[1:])
        console.print(line, highlight=False, soft_wrap=True)

    def _on_validation(self, e: ev.Validation):
        if e.epoch_end:  # the epoch's line reports it
            return
        v = e.evaluation
        fields = [f"step {v.global_step} (epoch {v.epoch}):",
                  f"val loss {plus_minus(v.val_loss, v.val_loss_err)}, acc "
                  f"{plus_minus(v.val_accuracy, v.val_accuracy_err)}"]
        if not math.isnan(v.bench_accuracy):
            fields.append(f"| {self._bench_name()} acc {percent(v.bench_accuracy, v.bench_accuracy_err)}")
        if e.improved:
            fields.append("(best so far)")
        self._print_fields(self.err, fields)

    def _on_selected(self, e: ev.Selected):
        self.selected = e

    def _selected_line(self) -> str:
        e = self.selected
        if not e.step:
            line = f"best: no validation pass scored {e.metric}"
        else:
            line = f"best: step {e.step} (epoch {e.epoch}), {e.metric} {e.value:.4f}"
            line += "; -o holds its weights (--save-best)" if e.saved else ""
        if e.stopped_at:
            line += f"; stopped early at step {e.stopped_at} ({e.patience} validation passes without improvement)"
        return line

    def _on_benchmark(self, e: ev.Benchmark):
        self.bench = e
        self.err.print(f"--eval-benchmark ({e.benchmark}, {e.n_tasks} tasks) before training: "
                       f"acc {percent(e.accuracy, e.accuracy_err)}", highlight=False)

    def _bench_name(self) -> str:
        return self.bench.benchmark if self.bench else "benchmark"

    def _on_sample(self, e: ev.Sample):
        sep = " -> " if e.chat else ""  # an instruction (chat, Alpaca), then the model's answer
        self.err.print(f"[bold]sample[/] (epoch {e.epoch}, step {e.global_step}) "
                       f"[dim]{escape(e.prompt)}{sep}[/]{escape(e.text)}", soft_wrap=True)

    def _on_output_checked(self, e: ev.OutputChecked):
        types = ", ".join(f"{n} {t}" for t, n in e.types.items())
        if e.rescored:
            change = 100 * (e.val_loss_written / e.val_loss - 1) if e.val_loss else float("nan")
            self.err.print(f"as written ({types} trained tensors): val loss {e.val_loss_written:.4f} vs "
                           f"{e.val_loss:.4f} in memory ({change:+.2f} %)", highlight=False, soft_wrap=True)
        else:
            self.err.print(f"as written: the {types} trained tensors hold the trained weights exactly", highlight=False,
                           soft_wrap=True)

    def _on_saved(self, e: ev.Saved):
        self.err.print(f"wrote {e.path} ({mib(e.bytes)})", highlight=False, soft_wrap=True)

    def _on_warning(self, e: ev.Warning):
        self.err.print(f"[yellow]warning:[/] {escape(e.message)}", highlight=False, soft_wrap=True)

    def _on_checkpoint(self, e: ev.Checkpoint):
        self.err.print(f"checkpoint {e.path} (step {e.step}; {e.where})", highlight=False, soft_wrap=True)

    def _on_resumed(self, e: ev.Resumed):
        self.epochs = [asdict(r) for r in e.epochs]  # the summary covers the whole run, not this process's part
        self.err.print(f"resuming {e.path} at step {e.step} ({e.where})", highlight=False, soft_wrap=True)

    def _on_stopping(self, e: ev.Stopping):
        self.err.print(f"{e.signal}: finishing step {e.step + 1}, then writing a checkpoint "
                       f"(press Ctrl-C again to abort at once)", highlight=False, soft_wrap=True)

    def _print_summary(self) -> None:
        """The summary table, or (a terminal narrower than the table) each epoch as fields."""
        table = self._summary()
        natural = self.out.measure(table, options=self.out.options.update_width(10_000)).maximum
        if not self.out.is_terminal or natural <= self.out.width:
            self.out.print(table)
        else:
            self.out.print("finetune summary", highlight=False)
            if self.bench is not None:
                self.out.print(f"before: {self._bench_name()} acc "
                               f"{percent(self.bench.accuracy, self.bench.accuracy_err)}",
                               highlight=False)
            for info in self.epochs:
                self._print_fields(self.out, self._epoch_fields(info, timing=True))
        if self.selected is not None:
            self.out.print(self._selected_line(), highlight=False, soft_wrap=True)

    def _summary(self) -> Table:
        table = Table(title="finetune summary")
        bench = self.bench is not None or any(not math.isnan(e.get("bench_accuracy", math.nan)) for e in self.epochs)
        for col in ("epoch", "train loss", "train acc", "val loss", "val acc", "tok/s", "MFU", "time"):
            table.add_column(col, justify="right")
        if bench:  # --eval-benchmark: a row for the model before training, a column for each epoch
            table.add_column(f"{self._bench_name()} acc", justify="right")
            if self.bench is not None:
                table.add_row("before", *["-"] * 7, percent(self.bench.accuracy, self.bench.accuracy_err))
        for e in self.epochs:
            table.add_row(str(e["epoch"]), *(_with_err(e, key) for key in _EPOCH_STATS),
                          f"{e['tokens_per_s']:,.0f}", _percent_or_dash(e.get("mfu", math.nan)),
                          f"{e['seconds']:.1f}s",
                          *([percent(e["bench_accuracy"], e["bench_accuracy_err"])] if bench else []))
        return table


def data_line(data: dict) -> str:
    """The start report's line on the data (train/chat.py data_info)."""
    per_epoch = f"{data['loss_tokens_per_epoch']:,} tokens carry loss per epoch"
    if data["format"] == "text":
        left_out = data.get("left_out")
        left_out = (f"; {left_out} training windows overlapping a validation window left out (--val-pick random)"
                    if left_out else "")
        return f"data: text, every token of each window carries loss{left_out}; {per_epoch}"
    if data["format"] == "unpaired":
        notes = [f"{data['dropped']} dropped (longer than --ctx)"] if data["dropped"] else []
        notes += [f"{data['truncated']} KL completions cut to --ctx"] if data["truncated"] else []
        kl = "prompt once, then its completion and another example's for the KL estimate; " if data["kl"] else ""
        return (f"data: {data['examples']:,} {'conversational' if data['conversational'] else 'plain'} unpaired "
                f"examples ({data['desirable']:,} desirable, {data['undesirable']:,} undesirable), one per window "
                f"({kl}{data['padding']:.0%} padding){''.join('; ' + n for n in notes)}; {per_epoch} (the "
                f"completions' tokens)")
    if data["format"] == "preference":
        dropped = f"; {data['dropped']} dropped (longer than --ctx)" if data["dropped"] else ""
        return (f"data: {data['examples']:,} {'conversational' if data['conversational'] else 'plain'} preference "
                f"pairs, one per window (prompt once, then chosen and rejected; {data['padding']:.0%} padding)"
                f"{dropped}; {per_epoch} (the completions' tokens)")
    if data["format"] == "prompt":  # GRPO (train/grpo.py): completions sampled in the loop
        dropped = (f"; {data['dropped']} dropped (no room for --max-completion-length in --ctx)"
                   if data["dropped"] else "")
        return (f"data: {data['examples']:,} {'conversational' if data['conversational'] else 'plain'} prompts, "
                f"each sampled --num-generations times a step, one completion per window{dropped}")
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



def loss_line(losses: list) -> str:
    """'loss ▇▅▃▂▁ 5.3265 -> 2.0109 (steps 1-934)': the finetune summary's last line, and `llmtune plot`'s."""
    steps, values = [s for s, _ in losses], [v for _, v in losses]
    return (f"loss {sparkline(values)} {values[0]:.4f} -> {values[-1]:.4f} "
            f"(steps {steps[0]}-{steps[-1]})")


def _percent_or_dash(value: float) -> str:
    return "-" if value != value else f"{100 * value:.1f} %"


def _mfu(value: float) -> str:
    """", 41.2 % MFU" (model FLOP utilisation, train/flops.py); "" where it is unknown."""
    return "" if value != value else f", {100 * value:.1f} % MFU"


def _preference_words(metrics: dict) -> str:
    """A preference step's or validation's TRL metrics in a few words ("" for supervised runs);
    acc is then rewards/accuracies."""
    if not metrics:
        return ""
    if "reward" in metrics:  # GRPO (train/grpo.py): TRL's reward, its spread, clipping, KL, completion length
        words = f"reward {metrics['reward']:.3f} ± {metrics['reward_std']:.3f}, "
        if "clip_ratio/region_mean" in metrics:
            words += f"clip {metrics['clip_ratio/region_mean']:.3f}, "
        if "kl" in metrics:
            words += f"kl {metrics['kl']:.4f}, "
        return words + f"len {metrics['completions/mean_length']:.1f}, "
    # KTO's batch may hold one label only: TRL then logs no margin, nor the other label's reward
    words = "".join(f"{name} {metrics[key]:.3f}, " for name, key in (
        ("margin", "rewards/margins"), ("chosen", "rewards/chosen"), ("rejected", "rewards/rejected"), ("kl", "kl"))
        if key in metrics)
    if "log_odds_ratio" in metrics:
        words += f"nll {metrics['nll_loss']:.3f}, log odds ratio {metrics['log_odds_ratio']:.3f}, "
    return words
