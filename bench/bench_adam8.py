"""--optimizer adamw8bit against float32 AdamW (issue 25 part 5): loss curves, memory, what fits.

    python bench/bench_adam8.py curves [--model 15m|PATH] [--steps 30] [--ctx 128] [--lr 1e-4,1e-3]
    python bench/bench_adam8.py fits   [--config configs/llama-1b.toml] [--vocab 128256] [--gib 24]
                                       [--activations-gib 4]
    python bench/bench_adam8.py speed  [--values 4000000]

curves: a full finetune of the model (15m: the 15M shape, configs/llama-15m.toml, random weights as
bench/bench_train.py makes it; or a GGUF path such as SmolLM2-135M-Instruct.f32.gguf) on the same
slice of data/wikitext-100k.txt, one --ctx sequence per step, no shuffling, once with each
optimizer, each run in a fresh process: per-step loss, finetune's printed memory estimate and the
process's peak RSS (VmHWM).

fits: the state finetune's estimate counts for a full finetune of a config's shape (trained
weights + gradients + optimizer state, float32; activations come on top and depend on --ctx and
--grad-checkpoint), from the real Optimizer objects' state_bytes (their buffers are np.zeros,
which the OS does not back until written, so this allocates nothing of note).

speed: the CPU backend's optimizer step over one 8-bit tensor of --values values, ns per value,
best of 5 steps after one (adamw's fused step in the same run as the yardstick).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "data" / "wikitext-100k.txt"
sys.path.insert(0, str(REPO / "bench"))


def _worker(model: str, text: str, ctx: int, lr: float, optimizer: str) -> dict:
    """One finetune in this fresh process: per-step losses, the estimate, peak RSS."""
    import llmtune
    from llmtune.resources import peak_rss

    losses = []
    with tempfile.TemporaryDirectory() as tmp:
        res = llmtune.finetune(model, text, Path(tmp) / "out.gguf", ctx=ctx, epochs=1, lr=lr, val_split=0.0,
                               shuffle=False, optimizer=optimizer,
                               callback=lambda e: losses.append(e.loss) if e.kind == "step" else None)
    return {"losses": losses, "memory_mib": {k: v / 2**20 for k, v in res.memory.items()},
            "peak_rss_mib": peak_rss() / 2**20}


def run(model: Path, text: Path, ctx: int, lr: float, optimizer: str) -> dict:
    from bench_memory import fresh_process

    return fresh_process("bench_adam8", f"_worker({str(model)!r}, {str(text)!r}, {ctx}, {lr}, {optimizer!r})")


def curves(args) -> None:
    from bench_memory import text_for
    from bench_train import model_15m

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = model_15m(tmp) if args.model == "15m" else Path(args.model)
        text = text_for(tmp, model, args.ctx, args.steps)
        for lr in map(float, args.lr.split(",")):
            res = {kind: run(model, text, args.ctx, lr, kind) for kind in ("adamw", "adamw8bit")}
            a, b = (np.array(res[k]["losses"]) for k in ("adamw", "adamw8bit"))
            n = min(a.size, b.size)
            w = max(1, n // 6)
            print(f"\n{model.name} ctx {args.ctx} lr {lr:g}: {n} steps")
            print("steps      " + " ".join(f"{i + 1:>3}-{min(i + w, n):<3}" for i in range(0, n, w)))
            for k, x in (("adamw", a), ("adamw8bit", b)):
                print(f"{k:<10} " + " ".join(f"{x[i:i + w].mean():7.3f}" for i in range(0, n, w)))
            rel = np.abs(b[:n] - a[:n]) / a[:n]
            print(f"per-step |8bit - f32| / f32: median {np.median(rel):.4f}, max {rel.max():.4f}; "
                  f"last {w} steps mean {a[n - w:n].mean():.4f} vs {b[n - w:n].mean():.4f}")
            for k in ("adamw", "adamw8bit"):
                m = res[k]["memory_mib"]
                print(f"{k:<10} estimate {sum(m.values()):8.1f} MiB (optimizer {m['optimizer']:.1f}, gradients "
                      f"{m['gradients']:.1f}, activations {m['activations']:.1f}); peak RSS "
                      f"{res[k]['peak_rss_mib']:.1f} MiB")


def shape_tensors(config: Path, n_vocab: int, n_layer: int | None = None) -> list[tuple[str, int]]:
    """(name, size) of a llama config's tensors in GGUF naming (n_layer: instead of the config's);
    the trainer's order does not change the state's size, only which tensors keep float32 moments."""
    from llmtune.tomlfile import read_toml

    hp = read_toml(config)["model"]
    e, f, layers = hp["n_embd"], hp["n_ff"], n_layer or hp["n_layer"]
    kv = e // hp["n_head"] * hp.get("n_head_kv", hp["n_head"])
    out = [("token_embd.weight", n_vocab * e), ("output_norm.weight", e)]
    if not hp.get("tied_output", False):
        out.append(("output.weight", n_vocab * e))
    for i in range(layers):
        out += [(f"blk.{i}.{k}", s) for k, s in (("attn_norm.weight", e), ("attn_q.weight", e * e),
                                                 ("attn_k.weight", e * kv), ("attn_v.weight", e * kv),
                                                 ("attn_output.weight", e * e), ("ffn_norm.weight", e),
                                                 ("ffn_gate.weight", e * f), ("ffn_up.weight", e * f),
                                                 ("ffn_down.weight", f * e))]
    return out


def resident_gib(tensors, kind: str) -> tuple[float, float]:
    """(optimizer state, weights + gradients + state) in GiB for a full finetune of these tensors."""
    from llmtune.backends.cpu import CPUBackend
    from llmtune.train.optim import Optimizer

    n = sum(s for _, s in tensors)
    state = Optimizer(kind, CPUBackend(), n, tensors=tensors).state_bytes
    return state / 2**30, (2 * 4 * n + state) / 2**30


def fits(args) -> None:
    tensors = shape_tensors(Path(args.config), args.vocab)
    n = sum(s for _, s in tensors)
    print(f"{Path(args.config).name}: {n / 1e9:.3f}B trained values (vocabulary {args.vocab}); float32 weights + "
          f"gradients {2 * 4 * n / 2**30:.2f} GiB")
    for kind in ("adamw", "adamw8bit"):
        state, total = resident_gib(tensors, kind)
        print(f"  {kind:<10} optimizer state {state:6.2f} GiB ({state * 2**30 / n:.2f} B/value); weights + gradients + "
              f"state {total:6.2f} GiB; {args.gib - total:+.2f} GiB left of {args.gib:g} GiB for activations")
    # the deepest stack of the config's blocks whose weights + gradients + state + activations fit
    for kind in ("adamw", "adamw8bit"):
        layers = 1
        while (resident_gib(shape_tensors(Path(args.config), args.vocab, layers + 1), kind)[1]
               + args.activations_gib <= args.gib):
            layers += 1
        n_l = sum(s for _, s in shape_tensors(Path(args.config), args.vocab, layers))
        print(f"  {kind:<10} deepest that fits with {args.activations_gib:g} GiB of activations: {layers} blocks "
              f"({n_l / 1e9:.2f}B values)")


def speed(args) -> None:
    import time

    from llmtune.backends.cpu import CPUBackend
    from llmtune.train.optim import Optimizer

    n, rng = args.values, np.random.default_rng(0)
    w, g = rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 1e-2).astype(np.float32)
    for kind in ("adamw", "adamw8bit"):
        opt = Optimizer(kind, CPUBackend(), n, tensors=[("blk.0.ffn_up.weight", n)])
        opt.step(w, g, 1e-4)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            opt.step(w, g, 1e-4)
            times.append(time.perf_counter() - t)
        print(f"{kind:<10} {min(times) / n * 1e9:6.1f} ns/value ({n:,} values)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["curves", "fits", "speed"])
    ap.add_argument("--model", default="15m")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", default="1e-4,1e-3")
    ap.add_argument("--config", default=str(REPO / "configs" / "llama-1b.toml"))
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--gib", type=float, default=24.0)
    ap.add_argument("--activations-gib", type=float, default=4.0)
    ap.add_argument("--values", type=int, default=4_000_000)
    args = ap.parse_args()
    {"curves": curves, "fits": fits, "speed": speed}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
