"""Real models against their peers, every row of issue 23's table in one run, sides taking turns.

    bash ../shared/models/fetch-smollm2.sh DIR          # SmolLM2-135M-Instruct Q4_1 (tied Q8_0 output)
    python bench/bench_real.py --bin PATH/TO/llama.cpp/build/bin --model DIR/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--rows qlora,lora,full,decode,ppl] [--shapes smollm2,qwen2-0.5b,gemma3-270m] [--rounds 3]

Rows (--rows; each runs --rounds rounds, every side of a row in a fresh process each round, the
sides back to back; the table shows medians over the rounds):
- qlora / lora: LoRA rank 8 (alpha 16, q/k/v/o/gate/up/down, no dropout, AdamW lr 1e-4), ctx 128,
  one chat example per window (synthetic conversations cut from WikiText-2, rendered with the
  model's chat template, loss on the assistant turns only), on the Q4_1 file (qlora: QLoRA, its
  frozen matrices as stored plus the float32 copies the memory budget allows) and on its f32
  export (lora); the peer for both is transformers' LlamaForCausalLM on the f32 export with
  peft.get_peft_model, torch.set_num_threads 1 and 2 (the better is the peer), the same windows,
  the same masked cross-entropy. Tokens/s: ctx * batch / the median of --steps step times after
  untimed ones (llmtune: its OpenBLAS thread-count trials and one more; PyTorch: one).
- full: every weight of the f32 export trained (AdamW), ctx 128, against the same model in
  PyTorch (torch.optim.AdamW over every parameter), threads 1 and 2.
- lora-nopack (not in the default --rows): the lora row's llmtune side again with LLMTUNE_PACKED=0
  (no packed copies of the frozen base: numpy's BLAS for its products, OpenBLAS's threads tuned
  by timing), in turns with it, each in a fresh process: what the packed copies are worth.
- qlora-ab (not in the default --rows): QLoRA on the Q4_1 file, LoRA on the f32 export and QLoRA
  without its float copies, three trainers in one process, their steps taking turns (--ab-steps
  each, medians): the acceptance ratio QLoRA / LoRA-on-f32 with the machine's drift on all alike.
- decode: `llama-completion -t T -p PROMPT -n N --temp 0 --ignore-eos -no-cnv` (its "eval time")
  for T in 1, 2 (the faster is the peer) against llmtune in a fresh process (load, prompt, N greedy tokens); its time to
  first token (process start to the first sampled token) and prompt time; on the Q4_1 file and
  the f32 export.
- ppl: `llmtune perplexity FILE TEXT -c 512 --chunks 8` (the Q4_1 file and the f32 export) against
  `llama-perplexity -c 512 --chunks 8` at its fastest of -b 512 / 2048 and -t 1 / 2 (picked in the first round),
  wall clock of the whole command (start-up included) and each side's peak RSS (GNU time's maximum resident set),
  compared at both tools' default batch (2048 tokens in flight: llama.cpp's -b 2048, llmtune's
  1024-token passes one per core), the fastest setting's beside it.

--shapes: smollm2 is the real file (--model). qwen2-0.5b and gemma3-270m are RANDOM-WEIGHT models
in the real configurations (configs/qwen2-0.5b.toml: Qwen2.5-0.5B; configs/gemma3-270m.toml:
Gemma-3-270M; `llmtune init` seed 0 with the vocabulary named there, then `llmtune export --type
q4_k_m`), made once in --work: their speeds are real-shape speeds, their perplexities mean
nothing. They take the decode and ppl rows (the PyTorch peers here build llama models only).

Other jobs on a shared machine move every number: the load average before and after is printed;
compare ratios within one run.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import compileall
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "wikitext-2-raw-test.txt.gz"
PROMPT = "Once upon a time"
ROWS = ("qlora", "lora", "full", "decode", "ppl", "qlora-ab", "lora-nopack")
SHAPES = {  # name -> (config, vocabulary file), random weights
    "qwen2-0.5b": ("configs/qwen2-0.5b.toml", "tests/data/vocab/ggml-vocab-qwen2.gguf.gz"),
    "gemma3-270m": ("configs/gemma3-270m.toml", "tests/data/vocab/ggml-vocab-gemma-4.gguf.gz"),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA, LR = 8, 16.0, 1e-4

# ------------------------------------------------------------------------------------ decode (child)
_LLMTUNE_DECODE = r"""
import json, sys, time
t0 = time.perf_counter()
from llmtune.resources import prefer_small_pages
prefer_small_pages()  # as `llmtune generate` starts (cli.main)
from llmtune.eval.generate import Generator, load_for_generation
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.backends.cpu.native import kernels
model = load_for_generation(sys.argv[1])
gen = Generator(model, "cpu", n_ctx=int(sys.argv[3]))
ids = gen.tokenize_prompt(sys.argv[4])
first = []
res = gen.generate(ids, int(sys.argv[2]), Sampler(SamplerConfig(temp=0.0, seed=0)), stop_at_eog=False,
                   on_token=lambda t, s: first or first.append(time.perf_counter() - t0))
