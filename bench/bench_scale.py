"""QLoRA at scale: per model shape, LoRA rank and context, what a real `llmtune finetune` run takes.

    python bench/bench_scale.py [--shapes qwen2-7b,llama-1b] [--ranks 8,64] [--ctx 512,2048]
        [--steps 3] [--memory-limit SIZE] [--work DIR] [--json OUT]

Each shape is a configs/<shape>.toml written once with `llmtune init --type q4_k_m` (random
weights, the family's real vocabulary from tests/data/vocab; streamed, so a 7B shape needs no more
than ~100 MiB to make) into --work. Each row is one `llmtune finetune MODEL TEXT --lora-rank R
--ctx C --grad-checkpoint --val-split 0 --epochs 1 --metrics M` in a fresh process over a slice
of data/wikitext-100k.txt holding --steps windows (one window a step), and records:
- the time from the command's start to its first step's start (loading, tokenizing, planning:
  the first --metrics line's appearance less the training seconds it records) and to its end
  (the first step also decodes the frozen matrices into the copies the plan keeps, and compiles);
- the median s/step and tok/s of the later steps (the first one pays the copies' first decode);
- MFU: the step's model FLOPs (train/flops.py, what finetune prints) over the seconds of a
  step, over the machine's float32 GEMM peak (backends/cpu/probes.py, measured in this run too);
- peak RSS (the kernel's VmHWM through /usr/bin/time -v) against finetune's printed estimate.
llmtune's own BLAS settings apply (bench/blas_env.py: OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset);
run it on a quiet machine, one row at a time (a 7B row holds most of the memory).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "wikitext-100k.txt"
VOCAB = {"qwen2": "ggml-vocab-qwen2.gguf.gz", "llama": "ggml-vocab-llama-bpe.gguf.gz"}


def model_for(shape: str, work: Path) -> Path:
    """configs/<shape>.toml as a q4_k_m GGUF in `work`, made once (llmtune init streams it)."""
    out = work / f"{shape}-q4_k_m.gguf"
    if out.exists():
        return out
    config = REPO / "configs" / f"{shape}.toml"
    arch = re.search(r'architecture\s*=\s*"(\w+)"', config.read_text()).group(1)
    vocab = work / VOCAB[arch].removesuffix(".gz")
    if not vocab.exists():
        vocab.write_bytes(gzip.decompress((REPO / "tests" / "data" / "vocab" / VOCAB[arch]).read_bytes()))
    print(f"[{shape}] llmtune init --type q4_k_m (once)", flush=True)
    subprocess.run([sys.executable, "-m", "llmtune", "init", "--config", str(config), "--vocab-from", str(vocab),
                    "-o", str(out), "--type", "q4_k_m"], check=True)
    return out


def text_for(work: Path, model: Path, ctx: int, windows: int) -> Path:
    """The start of the WikiText file cut to `windows` training windows of ctx tokens for `model`'s
    tokenizer (text windows: ctx + 1 tokens every ctx / 2, train/data.py): the longest prefix of
    at most ctx + 1 + (windows - 1) * ctx / 2 tokens, found by bisection on characters."""
    from llmtune.model.loaded import load_model

    tok, text = load_model(model).tokenizer, TEXT.read_text(encoding="utf-8")
    need = ctx + 1 + (windows - 1) * (ctx // 2)
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tok.encode(text[:mid])) <= need else (lo, mid - 1)
    path = work / f"text-{model.stem}-{ctx}-{windows}.txt"
    path.write_text(text[:lo], encoding="utf-8")
    return path


def run_row(model: Path, text: Path, rank: int, ctx: int, memory_limit: str | None, work: Path) -> dict:
    """One finetune in a fresh process: its timings, MFU and peak RSS against the printed estimate."""
    metrics, out = work / "metrics.jsonl", work / "adapter.gguf"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "llmtune", "finetune", str(model), str(text), "-o", str(out), "--force",
           "--lora-rank", str(rank), "--ctx", str(ctx), "--grad-checkpoint", "--val-split", "0", "--epochs", "1",
           "--metrics", str(metrics)] + (["--memory-limit", memory_limit] if memory_limit else [])
    start = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v"] + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=os.environ)
    first = None
    while proc.poll() is None:  # the first --metrics line: the first step's end
        if first is None and metrics.exists() and metrics.stat().st_size > 0:
            first = time.perf_counter() - start
        time.sleep(0.2)
    log = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r.get("type") == "train_step"]
    seconds = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    # step n's MFU from the running one: flops / peak = mfu_n * (elapsed_n / n), the same every step
    last = steps[-1]
    work_s = last["mfu"] * last["elapsed_s"] / len(steps) if last.get("mfu") else float("nan")
    later = statistics.median(seconds) if seconds else float("nan")
    estimate = float(re.search(r"total ([\d,.]+) MiB", log).group(1).replace(",", ""))
    peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1))
    plan = [line for line in log.splitlines() if line.startswith("plan:")]
    return {"rank": rank, "ctx": ctx, "memory_limit": memory_limit, "steps": len(steps),
            "setup_s": round(first - steps[0]["elapsed_s"], 1) if first else None,
            "first_step_s": round(first, 1) if first else None, "first_step_train_s": round(steps[0]["elapsed_s"], 1),
            "s_per_step": round(later, 2), "tok_s": round(ctx / later, 1), "mfu": round(work_s / later, 3),
            "peak_rss_mib": round(peak_kib / 1024, 1), "estimate_mib": estimate,
            "rss_over_estimate": round(peak_kib / 1024 / estimate - 1, 3), "plan": plan,
            "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2-7b", help="configs/<shape>.toml names, comma-separated")
    ap.add_argument("--ranks", default="16")
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--steps", type=int, default=3, help="steps (windows) a row trains; the first is timed apart")
    ap.add_argument("--memory-limit", help="finetune's --memory-limit for every row")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmtune-bench-scale"))
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"BLAS: {blas_env.kernel()}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        model = model_for(shape, args.work)
        for ctx in map(int, args.ctx.split(",")):
            text = text_for(args.work, model, ctx, args.steps)
            for rank in map(int, args.ranks.split(",")):
                row = {"shape": shape, **run_row(model, text, rank, ctx, args.memory_limit, args.work)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| shape | rank | ctx | limit | start -> first step starts / ends | s/step | tok/s | MFU "
          "| peak RSS / estimate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['rank']} | {r['ctx']} | {r['memory_limit'] or '-'} | "
              f"{r['setup_s']} / {r['first_step_s']} s | "
              f"{r['s_per_step']} | {r['tok_s']} | {100 * r['mfu']:.1f} % | {r['peak_rss_mib']:,.0f} / "
              f"{r['estimate_mib']:,.0f} MiB ({100 * r['rss_over_estimate']:+.1f} %) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
