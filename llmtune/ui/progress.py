"""The progress bar every long command shows on stderr: label, bar, done/total, then its own columns."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn


def progress_bar(console: Console, *columns: ProgressColumn, transient: bool = True, **options) -> Progress:
    """A rich Progress showing `[bold]description`, a bar and `done/total`, followed by `columns`.

    Transient by default: the bar disappears when the work ends, leaving only the results. Off when
    the console is not a terminal: a log file gets the results only, no blank line where a bar was.
    """
    options.setdefault("disable", not console.is_terminal)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *columns,
                    console=console, transient=transient, **options)