print(json.dumps({"tok_s": res.tokens_per_s, "ttft_s": first[0], "prompt_s": res.prompt_seconds,
                  "n": len(res.tokens), "native": kernels.available()}))
"""


def llmtune_env(**extra: str) -> dict:
    """An llmtune child's environment: the checkout on PYTHONPATH, and Python's bytecode cache on,
    as an installed llmtune has it (pip compiles a package's modules when it installs them). A
    shell with PYTHONDONTWRITEBYTECODE set (this sandbox's) would make every start-up compile
    llmtune's modules again (~0.1 s of each perplexity run); main() compiles them once first."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


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


def llmtune_decode(model: Path, n: int, ctx: int, native: bool = True) -> dict:
    env = llmtune_env(LLMTUNE_NATIVE="1" if native else "0")
    done = subprocess.run([sys.executable, "-c", _LLMTUNE_DECODE, str(model), str(n), str(ctx), PROMPT],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"llmtune failed on {model}:\n{done.stderr[-2000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if res["native"] != native:
        raise RuntimeError(f"llmtune: compiled kernels {'not ' if native else ''}in use ({model})")
    return res


# ------------------------------------------------------------------------------------ perplexity
def timed(cmd: list[str], env=None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a command, the RSS from GNU time (-f %M, KiB)."""
    t = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    m = re.findall(r"MAXRSS (\d+)", done.stderr)
    if done.returncode or not m:
        raise RuntimeError(f"{cmd[0]} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    return wall, int(m[-1]) * 1024


def llama_ppl_cmd(bin_dir: Path, model: Path, text: Path, ctx: int, chunks: int, batch: int, threads: int) -> list[str]:
    return [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks",
            str(chunks), "-b", str(batch), "-t", str(threads)]


def llmtune_ppl_cmd(model: Path, text: Path, ctx: int, chunks: int) -> list[str]:
    return [sys.executable, "-m", "llmtune", "perplexity", str(model), str(text), "--ctx", str(ctx), "--chunks",
            str(chunks)]


# ------------------------------------------------------------------------------------ training (children)
def chat_windows(model_path: str, ctx: int, n: int, work: Path) -> Path:
    """n chat windows ([n, ctx] inputs and targets, -1 where no loss) of synthetic conversations
    (a user turn asking to continue a WikiText-2 paragraph's first sentence, the assistant turn the
    rest), rendered by the model's chat template, one example per window (finetune's default)."""
    out = work / f"chat-{Path(model_path).stem}-{ctx}-{n}.npz"
    if out.exists():
        return out
    from llmtune.model.loaded import load_model
    from llmtune.train.chat import build_dataset

    paras = [p.strip() for p in gzip.decompress(TEXT.read_bytes()).decode().split("\n") if len(p.strip()) > 300]
    records = work / "chat.jsonl"
    with open(records, "w", encoding="utf-8") as fh:
        for p in paras[: 4 * n]:
            head, _, rest = p.partition(". ")
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"Continue this text: {head}."},
                                              {"role": "assistant", "content": rest[:400]}]}) + "\n")
    ds, _ = build_dataset(load_model(model_path), records, ctx, 0.0, "chat")
    x, y = ds.gather(range(min(n, ds.n_train)))
    np.savez(out, x=x, y=y)
    return out


def llmtune_warmup() -> int:
    """Untimed llmtune steps: its OpenBLAS thread-count trials (threads.BlasTuner), then one more."""
    from llmtune.backends.cpu.threads import BlasTuner

    return BlasTuner.TRIAL_RUNS + 1


def _steps(step, windows, batch: int, steps: int, warmup: int = 1) -> list[float]:
    """`warmup` untimed steps, then `steps` timed ones, each on the next `batch` windows."""
    times = []
    for s in range(steps + warmup):
        idx = [(s * batch + i) % len(windows["x"]) for i in range(batch)]
        t = time.perf_counter()
        step(windows["x"][idx], windows["y"][idx])
        if s >= warmup:
            times.append(time.perf_counter() - t)
    return times


def llmtune_trainer(model_path: str, kind: str, ctx: int, batch: int):
    """llmtune's side of a training row: a Trainer of every weight (kind "full") or of a new LoRA
    adapter (rank LORA_RANK, alpha LORA_ALPHA), batch windows of ctx tokens a step, one per pass."""
    from llmtune.backends.cpu import CPUBackend
    from llmtune.model.adapter import attach, init_adapter
    from llmtune.model.loaded import load_model
    from llmtune.train.trainer import Trainer

    model = load_model(model_path)
    if kind == "full":
        trainable = list(model.tensors())
    else:
        adapter = init_adapter(model, LORA_RANK, alpha=LORA_ALPHA, seed=0)
        model = attach(model, [adapter])
        trainable = list(adapter.tensors())
    return Trainer(model, CPUBackend(), n_ctx=ctx, n_batch=ctx * batch, n_ubatch=ctx, trainable=trainable)


def torch_step(model_path: str, kind: str, threads: int):
    """PyTorch's side of a training row: step(x, y) -> loss, one AdamW step of transformers'
    LlamaForCausalLM on the f32 weights (every parameter, or peft.get_peft_model's LoRA), the
    masked cross-entropy (targets -1 carry no loss), torch.set_num_threads(threads)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_qlora import torch_llama

    torch.set_num_threads(threads)
    model = torch_llama(model_path)
    if kind == "full":
        params = list(model.parameters())
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                 target_modules=list(TARGETS)))
        params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def step(x, y) -> float:
        logits = model(input_ids=torch.from_numpy(x.astype(np.int64))).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y.astype(np.int64)).reshape(-1),
                               ignore_index=-1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def run_llmtune_train(model_path: str, windows_path: str, kind: str, ctx: int, batch: int, steps: int) -> dict:
    from llmtune.train.trainer import RunningStats

    windows = dict(np.load(windows_path))
    tr = llmtune_trainer(model_path, kind, ctx, batch)
    losses = []
    times = _steps(lambda x, y: losses.append(tr.train_step(x, y, LR, RunningStats())), windows, batch, steps,
                   llmtune_warmup())
    return {"step_s": times, "losses": losses, "memory": tr.memory_bytes()}


def run_torch_train(model_path: str, windows_path: str, kind: str, ctx: int, batch: int, steps: int,
                    threads: int) -> dict:
    windows = dict(np.load(windows_path))
    step, losses = torch_step(model_path, kind, threads), []
    return {"step_s": _steps(lambda x, y: losses.append(step(x, y)), windows, batch, steps), "losses": losses}


def run_llmtune_ab(q4_path: str, f32_path: str, windows_path: str, ctx: int, batch: int, steps: int) -> dict:
    """QLoRA (Q4_1) and LoRA (f32) trainers in one process, their steps taking turns (a busy
    machine's drift falls on both alike): {"qlora": step seconds, "lora": step seconds}, and
    QLoRA with its float copies off (the per-product decode) as a third."""
    from llmtune.backends.cpu import CPUBackend
    from llmtune.model.adapter import attach, init_adapter
    from llmtune.model.loaded import load_model
    from llmtune.train.trainer import RunningStats, Trainer

    windows = dict(np.load(windows_path))
    trainers = {}
    for name, path in (("qlora", q4_path), ("lora", f32_path), ("qlora, no float copies", q4_path)):
        model = load_model(path)
        adapter = init_adapter(model, LORA_RANK, alpha=LORA_ALPHA, seed=0)
        tr = Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=ctx, n_batch=ctx * batch, n_ubatch=ctx,
                     trainable=list(adapter.tensors()))
        if name.endswith("no float copies") and tr.float_copies is not None:
            # none kept, and OpenBLAS's threads tuned by timing as a run without copies has them
            tr.float_copies.budget, tr.float_copies.pack = 0, False
            tr._packed_products, tr._blas_tuner = False, CPUBackend().step_tuner(tr.n_workers)
        trainers[name] = tr
    times: dict[str, list[float]] = {n: [] for n in trainers}
    warmup = llmtune_warmup()
    for s in range(steps + warmup):
        idx = [(s * batch + i) % len(windows["x"]) for i in range(batch)]
        for name, tr in trainers.items():
            time.sleep(0.3)  # the last step's BLAS threads (the run without copies) stop spinning first
            t = time.perf_counter()
            tr.train_step(windows["x"][idx], windows["y"][idx], LR, RunningStats())
            if s >= warmup:
                times[name].append(time.perf_counter() - t)
    return times


