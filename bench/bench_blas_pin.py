"""What the exactness rule costs: every pass running OpenBLAS single-threaded where its bits follow
its thread count (threads.blas_threads.reproducible), against OpenBLAS keeping its own count.

    LLMTUNE_BENCH_BLAS_ENV=keep OPENBLAS_CORETYPE=Haswell OPENBLAS_L2_SIZE=512 python bench/bench_blas_pin.py
    python bench/bench_blas_pin.py          # the kernel OpenBLAS picks itself (where it keeps its bits)

Full finetunes (AdamW) of stories260K, llama-15m and llama-110m (configs/, random init, the
llama SPM vocabulary) at ctx 256, with one micro-batch a step (batch 256) and with two (batch 512,
ubatch 256). Two trainers in one process take turns step by step (the machine's drift on both):
- rule: the trainer as it runs (a worker per core for two micro-batches, each running OpenBLAS
  single-threaded; one micro-batch: OpenBLAS single-threaded where its bits follow its count, else
  the step tuner's choice);
- own count: one worker, every step inside blas_threads(all cores) (the outer block wins over the
  trainer's own), as llmtune ran before the rule: faster or not, its bits differ from a rank's.
Tokens/s from the median of --steps timed steps after --warmup untimed ones each.
"""

from __future__ import annotations

import blas_env

blas_env.at_its_best()

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from llmtune.backends.cpu import CPUBackend  # noqa: E402
from llmtune.backends.cpu.threads import blas_threads, n_cores  # noqa: E402
from llmtune.model.loaded import load_model  # noqa: E402
from llmtune.train.trainer import RunningStats, Trainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = REPO / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"


def model_path(name: str, work: Path) -> Path:
    if name == "stories260K":
        return REPO / "tests" / "data" / "stories260K.gguf"
    path = work / f"{name}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "llmtune", "init", "--config", REPO / "configs" / f"{name}.toml",
                        "--vocab-from", VOCAB, "-o", path, "--seed", "0"], check=True, capture_output=True)
    return path


def compare(path: Path, ctx: int, batch: int, ubatch: int, warmup: int, steps: int) -> dict:
    model = load_model(path)
    kw = dict(n_ctx=ctx, n_batch=batch, n_ubatch=ubatch, trainable=list(model.weights))
    sides = {"rule": Trainer(model, CPUBackend(), **kw), "own count": Trainer(model, CPUBackend(), workers=1, **kw)}
    rng = np.random.default_rng(0)
    times: dict = {name: [] for name in sides}
    for i in range(warmup + steps):
        ids = rng.integers(0, model.hp.n_vocab, size=(batch // ctx, ctx + 1), dtype=np.int32)
        for name, tr in sides.items():
            block = blas_threads(n_cores()) if name == "own count" else nullcontext()
            t0 = time.perf_counter()
            with block:
                tr.train_step(ids[:, :-1], ids[:, 1:], 1e-4, RunningStats())
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"workers": sides["rule"].n_workers,
            **{name: batch / statistics.median(t) for name, t in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260K,llama-15m,llama-110m")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps per trainer (the tuner's 5 trials and one)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmtune-bench-blas-pin"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"numpy's BLAS: {blas_env.kernel()}; its bits follow its thread count: {not blas_threads.keeps_bits()}; "
          f"{n_cores()} cores")
    print("| model | micro-batches a step | rule: workers | rule tok/s | own count tok/s | rule / own count |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        path = model_path(name, args.work)
        for batch in (256, 512):
            r = compare(path, 256, batch, 256, args.warmup, args.steps)
            print(f"| {name} | {batch // 256} | {r['workers']} | {r['rule']:,.0f} | {r['own count']:,.0f} | "
                  f"{r['rule'] / r['own count']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
