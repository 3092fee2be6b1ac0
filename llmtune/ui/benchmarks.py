"""`llmtune eval` output: a progress bar, llama-perplexity's benchmark lines, per-topic table, JSON."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmtune.eval.benchmarks import BenchmarkProgress, BenchmarkResult, wilson_interval
from llmtune.ui.perplexity import write_json as _write_json
from llmtune.ui.progress import progress_bar

TITLES = {"hellaswag": "HellaSwag", "winogrande": "Winogrande", "multiple-choice": "Multiple choice"}


@contextmanager
def benchmark_progress(console: Console) -> Iterator[Callable[[BenchmarkProgress], None]]:
    """A transient bar over the tasks scored, with tokens/s; yields the `progress` callback."""
    columns = (TextColumn("tasks"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    with progress_bar(console, *columns, redirect_stdout=False) as bar:
        task = bar.add_task("benchmark", total=None, rate="")

        def on_progress(p: BenchmarkProgress) -> None:
            bar.update(task, completed=p.tasks_done, total=p.n_tasks,
                       rate=f"{p.tokens_done / max(p.seconds, 1e-9):,.0f} tok/s")

        yield on_progress


def running_lines(res: BenchmarkResult) -> list[str]:
    """One line per task with the accuracy so far, exactly as llama-perplexity prints them."""
    lines, correct = [], 0
    if res.kind == "hellaswag":
        lines.append("task\tacc_norm\t95% confidence interval")
        for i, t in enumerate(res.tasks, 1):
            correct += t.correct
            lo, hi = wilson_interval(correct, i)
            lines.append(f"{i}\t{100 * correct / i:3.8f}%\t[{100 * lo:3.4f}%, {100 * hi:3.4f}%]")
    elif res.kind == "winogrande":
        for i, t in enumerate(res.tasks, 1):
            correct += t.correct
            lines.append(f"{i}\t{100 * correct / i:.4f}\t{t.scores[0]:10.6f}  {t.scores[1]:10.6f}  "
                         f"{t.choice + 1}  {t.gold[0] + 1}")
    else:
        lines.append("task\tacc_norm")
        for i, t in enumerate(res.tasks, 1):
            correct += t.correct
            lines.append(f"{i}\t{100 * correct / i:.8f}")
    return lines


def summary_lines(res: BenchmarkResult) -> list[str]:
    """llama-perplexity's final lines, then what llmtune adds (base model, speed)."""
    n, p = res.n_tasks, res.accuracy
    if res.kind == "hellaswag":
        lines = [f"HellaSwag acc_norm: {100 * p:.4f} % [{100 * res.ci_low:.4f} %, {100 * res.ci_high:.4f} %] "
                 f"(95 % interval) over {n} tasks"]
    elif res.kind == "winogrande":
        lines = [f"Final Winogrande score({n} tasks): {100 * p:.4f} +/- {100 * res.accuracy_err:.4f}"]
    else:
        rc = res.random_chance
        rc_err = math.sqrt(rc * (1 - rc) / (n - 1)) if n > 1 else 0.0
        lines = [f"Final result: {100 * p:.4f} +/- {100 * res.accuracy_err:.4f}",
                 f"Random chance: {100 * rc:.4f} +/- {100 * rc_err:.4f}"]
    if res.base_accuracy is not None:
        lines.append(f"base model: accuracy {100 * res.base_accuracy:.4f} %, same answer {100 * res.same_choice:.2f} % "
                     f"of tasks, mean KLD {res.kl:.6f} (max {res.kl_max:.6f}) over the scored tokens")
    rate = n / res.seconds if res.seconds > 0 else float("inf")
    shared = f" ({res.n_computed:,} computed: questions shared)" if 0 < res.n_computed < res.n_tokens else ""
    lines.append(f"{n} tasks ({res.n_correct} right), {res.n_tokens:,} tokens{shared} in {res.seconds:.2f} s: "
                 f"{rate:,.1f} tasks/s, {res.tokens_per_s:,.0f} tokens/s")
    return lines


def format_report(res: BenchmarkResult, running: bool = True) -> str:
    return "\n".join((running_lines(res) + [""] if running else []) + summary_lines(res))


def topics_table(res: BenchmarkResult) -> Table:
    table = Table(title=f"{TITLES.get(res.kind, res.kind)}: accuracy per topic")
    for col, justify in (("topic", "left"), ("right", "right"), ("tasks", "right"), ("accuracy", "right")):
        table.add_column(col, justify=justify)
    for topic, (right, total) in res.topics.items():
        table.add_row(str(topic), str(right), str(total), f"{100 * right / total:.2f} %")
    table.add_row("all", str(res.n_correct), str(res.n_tasks), f"{100 * res.accuracy:.2f} %", style="bold")
    return table


def write_json(result: BenchmarkResult, path, *inputs):
    """Every task's scores and choice, the totals and timings, as JSON (atomic, never over an input)."""
    return _write_json(result, path, *inputs)
