"""What a run may use, checked before the work starts: memory, free disk space, writable folders."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from llmtune.errors import LlmtuneError


def available_memory(backend=None) -> Optional[int]:
    """Bytes a run may allocate: the device's free memory (a backend that can tell), else
    MemAvailable on the host; None when unknown."""
    probe = getattr(backend, "available_memory", None)
    if probe is not None:
        return probe()
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_rss() -> Optional[int]:
    """Resident bytes of this process now (/proc/self/statm), None where it cannot be read."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def free_disk(folder: str | os.PathLike) -> Optional[int]:
    """Bytes free for an unprivileged writer in `folder` (None when the file system cannot say)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def check_writable_folder(path: Path, flag: str) -> None:
    """Create and remove a file in `path`'s folder: the one test that also holds for root, read-only
    mounts and full quotas. A LlmtuneError naming `flag` when it fails."""
    try:
        # a name no leftover scan matches (another rank may be looking for OUT.*.tmp right now)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".write-test", dir=str(path.parent))
    except OSError as exc:
        raise LlmtuneError(f"{flag} {path}: cannot write in {path.parent} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise LlmtuneError(f"{flag} {path}: the file is read-only")


def check_disk_space(folder: Path, need: int, what: str, hint: str = "") -> None:
    """Refuse up front when `folder`'s file system has less than `need` bytes free."""
    free = free_disk(folder)
    if free is not None and need > free:
        raise LlmtuneError(
            f"{folder}: {what} need about {need / 2**20:,.0f} MiB of disk space but only {free / 2**20:,.0f} MiB is free"
            + (f" ({hint})" if hint else "")
        )
