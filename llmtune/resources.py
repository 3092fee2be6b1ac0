"""What a run may use, checked before the work starts: memory, free disk space, writable folders;
and the one way outputs are written (atomically, through a temp file beside them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Optional

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


def peak_rss() -> Optional[int]:
    """This process's own peak resident bytes (VmHWM), None where it cannot be read. Not ru_maxrss:
    a vfork'ed child hands its parent's memory to execve, which folds the parent's high-water mark
    into the child's maxrss."""
    try:
        with open("/proc/self/status") as fh:
            return int(next(line for line in fh if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, ValueError, IndexError, StopIteration):
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


def write_atomically(path: Path, write: Callable[[BinaryIO], None], failure: str = "cannot write") -> Path:
    """Write `path` through a temp file beside it (PATH.XXXX.tmp, the name leftover scans look
    for): `write(fh)`, synced, given the usual permissions and renamed into place. The temp file
    goes on every exit path (signals included); an OSError becomes one line, "PATH: failure (why)"."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=str(path.parent))
    except OSError as exc:
        raise LlmtuneError(f"{path}: {failure} ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise LlmtuneError(f"{path}: {failure} ({exc.strerror or exc})") from None
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
