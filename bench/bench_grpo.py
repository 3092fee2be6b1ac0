"""GRPO's generation (finetune --method grpo's rollouts, eval/generate.py PolicySampler) against
llama.cpp's batched decode, llama-batched-bench (issue 39's "Fast" criterion).

    python bench/bench_grpo.py --bin PATH/TO/llama-batched-bench MODEL.gguf
        [--prompts 2] [--generations 8] [--length 64] [--npp 48] [--rounds 3] [--threads 2] [--no-share]

One real LoRA GRPO run (llmtune.train.finetune.finetune, --method grpo, LoRA r8, a regex reward)
of rounds + 1 steps, each step PROMPTS distinct prompts (slices of a story, NPP tokens each, BOS
included) x GENERATIONS completions of up to LENGTH tokens at temperature 1 (a story seldom ends
within LENGTH: the lengths are printed). Its sampler is PolicySampler, timed around each step's
call; between the steps (alternating before and after ours) one
`llama-batched-bench -m MODEL -c 4096 -b 2048 -ub 512 -npp NPP -ntg LENGTH -npl PROMPTS*GENERATIONS -t THREADS`.
The first step (compiling, warming) is left out; medians of the other rounds.

Figures, both sides B = PROMPTS x GENERATIONS sequences:
- decode (the acceptance's figure): llmtune's tokens sampled after each lane's first, over the
  decode time (each step B tokens), against llama-batched-bench's S_TG (B x NTG / T_TG);
- whole generation: llmtune's completion tokens over the sampler's whole call (prefill, whose
  prompts are prefilled once per prompt and copied to its lanes, and decode), against
  llama-batched-bench's B x NTG / T (its T: B prompts prefilled, then the decode).
--no-share prefills every lane's prompt (no k/v copy): whether the copy matters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench_batched import STORY, cpu_name, llama, llama_cmd  # (first of numpy's importers: its BLAS set)
from llmtune.eval.generate import PolicySampler
from llmtune.model.loaded import load_model
from llmtune.train.finetune import finetune


def story_prompts(model: Path, n: int, n_tok: int) -> list[str]:
    """n distinct prompts of n_tok tokens (BOS included where the model adds one): STORY's slices,
    each starting 6 tokens after the previous one."""
    tok = load_model(model).tokenizer
    ids = tok.encode(STORY, add_special=False, parse_special=False)
    body = n_tok - int(bool(tok.add_bos))
    if len(ids) < body + 6 * (n - 1):
        raise SystemExit(f"--npp {n_tok}: the story has {len(ids)} tokens, too few for {n} prompts")
    return [b"".join(tok.token_to_bytes(t, special=False) for t in ids[6 * i : 6 * i + body]).decode("utf-8", "replace")
            for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's llama-batched-bench")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="--num-generations")
    ap.add_argument("--length", type=int, default=64, help="--max-completion-length (llama's -ntg)")
    ap.add_argument("--npp", type=int, default=48, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-share", action="store_true", help="prefill each lane's prompt (no k/v copy)")
    args = ap.parse_args()
    b = args.prompts * args.generations
    largs = SimpleNamespace(npp=args.npp, ntg=args.length, npl=[b], threads=args.threads)
    steps: list[dict] = []
    load_before = os.getloadavg()[0]

    class TimedSampler(PolicySampler):
        """PolicySampler, timed; llama-batched-bench run next to each call (alternating sides)."""

        def __init__(self, trainer, n_ctx):
            super().__init__(trainer, n_ctx, share_prompts=not args.no_share)

        def __call__(self, prompts, n, max_tokens, temperature, top_p, seeds):
            k = len(steps)
            theirs = llama(args.bin, args.model, largs)[b] if k % 2 else None
            t0 = time.perf_counter()
            out = super().__call__(prompts, n, max_tokens, temperature, top_p, seeds)
            wall = time.perf_counter() - t0
            theirs = theirs or llama(args.bin, args.model, largs)[b]
            firsts = self.results[:: self.chunk(n)]  # a chunk's lanes share its times: its first lane's
            decode, prefill = sum(r.decode_seconds for r in firsts), sum(r.prompt_seconds for r in firsts)
            lengths = [len(c) for c in out]
            row = {"wall": wall, "decode": decode, "prefill": prefill, "lengths": lengths,
                   "prompt_tokens": [len(p) for p in prompts],
                   "tg": sum(max(n_tok - 1, 0) for n_tok in lengths) / decode, "whole": sum(lengths) / wall,
                   "llama_tg": theirs["tg"], "llama_whole": b * args.length / theirs["t"],
                   "load": os.getloadavg()[0]}
            steps.append(row)
            print(f"  step {k + 1}: llmtune decode {row['tg']:.1f} t/s, whole {row['whole']:.1f} t/s "
                  f"(prefill {prefill:.2f} s, decode {decode:.2f} s, mean length {statistics.mean(lengths):.1f}); "
                  f"llama-batched-bench S_TG {row['llama_tg']:.1f}, whole {row['llama_whole']:.1f} "
                  f"(load {row['load']:.2f})", file=sys.stderr, flush=True)
            return out

    prompts = story_prompts(args.model, args.prompts * (args.rounds + 1), args.npp)
    ctx = -(-(args.npp + args.length + 8) // 32) * 32
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        finetune(args.model, data, Path(tmp) / "out.gguf", rollout=TimedSampler, method="grpo",
                 reward=[r"regex:\bball\b"], num_generations=args.generations, max_completion_length=args.length,
                 ctx=ctx, batch=ctx * b, ubatch=ctx * args.generations, lora_rank=8, lr=1e-5, epochs=1,
                 val_split=0.0, seed=0, shuffle=False)
    measured = steps[1:]
    med = {k: statistics.median(s[k] for s in measured) for k in ("tg", "whole", "llama_tg", "llama_whole")}
    print(f"CPU: {cpu_name()}; load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"medians of {len(measured)} GRPO steps (the first, warming up, left out)\n")
    print(f"- llama.cpp: `{' '.join(llama_cmd(args.bin, args.model, largs))}`")
    print(f"- llmtune: finetune --method grpo, LoRA r8, {args.prompts} prompts x --num-generations {args.generations}, "
          f"--max-completion-length {args.length}, --ctx {ctx}, prompts of {measured[0]['prompt_tokens']} tokens, "
          f"k/v copy {'off' if args.no_share else 'on'}; completion lengths "
          f"{sorted(n for s in measured for n in s['lengths'])[::b // 2 or 1]} (every {b // 2 or 1}th, sorted)\n")
    print("| B | decode t/s: llama-batched-bench S_TG | llmtune | ratio | whole generation t/s: llama.cpp | llmtune "
          "| ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {b} | {med['llama_tg']:.1f} | {med['tg']:.1f} | **{med['tg'] / med['llama_tg']:.2f}x** | "
          f"{med['llama_whole']:.1f} | {med['whole']:.1f} | {med['whole'] / med['llama_whole']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
