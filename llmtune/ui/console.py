"""The CLI's consoles: rich on a terminal, unwrapped lines when the output goes to a file or pipe."""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions

NO_WRAP_WIDTH = 4096  # a line (or table) piped to a file is laid out as wide as its content, up to this


class NoWrapConsole(Console):
    """A rich Console that wraps at the terminal's width on a terminal only. Piped or redirected,
    rich would wrap tables and messages at 80 columns (or at another stream's terminal width),
    splitting paths and numbers mid-word; this one lays them out at their natural width. An
    explicit width (or COLUMNS) still wins."""

    @property
    def size(self) -> ConsoleDimensions:
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(NO_WRAP_WIDTH, self._height or 25)
        return Console.size.fget(self)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)