def child(args) -> None:
    if args.child in ("ab", "llmtune"):
        from llmtune.resources import prefer_small_pages

        prefer_small_pages()  # as llmtune's commands start (cli.main)
    if args.child == "ab":
        q4, f32 = args.model.split(",")
        print("RESULT " + json.dumps(run_llmtune_ab(q4, f32, args.windows, args.ctx, args.batch, args.steps)),
              flush=True)
        return
    if args.child == "llmtune":
        res = run_llmtune_train(args.model, args.windows, args.kind, args.ctx, args.batch, args.steps)
    else:
        res = run_torch_train(args.model, args.windows, args.kind, args.ctx, args.batch, args.steps, args.threads)
    print("RESULT " + json.dumps(res), flush=True)


def train_side(side: str, model: Path, windows: Path, kind: str, args, threads: int = 0,
               env: dict | None = None) -> float:
    """Tokens/s of one side in a fresh process (env: its extra variables): ctx * batch / the
    median timed step."""
    cmd = [sys.executable, __file__, "--child", side, "--model", str(model), "--windows", str(windows), "--kind", kind,
           "--ctx", str(args.ctx), "--batch", str(args.batch), "--steps", str(args.steps), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=llmtune_env(**(env or {})))
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"{side} {kind} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    print(f"  {side}{f' t{threads}' if threads else ''} {kind} {model.name}: steps {res['step_s']}, "
          f"losses {[round(v, 4) for v in res['losses']]}" + (f", memory {res['memory']}" if "memory" in res else ""),
          flush=True)
    return args.ctx * args.batch / statistics.median(res["step_s"])


