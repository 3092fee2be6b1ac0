"""The CUDA kernels of ops.py's section on weights kept in a GGUF type (quant.cu): a stored matrix
dequantized a block of rows at a time into a scratch, then cuBLAS; activations rounded as
llama.cpp's CPU matmul rounds them (quant/matmul.py is the reference). Type ids, block sizes and
bytes come from quant/types.py (its #defines)."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import BLOCK, flat_grid
from llmtune.quant.types import qtype_of


class QuantKernels:
    q_scratch_elements = 1 << 26  # floats of W dequantized at once by qlinear / qlinear_back (256 MiB)

    def _dequant(self, out, w, qtype, row0=0, ids=None):
        """out [rows, n_cols] = rows row0.. (or ids) of the stored matrix w (uint8 [rows, bytes])."""
        if out.size:
            has_ids = ids is not None
            ids = self._ids(ids) if has_ids else self._no_ids()
            self._launch("dequant_rows", out.dtype, flat_grid(out.size), (BLOCK,), w, ids, out, np.int64(out.size),
                         np.int32(out.shape[-1]), np.int64(w.shape[1]), np.int64(row0), np.int32(has_ids),
                         np.int32(w.shape[0]), np.int32(qtype_of(qtype).ggml_id))
        return out

    def _no_ids(self):
        ids = getattr(self, "_dummy_ids", None)
        if ids is None:
            ids = self._dummy_ids = self.rt.to_device(np.zeros(1, np.int32), np.int32)
        return ids

    def _q_block_rows(self, n_rows, n_cols):
        return max(1, min(n_rows, self.q_scratch_elements // max(1, n_cols)))

    def _k_qlinear(self, out, x, w, qtype, round_x):
        qt = qtype_of(qtype)
        n_out, n_in = out.shape[-1], x.shape[-1]
        x2, o2 = self._contig(x).reshape(-1, n_in), out.reshape(-1, n_out)
        if out.size == 0:
            return out
        corr = None
        if round_x:
            xr = self.xp.empty(x2.shape, x2.dtype)
            block = qt.act_type.block
            corr = self.xp.empty((x2.shape[0], n_in // 32 if qt.has_min else 1), x2.dtype)
            if x2.size:
                n_blocks = x2.size // block
                self._launch("round_act", x2.dtype, flat_grid(n_blocks), (BLOCK,), x2, xr, corr, np.int64(n_blocks),
                             np.int32(block), np.int32(qt.act_type.kind))
            x2 = xr
        rb = self._q_block_rows(n_out, n_in)
        wb = self.xp.empty((rb, n_in), out.dtype)
        for r0 in range(0, n_out, rb):
            r1 = min(n_out, r0 + rb)
            blk = self._dequant(wb[: r1 - r0], w, qtype, r0)
            if n_in == 0:
                o2[:, r0:r1] = 0
                continue
            self._gemm_into(o2[:, r0:r1], x2, blk, True)
            if round_x and qt.has_min:  # + corr @ mins^T: ggml's min term uses s = fp16(d sum q)
                nb = n_in // 32
                mins = self.xp.empty((r1 - r0, nb), out.dtype)
                self._launch("block_mins", out.dtype, flat_grid(mins.size), (BLOCK,), w, mins, np.int64(mins.size),
                             np.int32(nb), np.int64(w.shape[1]), np.int64(r0), np.int32(qt.size))
                part = self.xp.empty((x2.shape[0], r1 - r0), out.dtype)
                self._gemm_into(part, corr, mins, True)
                self.xp.add(o2[:, r0:r1], part, out=o2[:, r0:r1])
        return out

    def _k_qlinear_back(self, out, g, w, qtype):
        n_in, n_out = out.shape[-1], g.shape[-1]
        g2, o2 = self._contig(g).reshape(-1, n_out), out.reshape(-1, n_in)
        if out.size == 0:
            return out
        if n_out == 0:
            out.fill(0)
            return out
        rb = self._q_block_rows(n_out, n_in)
        wb = self.xp.empty((rb, n_in), out.dtype)
        part = None
        for r0 in range(0, n_out, rb):
            r1 = min(n_out, r0 + rb)
            blk = self._dequant(wb[: r1 - r0], w, qtype, r0)
            if r0 == 0:
                self._gemm_into(o2, g2[:, r0:r1], blk, False)
                continue
            if part is None:
                part = self.xp.empty(o2.shape, out.dtype)
            self._gemm_into(part, g2[:, r0:r1], blk, False)
            self.xp.add(o2, part, out=o2)
        return out

    def _k_qget_rows(self, out, w, ids, qtype):
        ids = self._ids(ids).reshape(-1)
        return self._dequant(out.reshape(ids.size, out.shape[-1]), w, qtype, ids=ids).reshape(out.shape)

    def _k_dequantize(self, out, w, qtype):
        return self._dequant(out.reshape(-1, out.shape[-1]), w, qtype).reshape(out.shape)
