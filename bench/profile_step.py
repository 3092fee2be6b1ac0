"""A training step op by op: llmtune's kernels against torch.profiler on the PEFT / PyTorch run.

    python bench/profile_step.py --model DIR/SmolLM2-135M-Instruct.f32.gguf [--kind lora|full]
        [--ctx 128] [--batch 1] [--steps 5] [--threads 2] [--side llmtune,torch] [--top 25]

Both sides train the windows bench/bench_real.py trains (synthetic chat examples, loss on the
assistant turns only, one example per window), the same LoRA (rank 8, alpha 16, q/k/v/o/gate/up/
down, AdamW) or every weight (--kind full). After untimed warm-up steps (llmtune: its thread-count
trials, then the timed windows once, so every pass shape is compiled before the timers start)
each side runs --steps steps under its profiler:
- llmtune: every kernel call of the replayed training program timed by op name (planner.Replay's
  pre-bound calls wrapped in a timer), plus the optimizer step and what the step spends outside
  the kernels (feeding, the loss's host copy);
- PyTorch: torch.profiler's self CPU time per aten op (LlamaForCausalLM + peft.get_peft_model,
  torch.set_num_threads(--threads)).
Each side prints its ops by total time, ms per step, and its whole step's median; compare where
the milliseconds go, not just the totals. Run on a quiet machine: the two sides run one after the
other, in separate processes.

    python bench/profile_step.py --finetune "MODEL DATA -o OUT --lora-rank 16 --ctx 512 ..." [--by-shape]

profiles a real `llmtune finetune` run instead (its plan, copies and --grad-checkpoint's recompute
included), llmtune's side only, from its second step on.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import collections
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_real import LR, chat_windows, llmtune_trainer, llmtune_warmup, torch_step  # noqa: E402


def _batches(windows, batch: int, n: int):
    for s in range(n):
        idx = [(s * batch + i) % len(windows["x"]) for i in range(batch)]
        yield windows["x"][idx], windows["y"][idx]


def _label(call, op: str) -> str:
    """op name with its operands' shapes (matmul: a x b and the transposes), where the call shows them."""
    args = getattr(call, "args", None)
    keep = getattr(call, "keep", None)  # a pre-bound compiled call (native/kernels.py): its arrays
    if op == "matmul" and keep:
        return f"matmul compiled {tuple(keep[1].shape)} -> {tuple(keep[0].shape)}"
    if op != "matmul" or not args or len(args) < 3:
        return op
    kw = getattr(call, "keywords", {}) or {}
    a, b = args[1], args[2]
    return f"matmul {tuple(a.shape)}{'T' if kw.get('ta') else ''} x {tuple(b.shape)}{'T' if kw.get('tb') else ''}"


def timed_compiled_runs(timers: dict, active: list, by_shape: bool):
    """planner._compiled_runs' stand-in: each pre-bound call of a replay timed under its op's name
    (with its operands' shapes: by_shape) into timers[op] = [seconds, calls], while active[0]."""
    def timed_runs(backend, calls, readers):
        def wrap(call, op):
            def run():
                if not active[0]:
                    return call()
                t = time.perf_counter()
                call()
                cell = timers[op]
                cell[0] += time.perf_counter() - t
                cell[1] += 1
            return run
        return [wrap(e[0], _label(e[0], e[2]) if by_shape else e[2]) for e in calls]
    return timed_runs


