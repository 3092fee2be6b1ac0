"""`llmtune eval MODEL TASK.jsonl --reward ...` against llama.cpp's llama-completion: the same prompts
completed greedily by both, graded by the same graders (train/rewards.py), prompt by prompt.

    python bench/check_eval_reward.py --bin PATH/TO/llama.cpp/build/bin --model M.gguf --task T.jsonl \
        --reward number:answer [--reward ...] [--reward-weights W] [--lora A.gguf | --random-lora OUT.gguf] \
        [-n 32] [--ctx 512] [--json OUT]
    python bench/check_eval_reward.py --write-arithmetic T.jsonl [--count 12]   # a chat arithmetic task
        # and T.rewards.py's last_number: the completion's last number equals "answer" (a small model
        # repeats the sum, "13 + 14 = 27", where number:answer reads the first number)

Each prompt is given to llama-completion as the text llmtune tokenizes (a plain prompt as it is; a
conversation rendered with the model's chat template and its generation prompt), raw (-no-cnv,
--no-escape: special-token strings parsed, BOS per the model's flag, as llmtune's read_prompts);
its --verbose-prompt token ids are checked against llmtune's. llama.cpp runs greedy (--temp 0) in
f32 (-ctk f32 -ctv f32 -fa off: its default f16 KV cache moves logits enough to flip near-ties),
with --lora for the adapter. Its completions (stdout, " [end of text]" removed) are graded with the
same graders; completion_ids for a length: grader are llmtune's tokens of llama.cpp's text (plus the
end-of-generation token when llama.cpp stopped on one). Printed: per prompt both answers, whether they
are the same text and the same reward; then both mean rewards per grader for base and adapter.

--random-lora writes a rank-8 adapter on every attention and MLP matrix with B ~ N(0, --b-std)
(A as PEFT initialises it), so the adapter moves the answers without training one.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmtune.eval.graded import GradedSettings, evaluate_graded  # noqa: E402
from llmtune.model.adapter import init_adapter, write_adapter  # noqa: E402
from llmtune.model.loaded import load_model  # noqa: E402
from llmtune.train.grpo import read_prompts  # noqa: E402
from llmtune.train.rewards import Rewards, parse_weights, weighted_sum  # noqa: E402

F32_ARGS = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
END = b" [end of text]\n"


def write_arithmetic(path: Path, count: int, seed: int = 0) -> None:
    """Chat records {"prompt": [user turn], "answer": a + b}: small sums a 135M model half gets."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(count):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            msg = f"What is {a} + {b}? Reply with the number only."
            fh.write(json.dumps({"prompt": [{"role": "user", "content": msg}], "answer": a + b}) + "\n")
    path.with_suffix(".rewards.py").write_text(LAST_NUMBER)


LAST_NUMBER = '''import re


def last_number(prompts, completions, answer, **kwargs):
    """1.0 when the completion's last number equals the answer (TRL's reward-function signature)."""
    out = []
    for c, want in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        found = re.findall(r"-?\\d+(?:\\.\\d+)?", text)
        out.append(float(bool(found) and float(found[-1]) == float(want)))
    return out
'''


def random_lora(model_path: Path, out: Path, b_std: float, seed: int = 0) -> Path:
    model = load_model(model_path)
    adapter = init_adapter(model, 8, 16.0, r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$", seed=seed)
    rng = np.random.default_rng(seed)
    for pair in adapter.pairs.values():
        pair.b[...] = rng.normal(0.0, b_std, pair.b.shape).astype(np.float32)
    return write_adapter(out, adapter, base=model.gguf)


def llama_completion(bin_dir: Path, model: Path, text: str, n: int, ctx: int, lora) -> tuple[bytes, list[int]]:
    """(completion bytes with the end marker kept, prompt ids) of a greedy run; repeated until two
    runs agree (llama.cpp's asynchronous logger can drop the end of stdout at exit)."""
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", text, "-n", str(n), "-c", str(ctx), "--temp",
           "0", "-no-cnv", "--no-escape", "--no-display-prompt", "--no-warmup", "--verbose-prompt", "-t", "2",
           *F32_ARGS, *(["--lora", str(lora)] if lora else [])]
    outs, ids = [], []
    for _ in range(6):
        done = subprocess.run(cmd, capture_output=True)
        if done.returncode:
            raise RuntimeError(f"llama-completion failed: {done.stderr.decode(errors='replace')[-2000:]}")
        out = done.stdout[:-2] if done.stdout.endswith(b"\n\n") else done.stdout
        err = done.stderr.decode("utf-8", "replace")
        m = re.search(r"number of tokens in prompt = (\d+)\n", err)
        ids = [int(t) for t in re.findall(r"^\S+ I +(\d+) -> '", err[m.end():], re.M)[: int(m.group(1))]]
        if out in outs:
            break
        outs.append(out)
    return max(outs, key=len), ids


