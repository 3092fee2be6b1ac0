"""What a run may use, checked before the work starts: memory, free disk space, writable folders;
and the one way outputs are written (atomically, through a temp file beside them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Optional

from llmtune.errors import LlmtuneError


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"


MEMORY_LIMIT_ENV = "LLMTUNE_MEMORY_LIMIT"  # a cap on what a run may use (bytes, or 512M, 2G...)
_limit_flag: Optional[tuple[str, int]] = None  # --memory-limit as given and in bytes (set_memory_limit)


def parse_size(value: str, where: str) -> int:
    """Bytes of a size written as a number, optionally with K, M, G or T (powers of 1024): 3.5G.
    A LlmtuneError naming `where` (the flag or variable) when it is not one."""
    value = value.strip()
    scale = 1024 ** (" KMGT".index(value[-1].upper())) if value and value[-1].upper() in "KMGT" else 1
    try:
        size = int(float(value[:-1] if scale > 1 else value) * scale)
    except ValueError:
        size = -1
    if size <= 0:
        raise LlmtuneError(f"{where}: not a size (bytes, or a number with K, M, G or T, as 3.5G)")
    return size


def set_memory_limit(value: Optional[str], flag: str = "--memory-limit") -> None:
    """A command's --memory-limit: the cap every memory decision of this process reads (in place
    of LLMTUNE_MEMORY_LIMIT, its default); None drops it."""
    global _limit_flag
    _limit_flag = None if value is None else (f"{flag} {value}", parse_size(value, f"{flag} {value}"))


def memory_limit() -> Optional[int]:
    """The cap on what a run may use, in bytes: --memory-limit (set_memory_limit), else
    LLMTUNE_MEMORY_LIMIT (a number, optionally with K, M, G or T); None when neither is set."""
    if _limit_flag is not None:
        return _limit_flag[1]
    value = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    return parse_size(value, f"{MEMORY_LIMIT_ENV}={value}") if value else None


def memory_limit_source() -> str:
    """Where the cap came from, as the user wrote it ("--memory-limit 3.5G", "LLMTUNE_MEMORY_LIMIT=2G")."""
    if _limit_flag is not None:
        return _limit_flag[0]
    return f"{MEMORY_LIMIT_ENV}={os.environ.get(MEMORY_LIMIT_ENV, '').strip()}"


def available_memory(backend=None) -> Optional[int]:
    """Bytes a run may allocate: the device's free memory (a backend that can tell), else
    MemAvailable on the host; at most LLMTUNE_MEMORY_LIMIT; None when unknown."""
    limit = memory_limit()
    probe = getattr(backend, "available_memory", None)
    if probe is not None:
        avail = probe()
    else:
        avail = _host_available()
    return avail if limit is None else limit if avail is None else min(avail, limit)


def binding_limit(backend=None) -> Optional[int]:
    """The memory limit (--memory-limit, LLMTUNE_MEMORY_LIMIT) when it, not the free memory, bounds
    the run: then it is the budget of the whole process, what it holds already included."""
    limit = memory_limit()
    if limit is None:
        return None
    probe = getattr(backend, "available_memory", None)
    free = probe() if probe is not None else _host_available()
    return limit if free is None or limit <= free else None


def limit_reserve(limit: int) -> int:
    """Bytes of a memory limit kept for what no estimate names (OpenBLAS's per-thread buffers, the
    allocator's slack, numpy's temporaries between planned buffers, a checkpoint's write): 5 % of
    it, at least 256 MiB (a quarter of a limit under 1 GiB). Measured: a 1B-class QLoRA run
    (configs/llama-1b.toml, q4_k_m, ctx 512) peaked 160 MiB above its printed estimate, runtime
    included."""
    return max(min(256 << 20, limit // 4), limit * 5 // 100)


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(need: int, what: str, shrink: str, backend=None) -> None:
    """Refuse up front, in one line, work that needs more memory than is available: `what` (the
    file or command) needs about NEED but only AVAIL is available (lower `shrink`)."""
    avail = available_memory(backend)
    if avail is not None and need > avail:
        raise LlmtuneError(f"{what}: needs about {_mib(need)} of memory but only {_mib(avail)} is available"
                           + (f" (lower {shrink})" if shrink else ""))


def out_of_memory_message(exc: MemoryError, what: str, shrink: str) -> str:
    """An allocation that failed anyway (numpy's or cupy's MemoryError) in check_memory's words."""
    need = getattr(exc, "_total_size", None) or getattr(exc, "size", None)  # numpy's _ArrayMemoryError; cupy's
    avail = available_memory()
    asked = f"could not allocate {_mib(need)}" if isinstance(need, int) else "ran out of memory"
    have = f"; {_mib(avail)} is available" if avail is not None else ""
    return f"{what}: {asked}{have}" + (f" (lower {shrink})" if shrink else "")


HUGEPAGE_ENV = "NUMPY_MADVISE_HUGEPAGE"


def prefer_small_pages() -> bool:
    """Stop numpy from asking the kernel for transparent huge pages for its big arrays (its default
    on Linux, unless the user set NUMPY_MADVISE_HUGEPAGE, which then decides). A madvised region's
    first touch compacts memory when free memory is fragmented (Linux's default THP defrag=madvise):
    on a long-running machine a pass's fresh 97 MiB arena took 1.0-1.6 s to fault in that way,
    against ~0.05 s in 4 KiB pages, and later passes ran no faster with huge pages (a SmolLM2
    perplexity pass, a LoRA step). ggml's buffers take no advice either. The commands call this
    first; the library leaves the caller's numpy alone. True where it took effect."""
    if os.environ.get(HUGEPAGE_ENV, "").strip():
        return False
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # noqa: PLC0415 - private: tried, numpy 2
    except ImportError:  # numpy < 2: numpy.core
        try:
            from numpy.core.multiarray import _set_madvise_hugepage  # noqa: PLC0415 - numpy 1's place
        except ImportError:
            return False
    _set_madvise_hugepage(False)
    return True


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
            f"{folder}: {what} need about {need / 2**20:,.0f} MiB of disk space but only "
            f"{free / 2**20:,.0f} MiB is free"
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
