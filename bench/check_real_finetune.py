"""A real model, trained as a new user would and loaded by llama.cpp: what the output keeps.

    bash ../shared/models/fetch-smollm2.sh /work/models          # SmolLM2-135M-Instruct Q4_1
    python bench/check_real_finetune.py /work/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-bin PATH/TO/llama.cpp/build/bin [--examples 120] [--epochs 2] [--json FILE]

On bench_pack.py's chat set (short questions with one-sentence answers ending "I really hope that
helps you.", a phrase the base model never says), with every 10th conversation held out:
1. a full finetune of the Q4_1 file (the default output: trained tensors F32), its validation loss
   in memory and as written (llmtune re-scores the file), then the same weights re-quantized with
   --out-type q4_1 (what llmtune wrote before the output policy) and --out-type q8_0;
2. a LoRA finetune (rank 8) of the same file;
3. llama-completion loads each output (the LoRA one with --lora) and answers a held-out training
   question greedily; the answer is printed and checked for the trained phrase.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llmtune  # noqa: E402
from bench_pack import chat_rows  # noqa: E402

PHRASE = "I really hope that helps you"


def finetune(model, data, out, **settings) -> dict:
    events = []
    res = llmtune.finetune(model, data, out, callback=events.append, **settings)
    check = next((e for e in events if e.kind == "output_checked"), None)
    return {"output": str(out), "bytes": os.path.getsize(out), "val_loss": res.epochs[-1].val_loss,
            "val_loss_written": res.val_loss_written, "types": check.types if check else None,
            "first_loss": res.first_loss}


def llama_answer(bin_dir: Path, model: Path, question: str, lora: Path | None = None) -> str:
    prompt = (f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", prompt, "-n", "32", "--temp", "0", "-t", "2",
           "-no-cnv", "--no-display-prompt", "-s", "0"]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-completion failed on {model}:\n{done.stderr[-2000:]}")
    return done.stdout.split("<|im_end|>")[0].strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--llama-bin", type=Path)
    ap.add_argument("--examples", type=int, default=120)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    rows = chat_rows(args.examples)
    held_out = rows[5::10]
    train = [r for i, r in enumerate(rows) if i % 10 != 5] + held_out  # the last windows validate
    question = held_out[0]["messages"][0]["content"]
    report = {"model": str(args.model), "examples": len(rows), "question": question}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "chat.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in train), encoding="utf-8")
        common = dict(ctx=128, epochs=args.epochs, val_split=len(held_out) / len(train), seed=0)
        report["full_f32"] = finetune(args.model, data, tmp / "full.gguf", lr=1e-4, **common)
        for t in ("q4_1",):
            report[f"full_{t}"] = finetune(args.model, data, tmp / f"full-{t}.gguf", lr=1e-4, out_type=t, **common)
        report["lora"] = finetune(args.model, data, tmp / "lora.gguf", lr=1e-3, lora_rank=8, **common)
        if args.llama_bin:
            answers = {"base": llama_answer(args.llama_bin, args.model, question),
                       "full_f32": llama_answer(args.llama_bin, tmp / "full.gguf", question),
                       "full_q4_1": llama_answer(args.llama_bin, tmp / "full-q4_1.gguf", question),
                       "lora": llama_answer(args.llama_bin, args.model, question, lora=tmp / "lora.gguf")}
            report["llama_completion"] = {k: {"answer": v, "trained_phrase": PHRASE in v} for k, v in answers.items()}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
