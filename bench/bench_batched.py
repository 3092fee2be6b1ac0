"""Batched generation throughput against llama.cpp's llama-batched-bench (issue 40 items 3-4).

    python bench/bench_batched.py --bin PATH/TO/llama-batched-bench MODEL.gguf
        [--npl 1,4,8,16] [--npp 64] [--ntg 128] [--threads 2] [--rounds 3]

Per round, alternating which side goes first: one llama-batched-bench process
(`-m MODEL -c 4096 -b 2048 -ub 512 -npp NPP -ntg NTG -npl NPL -t THREADS`: B sequences of NPP prompt
tokens, then NTG decode steps of B tokens each), and per B one
`llmtune generate MODEL -p PROMPT --parallel B -n NTG+1 --bench -c 4096 --temp 0` (the first token
of each sequence comes from its prompt's logits, so NTG+1 tokens are NTG decode steps of B tokens:
llama-batched-bench's TG). PROMPT is NPP tokens of a story (cut at a token boundary and decoded; the
table gives the count llmtune evaluated). Both read S_TG t/s: B * TG / the decode time. Medians of
the rounds; the ratio llmtune / llama.cpp per B (the machine may be shared: the load average is
printed before and after, and the ratio of the medians is the figure to read).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
         "friends. One day, she saw a big red ball under a tree. She ran to the ball and picked it up. It was "
         "shiny and new. Lily looked around to see whose ball it was, but nobody was there. She decided to take "
         "the ball home and show it to her mom. Her mom smiled and said that they should keep it safe until "
         "its owner came looking for it. The next morning, a small boy knocked on the door.")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def prompt_of(model: Path, n_tok: int) -> str:
    """The first n_tok tokens of STORY (BOS included where the model adds one) as text."""
    from llmtune.model.loaded import load_model

    tok = load_model(model).tokenizer
    ids = tok.encode(STORY, add_special=False, parse_special=False)
    n = n_tok - int(bool(tok.add_bos))
    if len(ids) < n:
        raise SystemExit(f"--npp {n_tok}: the story has {len(ids)} tokens only")
    return b"".join(tok.token_to_bytes(t, special=False) for t in ids[:n]).decode("utf-8", "replace")


def llama_cmd(binary: Path, model: Path, args) -> list[str]:
    return [str(binary), "-m", str(model), "-c", "4096", "-b", "2048", "-ub", "512", "-npp", str(args.npp),
            "-ntg", str(args.ntg), "-npl", ",".join(map(str, args.npl)), "-t", str(args.threads)]


def llama(binary: Path, model: Path, args) -> dict[int, dict]:
    """{B: {"pp": S_PP, "tg": S_TG, "t_pp": T_PP, "t_tg": T_TG, "t": T}} from one llama-batched-bench run."""
    res = subprocess.run(llama_cmd(binary, model, args), capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"llama-batched-bench failed:\n{res.stderr[-2000:]}")
    rows = {}
    for line in (res.stdout + res.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            rows[int(cells[2])] = {"pp": float(cells[5]), "tg": float(cells[7]), "t_pp": float(cells[4]),
                                   "t_tg": float(cells[6]), "t": float(cells[8])}
    if set(rows) != set(args.npl):
        raise RuntimeError(f"llama-batched-bench: rows for {sorted(rows)}, wanted {args.npl}:\n{res.stdout[-2000:]}")
    return rows


def ours_cmd(model: Path, prompt: str, b: int, args) -> list[str]:
    return [sys.executable, "-m", "llmtune", "generate", str(model), "-p", prompt, "--parallel", str(b),
            "-n", str(args.ntg + 1), "--bench", "-c", "4096", "--temp", "0"]


def ours(model: Path, prompt: str, b: int, args) -> dict:
    res = subprocess.run(ours_cmd(model, prompt, b, args), capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if res.returncode:
        raise RuntimeError(f"llmtune generate --bench failed:\n{res.stderr[-2000:]}")
    cells = [c.strip() for c in res.stdout.strip().strip("|").split("|")]
    return {"pp_tokens": int(cells[0]), "pp": float(cells[5]), "tg": float(cells[7])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's llama-batched-bench")
    ap.add_argument("--npl", type=lambda v: [int(t) for t in v.split(",")], default=[1, 4, 8, 16])
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompt = prompt_of(args.model, args.npp)
    load_before = os.getloadavg()[0]
    llama_runs: list[dict] = []
    our_runs: dict[int, list] = {b: [] for b in args.npl}

    def run_llama():
        llama_runs.append(llama(args.bin, args.model, args))
        print("  llama-batched-bench: " + ", ".join(f"B={b} S_TG {r['tg']:.2f}" for b, r in llama_runs[-1].items())
              + f" (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)

    def run_ours():
        for b in args.npl:
            our_runs[b].append(ours(args.model, prompt, b, args))
            print(f"  llmtune B={b}: S_TG {our_runs[b][-1]['tg']:.2f} (load {os.getloadavg()[0]:.2f})",
                  file=sys.stderr, flush=True)

    for r in range(args.rounds):
        for side in ((run_llama, run_ours) if r % 2 == 0 else (run_ours, run_llama)):
            side()
    med = {b: {k: statistics.median(run[b][k] for run in llama_runs) for k in ("pp", "tg")} for b in args.npl}
    our = {b: {k: statistics.median(run[k] for run in our_runs[b]) for k in ("pp", "tg")} for b in args.npl}
    print(f"CPU: {cpu_name()}; numpy's BLAS: {blas_env.kernel()}; load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; medians of {args.rounds} alternating rounds\n")
    print(f"- llama.cpp: `{' '.join(llama_cmd(args.bin, args.model, args))}`")
    print(f"- llmtune: `{' '.join(ours_cmd(args.model, 'PROMPT', 'B', args))}` per B "
          f"(PROMPT: {our_runs[args.npl[0]][0]['pp_tokens']} tokens)\n")
    print("| B | llama-batched-bench S_TG t/s | llmtune S_TG t/s | llmtune / llama.cpp "
          "| S_PP t/s: llama.cpp | llmtune |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in args.npl:
        print(f"| {b} | {med[b]['tg']:.2f} | {our[b]['tg']:.2f} | **{our[b]['tg'] / med[b]['tg']:.2f}x** | "
              f"{med[b]['pp']:.2f} | {our[b]['pp']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
