"""The CUDA kernels of ops.py's normalization section (norm.cu): RMS and layer norm and their
backwards, one block per row."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import row_threads


class NormKernels:
    def _norm_rows(self, name, out, x, eps, g=None):
        """One block per row of x: kernel `name`(x, [g,] out, n, eps)."""
        x, rows, n = self._rows(x)
        if rows:
            grads = () if g is None else (self._contig(g),)
            self._launch(name, out.dtype, (rows,), row_threads(n), x, *grads, out, np.int32(n), out.dtype.type(eps))
        return out

    def _k_rms_norm(self, out, x, eps):
        return self._norm_rows("rms_norm", out, x, eps)

    def _k_rms_norm_back(self, out, x, g, eps):
        return self._norm_rows("rms_norm_back", out, x, eps, g)

    def _k_row_rnorm(self, out, x):
        """One block per row: out[row] = 1 / ||x[row]||_2."""
        x, rows, n = self._rows(x)
        if rows:
            self._launch("row_rnorm", out.dtype, (rows,), row_threads(n), x, out, np.int32(n))
        return out

    def _k_layer_norm(self, out, x, eps):
        return self._norm_rows("layer_norm", out, x, eps)

    def _k_layer_norm_back(self, out, x, g, eps):
        return self._norm_rows("layer_norm_back", out, x, eps, g)
