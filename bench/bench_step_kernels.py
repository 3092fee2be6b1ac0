"""The compiled kernels of a training step and an evaluation pass beside their numpy references,
on SmolLM2-135M's shapes: blockwise causal attention (native/attention.c lt_flash_attn /
lt_flash_attn_back against backends/cpu_attention.py's block walk), a LoRA step's adapter terms (lt_lora /
lt_lora_back against k_lora's numpy products), swiglu's and rms_norm's gradients, and the AdamW
update (native/optim.c lt_adamw against the blocked numpy update) with the step's gradient sum of
squares.

    python bench/bench_step_kernels.py [--lengths 128,512,1024] [--reps 11] [--threads 1,2]

Attention: 9 query heads over 3 KV heads of 64, one sequence; milliseconds per call (medians of
--reps) and the compiled kernel's speed-up, at each thread count (numpy's BLAS at it; the
compiled pool at it with OpenBLAS single-threaded, as a packed-product step runs them). Adapter
terms: rank 8 over 128 rows, the four widths of a SmolLM2 layer's seven terms (microseconds,
forward and backward). AdamW: 135M float32 values (a full finetune's), milliseconds per step.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import sys
from pathlib import Path

import numpy as np

from llmtune.backends.cpu import attention as cpu_attention, backend as cpu
from llmtune.backends.cpu.native import kernels
from llmtune.backends.cpu.threads import blas_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import median_s  # noqa: E402

H, HKV, D = 9, 3, 64  # SmolLM2-135M's attention


def _median_ms(fn, reps: int) -> float:
    return median_s(fn, reps) * 1e3


_DECLINED = ("flash_attn", "flash_attn_back", "adamw", "lora", "lora_back", "swiglu_back", "rms_norm_back")


def _numpy_only(fn):
    """fn with the compiled kernels above declined (numpy's path)."""
    def run():
        saved = {name: getattr(kernels, name) for name in _DECLINED + ("sum_squares",)}
        for name in _DECLINED:
            setattr(kernels, name, lambda *a, **k: False)
        kernels.sum_squares = lambda *a: None
        try:
            fn()
        finally:
            for name, f in saved.items():
                setattr(kernels, name, f)
    return run


def _numpy_ms(fn, reps: int, threads: int) -> float:
    with blas_threads(threads):
        return _median_ms(_numpy_only(fn), reps)


def _compiled_ms(fn, reps: int, threads: int) -> float:
    """fn's compiled kernels on `threads` of the pool, OpenBLAS single-threaded (as in a step with
    packed products: with OpenBLAS's threads spinning, the kernels keep to the calling thread)."""
    kernels.library().lt_set_gemm_threads(threads)
    with blas_threads(1):
        return _median_ms(fn, reps)


def attention_rows(lengths, reps: int, threads: int) -> None:
    rng = np.random.default_rng(0)
    for T in lengths:
        q = rng.standard_normal((1, T, H, D), dtype=np.float32)
        k, v = (rng.standard_normal((1, T, HKV, D), dtype=np.float32) for _ in range(2))
        g = rng.standard_normal(q.shape, dtype=np.float32)
        packed = np.zeros(q.size + H * T, np.float32)
        grads = np.zeros(q.size + 2 * k.size, np.float32)

        def fwd():
            cpu_attention.k_flash_attn(packed, q, k, v, scale=0.125, softcap=0.0, window=0)

        def back():
            cpu_attention.k_flash_attn_back(grads, q, k, v, packed, g, scale=0.125, softcap=0.0, window=0)

        fwd()
        row = {name: (_numpy_ms(f, reps, threads), _compiled_ms(f, reps, threads))
               for name, f in (("forward", fwd), ("backward", back))}
        print(f"| attention, T {T}, {threads} thread(s) | " + " | ".join(
            f"{n} {a:.2f} -> {b:.2f} ms ({a / b:.1f}x)" for n, (a, b) in row.items()) + " |")


def lora_rows(reps: int, threads: int) -> None:
    """A LoRA step's terms (rank 8, 128 rows) at a SmolLM2 layer's widths, and the swiglu and
    rms_norm gradients of its passes: numpy's products and passes against the compiled ones."""
    rng = np.random.default_rng(2)
    cells = []
    for n_in, n_out in ((576, 576), (576, 192), (576, 1536), (1536, 576)):
        y, g = (rng.standard_normal((128, n_out), dtype=np.float32) for _ in range(2))
        x, a, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((128, n_in), (8, n_in), (n_out, 8)))
        out, grads = np.empty_like(y), np.empty(x.size + a.size + b.size, np.float32)

        def fwd():
            cpu.k_lora(out, y, x, a, b, 2.0)

        def back():
            cpu.k_lora_back(grads, x, a, b, g, 2.0, True)

        times = [(_numpy_ms(f, reps, threads), _compiled_ms(f, reps, threads)) for f in (fwd, back)]
        cells.append(f"{n_in}->{n_out} " + " / ".join(f"{1e3 * p:.0f} -> {1e3 * c:.0f} us" for p, c in times))
    print(f"| adapter terms (forward / backward), {threads} thread(s) | " + "; ".join(cells) + " |")
    gate, up, g = (rng.standard_normal((128, 1536), dtype=np.float32) for _ in range(3))
    x, gx = (rng.standard_normal((128, 576), dtype=np.float32) for _ in range(2))
    out, out_x = np.empty_like(gate), np.empty_like(x)
    rows = {"swiglu gradient 128 x 1536": lambda: cpu.k_swiglu_back(out, gate, up, g, 0),
            "rms_norm gradient 128 x 576": lambda: cpu.k_rms_norm_back(out_x, x, gx, 1e-5)}
    print(f"| passes, {threads} thread(s) | " + "; ".join(
        f"{name} {1e3 * _numpy_ms(f, reps, threads):.0f} -> {1e3 * _compiled_ms(f, reps, threads):.0f} us"
        for name, f in rows.items()) + " |")


def adamw_row(reps: int, threads: int) -> None:
    n = 135_000_000
    rng = np.random.default_rng(1)
    w, g = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    be = cpu.CPUBackend()

    def step():
        be.adamw_step(w, g, m, v, lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, t=1)

    def norm():
        be.sum_squares(g)

    reps = max(3, reps // 3)
    a, b = _median_ms(_numpy_only(step), reps), _median_ms(step, reps)
    c, d = _median_ms(_numpy_only(norm), reps), _median_ms(norm, reps)
    print(f"| AdamW over 135M, {threads} thread(s) | update {a:.0f} -> {b:.0f} ms ({a / b:.1f}x) | "
          f"sum of squares {c:.0f} -> {d:.0f} ms ({c / d:.1f}x) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    if not kernels.attention_available():
        raise SystemExit(f"no compiled attention in this build: {kernels.reason() or 'no AVX-512'}")
    print("| kernel | numpy -> compiled | |")
    print("| --- | --- | --- |")
    for threads in (int(t) for t in args.threads.split(",")):
        attention_rows([int(t) for t in args.lengths.split(",")], args.reps, threads)
        lora_rows(args.reps * 5, threads)
    kernels.library().lt_set_gemm_threads(kernels.threads())
    adamw_row(args.reps, kernels.threads())


if __name__ == "__main__":
    main()
