"""Benchmark for `llmtune perplexity` (results go to BENCHMARKS.md, section "Perplexity").

    python bench/bench_perplexity.py [stories] [15m] [--repeat N] [--batch TOKENS] [--chunks N] [--backend B]

stories  stories260K on the whole WikiText-2 raw test file at ctx 128 (llama.cpp: PPL = 154.7236 +/- 1.02369)
15m      a 15M-shape model (configs/llama-15m.toml, random init, the 32000-token llama SPM vocabulary)
         on the same text at ctx 256

Each run is a fresh process (so peak RSS is its own) going through `llmtune.perplexity`, the
library call behind the CLI: tokenize the text, load the model, evaluate. tokens/s counts the
tokens run through the model (n_chunks * ctx) over the evaluation time, as llama-perplexity's
timings do; "best" is the fastest of --repeat runs (the machine is shared), "median" the median.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
WIKI = DATA / "wikitext-2-raw-test.txt.gz"
VOCAB_32K = DATA / "vocab" / "ggml-vocab-llama-spm.gguf"
CONFIG_15M = ROOT / "configs" / "llama-15m.toml"
CASES = {"stories": 128, "15m": 256}  # case -> ctx
LLAMA_CPP_TOKENS_PER_S = {"stories": 13.9e3, "15m": 5.4e3}  # llama-perplexity on this machine kind


def run_one(model: str, ctx: int, batch: int | None, chunks: int | None, backend: str) -> dict:
    """One evaluation in this process; returns its figures."""
    import llmtune

    res = llmtune.perplexity(model, WIKI, ctx=ctx, batch=batch, chunks=chunks, backend=backend)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"ppl": res.ppl, "ppl_err": res.ppl_err, "n_chunks": len(res.chunks), "n_tokens": res.n_tokens,
            "seconds": res.seconds, "tokens_per_s": res.tokens_per_s, "peak_rss_mib": peak_kib / 1024}


def model_for(case: str, tmp: Path) -> Path:
    if case == "stories":
        return STORIES
    from llmtune.convert.init import init_model

    return init_model(CONFIG_15M, VOCAB_32K, tmp / "llama-15m.gguf", seed=0)


def run_case(case: str, model: Path, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", str(model), "--ctx", str(CASES[case]), "--backend", args.backend]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    runs = []
    for _ in range(args.repeat):
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def report(case: str, runs: list[dict]) -> str:
    speeds = [r["tokens_per_s"] for r in runs]
    r = max(runs, key=lambda r: r["tokens_per_s"])
    anchor = LLAMA_CPP_TOKENS_PER_S[case]
    return (f"| {case} | {CASES[case]} | {r['n_chunks']} | {r['ppl']:.4f} +/- {r['ppl_err']:.5f} | "
            f"{max(speeds):,.0f} | {statistics.median(speeds):,.0f} | {max(speeds) / anchor:.2f}x | "
            f"{max(x['peak_rss_mib'] for x in runs):.0f} |")


def main() -> None:
    from llmtune.resources import prefer_small_pages

    prefer_small_pages()  # llmtune measured as its commands run (cli.main)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", choices=[*CASES, []], default=[])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.ctx, args.batch, args.chunks, args.backend)))
        return
    print("| model | ctx | chunks | PPL | tokens/s best | tokens/s median | vs llama.cpp | peak RSS MiB |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases or list(CASES):
            print(report(case, run_case(case, model_for(case, Path(tmp)), args)), flush=True)


if __name__ == "__main__":
    main()
