"""Decode speed and time to first token against llama.cpp's llama-completion, in the same run
(issue 23 part 3), and where llmtune's decode step goes.

    python bench/bench_decode.py --bin PATH/TO/llama.cpp/build/bin MODEL.gguf [MODEL.gguf ...]
        [--n 128] [--rounds 3] [--profile]

Per model and round, back to back: llama-completion -t 1, llama-completion -t 2 (greedy --temp 0,
--ignore-eos, -c 512, the prompt "Once upon a time", default settings otherwise) and
`llmtune generate` with the same arguments, each a fresh process. Decode speed: llama.cpp's "eval
time" line (n - 1 single-token passes), llmtune's summary line (the same passes). Time to first
token: from starting the process to the first byte of generated text on its stdout (start-up,
model load, prompt; llama.cpp's includes its warm-up pass), and llmtune's prompt time alone.
Medians over the rounds; the load average before and after (the machine may be shared). Also
checks that both greedy continuations are the same bytes (reported, not asserted).

--profile: llmtune's decode step in this process with the compiled programs' per-op timers
(native/kernels.py profile), milliseconds per token.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"


def _first_byte_run(cmd: list[str], env=None, skip: bytes = b"") -> tuple[float, bytes, str]:
    """(seconds to the first stdout byte after `skip`, all stdout, all stderr)."""
    # stderr to a file, not a pipe: llama.cpp logs a line per odd token of a 262k vocabulary (Gemma 3's,
    # 12 MB), which fills a pipe nobody reads until stdout's first byte, and both processes wait forever
    err_file = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, env=env, bufsize=0)
    got, first = b"", None
    while True:
        chunk = proc.stdout.read(1)
        if not chunk:
            break
        got += chunk
        if first is None and len(got) > len(skip):
            first = time.perf_counter() - t0
        if first is not None:
            break
    rest, _ = proc.communicate()
    err_file.seek(0)
    err = err_file.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.decode(errors='replace')[-2000:]}")
    return first if first is not None else float("nan"), got + rest, err.decode(errors="replace")


def llama(bin_dir: Path, model: Path, n: int, threads: int) -> dict:
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", str(n), "-c", "512", "-no-cnv",
           "--no-display-prompt", "-t", str(threads), "--temp", "0", "--ignore-eos"]
    ttft, out, err = _first_byte_run(cmd)
    m = re.search(r" eval time =\s+[0-9.]+ ms /\s+(\d+) runs.*?([0-9.]+) tokens per second", err)
    p = re.search(r"prompt eval time =\s+([0-9.]+) ms", err)
    if not m:
        raise RuntimeError(f"no eval time from llama-completion:\n{err[-2000:]}")
    text = out[:-len(b" [end of text]\n")] if out.endswith(b" [end of text]\n") else out
    return {"tok_s": float(m.group(2)), "ttft": ttft, "prompt_s": float(p.group(1)) / 1e3 if p else float("nan"),
            "text": text.rstrip(b"\n")}


def ours(model: Path, n: int, env_extra=None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    cmd = [sys.executable, "-m", "llmtune", "generate", str(model), "-p", PROMPT, "-n", str(n), "-c", "512",
           "--temp", "0", "--ignore-eos", "--no-display-prompt"]
    ttft, out, err = _first_byte_run(cmd, env)
    m = re.search(r"generation ([0-9.]+) tok/s", err)
    p = re.search(r"prompt (\d+) new tokens at ([0-9.]+) tok/s", err)
    if not m:
        raise RuntimeError(f"no speed from llmtune generate:\n{err[-2000:]}")
    prompt_s = int(p.group(1)) / float(p.group(2)) if p and float(p.group(2)) > 0 else float("nan")
    return {"tok_s": float(m.group(1)), "ttft": ttft, "prompt_s": prompt_s, "text": out.rstrip(b"\n")}


def profile(model: Path, n: int) -> None:
    import numpy as np

    from llmtune.backends.cpu.native import kernels, program
    from llmtune.eval.generate import Generator, load_for_generation

    gen = Generator(load_for_generation(model), n_ctx=512)
    logits = gen.feed(gen.tokenize_prompt(PROMPT))
    tok = int(np.argmax(logits))
    for _ in range(3):  # the recording runs
        tok = int(np.argmax(gen.step(tok)))
    kernels.profile(True)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(gen.step(tok)))
    wall = time.perf_counter() - t0
    timers = kernels.profile(False)
    names = {code: op for op, code in program.OPS.items()}
    print(f"\n{model.name}: {n} tokens, {wall / n * 1e3:.2f} ms per token in Python's loop "
          f"({n / wall:.1f} tok/s; load {os.getloadavg()[0]:.2f})")
    print("| op | ms per token | calls per token |\n| --- | ---: | ---: |")
    total = 0.0
    for code, (sec, calls) in sorted(timers.items(), key=lambda kv: -kv[1][0]):
        total += sec
        print(f"| {names.get(code, code)} | {sec / n * 1e3:.3f} | {calls / n:.0f} |")
    print(f"| all compiled steps | {total / n * 1e3:.3f} | |")


def main() -> int:
    from llmtune.resources import prefer_small_pages

    prefer_small_pages()  # llmtune measured as its commands run (cli.main)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--bin", type=Path, help="llama.cpp's build/bin (without it: llmtune only)")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fallback", action="store_true", help="also llmtune with LLMTUNE_NATIVE=0")
    ap.add_argument("--threads", type=lambda v: [int(t) for t in v.split(",")], default=[1, 2],
                    help="llama.cpp's thread counts, e.g. 1,2")
    args = ap.parse_args()
    if args.profile:
        for model in args.models:
            profile(model, args.n)
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    for model in args.models:
        runs: dict[str, list] = {}
        def record(key, res):
            runs.setdefault(key, []).append(res)
            print(f"  {model.name} {key}: {res['tok_s']:.1f} tok/s, first token {res['ttft']:.2f} s "
                  f"(load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)

        for _ in range(args.rounds):
            if args.bin:
                for t in args.threads:
                    record(f"llama -t {t}", llama(args.bin, model, args.n, t))
            record("llmtune", ours(model, args.n))
            if args.fallback:
                record("fallback", ours(model, args.n, {"LLMTUNE_NATIVE": "0"}))
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("tok_s", "ttft", "prompt_s")}
               for k, v in runs.items()}
        same = None
        if args.bin:
            same = runs["llmtune"][0]["text"] == runs[f"llama -t {args.threads[0]}"][0]["text"]
        rows.append((model.name, med, same, runs))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("| model | llama.cpp -t 1 | llama.cpp -t 2 | llmtune | / -t 2 | / -t 1 | time to first token: llama.cpp -t 2 "
          "| llmtune (prompt) | greedy text = llama.cpp's |" + (" LLMTUNE_NATIVE=0 |" if args.fallback else ""))
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |" + (" ---: |" if args.fallback else ""))
    for name, med, same, runs in rows:
        o = med["llmtune"]
        l1, l2 = med.get("llama -t 1"), med.get("llama -t 2")
        cells = [name, f"{l1['tok_s']:.1f} tok/s" if l1 else "-", f"{l2['tok_s']:.1f} tok/s" if l2 else "-",
                 f"{o['tok_s']:.1f} tok/s", f"**{o['tok_s'] / l2['tok_s']:.2f}x**" if l2 else "-",
                 f"{o['tok_s'] / l1['tok_s']:.2f}x" if l1 else "-", f"{l2['ttft']:.2f} s" if l2 else "-",
                 f"{o['ttft']:.2f} s ({o['prompt_s'] * 1e3:.0f} ms)", "-" if same is None
                 else ("yes" if same else "no")]
        if args.fallback:
            f = med["fallback"]
            cells.append(f"{f['tok_s']:.1f} tok/s (first token {f['ttft']:.2f} s)")
        print("| " + " | ".join(cells) + " |")
        if same is False:
            a, b = runs["llmtune"][0]["text"], runs[f"llama -t {args.threads[0]}"][0]["text"]
            k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            print(f"  {name}: texts part at byte {k}: llmtune {a[max(0, k - 40):k + 40]!r} / llama.cpp "
                  f"{b[max(0, k - 40):k + 40]!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
