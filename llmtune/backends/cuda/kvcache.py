"""The CUDA kernels of ops.py's scheduling and KV cache sections (kvcache.cu): `after` (a view of
its input) and cache_write (the new tokens' k/v written at their positions)."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import BLOCK, flat_grid


class CacheKernels:
    def _k_after(self, out, x, dep):
        return x

    def _k_cache_write(self, out, cache, x, pos):
        """cache[:, :, pos[t]] = x[:, t] in place (pos [B, T]: cache[b, :, pos[b, t]] = x[b, t]; the
        cache contiguous); returns the cache."""
        if not cache.flags.c_contiguous:
            raise ValueError("cache_write: the cache must be contiguous")
        x = self._contig(x)
        B, T, H, d = x.shape
        if x.size:
            self._launch("cache_write", cache.dtype, flat_grid(x.size), (BLOCK,), x, self._ids(pos), cache,
                         np.int32(T), np.int32(H), np.int32(cache.shape[2]), np.int32(d),
                         np.int32(T if len(pos.shape) == 2 else 0), np.int64(x.size))
        return cache