# ------------------------------------------------------------------------------------ files
def f32_export(model: Path) -> Path:
    out = model.with_name(model.name.replace(".gguf", "").replace(".Q4_1", "") + ".f32.gguf")
    if not out.exists():
        import llmtune

        llmtune.export(model, out, "f32")
    return out


def random_shape(name: str, work: Path) -> Path:
    """The q4_k_m file of a random-weight model in a real configuration (made once in work)."""
    import llmtune
    from llmtune.convert.init import init_model

    config, vocab = SHAPES[name]
    q4 = work / f"{name}-random.q4_k_m.gguf"
    if q4.exists():
        return q4
    work.mkdir(parents=True, exist_ok=True)
    voc = work / Path(vocab).name.replace(".gz", "")
    if not voc.exists():
        src = ROOT / vocab
        voc.write_bytes(gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes())
    f32 = work / f"{name}-random.f32.gguf"
    if not f32.exists():
        init_model(ROOT / config, voc, f32, seed=0)
    llmtune.export(f32, q4, "q4_k_m")
    f32.unlink()  # only the quantized file is measured
    return q4


# ------------------------------------------------------------------------------------ rows
def med(values) -> float:
    return statistics.median(values)


def train_rows(label: str, q4: Path, f32: Path, rows: list[str], args, out: list) -> None:
    windows = chat_windows(str(f32), args.ctx, max(16, args.batch * (max(args.steps, args.ab_steps) + 8)), args.work)
    runs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        print(f"{label} training, round {r + 1}", flush=True)
        if "qlora" in rows:
            runs.setdefault("qlora", []).append(train_side("llmtune", q4, windows, "lora", args))
        if "lora" in rows or "lora-nopack" in rows:
            runs.setdefault("lora", []).append(train_side("llmtune", f32, windows, "lora", args))
        if "lora-nopack" in rows:
            runs.setdefault("lora-nopack", []).append(
                train_side("llmtune", f32, windows, "lora", args, env={"LLMTUNE_PACKED": "0"}))
        if "qlora" in rows or "lora" in rows:
            for t in args.torch_threads:
                runs.setdefault(f"peft t{t}", []).append(train_side("torch", f32, windows, "lora", args, t))
        if "full" in rows:
            runs.setdefault("full", []).append(train_side("llmtune", f32, windows, "full", args))
            for t in args.torch_threads:
                runs.setdefault(f"torch t{t}", []).append(train_side("torch", f32, windows, "full", args, t))
    peft = max(med(runs[f"peft t{t}"])
               for t in args.torch_threads) if f"peft t{args.torch_threads[0]}" in runs else None
    best_t = lambda key: max(args.torch_threads, key=lambda t: med(runs[f"{key} t{t}"]))  # noqa: E731
    ctxs = f"ctx {args.ctx}, {args.batch} seq/step"
    if "qlora" in runs:
        q = med(runs["qlora"])
        out.append((f"{label}: LoRA r{LORA_RANK}, chat, {ctxs}, base Q4_1 (QLoRA)", f"{q:.0f} tok/s",
                    f"PyTorch+PEFT f32, {best_t('peft')} threads: {peft:.0f}", q / peft))
    if "lora" in runs:
        f = med(runs["lora"])
        if peft is not None:
            out.append((f"{label}: LoRA r{LORA_RANK}, same data, base f32", f"{f:.0f} tok/s",
                        f"PyTorch+PEFT f32, {best_t('peft')} threads: {peft:.0f}", f / peft))
        if "lora-nopack" in runs:
            n = med(runs["lora-nopack"])
            out.append((f"{label}: LoRA f32 with the frozen base's packed copies vs without (LLMTUNE_PACKED=0)",
                        f"{f:.0f} tok/s", f"without: {n:.0f}", f / n))
        if "qlora" in runs:
            out.append((f"{label}: QLoRA (Q4_1) vs LoRA (f32), llmtune both", f"{med(runs['qlora']):.0f} tok/s",
                        f"llmtune LoRA f32: {f:.0f}", med(runs["qlora"]) / f))
    if "full" in runs:
        full = med(runs["full"])
        peer = max(med(runs[f"torch t{t}"]) for t in args.torch_threads)
        out.append((f"{label}: full finetune, f32, {ctxs}", f"{full:.0f} tok/s",
                    f"PyTorch, {best_t('torch')} threads: {peer:.0f}", full / peer))


