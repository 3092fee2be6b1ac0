"""`llmtune eval` output: a progress bar, llama-perplexity's benchmark lines, per-topic table, JSON."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmtune.errors import plural
from llmtune.eval.benchmarks import BenchmarkProgress, BenchmarkResult, wilson_interval
from llmtune.ui.format import percent
from llmtune.ui.perplexity import stream_writer, write_json as _write_json
from llmtune.ui.progress import progress_bar

TITLES = {"hellaswag": "HellaSwag", "winogrande": "Winogrande", "multiple-choice": "Multiple choice"}


@contextmanager
def benchmark_progress(console: Console, out: Console = None) -> Iterator[Callable[[BenchmarkProgress], None]]:
    """A transient bar over the tasks scored, with tokens/s; yields the `progress` callback. With
    `out`, llama.cpp's running line per task streams there as each task finishes (in the order they
    finish: passes group tasks by length); the bar then shows only when `out` is not a terminal."""
    columns = (TextColumn("tasks"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    write = stream_writer(out)[0] if out is not None else None
    hide = out is not None and out.is_terminal
    state = {"done": 0, "correct": 0}
    try:
        with progress_bar(console, *columns, redirect_stdout=False, **({"disable": True} if hide else {})) as bar:
            task = bar.add_task("benchmark", total=None, rate="")

            def on_progress(p: BenchmarkProgress) -> None:
                for t in p.finished if write is not None else ():
                    if state["done"] == 0 and running_header(p.kind):
                        write(running_header(p.kind) + "\n")
                    state["done"] += 1
                    state["correct"] += t.correct
                    write(running_line(p.kind, state["done"], state["correct"], t) + "\n")
                bar.update(task, completed=p.tasks_done, total=p.n_tasks,
                           rate=f"{p.tokens_done / max(p.seconds, 1e-9):,.0f} tok/s")

            yield on_progress
    finally:
        if write is not None and state["done"]:
            write("\n")  # llama-perplexity's blank line between the running lines and the result


def running_header(kind: str) -> str:
    """The line llama-perplexity prints before its running lines ('' for Winogrande)."""
    return {"hellaswag": "task\tacc_norm\t95% confidence interval", "winogrande": ""}.get(kind, "task\tacc_norm")


def running_line(kind: str, i: int, correct: int, t) -> str:
    """llama-perplexity's line after i tasks, `correct` of them right, `t` the last one scored."""
    if kind == "hellaswag":
        lo, hi = wilson_interval(correct, i)
        return f"{i}\t{100 * correct / i:3.8f}%\t[{100 * lo:3.4f}%, {100 * hi:3.4f}%]"
    if kind == "winogrande":
        return (f"{i}\t{100 * correct / i:.4f}\t{t.scores[0]:10.6f}  {t.scores[1]:10.6f}  "
                f"{t.choice + 1}  {t.gold[0] + 1}")
    return f"{i}\t{100 * correct / i:.8f}"


def running_lines(res: BenchmarkResult) -> list[str]:
    """One line per task with the accuracy so far, exactly as llama-perplexity prints them."""
    lines = [running_header(res.kind)] if running_header(res.kind) else []
    correct = 0
    for i, t in enumerate(res.tasks, 1):
        correct += t.correct
        lines.append(running_line(res.kind, i, correct, t))
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
    if res.partial:
        lines.insert(0, f"Interrupted: the results below are over the {n} of {res.n_tasks_planned} tasks done")
    rate = n / res.seconds if res.seconds > 0 else float("inf")
    shared = f" ({res.n_computed:,} computed: questions shared)" if 0 < res.n_computed < res.n_tokens else ""
    lines.append(f"{plural(n, 'task')} ({res.n_correct} right), {plural(res.n_tokens, 'token')}{shared} in "
                 f"{res.seconds:.2f} s: "
                 f"{rate:,.1f} tasks/s, {res.tokens_per_s:,.0f} tokens/s")
    return lines


def format_report(res: BenchmarkResult, running: bool = True) -> str:
    """The running lines (unless they streamed already) and the final ones."""
    return "\n".join((running_lines(res) + [""] if running else []) + summary_lines(res))


def topics_table(res: BenchmarkResult) -> Table:
    table = Table(title=f"{TITLES.get(res.kind, res.kind)}: accuracy per topic")
    for col, justify in (("topic", "left"), ("right", "right"), ("tasks", "right"), ("accuracy", "right")):
        table.add_column(col, justify=justify)
    for topic, (right, total) in res.topics.items():
        table.add_row(str(topic), str(right), str(total), percent(right / total))
    table.add_row("all", str(res.n_correct), str(res.n_tasks), percent(res.accuracy), style="bold")
    return table


def write_json(result: BenchmarkResult, path, *inputs):
    """Every task's scores and choice, the totals and timings, as JSON (atomic, never over an input)."""
    return _write_json(result, path, *inputs)
