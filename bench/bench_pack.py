"""--pack against one example per window: loss-carrying tokens per second of a LoRA chat finetune.

    bash /work/shared/models/fetch-smollm2.sh /work/models      # SmolLM2-135M-Instruct Q4_1 (benchmarks only)
    python bench/bench_pack.py /work/models/SmolLM2-135M-Instruct.Q4_1.gguf [--examples 120] [--ctx 128]
        [--batch 1024] [--ubatch 512] [--steps 4] [--repeats 3] [--rank 8] [--backend cpu]

The data set is --examples short conversations (a question about a country, a city or a number and
its one-sentence answer) rendered with the model's chat template (SmolLM2's ChatML with its default
system prompt): about 56 tokens each, so one example per --ctx 128 window leaves over half of
every pass padding. Both layouts are built by finetune's own code (train/chat.py build_dataset,
with and without pack) and trained by its Trainer with the same LoRA (rank --rank on attention
and FFN matrices, the Q4_1 base frozen in its file type), --batch tokens per optimizer step.

Each repeat is --steps optimizer steps of each layout after one warm-up step of each (compilation,
BLAS tuning), timed on the steps alone, the two layouts' steps interleaved (unpacked then packed,
packed then unpacked, ...) so a load that drifts slows both alike; the figure is the loss-carrying
tokens (assistant turns and their <|im_end|>) of those steps per second; the medians and their ratio
are printed, with the load average before and after.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

COUNTRIES = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"),
             ("Peru", "Lima"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Norway", "Oslo"), ("Chile", "Santiago"),
             ("Greece", "Athens"), ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
             ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Cuba", "Havana"), ("Ghana", "Accra"),
             ("Sweden", "Stockholm"), ("Finland", "Helsinki")]


def chat_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        country, city = COUNTRIES[i % len(COUNTRIES)]
        kind = (i // len(COUNTRIES)) % 6
        if kind == 0:
            q, a = f"What is the capital of {country}?", f"The capital of {country} is {city}."
        elif kind == 1:
            q, a = f"Which country has {city} as its capital?", f"{city} is the capital of {country}."
        elif kind == 2:
            q, a = f"Name the capital city of {country}, please.", f"Sure: it is {city}, in {country}."
        elif kind == 3:
            q, a = f"What is {i} plus {i + 7}?", f"{i} plus {i + 7} is {2 * i + 7}."
        elif kind == 4:
            q, a = f"Is {city} in {country}?", f"Yes, {city} is the capital of {country}."
        else:
            q, a = f"Spell the name {city} backwards.", f"{city} backwards is {city[::-1].lower()}."
        a += " I really hope that helps you."
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return rows


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--examples", type=int, default=120)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    from llmtune.backends import get_backend
    from llmtune.model.adapter import attach, init_adapter
    from llmtune.model.loaded import load_model
    from llmtune.train.chat import build_dataset
    from llmtune.train.trainer import RunningStats, Trainer

    base = load_model(args.model)
    adapter = init_adapter(base, args.rank, None, None, 0)
    model = attach(base, [adapter])
    backend = get_backend(args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chat.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(args.examples)))
        layouts = {pack: build_dataset(model, data, args.ctx, 0.0, pack=pack)[0] for pack in (False, True)}
    plain = layouts[False]
    lengths = [len(ex.ids) for ex in plain.examples]
    print(f"{args.model.name}: {len(lengths)} examples of {statistics.mean(lengths):.1f} tokens on average "
          f"(min {min(lengths)}, max {max(lengths)}), ctx {args.ctx}, batch {args.batch}, ubatch {args.ubatch}, "
          f"LoRA rank {args.rank}, {args.backend}")
    trainers, seqs = {}, args.batch // args.ctx
    for pack, ds in layouts.items():
        print(f"  {'packed' if pack else 'unpacked'}: {ds.n_train} windows, {len(lengths) / ds.n_train:.2f} examples "
              f"per window, {ds.padding(range(ds.n_train)):.1%} padding")
        if ds.n_train < seqs * (args.steps + 1):
            sys.exit(f"{ds.n_train} windows are fewer than {args.steps + 1} steps of {seqs}: lower --steps or --batch")
        trainers[pack] = Trainer(model, backend, n_ctx=args.ctx, n_batch=args.batch, n_ubatch=args.ubatch,
                                 trainable=list(adapter.tensors()), packed=pack)
    print(f"load average before: {load_average()}")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):
        batches, tokens, seconds = {}, {False: 0, True: 0}, {False: 0.0, True: 0.0}
        for pack, ds in layouts.items():
            order = ds.train_order(r, 0, True)
            batches[pack] = [ds.gather(order[s * seqs : (s + 1) * seqs]) for s in range(args.steps + 1)]
            b = batches[pack][0]
            trainers[pack].train_step(b[0], b[1], 1e-4, RunningStats(), *b[2:])  # warm-up
        for s in range(1, args.steps + 1):  # steps interleaved (ABBA...): a load that drifts hits both alike
            for pack in ((False, True) if s % 2 else (True, False)):
                b, stats = batches[pack][s], RunningStats()
                t0 = time.perf_counter()
                trainers[pack].train_step(b[0], b[1], 1e-4, stats, *b[2:])
                seconds[pack] += time.perf_counter() - t0
                tokens[pack] += stats.tokens
        for pack in (False, True):
            rates[pack].append(tokens[pack] / seconds[pack])
            print(f"  repeat {r + 1} {'packed' if pack else 'unpacked'}: {tokens[pack]} loss tokens in "
                  f"{seconds[pack]:.2f} s ({seconds[pack] / args.steps:.2f} s/step) = "
                  f"{rates[pack][-1]:,.1f} loss tokens/s",
                  flush=True)
    med = {pack: statistics.median(v) for pack, v in rates.items()}
    print(f"load average after: {load_average()}")
    print(f"median loss tokens/s: unpacked {med[False]:,.1f}, packed {med[True]:,.1f}: {med[True] / med[False]:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"rates": {str(k): v for k, v in rates.items()},
                                         "ratio": med[True] / med[False]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
