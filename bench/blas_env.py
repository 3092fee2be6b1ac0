"""OpenBLAS at its best for a benchmark, and the kernel it ran, to print beside each figure.

Some machines set OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) because older OpenBLAS builds misbehave
on their processors; a current numpy's OpenBLAS then runs older kernels (Haswell's on an AVX-512
CPU), slower. llmtune is measured as it runs at its best: a bench script calls at_its_best() before
it imports numpy, which restarts it without both variables (in that command alone; children it
starts inherit that), unless LLMTUNE_BENCH_BLAS_ENV=keep asks to measure the kernels they choose.
"""

from __future__ import annotations

import os
import sys

KNOBS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


_named = False


def at_its_best() -> None:
    """Restart this script without KNOBS where any is set (and LLMTUNE_BENCH_BLAS_ENV is not
    'keep'); else name the kernel on stderr, once per process (stdout may be a child's JSON)."""
    global _named
    present = [k for k in KNOBS if k in os.environ]
    if not present or os.environ.get("LLMTUNE_BENCH_BLAS_ENV") == "keep":
        if not _named:
            _named = True
            print(f"numpy's BLAS: {kernel()}", file=sys.stderr, flush=True)
        return
    print(f"(restarting without {' and '.join(present)}: numpy's OpenBLAS at its best kernel; "
          f"LLMTUNE_BENCH_BLAS_ENV=keep measures with them)", file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def kernel() -> str:
    """'OpenBLAS 0.3.31 SkylakeX' (llmtune.backends.cpu.threads.blas_kernel), with the variables that chose it."""
    from llmtune.backends.cpu.threads import blas_kernel

    chosen = ", ".join(f"{k}={os.environ[k]}" for k in KNOBS if k in os.environ)
    return (blas_kernel() or "no OpenBLAS") + (f" ({chosen})" if chosen else "")
