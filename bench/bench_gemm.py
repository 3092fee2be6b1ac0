"""The float32 products of a SmolLM2 training step and perplexity pass: numpy's BLAS (what llmtune
multiplies with) and llmtune's compiled packed product (a training run's frozen base, where the
compiled layer has it) against torch.mm (PyTorch's BLAS, the peers' products), same process,
same arrays.

    python bench/bench_gemm.py [--threads 2] [--rows 128,2048] [--reps 40] [--cold 24]

For each shape (M activation rows, a weight of N rows and K columns) three products: forward
x @ W^T, the input gradient g @ W (both in every LoRA step and every evaluation pass), and the
weight gradient g^T @ x (full finetunes; no packed form: its weight changes every step). GFLOP/s
from the median of --reps calls; the BLAS each side runs is printed (threadpoolctl when
installed). --cold N: each call takes the next of N copies of the weight, so it comes from memory
as in a training step, which meets each weight once (the default reuses one, which stays in
cache). The packed product runs with numpy's BLAS at one thread, as a training step runs it, and
before the others, after a pause: OpenBLAS's and torch's threads spin for a while after their
products, which a training step (OpenBLAS single-threaded) never has beside its packed ones.
Needs torch (bench only).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import statistics
import time
from itertools import cycle

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
    ap.add_argument("--cold", type=int, default=1, help="copies of each weight to cycle through (1: warm)")
    args = ap.parse_args()
    from llmtune.backends.cpu.native import kernels
    from llmtune.backends.cpu.threads import blas_threads

    packed_ok = kernels.pack_wt_available()
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
    print("torch:", torch.__version__, "MKL" if torch.backends.mkl.is_available() else "no MKL",
          f"{args.threads} threads")
    rng = np.random.default_rng(0)
    print("| M | N x K | product | numpy GFLOP/s | llmtune packed | torch GFLOP/s | torch / numpy | packed / numpy |\n"
          "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    ratios, packed_ratios = [], []
    for m in (int(r) for r in args.rows.split(",")):
        for n, k in SHAPES:
            x, g = (rng.standard_normal(s, dtype=np.float32) for s in ((m, k), (m, n)))
            ws = [rng.standard_normal((n, k), dtype=np.float32) for _ in range(args.cold)]
            tx, tg, tws = torch.from_numpy(x), torch.from_numpy(g), [torch.from_numpy(w) for w in ws]
            out, dx, dw = np.empty((m, n), np.float32), np.empty((m, k), np.float32), np.empty((n, k), np.float32)
            to, tdx, tdw = (torch.from_numpy(a) for a in (out, dx, dw))
            fwd = [kernels.pack_wt(w) for w in ws] if packed_ok else None
            bwd = [kernels.pack_wt(w, transposed=True) for w in ws] if packed_ok else None
            turn = cycle(range(args.cold))
            cases = (("x @ W^T", lambda i: np.matmul(x, ws[i].T, out=out), lambda i: torch.mm(tx, tws[i].t(), out=to),
                      fwd and (lambda i: kernels.sgemm_packed(out, x, fwd[i], n, k))),
                     ("g @ W", lambda i: np.matmul(g, ws[i], out=dx), lambda i: torch.mm(tg, tws[i], out=tdx),
                      bwd and (lambda i: kernels.sgemm_packed(dx, g, bwd[i], k, n))),
                     ("g^T @ x", lambda i: np.matmul(g.T, x, out=dw), lambda i: torch.mm(tg.t(), tx, out=tdw), None))
            flop = 2.0 * m * n * k
            for name, ours, theirs, packed in cases:
                c = None
                if packed is not None:  # first, once the BLAS threads of the last products sleep again
                    time.sleep(0.3)  # (OpenBLAS's spin ~0.1 s after a product, taking a core from the pool's)
                    with blas_threads(1):
                        c = flop / median_s(lambda: packed(next(turn)), args.reps) / 1e9
                a = flop / median_s(lambda: ours(next(turn)), args.reps) / 1e9
                b = flop / median_s(lambda: theirs(next(turn)), args.reps) / 1e9
                if c is not None:
                    packed_ratios.append(c / a)
                ratios.append(b / a)
                cs, cr = (f"{c:.0f}", f"{c / a:.2f}x") if c else ("-", "-")
                print(f"| {m} | {n} x {k} | {name} | {a:.0f} | {cs} | {b:.0f} | {b / a:.2f}x | {cr} |", flush=True)
    print(f"median torch / numpy over the shapes: {statistics.median(ratios):.2f}x")
    if packed_ratios:
        print("median llmtune packed / numpy over the forward and input-gradient shapes: "
              f"{statistics.median(packed_ratios):.2f}x")
    if limits is not None:
        limits.restore_original_limits()


if __name__ == "__main__":
    main()
