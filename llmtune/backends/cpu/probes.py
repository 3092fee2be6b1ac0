"""Two rates of this machine, cached as the BLAS bit-probe is (threads.py ProbeCache): the float32
GEMM peak a finetune's model FLOP utilisation is a share of (the best ever measured), and what a
product of a matrix decoded per block costs against the same product on its float32 copy (what a
memory limit that leaves a frozen matrix without its copy costs a step)."""

from __future__ import annotations

import time

import numpy as np
from gguf import GGMLQuantizationType

from llmtune.backends.cpu.products import qlinear
from llmtune.backends.cpu.threads import ProbeCache, _blas_identity, blas_threads, n_cores
from llmtune.quant.blocks import quantize

# a training step's shapes at 1B scale: 512 tokens through a 2048 -> 4096 matrix (8.6 GFLOP, ~20 ms
# at 450 GFLOP/s), the best of a few runs: a peak, not an average
PEAK_SHAPE = (512, 2048, 4096)
PEAK_RUNS = 5
# one product of 512 rows (a training pass's) with a 4096 x 4096 matrix, decoded a block of rows at a
# time (four blocks: products.SCRATCH_ELEMENTS, as a wide model's), against numpy's product on its
# float32 copy, on all cores as a run multiplies: the median ratio of COST_RUNS pairs
COST_SHAPE = (512, 4096, 4096)
COST_RUNS = 3


def _best(fn, runs: int) -> float:
    fn()  # first touch, thread start-up
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_peak() -> float:
    """FLOP/s of numpy's float32 GEMM on all cores: the best of PEAK_RUNS products of PEAK_SHAPE,
    measured at every call (~0.2 s on a quiet machine) and kept as the best this machine and BLAS
    have ever shown (its cache key: threads.py _blas_identity). A peak measured while other work
    shares the cores reads low and would make MFU read high; keeping the maximum, a measurement on
    a busy machine never lowers it and the first quiet one raises it."""
    n = n_cores()
    cache = ProbeCache("gemm-peak", _blas_identity(n) + f"\nshape {PEAK_SHAPE}", kind=float)
    best_seen = cache.get()
    m, k, cols = PEAK_SHAPE
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, cols), dtype=np.float32)
    out = np.empty((m, cols), np.float32)
    with blas_threads(n):
        seconds = _best(lambda: np.matmul(a, b, out=out), PEAK_RUNS)
    rate = 2.0 * m * k * cols / seconds
    if best_seen is not None and best_seen >= rate:
        return best_seen
    cache.put(rate)
    return rate


def decode_cost(qtype: str) -> float:
    """How many times longer a product with a matrix stored as `qtype` takes decoded a block of
    rows at a time (products.qlinear without a float copy) than numpy's product on its float32
    copy, on all cores (COST_SHAPE: the median ratio of COST_RUNS pairs of timings, each the best of
    three); measured once per type, machine and BLAS. 1.0 for a float32 matrix. (A one-thread probe
    of a matrix decoded in one block read 1.0-1.15x where a 7B-class run's products took 1.2-1.6x:
    the decode runs on one core while the product's blocks use all, and short blocks cost the BLAS.)"""
    if qtype == "F32":
        return 1.0
    n = n_cores()
    cache = ProbeCache("decode-cost", _blas_identity(n) + f"\n{qtype} {COST_SHAPE}", kind=float)
    cached = cache.get()
    if cached is not None:
        return cached
    rows, n_in, n_out = COST_SHAPE
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02)
    raw = np.ascontiguousarray(quantize(w, GGMLQuantizationType[qtype])).view(np.uint8)  # F16: its bytes
    x = rng.standard_normal((rows, n_in), dtype=np.float32)
    out = np.empty((rows, n_out), np.float32)
    decoded = lambda: qlinear(out, x, raw, qtype, round_x=False)  # noqa: E731
    dense = lambda: np.matmul(x, w.T, out=out)  # noqa: E731
    # in pairs, each the best of three: on a shared machine the load drifts between them and
    # OpenBLAS's threads contending for the cores make single timings swing
    with blas_threads(n):
        ratios = sorted(_best(decoded, 3) / _best(dense, 3) for _ in range(COST_RUNS))
    ratio = max(1.0, ratios[len(ratios) // 2])
    cache.put(ratio)
    return ratio
