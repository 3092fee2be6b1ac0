"""A training step's useful arithmetic, counted from its compiled program, and the model FLOP
utilisation (MFU, PaLM's appendix B) it reaches against the backend's measured float32 peak.

Every product the step runs counts, as planned: the forward's (2·N·T for N weights multiplied over
T tokens, attention's QK^T and PV), the input gradients' (2·N·T again, through the frozen matrices
too), the trained weights' own gradients, LoRA's rank-r products and, under --grad-checkpoint, the
forward recomputed in the backward, and the logits a loss over vocabulary chunks recomputes. Norms,
activations, rope, the softmax and the optimizer are not products and are left out (they are a few
percent of a step's arithmetic)."""

from __future__ import annotations

import math

import numpy as np


def node_flops(n) -> int:
    """Multiply-adds x 2 of one graph node that is a product (0 for any other op)."""
    if n.op == "matmul":
        a, _ = n.inputs
        k = a.shape[-2] if n.attrs["ta"] else a.shape[-1]
        return 2 * int(np.prod(n.shape)) * k
    if n.op in ("qlinear", "qlinear_back"):  # out [..., n] from x [..., k]
        return 2 * int(np.prod(n.shape)) * n.inputs[0].shape[-1]
    if n.op == "lora":  # y + s (x A^T) B^T: x A^T, then t B^T
        _, x, a, b = n.inputs
        rows = int(np.prod(x.shape[:-1]))
        return 2 * rows * a.shape[0] * (a.shape[1] + b.shape[0])
    if n.op == "lora_back":  # t = s x A^T recomputed, u = s g B, dA = u^T x, dB = g^T t, dx = u A
        x, a, b, _ = n.inputs
        rows, (r, n_in), n_out = int(np.prod(x.shape[:-1])), a.shape, b.shape[0]
        return 2 * rows * r * (n_in + n_out + n_in + n_out + (n_in if n.attrs["dx"] else 0))
    if n.op in ("vocab_stats", "linear_cross_entropy_back"):  # x [N, d] W [V, d]^T; back: recomputed, G W, G^T x
        (rows, d), n_vocab = n.inputs[0].shape, n.inputs[1].shape[0]
        products = 1 if n.op == "vocab_stats" else 1 + n.attrs["dx"] + n.attrs["dw"]
        return 2 * products * rows * n_vocab * d
    if n.op in ("flash_attn", "flash_attn_back"):  # q [B, T, H, d]: S = QK^T and O = PV; back: dV, dP, dQ, dK
        b, t, h, d = n.inputs[0].shape
        return (4 if n.op == "flash_attn" else 8) * b * h * t * t * d
    return 0


def program_flops(order) -> int:
    """The products' FLOPs of one run of a program's steps (node_flops summed)."""
    return sum(node_flops(n) for n in order)


def mfu(flops_per_step: float, seconds_per_step: float, peak: float | None) -> float:
    """Model FLOP utilisation: a step's useful FLOP/s over the peak; NaN where either is unknown."""
    if not peak or seconds_per_step <= 0 or not flops_per_step:
        return math.nan
    return flops_per_step / seconds_per_step / peak
