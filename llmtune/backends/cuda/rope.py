"""The CUDA kernel of ops.py's rope section (rope.cu): a cos/sin table per position, then the
rotation (norm or NEOX pairs), forward and inverse."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import BLOCK, element_strides, flat_grid


class RopeKernels:
    def _k_rope(self, out, x, pos, freq_factors=None, *, n_rot, base, freq_scale, mode, inverse):
        pos = self._ids(pos)
        x4 = x if x.ndim == 4 else x.reshape((-1,) + x.shape[-3:])
        n_seq, n_tok, n_head, head_dim = x4.shape
        if out.size == 0:
            return out
        half = n_rot // 2
        dtype = out.dtype
        cos_t = self.xp.empty((n_tok, half), dtype)
        sin_t = self.xp.empty((n_tok, half), dtype)
        if half:
            ff = cos_t if freq_factors is None else self._contig(freq_factors.reshape(-1), dtype)
            self._launch("rope_table", dtype, flat_grid(n_tok * half), (BLOCK,), pos, ff, cos_t, sin_t,
                         np.int32(n_tok), np.int32(half), np.int32(n_rot), np.float64(base),
                         np.float64(freq_scale), np.int32(freq_factors is not None), np.int32(bool(inverse)))
        strides = [np.int64(s) for s in element_strides(x4)]
        self._launch("rope", dtype, flat_grid(out.size), (BLOCK,), x4, cos_t, sin_t, out,
                     np.int32(n_seq), np.int32(n_tok), np.int32(n_head), np.int32(head_dim), *strides,
                     np.int32(n_rot), np.int32(mode == "neox"))
        return out
