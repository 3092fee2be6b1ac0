"""Two llmtune trees on the same real-model commands, taking turns: does a change move speed?

    git worktree add /tmp/before <commit>
    python bench/bench_ab.py --before /tmp/before --model DIR/SmolLM2-135M-Instruct.Q4_1.gguf [--rounds 3]

Rows, each command run in a fresh process per tree per round, the trees back to back in
alternating order (A B, B A, ...) so the machine's drift falls on both alike; the table shows
medians over the rounds and the after/before ratio (>1: the change is faster):
- decode: `generate MODEL -p ... -n 128 --temp 0 --ignore-eos`, its own generation tok/s;
- prompt: the same command's prompt tok/s (a 64-token prompt);
- ppl: `perplexity MODEL TEXT -c 512 --chunks 4`, its own tokens/s;
- qlora: `finetune MODEL TEXT --lora-rank 8 --ctx 128 --epochs 1` over a small text, wall seconds
  of the whole command (load, steps, write), shown as 1/seconds so that >1 is faster.
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are unset for both sides (bench/blas_env.py).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import gzip
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The history of the city begins with a small settlement on the river, where traders from the north "
          "met farmers from the valley and exchanged grain, salt and tools for furs and timber.")


def run(tree: Path, args: list[str]) -> tuple[float, str]:
    """(wall seconds, stderr + stdout) of `python -m llmtune ARGS` with `tree` first on the path."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "llmtune", *args], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"{tree}: llmtune {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return wall, done.stderr + done.stdout


def rate(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if not m:
        raise RuntimeError(f"no match for {pattern!r} in:\n{text[-1500:]}")
    return float(m.group(1).replace(",", ""))


def rows(model: Path, text: Path, small: Path, out: Path) -> dict:
    """Row name -> (llmtune args, what to read: 'wall' or a regex of a rate)."""
    gen = ["generate", str(model), "-p", PROMPT, "-n", "128", "--temp", "0", "--ignore-eos"]
    return {
        "decode tok/s": (gen, r"generation ([0-9,.]+) tok/s"),
        "prompt tok/s": (gen, r"prompt \d+ new tokens at ([0-9,.]+) tok/s"),
        "ppl tok/s": (["perplexity", str(model), str(text), "-c", "512", "--chunks", "4"], r"([0-9,.]+) tokens/s"),
        "qlora 1/s": (["finetune", str(model), str(small), "-o", str(out), "--lora-rank", "8", "--ctx", "128",
                       "--epochs", "1", "--val-split", "0", "--lr", "1e-4"], "wall"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the other tree (a git worktree)")
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="decode tok/s,prompt tok/s,ppl tok/s,qlora 1/s")
    args = ap.parse_args()
    args.model = args.model.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    text = tmp / "wiki.txt"
    text.write_text(gzip.open(ROOT / "tests" / "data" / "wikitext-2-raw-test.txt.gz", "rt").read())
    small = tmp / "small.txt"
    small.write_text(text.read_text()[:12000])
    table = rows(args.model, text, small, tmp / "adapter.gguf")
    wanted = [r.strip() for r in args.rows.split(",")]
    print(f"before {args.before}, after {args.after}; numpy BLAS {blas_env.kernel()}; {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| row | before | after | after / before |")
    print("| --- | ---: | ---: | ---: |")
    for name in wanted:
        cmd, read = table[name]
        got: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            order = [("before", args.before), ("after", args.after)]
            for side, tree in order if r % 2 == 0 else order[::-1]:
                wall, out = run(tree, cmd)
                got[side].append(1.0 / wall if read == "wall" else rate(read, out))
        b, a = statistics.median(got["before"]), statistics.median(got["after"])
        print(f"| {name} | {b:.4g} | {a:.4g} | {a / b:.3f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
