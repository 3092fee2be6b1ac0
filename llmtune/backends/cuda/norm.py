"""The CUDA kernels of ops.py's normalization section (norm.cu): RMS and layer norm and their
backwards, one block per row."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import row_threads


class NormKernels:
    def _k_rms_norm(self, out, x, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("rms_norm", out.dtype, (rows,), row_threads(n), x, out, np.int32(n), out.dtype.type(eps))
        return out

    def _k_rms_norm_back(self, out, x, g, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("rms_norm_back", out.dtype, (rows,), row_threads(n), x, self._contig(g), out,
                         np.int32(n), out.dtype.type(eps))
        return out

    def _k_layer_norm(self, out, x, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("layer_norm", out.dtype, (rows,), row_threads(n), x, out, np.int32(n), out.dtype.type(eps))
        return out

    def _k_layer_norm_back(self, out, x, g, eps):
        x, rows, n = self._rows(x)
        if rows:
            self._launch("layer_norm_back", out.dtype, (rows,), row_threads(n), x, self._contig(g), out,
                         np.int32(n), out.dtype.type(eps))
        return out