def prompt_texts(model, task: Path, rewards: Rewards, room: int) -> tuple[list, list[str]]:
    kept, _, template = read_prompts(model, task, rewards, None, room)
    if template is None:
        return kept, [k[1] for k in kept]
    return kept, [template.render(k[1], add_generation_prompt=True) for k in kept]


def grade_llamacpp(model, rewards: Rewards, kept, outs: list[bytes]) -> tuple[np.ndarray, list[str]]:
    """([n, graders], texts) of llama.cpp's completions, graded as llmtune grades its own."""
    tok = model.tokenizer
    eog = tok.eos_id
    texts = [(o[: -len(END)] if o.endswith(END) else o).decode("utf-8", "replace") for o in outs]
    ids = [tok.encode(t, add_special=False) + ([eog] if o.endswith(END) else []) for t, o in zip(texts, outs)]
    conversational = not isinstance(kept[0][1], str)
    shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    keys = list(kept[0][2])
    columns = {k: [c[2].get(k) for c in kept] for k in keys}
    return rewards.score([k[1] for k in kept], shown, ids, columns, [k[3] for k in kept]), texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--task", type=Path)
    ap.add_argument("--reward", action="append")
    ap.add_argument("--reward-weights")
    ap.add_argument("--lora", type=Path)
    ap.add_argument("--random-lora", type=Path, help="write a random adapter here and use it as --lora")
    ap.add_argument("--b-std", type=float, default=0.01)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write-arithmetic", type=Path)
    ap.add_argument("--count", type=int, default=12)
    a = ap.parse_args()
    if a.write_arithmetic:
        write_arithmetic(a.write_arithmetic, a.count)
        return
    if a.random_lora:
        a.lora = random_lora(a.model, a.random_lora, a.b_std)
    weights = parse_weights(a.reward_weights, len(a.reward))
    t0 = time.perf_counter()
    ours = evaluate_graded(a.model, a.task, a.reward, weights, settings=GradedSettings(max_completion_length=a.n,
                                                                                       ctx=a.ctx),
                           lora=[a.lora] if a.lora else None)
    ours_s = time.perf_counter() - t0
    model = load_model(a.model)
    rewards = Rewards.of(a.reward, weights)
    kept, texts = prompt_texts(model, a.task, rewards, a.ctx - a.n)
    runs = [("base", None, ours.base if a.lora else ours.model)] + ([("adapter", a.lora, ours.model)] if a.lora else [])
    report = {"model": str(a.model), "task": str(a.task), "lora": str(a.lora) if a.lora else None, "n": a.n,
              "llmtune_seconds": ours_s}
    for label, lora, res in runs:
        t0 = time.perf_counter()
        got = [llama_completion(a.bin, a.model, t, a.n, a.ctx, lora) for t in texts]
        secs = time.perf_counter() - t0
        same_ids = sum(list(map(int, k[0])) == g[1] for k, g in zip(kept, got))
        scores, theirs = grade_llamacpp(model, rewards, kept, [g[0] for g in got])
        total = weighted_sum(scores, rewards.weights)
        same_text = same_reward = 0
        print(f"\n## {label}: prompt ids equal llama.cpp's for {same_ids}/{len(kept)} prompts")
        for p, (ours_p, t, r) in enumerate(zip(res.prompts, theirs, total)):
            o = ours_p.texts[0]
            st, sr = o == t, ours_p.rewards[0] == r or (np.isnan(r) and np.isnan(ours_p.rewards[0]))
            same_text, same_reward = same_text + int(st), same_reward + int(sr)
            print(f"{p + 1:3d} same_text={'yes' if st else 'NO '} reward llmtune {ours_p.rewards[0]:.3f} llama.cpp "
                  f"{r:.3f}  llmtune {o[:40]!r}  llama.cpp {t[:40]!r}")
        means = {n: float(np.nanmean(scores[:, i])) for i, n in enumerate(rewards.names)}
        print(f"{label}: llmtune rewards {res.rewards} reward {res.reward:.4f}; llama.cpp rewards {means} reward "
              f"{float(np.nanmean(total)):.4f}; same text {same_text}/{len(kept)}, same reward "
              f"{same_reward}/{len(kept)}; llama.cpp {secs:.1f} s")
        report[label] = {"llmtune": {"rewards": res.rewards, "reward": res.reward},
                         "llama.cpp": {"rewards": means, "reward": float(np.nanmean(total)), "seconds": secs},
                         "same_prompt_ids": same_ids, "same_text": same_text, "same_reward": same_reward,
                         "prompts": len(kept)}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
