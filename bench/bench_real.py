"""Real models against llama.cpp, same run: decode speed and time to first token.

    bash ../shared/models/fetch-smollm2.sh DIR          # SmolLM2-135M-Instruct Q4_1 (tied Q8_0 output)
    python bench/bench_real.py --bin PATH/TO/llama.cpp/build/bin --model DIR/SmolLM2-135M-Instruct.Q4_1.gguf

For the Q4_1 file and its f32 export (`llmtune export --type f32`, made next to the model when
missing), three rounds, each running back to back:
- `llama-completion -t T -p PROMPT -n N --temp 0 --ignore-eos -no-cnv` for T in --threads (its
  "eval time": N - 1 single-token passes, load and prompt excluded);
- llmtune in a fresh process (as a user runs `llmtune generate`): load, Generator, prompt, then N
  greedy tokens without stopping at EOS; its decode rate (tokens after the first per second), its
  time to first token (start of the process to the first sampled token: imports, load, compile,
  prompt) and its prompt time; with the compiled kernels (llmtune/native) and, as the fallback a
  machine without a compiler runs, with LLMTUNE_NATIVE=0.
The medians of the rounds are printed as a Markdown table, with the load average before and after
(other jobs on a shared machine move every number).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"

_LLMTUNE = r"""
import json, sys, time
t0 = time.perf_counter()
from llmtune.eval.generate import Generator, load_for_generation
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.quant.qtensor import evaluation_copies
from llmtune.native import kernels
model = load_for_generation(sys.argv[1])
gen = Generator(model, "cpu", n_ctx=int(sys.argv[3]))
ids = gen.tokenize_prompt(sys.argv[4])
first = []
with evaluation_copies(gen.backend):
    res = gen.generate(ids, int(sys.argv[2]), Sampler(SamplerConfig(temp=0.0, seed=0)), stop_at_eog=False,
                       on_token=lambda t, s: first or first.append(time.perf_counter() - t0))
print(json.dumps({"tok_s": res.tokens_per_s, "ttft_s": first[0], "prompt_s": res.prompt_seconds,
                  "n": len(res.tokens), "native": kernels.available()}))
"""


def llama_decode(bin_dir: Path, model: Path, n: int, ctx: int, threads: int) -> float:
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", str(n), "--temp", "0",
           "--ignore-eos", "-no-cnv", "--no-display-prompt", "-c", str(ctx), "-t", str(threads)]
    for _ in range(3):  # its asynchronous logger can drop the last lines at exit: run again
        done = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r"eval time =\s+[0-9.]+ ms /\s+\d+ runs.*?([0-9.]+) tokens per second\)",
                      (done.stderr + done.stdout).split("prompt eval time")[-1])
        if m:
            return float(m.group(1))
    raise RuntimeError(f"llama-completion failed on {model}:\n{(done.stdout + done.stderr)[-2000:]}")


def llmtune_decode(model: Path, n: int, ctx: int, native: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), LLMTUNE_NATIVE="1" if native else "0")
    done = subprocess.run([sys.executable, "-c", _LLMTUNE, str(model), str(n), str(ctx), PROMPT], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"llmtune failed on {model}:\n{done.stderr[-2000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if res["native"] != native:
        raise RuntimeError(f"llmtune: compiled kernels {'not ' if native else ''}in use ({model})")
    return res


def f32_export(model: Path) -> Path:
    out = model.with_name(model.name.replace(".gguf", "") + ".f32.gguf")
    if not out.exists():
        import llmtune

        llmtune.export(model, out, "f32")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp build/bin (llama-completion)")
    ap.add_argument("--model", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("-n", type=int, default=128, help="tokens to generate")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="llama-completion thread counts")
    ap.add_argument("--no-fallback", action="store_true", help="skip the LLMTUNE_NATIVE=0 runs")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    models = [("Q4_1", args.model), ("f32 export", f32_export(args.model))]
    load0 = os.getloadavg()
    rows = []
    for label, path in models:
        runs: dict[str, list] = {}
        for _ in range(args.rounds):
            for t in threads:
                runs.setdefault(f"llama -t {t}", []).append(llama_decode(args.bin, path, args.n, args.ctx, t))
            for native in (True,) if args.no_fallback else (True, False):
                runs.setdefault(f"llmtune native={int(native)}", []).append(llmtune_decode(path, args.n, args.ctx, native))
        rows.append((label, runs))
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; {args.rounds} rounds, medians; "
          f"-n {args.n}, ctx {args.ctx}, prompt {PROMPT!r}")
    heads = [f"llama.cpp -t {t}" for t in threads]
    print("| model | " + " | ".join(heads) + " | llmtune (native) | llmtune / llama.cpp -t 2 | llmtune / best llama.cpp"
          " | llmtune time to first token | llmtune LLMTUNE_NATIVE=0 |")
    print("| --- |" + " ---: |" * (len(heads) + 5))
    for label, runs in rows:
        llama = [statistics.median(runs[f"llama -t {t}"]) for t in threads]
        ours = runs["llmtune native=1"]
        tok = statistics.median(r["tok_s"] for r in ours)
        ttft = statistics.median(r["ttft_s"] for r in ours)
        prompt = statistics.median(r["prompt_s"] for r in ours)
        two = llama[threads.index(2)] if 2 in threads else float("nan")
        fallback = "—"
        if "llmtune native=0" in runs:
            fb = runs["llmtune native=0"]
            fallback = (f"{statistics.median(r['tok_s'] for r in fb):.1f} tok/s "
                        f"(first token {statistics.median(r['ttft_s'] for r in fb):.2f} s)")
        print(f"| {label} | " + " | ".join(f"{v:.1f} tok/s" for v in llama) + f" | {tok:.1f} tok/s | {tok / two:.2f}x | "
              f"{tok / max(llama):.2f}x | {ttft:.2f} s (prompt {prompt * 1e3:.0f} ms) | {fallback} |")


if __name__ == "__main__":
    main()
