"""The CUDA kernels of ops.py's embeddings section (embeddings.cu): get_rows and its gradient add_rows."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import BLOCK, flat_grid


class EmbeddingKernels:
    def _k_get_rows(self, out, w, ids):
        ids = self._ids(ids)
        w2 = self._contig(w).reshape(w.shape[0], -1)
        total = ids.size * w2.shape[1]
        if total:
            self._launch("get_rows", out.dtype, flat_grid(total), (BLOCK,), w2, ids, out,
                         np.int64(ids.size), np.int32(w2.shape[1]), np.int32(w2.shape[0]))
        return out

    def _k_add_rows(self, out, g, ids, n_rows):
        ids = self._ids(ids)
        out.fill(0)
        g2 = self._contig(g).reshape(ids.size, -1)
        total = g2.size
        if total:
            self._launch("add_rows", out.dtype, flat_grid(total), (BLOCK,), g2, ids, out,
                         np.int64(ids.size), np.int32(g2.shape[1]), np.int32(n_rows))
        return out
