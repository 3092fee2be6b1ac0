"""The CUDA kernels of ops.py's elementwise section (activations in elementwise.cu; add, mul, scale,
sum_to and broadcast_to as cupy ufuncs, which broadcast as numpy does)."""

from __future__ import annotations

import numpy as np


class ElementwiseKernels:
    def _k_add(self, out, a, b):
        return self.xp.add(a, b, out=out)

    def _k_mul(self, out, a, b):
        return self.xp.multiply(a, b, out=out)

    def _k_scale(self, out, a, s):
        return self.xp.multiply(a, a.dtype.type(s), out=out)

    def _k_sum_to(self, out, x, shape):
        lead = x.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1)
        reduced = tuple(d for i, d in enumerate(x.shape) if i not in axes)
        self.xp.sum(x, axis=axes, out=out.reshape(reduced))
        return out

    def _k_broadcast_to(self, out, x, shape):
        return self.xp.broadcast_to(x, shape)

    def _k_silu(self, out, x):
        return self._flat("silu_fwd", out, x)

    def _k_silu_back(self, out, x, g):
        return self._flat("silu_back", out, x, g)

    def _k_swiglu(self, out, gate, up):
        return self._flat("swiglu_fwd", out, gate, up)

    def _k_swiglu_back(self, out, gate, up, g, wrt):
        return self._flat("swiglu_back", out, gate, up, g, extra=(np.int32(wrt),))

    def _k_gelu(self, out, x):
        return self._flat("gelu_fwd", out, x)

    def _k_gelu_back(self, out, x, g):
        return self._flat("gelu_back", out, x, g)

    def _k_geglu(self, out, gate, up):
        return self._flat("geglu_fwd", out, gate, up)

    def _k_geglu_back(self, out, gate, up, g, wrt):
        return self._flat("geglu_back", out, gate, up, g, extra=(np.int32(wrt),))

    def _k_softcap(self, out, x, cap):
        r = out.dtype.type
        return self._flat("softcap_fwd", out, x, extra=(r(1.0 / cap), r(cap)))

    def _k_softcap_back(self, out, y, g, cap):
        return self._flat("softcap_back", out, y, g, extra=(out.dtype.type(1.0 / cap),))
