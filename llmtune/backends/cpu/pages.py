"""Host pages handed back to the kernel: the whole pages inside a stretch of an array that holds
zeros (madvise MADV_DONTNEED: a private anonymous page then reads as zeros again and costs no
memory until it is written). Linux only; elsewhere nothing is done."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no libc symbol: nothing to hand back
        _madvise = None


def release_zeros(arr: np.ndarray) -> int:
    """Hand back the whole pages inside `arr` (C-contiguous), whose elements the caller knows to
    be zeros: they stay zeros. Bytes handed back (0 where madvise is not there or refuses)."""
    if _madvise is None or arr.size == 0 or not arr.flags.c_contiguous:
        return 0
    page = mmap.PAGESIZE
    start = -(-arr.ctypes.data // page) * page  # a page part of which lies outside stays
    end = (arr.ctypes.data + arr.nbytes) // page * page
    if end <= start or _madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start
