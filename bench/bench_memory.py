"""Long contexts: peak memory (RSS) and training speed of the 15M shape (configs/llama-15m.toml)
at ctx 512..4096, with and without --grad-checkpoint, beside finetune's printed estimate; and
PyTorch's training speed of the same shape with scaled_dot_product_attention (flash attention on
the CPU) at ctx 2048, when torch is installed.

    python bench/bench_memory.py [--ctx 512,1024,2048,4096] [--repeats 3] [--steps 2] [--torch]

Each configuration runs `llmtune.finetune` in a fresh process (peak RSS = its VmHWM): one
sequence per step (--batch = --ctx), steps + 1 steps over a slice of data/wikitext-100k.txt, the
first one not timed; medians over the repeats (the machine may be shared).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmtune.resources import peak_rss

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
TEXT = REPO / "data" / "wikitext-100k.txt"


def _worker(model: str, text: str, ctx: int, steps: int, checkpoint: bool, lora: bool) -> dict:
    """One finetune run in this (fresh) process: its estimate, peak RSS and step speed."""
    import llmtune

    times = []

    def on(event, info):
        if event == "step":
            times.append(time.perf_counter())

    settings = dict(ctx=ctx, epochs=1, lr=1e-5, val_split=0.0, shuffle=False, grad_checkpoint=checkpoint)
    if lora:
        settings["lora_rank"] = 8
    with tempfile.TemporaryDirectory() as tmp:
        res = llmtune.finetune(model, text, Path(tmp) / "out.gguf", callback=on, **settings)
    step_s = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")
    return {"estimate_mib": sum(res.memory.values()) / 2**20, "memory": {k: v / 2**20 for k, v in res.memory.items()},
            "peak_rss_mib": peak_rss() / 2**20,
            "tokens_per_s": ctx / step_s, "steps": len(times)}


def fresh_process(module: str, call: str):
    """bench/<module>.py's `call` (a Python expression with a JSON result) in a fresh interpreter,
    so that its peak RSS is its own."""
    code = (f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import {module} as b; "
            f"print(json.dumps(b.{call}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(model: Path, text: Path, ctx: int, steps: int, checkpoint: bool, lora: bool = False) -> dict:
    return fresh_process("bench_memory",
                         f"_worker({str(model)!r}, {str(text)!r}, {ctx}, {steps}, {checkpoint}, {lora})")


def text_for(tmp: Path, model: Path, ctx: int, steps: int) -> Path:
    """A slice of the WikiText file holding steps + 1 training windows of ctx tokens (windows start
    every ctx / 2 tokens): characters cut by the model's own token count."""
    from llmtune.model.loaded import load_model

    tok = load_model(model).tokenizer
    text = TEXT.read_text(encoding="utf-8")
    need = (steps + 2) * ctx // 2 + ctx + 2
    n = len(text)
    while n > 1000 and len(tok.encode(text[: n // 2])) > need:
        n //= 2
    while len(tok.encode(text[:n])) < need:
        text = text + "\n" + text
        n = min(len(text), 2 * n)
    path = tmp / f"text-{ctx}.txt"
    path.write_text(text[:n], encoding="utf-8")
    return path


def torch_sdpa_tokens_per_s(model: Path, ctx: int, steps: int) -> float:
    """Training tokens/s of the same shape in PyTorch (float32, one sequence per step): llama blocks
    with F.scaled_dot_product_attention(is_causal=True), AdamW; median step after a warmup."""
    import torch
    import torch.nn.functional as F

    from llmtune.model.loaded import load_model

    hp = load_model(model).hp
    torch.manual_seed(0)
    E, H, L, FF, V, d = hp.n_embd, hp.n_head, hp.n_layer, hp.n_ff, hp.n_vocab, hp.head_dim

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = torch.nn.RMSNorm(E, eps=hp.norm_eps), torch.nn.RMSNorm(E, eps=hp.norm_eps)
            self.qkv = torch.nn.Linear(E, 3 * E, bias=False)
            self.o = torch.nn.Linear(E, E, bias=False)
            self.gate, self.up = torch.nn.Linear(E, FF, bias=False), torch.nn.Linear(E, FF, bias=False)
            self.down = torch.nn.Linear(FF, E, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(B, T, E))
            h = self.n2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def rope(x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    emb, blocks = torch.nn.Embedding(V, E), torch.nn.ModuleList(Block() for _ in range(L))
    norm, head = torch.nn.RMSNorm(E, eps=hp.norm_eps), torch.nn.Linear(E, V, bias=False)
    params = [p for m in (emb, blocks, norm, head) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    inv = hp.rope_freq_base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    theta = torch.arange(ctx, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = theta.cos(), theta.sin()
    times = []
    for _ in range(steps + 1):
        ids = torch.randint(0, V, (1, ctx + 1))
        t = time.perf_counter()
        x = emb(ids[:, :-1])
        for b in blocks:
            x = b(x, cos, sin)
        loss = F.cross_entropy(head(norm(x)).view(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return ctx / statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", default="512,1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--torch", action="store_true", help="also PyTorch SDPA training tokens/s at ctx 2048")
    args = ap.parse_args()
    from bench_train import model_15m

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = model_15m(tmp)
        print("| ctx | --grad-checkpoint | estimate MiB | peak RSS MiB | estimate / RSS | RSS per token "
              "KiB | tokens/s |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for ctx in map(int, args.ctx.split(",")):
            text = text_for(tmp, model, ctx, args.steps)
            for ckpt in (False, True):
                rs = [run(model, text, ctx, args.steps, ckpt) for _ in range(args.repeats)]
                est = statistics.median(r["estimate_mib"] for r in rs)
                rss = statistics.median(r["peak_rss_mib"] for r in rs)
                tps = statistics.median(r["tokens_per_s"] for r in rs)
                print(f"| {ctx} | {'yes' if ckpt else 'no'} | {est:.0f} | {rss:.0f} | {est / rss:.3f} | "
                      f"{rss * 1024 / ctx:.0f} | {tps:.0f} |", flush=True)
        if args.torch:
            import torch

            torch.set_num_threads(1)
            ts = [torch_sdpa_tokens_per_s(model, 2048, args.steps) for _ in range(args.repeats)]
            print(f"PyTorch {torch.__version__} SDPA, ctx 2048, 1 thread: {statistics.median(ts):.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
