"""The progress bar every long command shows on stderr: label, bar, done/total, then its own columns."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn


def progress_bar(console: Console, *columns: ProgressColumn, transient: bool = True, **options) -> Progress:
    """A rich Progress showing `[bold]description`, a bar and `done/total`, followed by `columns`.

    Transient by default: the bar disappears when the work ends, leaving only the results. Off when
    the console is not a terminal: a log file gets the results only, no blank line where a bar was.
    """
    options.setdefault("disable", not console.is_terminal)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *columns,
                    console=console, transient=transient, **options)


@contextmanager
def tensor_progress(console: Console, description: str,
                    line_every: float = 30.0) -> Iterator[Callable[[int, int, str], None]]:
    """The progress of a command that writes a model tensor by tensor (export, init); yields their
    `progress(done, total, name)` callback. On a terminal, a transient bar naming the tensor just
    written; off one (a log), a line at most every `line_every` seconds, so a long run (a 7B init
    takes many minutes) shows it is moving and a short one prints nothing."""
    start = last = time.monotonic()
    with progress_bar(console, TimeElapsedColumn(), TextColumn("{task.fields[tensor]}")) as bar:
        task = bar.add_task(description, total=None, tensor="")

        def on_tensor(done: int, total: int, name: str) -> None:
            nonlocal last
            bar.update(task, completed=done, total=total, tensor=name)
            now = time.monotonic()
            if not console.is_terminal and now - last >= line_every:
                last = now
                console.print(f"{description}: {done}/{total} tensors written ({name}), {now - start:,.0f} s",
                              highlight=False)

        yield on_tensor
