"""The CLI's consoles: rich on a terminal, unwrapped lines when the output goes to a file or pipe;
standard streams that survive a reader that goes away."""

from __future__ import annotations

import io
import os
import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console, ConsoleDimensions

NO_WRAP_WIDTH = 4096  # a line (or table) piped to a file is laid out as wide as its content, up to this


class NoWrapConsole(Console):
    """A rich Console that wraps at the terminal's width on a terminal only. Piped or redirected,
    rich would wrap tables and messages at 80 columns (or at another stream's terminal width),
    splitting paths and numbers mid-word; this one lays them out at their natural width, and ends
    lines without the padding a table would add. An explicit width (or COLUMNS) still wins."""

    @property
    def size(self) -> ConsoleDimensions:
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(NO_WRAP_WIDTH, self._height or 25)
        return Console.size.fget(self)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)

    def _render_buffer(self, buffer) -> str:
        """What rich writes; off a terminal without the spaces that pad a line to its table's width."""
        text = super()._render_buffer(buffer)
        if self.is_terminal or " \n" not in text:
            return text
        *lines, last = text.split("\n")
        return "\n".join([line.rstrip(" ") for line in lines] + [last])


class PipeSafeStream:
    """A text (or binary) stream that outlives its reader: the first write or flush that finds the
    pipe closed (EPIPE, `llmtune ... | head`) points the stream's descriptor at /dev/null, and from
    then on the output is dropped while the work goes on (files are still written). Everything else
    is the wrapped stream's (isatty, encoding, fileno...)."""

    def __init__(self, stream):
        self._stream = stream
        self.pipe_closed = False

    def __getattr__(self, name):
        return getattr(self._stream, name)

    @property
    def buffer(self):  # `sys.stdout.buffer.write(...)` (tokenize's raw pieces) is guarded too
        raw = getattr(self._stream, "buffer", None)
        return None if raw is None else PipeSafeStream(raw)

    def _closed_pipe(self) -> None:
        self.pipe_closed = True
        try:  # later writes (and the interpreter's last flush) go nowhere instead of raising again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass

    def write(self, data):
        if not self.pipe_closed:
            try:
                return self._stream.write(data)
            except BrokenPipeError:
                self._closed_pipe()
        return len(data)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.pipe_closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._closed_pipe()
                try:
                    self._stream.flush()  # what the buffer still held goes to /dev/null now
                except OSError:
                    pass


@contextmanager
def survive_closed_pipes() -> Iterator[None]:
    """Inside, sys.stdout and sys.stderr are PipeSafeStreams (and so is every console printing to
    them): a reader that goes away (`| head`, a closed terminal) stops the output, not the command.
    Python ignores SIGPIPE, so a closed pipe shows as BrokenPipeError on the write."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if s is None or isinstance(s, PipeSafeStream) else PipeSafeStream(s) for s in saved)
    try:
        yield
    finally:
        for wrapped in (sys.stdout, sys.stderr):
            if isinstance(wrapped, PipeSafeStream):
                wrapped.flush()
        sys.stdout, sys.stderr = saved
