"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM: the first signal asks the run
to finish its current step and write a checkpoint; a second one aborts at once (Interrupted)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Optional

from llmtune.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}.get(signum, f"signal {signum}")


class StopRequest:
    """While entered (in the main thread only: Python delivers signals there), SIGINT and SIGTERM
    set `signum` instead of stopping the process; the run polls `requested` between steps.
    `on_request(signum)` is told at once (the CLI prints what will happen). The handlers that
    were installed before come back on exit."""

    def __init__(self, on_request: Optional[Callable[[int], None]] = None):
        self.signum: Optional[int] = None
        self.on_request = on_request
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: abort now, whatever is running
            raise Interrupted(signum, f"{signal_name(signum)} again: aborted at once")
        self.signum = signum
        if self.on_request is not None:
            self.on_request(signum)


@contextmanager
def signals_held():
    """SIGINT and SIGTERM that arrive inside are held until its end, then handled as they would
    have been (the handler installed before, usually raising Interrupted): what the block does, a
    write and the record of what it wrote, happens whole or not at all. In the main thread only
    (Python delivers signals there); elsewhere a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])  # delivered again, to the handler now back in place
