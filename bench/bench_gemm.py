"""The float32 products of a SmolLM2 training step and perplexity pass: numpy's BLAS (what llmtune
multiplies with) against torch.mm (PyTorch's BLAS, the peers' products), same process, same arrays.

    python bench/bench_gemm.py [--threads 2] [--rows 128,2048] [--reps 40]

For each shape (M activation rows, a weight of N rows and K columns) three products: forward
x @ W^T, the input gradient g @ W (both in every LoRA step and every evaluation pass), and the
weight gradient g^T @ x (full finetunes). GFLOP/s from the median of --reps calls; the BLAS each
side runs is printed (threadpoolctl when installed). Needs torch (bench only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

# SmolLM2-135M: q/o, k/v, gate/up, down, the tied vocabulary projection
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def median_s(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="128,2048", help="activation rows M: a training pass, a perplexity pass")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    try:
        from threadpoolctl import threadpool_info, threadpool_limits

        limits = threadpool_limits(args.threads, user_api="blas")
        print("numpy BLAS:", "; ".join(f"{i['internal_api']} {i['version']} ({i.get('architecture')})"
                                       for i in threadpool_info() if i["user_api"] == "blas"))
    except ImportError:
        limits = None
        print("numpy BLAS: (pip install threadpoolctl to name it; OPENBLAS_NUM_THREADS sets its threads)")
    print("torch:", torch.__version__, "MKL" if torch.backends.mkl.is_available() else "no MKL", f"{args.threads} threads")
    rng = np.random.default_rng(0)
    print(f"| M | N x K | product | numpy GFLOP/s | torch GFLOP/s | torch / numpy |\n| ---: | --- | --- | ---: | ---: | ---: |")
    ratios = []
    for m in (int(r) for r in args.rows.split(",")):
        for n, k in SHAPES:
            x, w, g = (rng.standard_normal(s, dtype=np.float32) for s in ((m, k), (n, k), (m, n)))
            tx, tw, tg = (torch.from_numpy(a) for a in (x, w, g))
            out, dx, dw = np.empty((m, n), np.float32), np.empty((m, k), np.float32), np.empty((n, k), np.float32)
            to, tdx, tdw = (torch.from_numpy(a) for a in (out, dx, dw))
            cases = (("x @ W^T", lambda: np.matmul(x, w.T, out=out), lambda: torch.mm(tx, tw.t(), out=to)),
                     ("g @ W", lambda: np.matmul(g, w, out=dx), lambda: torch.mm(tg, tw, out=tdx)),
                     ("g^T @ x", lambda: np.matmul(g.T, x, out=dw), lambda: torch.mm(tg.t(), tx, out=tdw)))
            flop = 2.0 * m * n * k
            for name, ours, theirs in cases:
                a, b = flop / median_s(ours, args.reps) / 1e9, flop / median_s(theirs, args.reps) / 1e9
                ratios.append(b / a)
                print(f"| {m} | {n} x {k} | {name} | {a:.0f} | {b:.0f} | {b / a:.2f}x |", flush=True)
    print(f"median torch / numpy over the shapes: {statistics.median(ratios):.2f}x")
    if limits is not None:
        limits.restore_original_limits()


if __name__ == "__main__":
    main()
