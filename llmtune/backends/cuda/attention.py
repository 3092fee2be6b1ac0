"""The CUDA kernels of ops.py's attention softmax and fused attention sections (attention.cu):
causal / masked softmax and its backward one block per row, and blockwise attention
(flash_attn: FlashAttention-2's forward and backward, one block of FA_THREADS per row)."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import row_threads
from llmtune.errors import LlmtuneError

FA_THREADS, FA_MAX_D = 128, 512  # threads per block of the flash_attn kernels; the head_dim bound
C_DEFINES = {"FA_THREADS": FA_THREADS, "FA_MAX_D": FA_MAX_D}  # the same numbers for attention.cu


class AttentionKernels:
    def _k_softmax_causal(self, out, x, pos=None, *, scale, n_q, n_past, window=0):
        x, rows, n = self._rows(x)
        if rows:
            pos_rows = 0  # rows per sequence when positions are per sequence (pos [B, n_q]), else 0
            if pos is None:  # a valid pointer the kernel never reads
                pos_arg, has_pos = getattr(self, "_no_pos", None), 0
                if pos_arg is None:
                    pos_arg = self._no_pos = self.rt.to_device(np.zeros(1, np.int32), np.int32)
            else:
                pos_arg, has_pos = self._ids(pos), 1
                if len(pos.shape) == 2:
                    pos_rows = rows // pos.shape[0]
            self._launch("softmax_causal", out.dtype, (rows,), row_threads(n), x, out, pos_arg, np.int32(has_pos),
                         np.int64(pos_rows), np.int32(n), np.int32(n_q), np.int32(n_past), np.int32(window),
                         out.dtype.type(scale))
        return out

    def _k_softmax_masked(self, out, x, mask, *, scale):
        x, rows, n = self._rows(x)
        if rows:
            mask = self._contig(mask, out.dtype)
            self._launch("softmax_masked", out.dtype, (rows,), row_threads(n), x, out, mask,
                         np.int64(rows // mask.shape[0]), np.int32(n), np.int32(mask.shape[1]), out.dtype.type(scale))
        return out

    def _k_softmax_back(self, out, y, g, scale):
        y, rows, n = self._rows(y)
        if rows:
            self._launch("softmax_back", out.dtype, (rows,), row_threads(n), y, self._contig(g), out,
                         np.int32(n), out.dtype.type(scale))
        return out

    def _fa_args(self, q, k, out, scale, softcap, window) -> tuple:
        """(q, k contiguous), grid rows and the shape/attribute arguments shared by the kernels."""
        B, T, H, d = q.shape
        if d > FA_MAX_D:
            raise LlmtuneError(f"flash_attn: head_dim {d} > {FA_MAX_D}, the CUDA kernel's bound")
        r = out.dtype.type
        return (np.int32(T), np.int32(H), np.int32(k.shape[2]), np.int32(d), r(scale), r(softcap), np.int32(window))

    def _k_flash_attn(self, out, q, k, v, *, scale, softcap, window):
        """O | logsumexp of ops.flash_attn (packed): one block per query row."""
        q, k, v = self._contig(q), self._contig(k), self._contig(v)
        if q.size:
            self._launch("flash_attn_fwd", out.dtype, (q.size // q.shape[-1],), (FA_THREADS,), q, k, v, out[: q.size],
                         out[q.size :], *self._fa_args(q, k, out, scale, softcap, window))
        return out

    def _k_flash_attn_back(self, out, q, k, v, packed, g, *, scale, softcap, window):
        """dq | dk | dv of ops.flash_attn: dq per query row (which also leaves D = rowsum(dO * O)),
        then dk, dv per key row."""
        q, k, v, g = self._contig(q), self._contig(k), self._contig(v), self._contig(g)
        if q.size:
            args = self._fa_args(q, k, out, scale, softcap, window)
            rows = q.size // q.shape[-1]
            D = self.xp.empty(rows, dtype=out.dtype)
            nq, nkv = q.size, k.size
            o, lse = packed[:nq], packed[nq:]
            self._launch("flash_attn_back_q", out.dtype, (rows,), (FA_THREADS,), q, k, v, o, lse, g, out[:nq], D, *args)
            self._launch("flash_attn_back_kv", out.dtype, (k.size // k.shape[-1],), (FA_THREADS,), q, k, v, lse, D, g,
                         out[nq : nq + nkv], out[nq + nkv :], *args)
        return out
