"""`llmtune eval --reward` output: a progress bar, the per-grader table (base and adapter side by
side with --lora), confusion tables of label answers, the JSON."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from rich.console import Console
from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from llmtune.errors import plural
from llmtune.eval.graded import Comparison, GradedProgress, GradedResult
from llmtune.ui.perplexity import write_json as _write_json
from llmtune.ui.progress import progress_bar


@contextmanager
def graded_progress(console: Console, line_every: float = 30.0) -> Iterator[Callable[[GradedProgress], None]]:
    """A transient bar over the completions (each stage: base, adapter), with tokens/s and the
    running mean reward; off a terminal, a line at most every `line_every` seconds."""
    columns = (TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[reward]}"), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    last = [time.monotonic()]
    with progress_bar(console, *columns) as bar:
        tasks: dict[str, int] = {}

        def on_progress(p: GradedProgress) -> None:
            if p.stage not in tasks:
                tasks[p.stage] = bar.add_task(f"{p.stage} completions", total=p.total, rate="", reward="")
            reward = f"reward {p.reward:.4f}" if p.reward is not None else ""
            bar.update(tasks[p.stage], completed=p.done, rate=f"{p.tokens / max(p.seconds, 1e-9):,.0f} tok/s",
                       reward=reward)
            now = time.monotonic()
            if not console.is_terminal and now - last[0] >= line_every:
                last[0] = now
                console.print(f"eval: {p.stage} {p.done}/{p.total} completions, {reward}, {p.seconds:,.0f} s",
                              highlight=False)

        yield on_progress


def _num(v: Optional[float], signed: bool = False) -> str:
    return "-" if v is None else f"{v:+.4f}" if signed else f"{v:.4f}"


def rewards_table(c: Comparison) -> Table:
    """Rows: each grader's mean (its weight), the weighted reward, pass@1 and pass@k; columns: the
    model, or base, adapter and their difference."""
    k = c.model.k
    title = (f"{c.task}: {plural(len(c.model.prompts), 'prompt')}, "
             + (f"{k} samples each at temp {c.settings.temp:g}" if c.settings.samples else "greedy"))
    table = Table(title=Text(title))
    table.add_column("grader")
    cols = [c.base, c.model] if c.base is not None else [c.model]
    for name in (["base", "adapter", "difference"] if c.base is not None else ["mean"]):
        table.add_column(name, justify="right")

    def row(label: str, values: list, style: Optional[str] = None) -> None:
        diff = [_num(values[1] - values[0] if None not in values else None, True)] if len(values) == 2 else []
        table.add_row(Text(label), *map(_num, values), *diff, style=style)

    for (name, spec, weight) in c.graders:
        row(f"{name} (x{weight:g})", [r.rewards[name] for r in cols])
    row("reward (weighted sum)", [r.reward for r in cols], style="bold")
    passes = [r.pass_at() for r in cols]
    for j in sorted({1, k}):
        row(f"pass@{j} (reward >= {c.model.threshold:g})", [p.get(j) for p in passes])
    return table


def confusion_tables(res: GradedResult, label: str = "") -> list[Table]:
    """One table per label grader: rows gold, columns predicted (normalised answers)."""
    tables = []
    for name, conf in res.confusion().items():
        table = Table(title=Text(f"{name}{label}: gold (rows) x predicted (columns)"))
        table.add_column("gold")
        for p in conf["predicted"]:
            table.add_column(Text(p), justify="right")
        for gold, counts in zip(conf["gold"], conf["counts"]):
            table.add_row(Text(gold), *map(str, counts))
        tables.append(table)
    return tables


def summary_lines(c: Comparison) -> list[str]:
    lines = []
    if c.partial:
        lines.append(f"Interrupted: the results are over the {len(c.model.prompts)} of {c.model.n_planned} prompts "
                     f"done")
    for label, r in (("base", c.base), ("adapter" if c.base is not None else "model", c.model)):
        if r is not None:
            rate = r.n_tokens / r.seconds if r.seconds > 0 else 0.0
            lines.append(f"{label}: {plural(r.n_tokens, 'completion token')} in {r.seconds:.2f} s ({rate:,.1f} "
                         f"tokens/s)")
    return lines


def write_json(result: Comparison, path, *inputs):
    """rewards {grader: mean}, reward, pass_at, confusion, every prompt's completions and grades;
    with --lora those of the adapted model, and the base's under "base" (atomic, never over an input)."""
    return _write_json(result, path, *inputs)


def report(out: Console, c: Comparison, json_out, inputs) -> None:
    """The tables and summary on stdout, then --json."""
    out.print(rewards_table(c))
    for table in [*(confusion_tables(c.base, " (base)") if c.base else []), *confusion_tables(c.model)]:
        out.print(table)
    for line in summary_lines(c):
        out.print(line, highlight=False)
    if json_out is not None:
        write_json(c, json_out, *inputs)