def ab_row(label: str, q4: Path, f32: Path, args, out: list) -> None:
    """qlora-ab: QLoRA against LoRA on f32 in one process, steps alternating (run_llmtune_ab)."""
    windows = chat_windows(str(f32), args.ctx, max(16, args.batch * (max(args.steps, args.ab_steps) + 8)), args.work)
    cmd = [sys.executable, __file__, "--child", "ab", "--model", f"{q4},{f32}", "--windows", str(windows),
           "--ctx", str(args.ctx), "--batch", str(args.batch), "--steps", str(args.ab_steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=llmtune_env())
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"qlora-ab failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    times = json.loads(line[len("RESULT "):])
    print(f"  qlora-ab step seconds: {times}", flush=True)
    tok = {n: args.ctx * args.batch / med(t) for n, t in times.items()}
    out.append((f"{label}: QLoRA (Q4_1) vs LoRA (f32), one process, {args.ab_steps} alternating steps",
                f"{tok['qlora']:.0f} tok/s", f"llmtune LoRA f32: {tok['lora']:.0f}", tok["qlora"] / tok["lora"]))
    out.append((f"{label}: the same QLoRA without float copies (decode per product)",
                f"{tok['qlora, no float copies']:.0f} tok/s", f"llmtune LoRA f32: {tok['lora']:.0f}",
                tok["qlora, no float copies"] / tok["lora"]))


def decode_rows(label: str, files: list[tuple[str, Path]], args, out: list) -> None:
    for kind, path in files:
        llama: dict[int, list[float]] = {}
        ours, fallback = [], []
        for r in range(args.rounds):
            print(f"{label} decode {kind}, round {r + 1}", flush=True)
            for t in (1, 2):
                llama.setdefault(t, []).append(llama_decode(args.bin, path, args.n, 512, t))
            ours.append(llmtune_decode(path, args.n, 512))
            if args.fallback:
                fallback.append(llmtune_decode(path, args.n, 512, native=False))
        tok = med(r["tok_s"] for r in ours)
        best = max((1, 2), key=lambda t: med(llama[t]))  # the peer at its best thread count
        two = med(llama[best])
        out.append((f"{label}: decode, {kind}, greedy {args.n} tokens", f"{tok:.1f} tok/s",
                    f"llama-completion -t {best}: {two:.1f} (-t {3 - best}: {med(llama[3 - best]):.1f})", tok / two))
        out.append((f"{label}: time to first token, {kind} (start-up + {PROMPT!r})",
                    f"{med(r['ttft_s'] for r in ours):.2f} s (prompt {med(r['prompt_s'] for r in ours) * 1e3:.0f} ms)",
                    "—", None))
        if fallback:
            fb = med(r["tok_s"] for r in fallback)
            out.append((f"{label}: decode, {kind}, LLMTUNE_NATIVE=0 (no compiled layer)", f"{fb:.1f} tok/s",
                        f"llama-completion -t {best}: {two:.1f}", fb / two))


def ppl_rows(label: str, files: list[tuple[str, Path]], args, out: list) -> None:
    text = args.work / "wiki.test.raw"
    if not text.exists():
        text.write_bytes(gzip.decompress(TEXT.read_bytes()))
    env = llmtune_env()
    n_tok = 512 * args.chunks
    for kind, path in files:
        best, ours, theirs = None, [], []
        for r in range(args.rounds):
            print(f"{label} perplexity {kind}, round {r + 1}", flush=True)
            if best is None:  # llama.cpp's fastest setting, picked in the first round
                tried = {(b, t): timed(llama_ppl_cmd(args.bin, path, text, 512, args.chunks, b, t))
                         for b in (512, 2048) for t in (1, 2)}
                best = min(tried, key=lambda k: tried[k][0])
                theirs.append(tried[best])
            else:
                theirs.append(timed(llama_ppl_cmd(args.bin, path, text, 512, args.chunks, *best)))
            ours.append(timed(llmtune_ppl_cmd(path, text, 512, args.chunks), env=env))
        ow, orss = med(w for w, _ in ours), med(m for _, m in ours)
        tw, trss = med(w for w, _ in theirs), med(m for _, m in theirs)
        out.append((f"{label}: perplexity, {kind}, ctx 512, {args.chunks} chunks (wall clock, start-up included)",
                    f"{n_tok / ow:.0f} tok/s", f"llama-perplexity -b {best[0]} -t {best[1]}: {n_tok / tw:.0f}",
                    tw / ow))
        # memory at the same tokens in flight: llmtune's default (1024-token passes, one per core)
        # against llama.cpp's default -b 2048 (RSS measured in round 1), and at the fastest setting
        default_rss = tried[(2048, best[1])][1]
        out.append((f"{label}: peak RSS, perplexity, {kind} (both at their default batch)", f"{orss / 2**20:.0f} MiB",
                    f"llama-perplexity -b 2048 -t {best[1]}: {default_rss / 2**20:.0f} MiB (-b {best[0]}: "
                    f"{trss / 2**20:.0f} MiB)", orss / default_rss))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, help="llama.cpp build/bin (llama-completion, llama-perplexity)")
    ap.add_argument("--model", help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--rows", default=",".join(ROWS[:5]), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--ab-steps", type=int, default=9, help="qlora-ab: timed steps of each trainer")
    ap.add_argument("--shapes", default="smollm2", help=f"comma-separated, of smollm2, {', '.join(SHAPES)}")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmtune-bench-real"), help="made files, kept and reused")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per process")
    ap.add_argument("--ctx", type=int, default=128, help="training context")
    ap.add_argument("--batch", type=int, default=1, help="training sequences per step")
    ap.add_argument("--torch-threads", default="1,2")
    ap.add_argument("-n", type=int, default=128, help="tokens to generate")
    ap.add_argument("--chunks", type=int, default=8, help="perplexity chunks of 512 tokens")
    ap.add_argument("--fallback", action="store_true", help="decode also with LLMTUNE_NATIVE=0 (numpy only)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--windows", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = [r for r in args.rows.split(",") if r]
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [r for r in rows if r not in ROWS] + [s for s in shapes if s != "smollm2" and s not in SHAPES]
    if bad:
        ap.error(f"unknown row or shape: {', '.join(bad)}")
    if ("decode" in rows or "ppl" in rows) and args.bin is None:
        ap.error("--bin: the decode and ppl rows need llama.cpp's build/bin")
    if "smollm2" in shapes and args.model is None:
        ap.error("--model: the smollm2 shape needs SmolLM2-135M-Instruct.Q4_1.gguf")
    if not shutil.which("/usr/bin/time") and "ppl" in rows:
        ap.error("the ppl row needs GNU time at /usr/bin/time (peak RSS)")
    args.torch_threads = [int(t) for t in args.torch_threads.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    compileall.compile_dir(str(ROOT / "llmtune"), quiet=1)  # the children's bytecode cache (llmtune_env)
    load0, t0 = os.getloadavg(), time.time()
    out: list = []
    for shape in shapes:
        if shape == "smollm2":
            q4 = Path(args.model)
            f32 = f32_export(q4)
            label, files = "SmolLM2-135M", [("Q4_1", q4), ("f32 export", f32)]
            if {"qlora", "lora", "full", "lora-nopack"} & set(rows):
                train_rows(label, q4, f32, rows, args, out)
            if "qlora-ab" in rows:
                ab_row(label, q4, f32, args, out)
        else:
            label, files = f"{shape} shape, RANDOM weights", [("Q4_K_M", random_shape(shape, args.work))]
        if "decode" in rows:
            decode_rows(label, files, args, out)
        if "ppl" in rows:
            ppl_rows(label, files, args, out)
    load1 = os.getloadavg()
    print(f"\nload average {load0[0]:.2f} before, {load1[0]:.2f} after ({os.cpu_count()} cores); {args.rounds} "
          f"rounds, medians; {(time.time() - t0) / 60:.0f} min")
    print("| workload | llmtune | peer | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, ours, peer, ratio in out:
        print(f"| {name} | {ours} | {peer} | {'' if ratio is None else f'{ratio:.2f}x'} |")


if __name__ == "__main__":
    main()
