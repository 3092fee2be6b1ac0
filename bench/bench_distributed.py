"""Data-parallel finetune: tokens/s for 1 rank vs N ranks on the 15M shape, each rank single-threaded,
and the all-reduce time per step (llmtune/backends/dist.py).

    python bench/bench_distributed.py [--ranks 2] [--chars 20000] [--ctx 128] [--batch 512] [--ubatch 128]

Writes out/bench-dist/llama-15m.gguf (llmtune init, configs/llama-15m.toml) once, then trains it on
the first --chars characters of data/wikitext-100k.txt:
  1 rank:  taskset -c 0, OPENBLAS_NUM_THREADS=1 (one core, one worker)
  N ranks: mpiexec -n N (each rank takes 1/N of the cores: one core each on an N-core machine)
Reports tokens/s over the steps after the first (which compiles), the time each step spends in
the gradient all-reduce (waiting for the slower rank included), and, alone after a barrier, an
all-reduce of the same flat buffer (the transfer itself).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "out" / "bench-dist"


def worker(args) -> None:
    """One rank (or the single process): train, then rank 0 writes the numbers as JSON."""
    from llmtune.backends.dist import world
    from llmtune.train.finetune import finetune

    comm = world()
    metrics = OUT / f"metrics-{comm.size}.jsonl"
    t0 = time.perf_counter()
    finetune(args.model, args.data, OUT / f"tuned-{comm.size}.gguf", ctx=args.ctx, batch=args.batch, ubatch=args.ubatch,
             epochs=1, lr=1e-4, val_split=0.0, metrics=str(metrics), keep_checkpoints=None)
    wall = time.perf_counter() - t0
    trainer_comm = comm  # cpu: the world communicator itself
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if comm.is_root else []
    steps = [r for r in steps if r["type"] == "train_step"]
    pure = None
    if comm.size > 1:
        from llmtune.model.loaded import load_model

        n = sum(w.size for w in load_model(args.model).weights.values())
        buf = np.zeros(n, np.float32)
        comm.barrier()
        times = []
        for _ in range(5):
            comm.barrier()
            t = time.perf_counter()
            comm.allreduce(buf, "the benchmark's all-reduce")
            times.append(time.perf_counter() - t)
        pure = {"n_values": n, "mb": buf.nbytes / 1e6, "seconds_median": float(np.median(times))}
    if comm.is_root:
        timed = steps[1:]  # the first step compiles the programs
        tokens = len(timed) * args.batch
        seconds = timed[-1]["elapsed_s"] - steps[0]["elapsed_s"]
        calls = max(trainer_comm.allreduce_calls - (5 if pure else 0), 1)
        in_training = (trainer_comm.allreduce_seconds - (sum(times) if pure else 0)) / calls if comm.size > 1 else 0.0
        result = {"ranks": comm.size, "steps": len(steps), "tokens_per_s": tokens / seconds, "wall_s": wall,
                  "allreduce_s_per_step": in_training, "pure_allreduce": pure, "final_loss": steps[-1]["loss"]}
        (OUT / f"result-{comm.size}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--chars", type=int, default=20000)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ubatch", type=int, default=128)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=str(OUT / "llama-15m.gguf"), help=argparse.SUPPRESS)
    ap.add_argument("--data", default=str(OUT / "data.txt"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if not Path(args.model).exists():
        subprocess.run([sys.executable, "-m", "llmtune", "init", "--config", REPO / "configs" / "llama-15m.toml",
                        "--vocab-from", REPO / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf",
                        "-o", args.model, "--seed", "0"], check=True)
    Path(args.data).write_text((REPO / "data" / "wikitext-100k.txt").read_text()[: args.chars])
    me = [sys.executable, __file__, "--worker", "--ctx", str(args.ctx), "--batch", str(args.batch),
          "--ubatch", str(args.ubatch), "--model", args.model, "--data", args.data]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    subprocess.run(["taskset", "-c", "0", *me], check=True, env={**env, "OPENBLAS_NUM_THREADS": "1"})
    mpiexec = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    subprocess.run([mpiexec, "-n", str(args.ranks), *me], check=True, env=env)
    one, many = (json.loads((OUT / f"result-{n}.json").read_text()) for n in (1, args.ranks))
    print("| ranks | tokens/s | speed-up | all-reduce per step (in training) | all-reduce alone | final loss |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in (one, many):
        pure = r["pure_allreduce"]
        alone = f"{pure['seconds_median'] * 1e3:.0f} ms ({pure['mb']:.1f} MB)" if pure else "-"
        inside = f"{r['allreduce_s_per_step'] * 1e3:.0f} ms" if r["ranks"] > 1 else "-"
        print(f"| {r['ranks']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / one['tokens_per_s']:.2f} | {inside} | "
              f"{alone} | {r['final_loss']:.4f} |")
    print(f"({one['steps']} steps of {args.batch} tokens, ctx {args.ctx}, ubatch {args.ubatch})")


if __name__ == "__main__":
    main()
