"""What a run records about itself: the --metrics file, and the loss-spike watch."""

from __future__ import annotations

import collections
import json
import os
from typing import Callable, Optional

SPIKE_FACTOR, SPIKE_GAP, SPIKE_WINDOW = 3.0, 2.0, 20  # a loss 3 x (and 2 nats) above the mean of the last 20 steps warns


class MetricsLog:
    """--metrics: one JSON record per line (NaN written as null, which JSON has), flushed as it goes.

    A file that fails (disk full, removed folder) is reported once through `warn` and dropped: it
    never costs the run or its model. `keep_lines` (a resumed run): the file's first lines, those
    written up to the checkpoint, stay and the rest are replaced. `lines`: records in the file."""

    def __init__(self, path: Optional[str], warn: Callable[[str], None], keep_lines: Optional[int] = None):
        self.path, self.warn, self.fh, self.lines = path, warn, None, 0
        if not path:
            return
        try:
            kept = []
            if keep_lines is not None and os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    kept = [line for _, line in zip(range(keep_lines), fh)]
            self.fh = open(path, "w", encoding="utf-8")
            self.fh.writelines(kept)
            self.lines = len(kept)
        except (OSError, UnicodeDecodeError) as exc:
            self._fail(exc)

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.fh:
            try:
                self.fh.close()
            except OSError as err:
                self.fh = None
                self._fail(err)

    def _fail(self, exc: Exception) -> None:
        self.warn(f"--metrics {self.path}: cannot write ({getattr(exc, 'strerror', None) or exc}); "
                  f"training goes on without it")
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass
        self.fh = None

    def write(self, record: dict) -> None:
        if self.fh:
            clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}
            try:
                self.fh.write(json.dumps(clean) + "\n")
                self.fh.flush()
                self.lines += 1
            except OSError as exc:
                self._fail(exc)


class LossWatch:
    """Warns (once per excursion) when a step's loss is far above its running average: more than
    SPIKE_FACTOR times the mean of the last SPIKE_WINDOW steps and SPIKE_GAP nats above it."""

    def __init__(self):
        self.recent: collections.deque = collections.deque(maxlen=SPIKE_WINDOW)
        self.high = False

    def check(self, loss: float) -> Optional[str]:
        message = None
        if len(self.recent) >= 5:
            avg = sum(self.recent) / len(self.recent)
            spike = loss > SPIKE_FACTOR * avg and loss > avg + SPIKE_GAP
            if spike and not self.high:
                message = (f"the loss {loss:.4f} is {loss / avg:.1f} x its running average {avg:.4f} "
                           f"(is the learning rate too high?)")
            self.high = spike
        self.recent.append(loss)
        return message
