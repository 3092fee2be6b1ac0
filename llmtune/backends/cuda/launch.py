"""What every section's launchers share: grid shapes, and the helpers that turn backend arrays
into kernel arguments (contiguous copies, int32 ids, rows)."""

from __future__ import annotations

import numpy as np

BLOCK = 256  # threads per block of the flat (grid-stride) kernels
MAX_BLOCKS = 1 << 16


def flat_grid(n: int) -> tuple:
    return (max(1, min((n + BLOCK - 1) // BLOCK, MAX_BLOCKS)),)


def row_threads(n: int) -> tuple:
    """Threads per block for a row of n elements: about 4 elements per thread, 32..1024."""
    t = 32
    while t < 1024 and t * 4 < n:
        t *= 2
    return (t,)


def element_strides(a) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


class Launcher:
    """The helpers of the section mixins (norm.py, rope.py, ...): `self.rt` is the runtime,
    `self.xp` its array module."""

    def _launch(self, name, dtype, grid, block, *args) -> None:
        self.rt.launch(name, np.dtype(dtype), grid, block, args)

    def _contig(self, a, dtype=None):
        """a itself when C-contiguous (and of dtype), else a contiguous copy; keeps 0-d arrays 0-d."""
        if a.flags.c_contiguous and (dtype is None or a.dtype == dtype):
            return a
        return self.xp.array(a, dtype=dtype or a.dtype, order="C", copy=True)

    def _ids(self, ids):
        """Integer inputs as contiguous int32 device arrays (host arrays are copied over)."""
        if not isinstance(ids, self.xp.ndarray):
            ids = self.rt.to_device(np.asarray(ids), np.int32)
        return self._contig(ids, np.int32)

    def _rows(self, x):
        """x as contiguous [rows, last axis] plus its sizes."""
        x = self._contig(x)
        n = x.shape[-1] if x.ndim else 1
        return x, (x.size // n if n else 0), n

    def _flat(self, name, out, *inputs, extra=()):
        """A grid-stride kernel over same-shaped contiguous inputs and out."""
        ins = [self._contig(a) for a in inputs]
        if out.size:
            self._launch(name, out.dtype, flat_grid(out.size), (BLOCK,), *ins, out, np.int64(out.size), *extra)
        return out