def profile_llmtune(model_path: str, windows_path: str, kind: str, ctx: int, batch: int, steps: int,
                    by_shape: bool = False) -> dict:
    from llmtune.graph import planner
    from llmtune.train.trainer import RunningStats

    timers: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])  # op -> [seconds, calls]
    active = [False]
    plain_runs = planner._compiled_runs
    timed_runs = timed_compiled_runs(timers, active, by_shape)
    planner._compiled_runs = timed_runs
    windows = dict(np.load(windows_path))
    tr = llmtune_trainer(model_path, kind, ctx, batch)
    opt_step = tr.optimizer.step

    def timed_opt(*a, **k):
        t = time.perf_counter()
        opt_step(*a, **k)
        if active[0]:
            timers["(optimizer step)"][0] += time.perf_counter() - t
            timers["(optimizer step)"][1] += 1

    tr.optimizer.step = timed_opt
    # warm-up: the thread-count trials, then the timed windows once (each pass shape compiled and
    # recorded before the timers start: a run compiles each once, then reuses it)
    timed = list(_batches(windows, batch, steps))
    warm = list(_batches(windows, batch, llmtune_warmup())) + timed
    step_s = []
    for s, (x, y) in enumerate(warm + timed):
        active[0] = s >= len(warm)
        t = time.perf_counter()
        tr.train_step(x, y, LR, RunningStats())
        if s >= len(warm):
            step_s.append(time.perf_counter() - t)
    planner._compiled_runs = plain_runs
    ops = {op: (sec / steps * 1e3, n // steps) for op, (sec, n) in timers.items()}
    ops["(outside kernels)"] = (sum(step_s) / steps * 1e3 - sum(v[0] for v in ops.values()), 0)
    return {"step_ms": statistics.median(step_s) * 1e3, "ops": ops}


def profile_finetune(argv: list[str], by_shape: bool) -> dict:
    """`llmtune finetune ARGV` in this process, its replayed kernels timed by op from the second
    step on (the first pays the frozen matrices' first decode into their copies): the breakdown of
    a real run, --grad-checkpoint's recompute, the memory plan and the optimizer included."""
    from llmtune import cli
    from llmtune.graph import planner
    from llmtune.train import loop

    timers: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    active, step_s = [False], []
    planner._compiled_runs = timed_compiled_runs(timers, active, by_shape)
    plain_step = loop._train_step

    def timed_step(run, s):
        active[0] = bool(step_s) or s > 0
        t = time.perf_counter()
        out = plain_step(run, s)
        step_s.append(time.perf_counter() - t)
        return out

    loop._train_step = timed_step
    sys.argv = ["llmtune", "finetune", *argv]
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code:
            raise
    timed = step_s[1:]
    ops = {op: (sec / len(timed) * 1e3, n // len(timed)) for op, (sec, n) in timers.items()}
    ops["(outside kernels: optimizer, feeding, Python)"] = (sum(timed) / len(timed) * 1e3
                                                           - sum(v[0] for v in ops.values()), 0)
    return {"step_ms": statistics.median(timed) * 1e3, "first_step_ms": step_s[0] * 1e3, "ops": ops}


def profile_torch(model_path: str, windows_path: str, kind: str, ctx: int, batch: int, steps: int,
                  threads: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    windows = dict(np.load(windows_path))
    step = torch_step(model_path, kind, threads)
    batches = list(_batches(windows, batch, 2 + steps))
    for x, y in batches[:2]:
        step(x, y)
    step_s = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches[2:]:
            t = time.perf_counter()
            step(x, y)
            step_s.append(time.perf_counter() - t)
    ops = {}
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            ops[ev.key] = (ev.self_cpu_time_total / 1e3 / steps, ev.count // steps)
    return {"step_ms": statistics.median(step_s) * 1e3, "ops": ops}


def show(side: str, res: dict, top: int) -> None:
    ops = sorted(res["ops"].items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in res["ops"].values())
    print(f"\n{side}: median step {res['step_ms']:.1f} ms (ops below sum to {total:.1f} ms/step)")
    print(f"  {'op':<44} {'ms/step':>8} {'share':>6} {'calls':>6}")
    for op, (ms, n) in ops[:top]:
        print(f"  {op[:44]:<44} {ms:8.2f} {ms / total:6.1%} {n:6d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an f32 llama GGUF (the PyTorch side loads it too)")
    ap.add_argument("--finetune", metavar="ARGS", help="profile `llmtune finetune ARGS` (one string) instead, "
                    "from its second step on: a real run's breakdown (plan, checkpointing, copies)")
    ap.add_argument("--kind", default="lora", choices=("lora", "full"))
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="PyTorch's threads")
    ap.add_argument("--side", default="llmtune,torch")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--by-shape", action="store_true", help="llmtune: products keyed by their operands' shapes")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmtune-bench-real"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--windows", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.finetune:
        res = profile_finetune(shlex.split(args.finetune), args.by_shape)
        print(f"\nfirst step {res['first_step_ms'] / 1e3:.1f} s")
        show("llmtune finetune", res, args.top)
        return
    if not args.model:
        ap.error("--model (or --finetune) is required")
    if args.child:
        if args.child == "llmtune":
            res = profile_llmtune(args.model, args.windows, args.kind, args.ctx, args.batch, args.steps, args.by_shape)
        else:
            res = profile_torch(args.model, args.windows, args.kind, args.ctx, args.batch, args.steps, args.threads)
        print("RESULT " + json.dumps(res))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    windows = chat_windows(args.model, args.ctx, max(64, args.batch * (args.steps + 8)), args.work)
    for side in args.side.split(","):
        cmd = [sys.executable, __file__, "--child", side, "--model", args.model, "--windows", str(windows),
               "--kind", args.kind, "--ctx", str(args.ctx), "--batch", str(args.batch), "--steps", str(args.steps),
               "--threads", str(args.threads)] + (["--by-shape"] if args.by_shape else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if done.returncode or line is None:
            sys.exit(f"{side} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        show(side, json.loads(line[len("RESULT "):]), args.top)


if __name__ == "__main__":
    main()
