"""Training and graph benchmarks (issues: graph engine, finetune).

    python bench/bench_train.py            # everything below, ~2-4 minutes on 2 cores
    python bench/bench_train.py graph      # planner memory + forward tokens/s (stories260K)
    python bench/bench_train.py train      # training tokens/s, GFLOP/s vs numpy sgemm peak, peak RSS
    python bench/bench_train.py quality    # the finetune acceptance run: 100 KB of WikiText, lr 1e-4 and 1e-5

Each configuration runs in a fresh subprocess so peak RSS is its own. Times are medians of
several optimizer steps after one warm-up step.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "tests" / "data" / "stories260K.gguf"
VOCAB = REPO / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"


def sgemm_peak() -> float:
    """Best numpy float32 matmul GFLOP/s over a few large square-ish shapes (same run, same BLAS)."""
    best = 0.0
    for n, k, m in [(1024, 1024, 1024), (512, 768, 2048), (2048, 288, 768)]:
        a = np.random.rand(n, k).astype(np.float32)
        b = np.random.rand(k, m).astype(np.float32)
        a @ b
        times = []
        for _ in range(7):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        best = max(best, 2 * n * k * m / np.median(times) / 1e9)
    return best


def train_flops_per_token(model, n_ctx: int) -> float:
    """6 x (weights used in matmuls) + attention (QK^T and PV: 2 matmuls x 2 flops x ctx x
    n_head*head_dim per layer, forward; x3 for forward + backward), full (unmasked) square."""
    hp = model.hp
    matmul_params = sum(w.size for n, w in model.weights.items() if w.ndim == 2 and n != "token_embd.weight")
    if hp.tied_output:
        matmul_params += model.weights["token_embd.weight"].size
    attn = 3 * 2 * 2 * n_ctx * hp.n_head * hp.head_dim * hp.n_layer
    return 6 * matmul_params + attn


def _worker(kind: str, path: str, ctx: int, batch: int, ubatch: int, steps: int) -> dict:
    import resource

    from llmtune.backends.cpu import CPUBackend
    from llmtune.model.loaded import load_model
    from llmtune.train.trainer import RunningStats, Trainer

    model = load_model(path)
    if kind == "forward":
        from llmtune.graph.planner import Program

        batch_, nodes, logits = model.build(batch // ctx, ctx)
        be = CPUBackend()
        prog = Program([logits], be, params={nodes[k]: v for k, v in model.weights.items()})
        rng = np.random.default_rng(0)
        x = rng.integers(0, model.hp.n_vocab, (batch // ctx, ctx)).astype(np.int32)
        pos = np.arange(ctx, dtype=np.int32)
        times = []
        for _ in range(steps + 1):
            t = time.perf_counter()
            prog.run(tokens=x, pos=pos)
            times.append(time.perf_counter() - t)
        dt = float(np.median(times[1:]))
        return {"tokens_per_s": batch / dt, "ms_per_pass": dt * 1e3,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    tr = Trainer(model, CPUBackend(), n_ctx=ctx, n_batch=batch, n_ubatch=ubatch, trainable=list(model.weights))
    rng = np.random.default_rng(0)
    stats = RunningStats()
    times = []
    for _ in range(steps + 1):
        w = rng.integers(0, model.hp.n_vocab, (batch // ctx, ctx + 1)).astype(np.int32)
        t = time.perf_counter()
        tr.train_step(w[:, :-1], w[:, 1:], 1e-4, stats)
        times.append(time.perf_counter() - t)
    dt = float(np.median(times[1:]))
    return {
        "tokens_per_s": batch / dt,
        "ms_per_step": dt * 1e3,
        "gflops": train_flops_per_token(model, ctx) * batch / dt / 1e9,
        "planned_mib": sum(p.memory.planned_bytes for p in tr.programs.train) / 2**20,
        "naive_mib": sum(p.memory.naive_bytes for p in tr.programs.train) / 2**20,
        "workers": tr.n_workers,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "n_params": model.n_params(),
    }


def run(kind, path, ctx, batch, ubatch, steps) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_train as b; "
            f"print(json.dumps(b._worker({kind!r}, {str(path)!r}, {ctx}, {batch}, {ubatch}, {steps})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_15m(tmp: Path) -> Path:
    from llmtune.convert.init import init_model

    path = tmp / "llama-15m.gguf"
    init_model(REPO / "configs" / "llama-15m.toml", VOCAB, path, seed=0)
    return path


def quality():
    """stories260K on the bundled first 100 KB of WikiText at ctx 256, 2 epochs: losses per epoch
    and perplexity (ctx 256) of the result against the base model on the same text."""
    import llmtune

    text = REPO / "data" / "wikitext-100k.txt"
    base = llmtune.perplexity(STORIES, text, ctx=256)
    print(f"## quality: base model perplexity on {text.name} at ctx 256: {base.ppl:.2f} +/- {base.ppl_err:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for lr in (1e-4, 1e-5):
            out = Path(tmp) / f"ft-{lr}.gguf"
            t = time.perf_counter()
            res = llmtune.finetune(STORIES, text, out, ctx=256, epochs=2, lr=lr)
            secs = time.perf_counter() - t
            ppl = llmtune.perplexity(out, text, ctx=256)
            epochs = "; ".join(f"epoch {e.epoch}: train {e.train_loss:.3f}+/-{e.train_loss_err:.3f} "
                               f"val {e.val_loss:.3f}+/-{e.val_loss_err:.3f} (acc {e.val_accuracy:.3f})"
                               for e in res.epochs)
            print(f"lr {lr:g}: first step {res.first_loss:.4f}; {epochs}; perplexity {ppl.ppl:.2f} "
                  f"(base {base.ppl:.2f}); {secs:.0f} s wall")


def main(argv):
    what = set(argv) or {"graph", "train", "quality"}
    if "quality" in what:
        quality()
    if "graph" in what:
        print("## graph: stories260K")
        r = run("train", STORIES, 256, 256, 256, 3)
        print(f"training graph ctx 256: planned buffers {r['planned_mib']:.1f} MiB vs sum of intermediates "
              f"{r['naive_mib']:.1f} MiB ({r['planned_mib'] / r['naive_mib']:.0%})")
        for batch in (128, 2048):
            f = run("forward", STORIES, 128, batch, batch, 30)
            print(f"forward ctx 128, {batch // 128} seq/pass: {f['tokens_per_s']:,.0f} tokens/s "
                  f"({f['ms_per_pass']:.1f} ms/pass)")
    if "train" in what:
        peak = sgemm_peak()
        print(f"## train (numpy sgemm peak in this run: {peak:.0f} GFLOP/s)")
        with tempfile.TemporaryDirectory() as tmp:
            # one micro-batch per step runs with 2-thread BLAS; several run one per core
            cases = [("stories260K", STORIES, 256, 256, 256), ("stories260K", STORIES, 256, 1024, 256),
                     ("llama-15m", model_15m(Path(tmp)), 256, 256, 256), ("llama-15m", None, 256, 512, 512),
                     ("llama-15m", None, 256, 2048, 512)]
            last = None
            for name, path, ctx, batch, ubatch in cases:
                path = path or last
                last = path
                r = run("train", path, ctx, batch, ubatch, 20 if "stories" in name else (3 if batch > 1024 else 6))
                print(f"{name:12s} ctx {ctx} batch {batch:5d} ubatch {ubatch:5d}: {r['tokens_per_s']:8,.0f} tokens/s, "
                      f"{r['gflops']:6.1f} GFLOP/s ({r['gflops'] / peak:.0%} of sgemm peak), "
                      f"{r['workers']} worker(s), activations {r['planned_mib']:.0f} MiB, peak RSS "
                      f"{r['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
