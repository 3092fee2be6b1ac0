"""Compile a C source of this folder into a shared library at first use, cached per machine.

As tinygrad's CPU backend does: the system compiler (`$CC`, else `cc`) builds `<name>.c` with
`-O3 -march=native` (retried without -march=native where the compiler refuses it) into
`<cache>/<name>-<key>.so`, where the key hashes the source, the compiler's identity, the flags and
the CPU's feature flags, so a changed source, compiler or machine gets its own build. The library
is written to a temporary name and renamed into place (two processes building at once both end
with a whole file). Every failure (no compiler, a compile error, an unwritable cache) is a
reason string, never an exception: the callers fall back to numpy.

The cache folder: `$LLMTUNE_CACHE_DIR`, else `$XDG_CACHE_HOME/llmtune`, else `~/.cache/llmtune`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off"]
NATIVE_FLAGS = ["-march=native"]
COMPILE_TIMEOUT_S = 120


class BuildError(Exception):
    """Why a native library is not available (a one-line reason)."""


def cache_dir() -> Path:
    env = os.environ.get("LLMTUNE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "llmtune"


def compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise BuildError(f"no C compiler ({cc!r} is not on PATH)")
    return path


def _compiler_identity(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} --version failed: {e}") from None
    return cc + "\n" + done.stdout


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_key(source: bytes, cc_identity: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, cc_identity.encode(), " ".join(flags).encode(), _cpu_flags().encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile(cc: str, src: Path, flags: list[str], out: Path) -> str | None:
    """None on success, else the compiler's last error line."""
    try:
        done = subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if done.returncode == 0:
        return None
    lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def build(name: str) -> Path:
    """The path of `<name>.c` compiled for this machine (built now if not cached)."""
    src = HERE / f"{name}.c"
    source = src.read_bytes()
    cc = compiler()
    identity = _compiler_identity(cc)
    folder = cache_dir()
    errors = []
    for flags in (FLAGS + NATIVE_FLAGS, FLAGS):
        lib = folder / f"{name}-{library_key(source, identity, flags)}.so"
        if lib.is_file():
            return lib
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            raise BuildError(f"cache folder {folder}: {e.strerror or e}") from None
        try:
            err = _compile(cc, src, flags, Path(tmp))
            if err is None:
                os.replace(tmp, lib)
                return lib
            errors.append(err)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise BuildError(f"{cc} could not build {src.name}: {errors[-1]}")


def load(name: str) -> ctypes.CDLL:
    """`<name>.c` built (or taken from the cache) and loaded."""
    path = build(name)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"{path}: {e}") from None
