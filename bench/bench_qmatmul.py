"""Speed of the quantized frozen-weight product (ops.qlinear's CPU kernel) against float32 BLAS.

    python bench/bench_qmatmul.py [--m 512] [--n 2048] [--k 2048] [--threads 1]

For each stored type: forward (activations rounded as ggml rounds them, W dequantized a block of
rows at a time into a reused scratch, then sgemm) and the input gradient (qlinear_back), in
GFLOP/s of the product, next to numpy's float32 matmul of the same shape and the dequantization
rate alone (ns per weight value).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType as QT

from llmtune.backends.cpu import products as qmatmul
from llmtune.backends.cpu.threads import blas_threads
from llmtune.quant import blocks


def best(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=512, help="activation rows (tokens)")
    ap.add_argument("--n", type=int, default=2048, help="weight rows (outputs)")
    ap.add_argument("--k", type=int, default=2048, help="weight columns (inputs)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads")
    ap.add_argument("--types", default="F16,BF16,Q8_0,Q4_0,Q5_0,Q4_1,Q5_1,Q4_K,Q5_K,Q6_K")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    m, n, k = args.m, args.n, args.k
    w = (0.02 * rng.standard_normal((n, k))).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    g = rng.standard_normal((m, n)).astype(np.float32)
    out, dx = np.empty((m, n), np.float32), np.empty((m, k), np.float32)
    flops = 2 * m * n * k
    with blas_threads(args.threads):
        f32 = flops / best(lambda: np.matmul(x, w.T, out=out)) / 1e9
        print(f"x [{m}, {k}] @ W^T, W [{n}, {k}]; {args.threads} BLAS thread(s); float32 matmul {f32:.1f} GFLOP/s")
        print("| type | forward GFLOP/s | vs f32 | input gradient GFLOP/s | dequantize ns/value | round "
              "activations ns/value |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name in args.types.split(","):
            raw = np.ascontiguousarray(blocks.quantize(w, QT[name])).view(np.uint8).reshape(n, -1)
            fwd = flops / best(lambda: qmatmul.qlinear(out, x, raw, name)) / 1e9
            bwd = flops / best(lambda: qmatmul.qlinear_back(dx, g, raw, name)) / 1e9
            rows = min(n, 256)
            deq = best(lambda: qmatmul.dequantize_rows(raw[:rows], name, np.empty((rows, k), np.float32))) / (rows * k)
            act = best(lambda: qmatmul.round_activations(x, qmatmul.QTYPES[name].act)) / (m * k)
            print(f"| {name} | {fwd:.1f} | {fwd / f32:.2f} | {bwd:.1f} | {deq * 1e9:.2f} | {act * 1e9:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
