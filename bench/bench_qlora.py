"""QLoRA on a 1B-class model: llmtune's LoRA on a q4_k_m base against PyTorch + PEFT LoRA in f32.

    python bench/bench_qlora.py [--work DIR] [--steps 4] [--rank 8] [--ctx 512] [--only llmtune|peft|llmtune-f32]

The model is configs/llama-1b.toml (Llama-3.2-1B's shape, the Llama 3 BPE vocabulary of 128,256
tokens, tied output) made by `llmtune init` (seed 0) and exported with `llmtune export --type
q4_k_m`; both files are kept in --work and reused. Every run trains the same LoRA (rank --rank,
alpha = rank, on attention q/k/v/o and FFN gate/up/down, no dropout; AdamW lr 1e-4) for --steps
optimizer steps of one --ctx-token sequence each, on the same WikiText-2 windows, in its own
process, whose peak resident memory (ru_maxrss: the memory-mapped base's touched pages included)
is reported with the tokens per second of the steps after the first.

- llmtune: the q4_k_m file; its matrices stay as the file's Q4_K / Q6_K bytes (memory-mapped),
  dequantized a few MiB at a time inside each product (ops.qlinear), activations rounded as
  llama.cpp rounds them; only input gradients flow through the base.
- llmtune-gc: the same with --grad-checkpoint (each block's activations recomputed in the backward).
- llmtune-f32: the same on the f32 file (the base as float32 views of the file).
- peft: transformers' LlamaForCausalLM with the f32 file's weights (q/k un-permuted from GGUF's
  rope layout), peft.get_peft_model(LoraConfig(...)), torch.optim.AdamW over the adapters.

PyTorch runs on every core (BENCH_TORCH_THREADS=1 for one thread: on a busy machine a second
thread can stall). The PyTorch side needs `pip install peft` (bench only; not a dependency of llmtune).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llmtune.resources import peak_rss

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama-1b.toml"
VOCAB = ROOT / "tests" / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf.gz"
TEXT = ROOT / "tests" / "data" / "wikitext-2-raw-test.txt.gz"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------ files
def prepare(work: Path, n_windows: int, ctx: int) -> dict:
    """The f32 and q4_k_m models and the token windows (made once, reused)."""
    import llmtune
    from llmtune.convert.init import init_model
    from llmtune.gguf.file import load_gguf
    from llmtune.tokenizer import Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    vocab = work / "llama-bpe.gguf"
    if not vocab.exists():
        vocab.write_bytes(gzip.decompress(VOCAB.read_bytes()))
    f32 = work / "llama-1b.gguf"
    if not f32.exists():
        t = time.perf_counter()
        init_model(CONFIG, vocab, f32, seed=0)
        print(f"init: {f32} in {time.perf_counter() - t:.0f} s", flush=True)
    q4 = work / "llama-1b-q4_k_m.gguf"
    if not q4.exists():
        t = time.perf_counter()
        summary = llmtune.export(f32, q4, "q4_k_m")
        print(f"export q4_k_m: {q4} in {time.perf_counter() - t:.0f} s ({dict(summary.type_counts())})", flush=True)
    tokens = work / f"windows-{ctx}.npy"
    if not tokens.exists():
        text = gzip.decompress(TEXT.read_bytes()).decode()[: 40 * n_windows * ctx]
        ids = np.asarray(Tokenizer.from_gguf(load_gguf(vocab)).encode(text, add_special=True), np.int32)
        windows = np.stack([ids[i * ctx: i * ctx + ctx + 1] for i in range(n_windows)])
        np.save(tokens, windows)
    return {"f32": f32, "q4_k_m": q4, "tokens": tokens}


# ------------------------------------------------------------------------------------ runs (child processes)
def run_llmtune(model_path: str, tokens_path: str, steps: int, rank: int, ctx: int, grad_checkpoint=False) -> dict:
    from llmtune.backends.cpu import CPUBackend
    from llmtune.model.adapter import attach, init_adapter
    from llmtune.model.loaded import load_model
    from llmtune.train.trainer import RunningStats, Trainer

    windows = np.load(tokens_path)
    t0 = time.perf_counter()
    model = load_model(model_path)
    adapter = init_adapter(model, rank, alpha=rank, seed=0)
    model = attach(model, [adapter])
    tr = Trainer(model, CPUBackend(), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, trainable=list(adapter.tensors()),
                 grad_checkpoint=grad_checkpoint)
    setup = time.perf_counter() - t0
    rss_ready = current_rss()
    times, losses = [], []
    stats = RunningStats()
    for s in range(steps):
        w = windows[s % len(windows)][None]
        t = time.perf_counter()
        losses.append(tr.train_step(w[:, :-1], w[:, 1:], 1e-4, stats))
        times.append(time.perf_counter() - t)
        print(f"  step {s + 1}: loss {losses[-1]:.4f}, {times[-1]:.1f} s", file=sys.stderr, flush=True)
    return {"setup_s": setup, "rss_ready": rss_ready, "step_s": times, "losses": losses,
            "memory_estimate": tr.memory_bytes(), "base_types": tr.base_types(), "n_trainable": tr.n_trainable}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF's q/k rows (llama.cpp's converter permutes them for its rope) back to HF's order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def torch_llama(model_path: str):
    """transformers' LlamaForCausalLM holding a llama GGUF's float32 weights (built on the meta
    device, then filled tensor by tensor: no second copy of the model in memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from llmtune.model.loaded import load_model

    m = load_model(model_path, quantized=False)  # float32 views of the file
    hp = m.hp
    cfg = LlamaConfig(vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=hp.n_ff,
                      num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head, num_key_value_heads=hp.n_head_kv,
                      max_position_embeddings=hp.n_ctx_train, rms_norm_eps=hp.norm_eps, rope_theta=hp.rope_freq_base,
                      tie_word_embeddings="output.weight" not in m.weights, attention_bias=False, mlp_bias=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").float()
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    sd = model.state_dict()
    with torch.no_grad():
        for name, w in m.weights.items():
            w = np.asarray(w)
            if name == "output.weight":
                continue
            if name == "token_embd.weight":
                key = "model.embed_tokens.weight"
            elif name == "output_norm.weight":
                key = "model.norm.weight"
            else:
                _, il, kind, _ = name.split(".")
                key = f"model.layers.{il}.{names[kind]}.weight"
                if kind in ("attn_q", "attn_k"):
                    w = _unpermute(w, hp.n_head if kind == "attn_q" else hp.n_head_kv)
            sd[key].copy_(torch.from_numpy(np.array(w)))
        if "output.weight" in m.weights:
            sd["lm_head.weight"].copy_(torch.from_numpy(np.array(m.weights["output.weight"])))
    if "output.weight" not in m.weights:
        model.tie_weights()
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)  # its buffers were left empty by to_empty
    return model


def run_peft(model_path: str, tokens_path: str, steps: int, rank: int, ctx: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", os.cpu_count() or 1)))
    windows = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    t0 = time.perf_counter()
    model = torch_llama(model_path)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=list(TARGETS)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    setup = time.perf_counter() - t0
    rss_ready = current_rss()
    times, losses = [], []
    for s in range(steps):
        w = windows[s % len(windows)][None]
        t = time.perf_counter()
        out = model(input_ids=w[:, :-1], labels=w[:, :-1].clone())  # HF shifts the labels itself
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(float(out.loss))
        print(f"  step {s + 1}: loss {losses[-1]:.4f}, {times[-1]:.1f} s", file=sys.stderr, flush=True)
    return {"setup_s": setup, "rss_ready": rss_ready, "step_s": times, "losses": losses,
            "n_trainable": sum(p.numel() for p in params)}


def child(kind: str, model: str, tokens: str, steps: int, rank: int, ctx: int) -> None:
    if kind == "peft":
        res = run_peft(model, tokens, steps, rank, ctx)
    else:
        res = run_llmtune(model, tokens, steps, rank, ctx, grad_checkpoint=kind == "llmtune-gc")
    res["peak_rss"] = peak_rss()
    print("RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------ report
def spawn(kind: str, model: Path, tokens: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", str(model), "--tokens", str(tokens),
           "--steps", str(args.steps), "--rank", str(args.rank), "--ctx", str(args.ctx)]
    print(f"{kind}: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"{kind} failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
    return json.loads(line[len("RESULT "):])


def summary_row(kind: str, res: dict, ctx: int) -> str:
    later = res["step_s"][1:] or res["step_s"]
    tps, best = ctx / (sum(later) / len(later)), ctx / min(later)
    gib = res["peak_rss"] / 2**30
    return (f"| {kind} | {gib:.2f} GiB | {res['rss_ready'] / 2**30:.2f} GiB | {tps:.1f} | {best:.1f} | "
            f"{' / '.join(f'{t:.1f}' for t in res['step_s'])} | {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmtune-qlora"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--only", action="append", choices=("llmtune", "llmtune-gc", "llmtune-f32", "peft"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.tokens, args.steps, args.rank, args.ctx)
        return 0
    files = prepare(args.work, max(args.steps, 4), args.ctx)
    runs = {"llmtune": files["q4_k_m"], "llmtune-gc": files["q4_k_m"], "peft": files["f32"],
            "llmtune-f32": files["f32"]}
    results = {}
    for kind in args.only or ["llmtune", "llmtune-gc", "peft"]:
        results[kind] = spawn(kind, runs[kind], files["tokens"], args)
        print(json.dumps(results[kind]), flush=True)
    print(f"\nLoRA rank {args.rank} on q/k/v/o/gate/up/down, ctx {args.ctx}, {args.steps} steps of one sequence, "
          f"{os.cpu_count()} cores")
    print("| run | peak RSS | RSS before step 1 | tokens/s (steps 2..) | best step tokens/s | step seconds | loss |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for kind, res in results.items():
        print(summary_row(kind, res, args.ctx))
    for kind, res in results.items():
        if "memory_estimate" in res:
            est = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in res["memory_estimate"].items())
            types = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in res["base_types"].items())
            print(f"{kind} estimate: {est} (base: {types})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
