"""The fused optimizer steps over one flat buffer (optim.cu): AdamW as ggml_opt_step_adamw, AdamW8bit
as bitsandbytes' (block-wise 8-bit moments, quant/dynamic8.py), SGD."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import BLOCK, MAX_BLOCKS, flat_grid
from llmtune.quant.dynamic8 import BLOCK as QBLOCK

# one thread block of BLOCK threads per quantization block, each thread holding QBLOCK / BLOCK values
C_DEFINES = {"ADAM8_PER_THREAD": QBLOCK // BLOCK}


class OptimizerKernels:
    def _check_flat(self, *bufs) -> int:
        n = bufs[0].size
        for b in bufs:
            if b.size != n or not b.flags.c_contiguous or b.dtype != bufs[0].dtype:
                raise ValueError("optimizer buffers must be contiguous, of one dtype and one size")
        return n

    def adamw_step(self, w, g, m, v, *, lr, beta1, beta2, eps, wd, t):
        n = self._check_flat(w, g, m, v)
        if n:
            r = w.dtype.type
            self._launch("adamw_step", w.dtype, flat_grid(n), (BLOCK,), w, g, m, v, np.int64(n), r(lr), r(beta1),
                         r(beta2), r(eps), r(wd), r(1.0 / (1.0 - beta1**t)), r(1.0 / (1.0 - beta2**t)))

    def adamw8bit_step(self, w, g, m, v, absmax_m, absmax_v, starts, code_m, code_v, *, lr, beta1, beta2, eps, wd, t):
        n = self._check_flat(w, g)
        self._check_flat(m, v)
        n_blocks = starts.size - 1
        if m.size != n or m.dtype != np.uint8 or absmax_m.size != n_blocks or absmax_v.size != n_blocks:
            raise ValueError("8-bit optimizer state does not fit the buffer")
        if n:
            r = w.dtype.type
            grid = (max(1, min(n_blocks, MAX_BLOCKS)),)
            self._launch("adamw8bit_step", w.dtype, grid, (BLOCK,), w, g, m, v, absmax_m, absmax_v,
                         self._contig(starts, np.int64), np.int64(n_blocks), code_m, code_v, r(lr), r(beta1), r(beta2),
                         r(1.0 - beta1), r(1.0 - beta2), r(eps), r(wd), r(1.0 / (1.0 - beta1**t)),
                         r(1.0 / (1.0 - beta2**t)))

    def sgd_step(self, w, g, *, lr, wd):
        n = self._check_flat(w, g)
        if n:
            r = w.dtype.type
            self._launch("sgd_step", w.dtype, flat_grid(n), (BLOCK,), w, g, np.int64(n), r(lr), r(wd))
