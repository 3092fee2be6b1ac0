"""User-facing errors: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import os
from pathlib import Path


class LlmtuneError(Exception):
    """A problem with the user's input (file, flag, data) rather than a bug.

    The message should name the file (or flag) and the problem in one line.
    """


def require_file(path: str | os.PathLike, kind: str) -> Path:
    """`path` as a Path when it names an existing file; otherwise a LlmtuneError saying it is
    missing or a directory (`kind` words what was expected: "a TOML config")."""
    path = Path(path)
    if not path.exists():
        raise LlmtuneError(f"{path}: no such file")
    if path.is_dir():
        raise LlmtuneError(f"{path}: is a directory, not {kind}")
    return path
