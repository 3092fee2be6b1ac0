"""CUDA training throughput: tokens/s for the llama-15m and llama-110m shapes (configs/), the
matmul TFLOP/s cuBLAS reaches through the backend in the same run, and model FLOP utilization.

    python bench/bench_cuda.py [--shapes 15m,110m] [--ctx 512] [--seqs 8] [--steps 5]
                               [--precision f32,bf16] [--profile] [--json out.json]

Each shape gets random weights (init_tensors, a 32000-token vocabulary as llama2.c's models)
and trains every tensor with AdamW through llmtune.train.trainer.Trainer, one optimizer step per
`seqs` sequences of `ctx` tokens. Model FLOPs per token are PaLM's 6 N + 12 L d T (N: weights
that take part in matmuls, so token_embd only when tied; L layers, d = n_head * head_dim, T the
context); utilization is that rate over the measured matmul peak of the same precision.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmtune.backends.cuda import CUDABackend  # noqa: E402
from llmtune.convert.init import init_tensors, load_init_config  # noqa: E402
from llmtune.model.loaded import Model  # noqa: E402
from llmtune.train.trainer import RunningStats, Trainer  # noqa: E402

N_VOCAB = 32000


def build_model(shape: str, seed: int = 0) -> Model:
    config_path = REPO / "configs" / f"llama-{shape}.toml"
    config = load_init_config(config_path)
    hp = config.model.hparams(n_vocab=N_VOCAB)
    weights = {name: data for name, data, _ in init_tensors(hp, config.std, seed)}
    return Model(config_path, None, hp, weights)


def flops_per_token(model: Model, n_ctx: int) -> float:
    hp = model.hp
    n_matmul = sum(w.size for name, w in model.weights.items() if name != "token_embd.weight")
    if hp.tied_output:
        n_matmul += model.weights["token_embd.weight"].size
    return 6.0 * n_matmul + 12.0 * hp.n_layer * hp.n_head * hp.head_dim * n_ctx


def timed(be, fn, reps: int, warmup: int = 2) -> float:
    """Seconds per call, measured with CUDA events around `reps` back-to-back calls."""
    import cupy

    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / reps


def matmul_tflops(be, m: int, n: int, k: int, tb: bool = False) -> float:
    rng = np.random.default_rng(0)
    a = be.asarray(rng.standard_normal((m, k), dtype=np.float32))
    b = be.asarray(rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32))
    out = be.zeros((m, n))
    matmul = be.kernels["matmul"]
    seconds = timed(be, lambda: matmul(out, a, b, False, tb), reps=10)
    return 2.0 * m * n * k / seconds / 1e12


def train_tokens_per_s(be, model: Model, ctx: int, seqs: int, steps: int, warmup: int = 2) -> dict:
    trainer = Trainer(model, be, n_ctx=ctx, n_batch=ctx * seqs, n_ubatch=ctx * seqs,
                      trainable=list(model.weights), optimizer="adamw")
    tokens = np.random.default_rng(1).integers(0, N_VOCAB, size=(seqs, ctx + 1), dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    stats = RunningStats()
    for _ in range(warmup):  # kernel compilation, cuBLAS heuristics, memory pool growth
        trainer.train_step(x, y, 1e-4, stats)
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(x, y, 1e-4, stats)
    be.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    return {"step_s": seconds, "tokens_per_s": ctx * seqs / seconds, "loss": stats.losses[-1],
            "memory_bytes": trainer.memory_bytes()}


def profile_ops(be, model: Model, ctx: int, seqs: int) -> list[tuple[str, float, int]]:
    """GPU milliseconds per op over one training step (each kernel timed with CUDA events)."""
    import cupy

    total = defaultdict(float)
    count = defaultdict(int)

    def wrap(op, fn):
        def run(*args, **kwargs):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            end.synchronize()
            total[op] += cupy.cuda.get_elapsed_time(start, end)
            count[op] += 1
            return result

        return run

    be.kernels = {op: wrap(op, fn) for op, fn in be.kernels.items()}
    be.accumulate = wrap("accumulate", be.accumulate)
    be.adamw_step = wrap("adamw_step", be.adamw_step)
    trainer = Trainer(model, be, n_ctx=ctx, n_batch=ctx * seqs, n_ubatch=ctx * seqs,
                      trainable=list(model.weights), optimizer="adamw")
    tokens = np.random.default_rng(1).integers(0, N_VOCAB, size=(seqs, ctx + 1), dtype=np.int32)
    trainer.train_step(tokens[:, :-1], tokens[:, 1:], 1e-4, RunningStats())  # warm
    total.clear()
    count.clear()
    trainer.train_step(tokens[:, :-1], tokens[:, 1:], 1e-4, RunningStats())
    return sorted(((op, ms, count[op]) for op, ms in total.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="15m,110m")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step (one pass)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precision", default="f32", help="comma list of f32, tf32, bf16")
    ap.add_argument("--profile", action="store_true", help="also time every op over one step")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    results = {"ctx": args.ctx, "seqs": args.seqs, "runs": []}
    for precision in args.precision.split(","):
        be = CUDABackend(np.float32, precision=precision)
        results["device"] = be.device_name
        peak = matmul_tflops(be, 8192, 8192, 8192)
        print(f"[{precision}] {be.device_name}: matmul 8192^3 {peak:.1f} TFLOP/s", flush=True)
        for shape in args.shapes.split(","):
            model = build_model(shape)
            hp = model.hp
            n_tok = args.ctx * args.seqs
            layer_mm = matmul_tflops(be, n_tok, hp.n_ff, hp.n_embd, tb=True)  # x @ W_up^T, a training-sized product
            run = train_tokens_per_s(be, model, args.ctx, args.seqs, args.steps)
            mfu = run["tokens_per_s"] * flops_per_token(model, args.ctx) / (peak * 1e12)
            run.update(shape=shape, precision=precision, n_params=sum(w.size for w in model.weights.values()),
                       matmul_peak_tflops=peak, ffn_matmul_tflops=layer_mm, mfu=mfu)
            print(f"[{precision}] llama-{shape} ({run['n_params'] / 1e6:.1f}M params) ctx {args.ctx} x {args.seqs}: "
                  f"{run['tokens_per_s']:,.0f} tokens/s ({run['step_s'] * 1e3:.1f} ms/step), MFU {100 * mfu:.1f}% "
                  f"of {peak:.1f} TFLOP/s; ffn-shaped matmul {layer_mm:.1f} TFLOP/s; loss {run['loss']:.3f}",
                  flush=True)
            if args.profile:
                prof = profile_ops(CUDABackend(np.float32, precision=precision), model, args.ctx, args.seqs)
                run["profile_ms"] = {op: ms for op, ms, _ in prof}
                step_ms = sum(ms for _, ms, _ in prof)
                for op, ms, n in prof[:12]:
                    print(f"    {op:20s} {ms:8.2f} ms {100 * ms / step_ms:5.1f}%  ({n} calls)")
            results["runs"].append(run)
            del model
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
