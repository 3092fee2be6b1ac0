"""What a run records about itself: the --metrics file (written, and read back by `llmtune plot`),
and the loss-spike watch."""

from __future__ import annotations

import collections
import json
import os
from typing import Callable, Optional

from llmtune.errors import LlmtuneError

# a loss 3 x (and 2 nats) above the mean of the last 20 steps warns
SPIKE_FACTOR, SPIKE_GAP, SPIKE_WINDOW = 3.0, 2.0, 20


class MetricsLog:
    """--metrics: one JSON record per line (NaN written as null, which JSON has), flushed as it goes.

    A file that fails (disk full, removed folder) is reported once through `warn` and dropped: it
    never costs the run or its model. `keep_lines` (a resumed run): the file's first lines, those
    written up to the checkpoint, stay and the rest are replaced. `lines`: records in the file.
    `listener(record)`: called with every record after it is written, with or without a file
    (--tensorboard and --plot draw from the same records, train/observe.py)."""

    def __init__(self, path: Optional[str], warn: Callable[[str], None], keep_lines: Optional[int] = None,
                 listener: Optional[Callable[[dict], None]] = None):
        self.path, self.warn, self.fh, self.lines, self.listener = path, warn, None, 0, listener
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
        clean = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}
        if self.fh:
            try:
                self.fh.write(json.dumps(clean) + "\n")
                self.fh.flush()
                self.lines += 1
            except OSError as exc:
                self._fail(exc)
        if self.listener is not None:
            self.listener(clean)


def read_metrics(path) -> list[dict]:
    """The records of a --metrics file, in order; a file that is missing, not JSON lines, or holds
    no train_step record is one line naming it (and the line). A last line without its newline
    that does not parse is a record being written by a running finetune, and is left out."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmtuneError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines) and not line.endswith("\n"):
                break
            raise LlmtuneError(f"{path}:{n}: not a JSON record ({exc.msg}); is it a --metrics file?") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise LlmtuneError(f"{path}:{n}: a record without a \"type\"; is it a --metrics file?")
        if record["type"] in ("train_step", "validation") and not isinstance(record.get("global_step"), int):
            raise LlmtuneError(f"{path}:{n}: a {record['type']} record without an integer \"global_step\"")
        records.append(record)
    if not any(r["type"] == "train_step" for r in records):
        raise LlmtuneError(f"{path}: no train_step record; is it a finetune --metrics file?")
    return records


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
