"""User-facing errors: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import os
from pathlib import Path


class LlmtuneError(Exception):
    """A problem with the user's input (file, flag, data) rather than a bug.

    The message should name the file (or flag) and the problem in one line.
    """

    exit_code = 2  # the CLI's exit status for it


def require_file(path: str | os.PathLike, kind: str) -> Path:
    """`path` as a Path when it names an existing file; otherwise a LlmtuneError saying it is
    missing or a directory (`kind` words what was expected: "a TOML config")."""
    path = Path(path)
    if not path.exists():
        raise LlmtuneError(f"{path}: no such file")
    if path.is_dir():
        raise LlmtuneError(f"{path}: is a directory, not {kind}")
    return path


class TrainingStopped(LlmtuneError):
    """A run that stopped itself (it diverged, or could not write its output) after training had
    begun. `checkpoint`: where its last good state is (None when there is none); `resumable`:
    whether resuming that checkpoint with the same settings finishes the run."""

    exit_code = 3

    def __init__(self, message: str, checkpoint: "Path | None" = None, resumable: bool = False):
        super().__init__(message)
        self.checkpoint, self.resumable = checkpoint, resumable


class Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM. A BaseException, as KeyboardInterrupt is, so that `except
    Exception` never swallows it while every `finally` (temp files) still runs. The CLI exits with
    128 + the signal number (130, 143). A finetune run stopped by the first signal sets
    `checkpoint` to the checkpoint it wrote (or the last one when a second signal aborted it); an
    evaluation (perplexity, eval) sets `partial` to its result over the work done so far."""

    def __init__(self, signum: int, message: str = "", checkpoint: "Path | None" = None):
        super().__init__(message or "interrupted")
        self.signum, self.message, self.checkpoint = signum, message, checkpoint
        self.partial = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class LlmtuneWarning(UserWarning):
    """Something the user should know that does not stop the command (the CLI prints one line)."""


def plural(n: int, word: str, many: str = "") -> str:
    """'1 token', '2 tokens', '1,024 tokens' (`many`: an irregular plural): every count a message
    shows, so none says "1 epochs"."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
