"""The one-row product of a decode step on SmolLM2-135M's real shapes: numpy against the two
compiled ideas issue 23 allows (numba; C built at first use, llmtune/native/).

    python bench/bench_native.py [--reps 200]

Rows (medians of --reps calls, microseconds per product and the weight bytes streamed per second):
- numpy f32 copy: `einsum("nk,k->n")` over a float32 copy (what decode did with decoded copies);
- numpy stored: quant/matmul.py qlinear without copies (dequantize a block of rows, then BLAS);
- numba (1 and 2 threads): an `@njit(parallel=True, cache=True)` Q4_1 x q8_1 / Q8_0 x q8_0 integer dot loop over
  the blocks (the activations quantized beforehand), prange over the output rows;
- C 1 thread / C 2 threads: llmtune/native/qdot.c lt_qlinear (activation quantization included).
numba is optional (the row is skipped without it).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import os
import timeit

import numpy as np
from gguf import GGMLQuantizationType as QT

from llmtune.backends.cpu import products as qmatmul
from llmtune.backends.cpu.native import kernels
from llmtune.quant import blocks

SHAPES = (  # (name, n_out, n_in, type) of SmolLM2-135M-Instruct.Q4_1
    ("attn_q / attn_output 576x576", 576, 576, "Q4_1"),
    ("attn_k / attn_v 192x576", 192, 576, "Q4_1"),
    ("ffn_gate / ffn_up 1536x576", 1536, 576, "Q4_1"),
    ("ffn_down 576x1536", 576, 1536, "Q4_1"),
    ("output (tied) 49152x576", 49152, 576, "Q8_0"),
)


def _numba_kernels():
    try:
        import numba
    except ImportError:
        return None
    from numba import njit, prange

    @njit(parallel=True, cache=True, nogil=True)
    def q4_1_scaled(w, wd, wm, xq, xd, xs, out):  # the scales decoded beforehand: wd, wm [n_out, nb]
        n_out, nb = w.shape[0], xq.shape[0]
        for r in prange(n_out):
            acc = np.float32(0)
            for b in range(nb):
                o = b * 20
                sumi = 0
                for j in range(16):
                    q = w[r, o + 4 + j]
                    sumi += np.int32(q & 15) * np.int32(xq[b, j]) + np.int32(q >> 4) * np.int32(xq[b, j + 16])
                acc += wd[r, b] * xd[b] * np.float32(sumi) + wm[r, b] * xs[b]
            out[r] = acc
        return out

    @njit(parallel=True, cache=True, nogil=True)
    def q8_0_scaled(w, wd, xq, xd, out):
        n_out, nb = w.shape[0], xq.shape[0]
        for r in prange(n_out):
            acc = np.float32(0)
            for b in range(nb):
                o = b * 34 + 2
                sumi = 0
                for j in range(32):
                    sumi += np.int32(np.int8(w[r, o + j])) * np.int32(xq[b, j])
                acc += wd[r, b] * xd[b] * np.float32(sumi)
            out[r] = acc
        return out

    return numba, q4_1_scaled, q8_0_scaled


def _median_us(fn, reps):
    fn()
    return float(np.median(timeit.repeat(fn, number=1, repeat=reps))) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    nb_kernels = _numba_kernels()
    print(f"load average {os.getloadavg()[0]:.2f}; C library: {kernels.reason() or 'built'}, AVX2 {kernels.simd()}")
    print("| shape | weight MB | numpy f32 copy | numpy stored | numba 1 thread | numba 2 threads | C 1 "
          "thread | C 2 threads |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n_out, n_in, qtype in SHAPES:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32)
        raw = blocks.quantize(w, QT[qtype]).reshape(n_out, -1)
        dense = qmatmul.dequantize_rows(raw, qtype, np.empty((n_out, n_in), np.float32))
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        out = np.empty((1, n_out), np.float32)
        cells = []
        cells.append(_median_us(lambda: np.einsum("nk,k->n", dense, x[0], out=out[0]), args.reps))
        native_qlinear, qmatmul.native.qlinear = qmatmul.native.qlinear, lambda *a: False  # the numpy path itself
        try:
            cells.append(_median_us(lambda: qmatmul.qlinear(out, x, raw, qtype), max(10, args.reps // 10)))
        finally:
            qmatmul.native.qlinear = native_qlinear
        if nb_kernels is not None:
            act = qmatmul.QTYPES[qtype].act
            xq_bytes = kernels.quantize_activations(x[0], act)
            bsz = 36 if act == "q8_1" else 34
            blk = xq_bytes[: n_in // 32 * bsz].reshape(-1, bsz)  # (the float copies of the scales follow)
            xd = blk[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
            xs = blk[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32) if act == "q8_1" else None
            xq = blk[:, bsz - 32:].copy().view(np.int8)
            wb = raw.reshape(n_out, -1, qmatmul.QTYPES[qtype].size)
            wd = wb[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            if qtype == "Q4_1":
                wm = wb[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                fn = lambda: nb_kernels[1](raw, wd, wm, xq, xd, xs, out[0])  # noqa: E731
            else:
                fn = lambda: nb_kernels[2](raw, wd, xq, xd, out[0])  # noqa: E731
            for threads in (1, 2):
                nb_kernels[0].set_num_threads(threads)
                cells.append(_median_us(fn, args.reps))
        else:
            cells += [None, None]
        for threads in (1, 2):
            kernels._load()
            kernels._state["threads"] = threads
            cells.append(_median_us(lambda: kernels.qlinear(out, x, raw, qtype), args.reps))
        mb = raw.nbytes / 1e6
        text = [f"{c:,.0f} us ({(dense.nbytes if i == 0 else raw.nbytes) / c / 1e3:.0f} GB/s)" if c else "—"
                for i, c in enumerate(cells)]
        print(f"| {name} ({qtype}) | {mb:.2f} | " + " | ".join(text) + " |")


if __name__ == "__main__":
    main()
