"""The fused optimizer steps over one flat buffer (optim.cu): AdamW as ggml_opt_step_adamw, SGD."""

from __future__ import annotations

import numpy as np

from llmtune.backends.cuda.launch import BLOCK, flat_grid


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

    def sgd_step(self, w, g, *, lr, wd):
        n = self._check_flat(w, g)
        if n:
            r = w.dtype.type
            self._launch("sgd_step", w.dtype, flat_grid(n), (BLOCK,), w, g, np.int64(n), r(lr), r(wd))
