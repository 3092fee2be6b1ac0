"""llmtune against PyTorch (training) and llama.cpp (perplexity), measured in the same run.

    python bench/bench_peers.py [--llama-bin DIR] [--reps 5] [--steps 3] [train] [ppl]

train  stories260K and the 15M shape (configs/llama-15m.toml), ctx 256, one optimizer step per
       row's batch: llmtune's Trainer against a PyTorch llama on the same weights (from the GGUF)
       and the same tokens: F.embedding, F.rms_norm, F.linear, batched rope on adjacent pairs,
       F.scaled_dot_product_attention(is_causal, enable_gqa), SwiGLU, cross-entropy, AdamW over
       every parameter (fused). Each side runs in its own process: llmtune as it chooses (one
       worker per core for several micro-batches, else BLAS threads picked by timing), PyTorch
       with torch.set_num_threads(cores) and again with 1, the better of the two being the peer.
       The parent takes turns (--reps rounds of --steps steps each, after WARMUP_STEPS untimed
       ones) and reports medians of the step times. The first losses are printed: they agree
       when every side runs the same model.
ppl    `llmtune perplexity` against llama-perplexity (--llama-bin; the rows are skipped without
       it), wall clock of the whole command including start-up, taking turns, median of --reps;
       llama.cpp at its fastest of -b ctx / -b 2048 and -t cores / -t 1 (picked in round one).

PyTorch is a bench-only dependency; nothing in llmtune or its tests imports it.
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
VOCAB = DATA / "vocab" / "ggml-vocab-llama-spm.gguf"
LR = 1e-4

# (label, model key, ctx, tokens per step, llmtune ubatch)
TRAIN_ROWS = [
    ("train stories260K ctx 256, 1 seq/step", "stories", 256, 256, 256),
    ("train stories260K ctx 256, 4 seq/step", "stories", 256, 1024, 256),
    ("train 15M shape ctx 256, 1 seq/step", "m15", 256, 256, 256),
    ("train 15M shape ctx 256, 8 seq/step (ubatch 512)", "m15", 256, 2048, 512),
]
# (label, model key, ctx, chunks)
PPL_ROWS = [
    ("perplexity stories260K ctx 128, 400 chunks", "stories", 128, 400),
    ("perplexity 15M shape f32 ctx 256, 40 chunks", "m15", 256, 40),
    ("perplexity 15M shape q8_0 ctx 256, 40 chunks", "m15q8", 256, 40),
]


def n_threads() -> int:
    from llmtune.backends.cpu.threads import n_cores

    return n_cores()


def step_tokens(n_vocab: int, n_seq: int, ctx: int, step: int) -> np.ndarray:
    """The tokens of one step ([n_seq, ctx + 1]), the same on both sides."""
    return np.random.default_rng(step).integers(0, n_vocab, (n_seq, ctx + 1)).astype(np.int32)


# ---------------------------------------------------------------------- the two trainers
def llmtune_stepper(path: str, ctx: int, batch: int, ubatch: int, threads: int):
    """threads: unused; llmtune picks its own (one worker per core, or BLAS threads by timing)."""
    from llmtune.backends.cpu import CPUBackend
    from llmtune.model.loaded import load_model
    from llmtune.train.trainer import RunningStats, Trainer

    model = load_model(path)
    tr = Trainer(model, CPUBackend(), n_ctx=ctx, n_batch=batch, n_ubatch=ubatch, trainable=list(model.weights))
    stats = RunningStats()

    def step(w: np.ndarray) -> float:
        return tr.train_step(w[:, :-1], w[:, 1:], LR, stats)

    return step, model.hp.n_vocab


class TorchLlama:
    """llama.cpp's llama graph in plain PyTorch, weights taken from the GGUF as float32."""

    def __init__(self, path: str):
        import torch

        from llmtune.model.loaded import load_model

        model = load_model(path)
        self.hp = hp = model.hp
        if hp.arch != "llama":
            raise ValueError(f"{path}: the PyTorch peer is a llama, not {hp.arch}")
        self.params = {n: torch.nn.Parameter(torch.from_numpy(np.array(w, dtype=np.float32)))
                       for n, w in model.weights.items()}
        d = hp.head_dim
        self.inv_freq = torch.tensor(hp.rope_freq_base ** (-np.arange(0, d, 2) / d) * hp.rope_freq_scale,
                                     dtype=torch.float32)
        self.rope_cache: dict = {}

    def rope(self, x, T: int):
        """Rotation of adjacent pairs (x[2i], x[2i+1]) by pos * theta_i (llama.cpp's NORM rope),
        one batched expression over [B, H, T, d]."""
        import torch

        if T not in self.rope_cache:
            ang = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            self.rope_cache[T] = (ang.cos(), ang.sin())
        cos, sin = self.rope_cache[T]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    def loss(self, tokens, targets):
        import torch.nn.functional as F

        hp, p = self.hp, self.params
        B, T = tokens.shape
        H, Hkv, d, eps = hp.n_head, hp.n_head_kv, hp.head_dim, hp.norm_eps
        x = F.embedding(tokens, p["token_embd.weight"])
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            h = F.rms_norm(x, (hp.n_embd,), p[b + "attn_norm.weight"], eps)
            q = self.rope(F.linear(h, p[b + "attn_q.weight"]).view(B, T, H, d).transpose(1, 2), T)
            k = self.rope(F.linear(h, p[b + "attn_k.weight"]).view(B, T, Hkv, d).transpose(1, 2), T)
            v = F.linear(h, p[b + "attn_v.weight"]).view(B, T, Hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, H * d), p[b + "attn_output.weight"])
            h = F.rms_norm(x, (hp.n_embd,), p[b + "ffn_norm.weight"], eps)
            g = F.silu(F.linear(h, p[b + "ffn_gate.weight"])) * F.linear(h, p[b + "ffn_up.weight"])
            x = x + F.linear(g, p[b + "ffn_down.weight"])
        x = F.rms_norm(x, (hp.n_embd,), p["output_norm.weight"], eps)
        out = p.get("output.weight", p["token_embd.weight"])
        return F.cross_entropy(F.linear(x, out).view(B * T, -1), targets.reshape(-1))


def torch_stepper(path: str, ctx: int, batch: int, ubatch: int, threads: int):
    import torch

    torch.set_num_threads(threads)
    model = TorchLlama(path)
    opt = torch.optim.AdamW(model.params.values(), lr=LR, weight_decay=0.0, fused=True)

    def step(w: np.ndarray) -> float:
        t = torch.from_numpy(w.astype(np.int64))
        opt.zero_grad(set_to_none=True)
        loss = model.loss(t[:, :-1], t[:, 1:])
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, model.hp.n_vocab


STEPPERS = {"llmtune": llmtune_stepper, "torch": torch_stepper}
# untimed steps per side: first-touch costs, PyTorch's kernel caches, and llmtune's one-time choice
# of a thread count (threads.BlasTuner's trial runs: a warm-up and two of each count)
WARMUP_STEPS = 6


def worker(side: str, path: str, ctx: int, batch: int, ubatch: int, threads: int) -> None:
    """Build one side, warm up, then answer each stdin line N with the times of N more steps."""
    step, n_vocab = STEPPERS[side](path, ctx, batch, ubatch, threads)
    n_seq = batch // ctx
    first = step(step_tokens(n_vocab, n_seq, ctx, 0))
    for done in range(1, WARMUP_STEPS):
        step(step_tokens(n_vocab, n_seq, ctx, done))
    done = WARMUP_STEPS
    print(json.dumps({"first_loss": first}), flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            w = step_tokens(n_vocab, n_seq, ctx, done)
            t = time.perf_counter()
            step(w)
            times.append(time.perf_counter() - t)
            done += 1
        print(json.dumps(times), flush=True)


def start_worker(side: str, threads: int, path: Path, ctx: int, batch: int, ubatch: int):
    cmd = [sys.executable, __file__, "--worker", side, str(path), str(ctx), str(batch), str(ubatch), str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return proc, json.loads(proc.stdout.readline())["first_loss"]


def train_row(path: Path, ctx: int, batch: int, ubatch: int, reps: int, steps: int) -> dict:
    """Median tokens/s of each side, the sides taking turns (the order reversed every round).
    PyTorch runs twice, with as many threads as llmtune has cores and with one: on a busy machine
    its OpenMP threads stall as OpenBLAS's do, and the peer gets the better of the two."""
    n = n_threads()
    sides = [("llmtune", n), ("torch", n)] + ([("torch", 1)] if n > 1 else [])
    procs, first = {}, {}
    for side, threads in sides:  # started one after the other: start-up overlaps no timing
        procs[side, threads], first[side, threads] = start_worker(side, threads, path, ctx, batch, ubatch)
    times = {side: [] for side in procs}
    order = list(procs)
    for r in range(reps):
        for side in (order if r % 2 == 0 else order[::-1]):
            proc = procs[side]
            proc.stdin.write(f"{steps}\n")
            proc.stdin.flush()
            times[side] += json.loads(proc.stdout.readline())
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    return {side: {"tokens_per_s": batch / statistics.median(t), "first_loss": first[side]}
            for side, t in times.items()}


def best_torch(r: dict) -> tuple[float, int]:
    """The faster PyTorch run of a train_row result: (tokens/s, threads)."""
    return max((v["tokens_per_s"], threads) for (side, threads), v in r.items() if side == "torch")


# ---------------------------------------------------------------------- perplexity
def wall(cmd: list[str], tries: int = 2) -> float:
    """Seconds of one run of a perplexity command (one retry: on this shared machine a run was
    once cut short without an error)."""
    for attempt in range(tries):
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        secs = time.perf_counter() - t
        if done.returncode == 0 and "Final estimate" in done.stdout + done.stderr:
            return secs
        print(f"  {Path(cmd[0]).name} run {attempt + 1} failed (exit {done.returncode})", flush=True)
    raise RuntimeError(f"{cmd[0]} failed:\n{(done.stdout + done.stderr)[-2000:]}")


def ppl_row(llama_bin: Path, model: Path, text: Path, ctx: int, chunks: int, reps: int) -> dict:
    """Median tokens/s (chunks x ctx over the command's wall clock) of each side, taking turns.
    llama.cpp runs at its fastest setting: the first round tries -b ctx / 2048 and -t cores / 1
    (its threads busy-wait, and on a busy machine one thread can beat two) and keeps the best,
    which the later rounds run."""
    ours = [sys.executable, "-m", "llmtune", "perplexity", str(model), str(text), "--ctx", str(ctx), "--chunks",
            str(chunks)]
    theirs = [str(llama_bin / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks",
              str(chunks)]
    settings = [(b, t) for t in sorted({n_threads(), 1}, reverse=True) for b in (ctx, 2048)]
    walls: dict = {"llmtune": [], "llama.cpp": []}
    for r in range(reps):
        for side in (["llmtune", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "llmtune"]):
            if side == "llmtune":
                walls[side].append(wall(ours))
                continue
            times = {(b, t): wall(theirs + ["-b", str(b), "-t", str(t)]) for b, t in settings}
            settings = [min(times, key=times.get)]
            walls[side].append(times[settings[0]])
    out = {side: chunks * ctx / statistics.median(w) for side, w in walls.items()}
    out["llama.cpp setting"] = "-b %d -t %d" % settings[0]
    return out


def llama_version(llama_bin: Path) -> str:
    done = subprocess.run([str(llama_bin / "llama-perplexity"), "--version"], capture_output=True, text=True)
    return (done.stdout + done.stderr).strip().splitlines()[0]


# ---------------------------------------------------------------------- main
def make_models(tmp: Path, need_q8: bool) -> dict[str, Path]:
    from llmtune.convert.init import init_model

    m15 = tmp / "llama-15m.gguf"
    init_model(REPO / "configs" / "llama-15m.toml", VOCAB, m15, seed=0)
    models = {"stories": STORIES, "m15": m15}
    if need_q8:
        models["m15q8"] = tmp / "llama-15m-q8_0.gguf"
        subprocess.run([sys.executable, "-m", "llmtune", "export", str(m15), "--type", "q8_0", "-o",
                        str(models["m15q8"])],
                       check=True, capture_output=True)
    return models


def fmt(x: float) -> str:
    return f"{x / 1000:.2f}k" if x < 10_000 else f"{x / 1000:.1f}k"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", choices=["train", "ppl"], default=[])
    ap.add_argument("--llama-bin", type=Path, default=None, help="directory holding llama-perplexity")
    ap.add_argument("--reps", type=int, default=5, help="alternating rounds per row")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per round")
    args = ap.parse_args(argv)
    what = set(args.what) or {"train", "ppl"}
    import torch

    from llmtune import __version__

    load = os.getloadavg()
    print(f"llmtune {__version__}, torch {torch.__version__}, {n_threads()} threads, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
    llama_bin = args.llama_bin
    if "ppl" in what and (llama_bin is None or not (llama_bin / "llama-perplexity").exists()):
        print("perplexity rows skipped: no llama-perplexity (--llama-bin DIR)")
        what.discard("ppl")
    if "ppl" in what:
        print(f"llama.cpp: {llama_version(llama_bin)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = make_models(tmp, "ppl" in what)
        if "train" in what:
            for label, key, ctx, batch, ubatch in TRAIN_ROWS:
                r = train_row(models[key], ctx, batch, ubatch, args.reps, args.steps)
                ours = r["llmtune", n_threads()]
                peer, threads = best_torch(r)
                print(f"  {label}: " + ", ".join(
                    f"{side if side == 'llmtune' else f'{side} {t} thr'} {fmt(v['tokens_per_s'])} tokens/s "
                    f"(first loss {v['first_loss']:.6f})" for (side, t), v in r.items()), flush=True)
                rows.append((label, ours["tokens_per_s"], f"PyTorch {fmt(peer)} ({threads} thr)",
                             ours["tokens_per_s"] / peer))
        if "ppl" in what:
            text = tmp / "wiki.test.raw"
            text.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
            for label, key, ctx, chunks in PPL_ROWS:
                r = ppl_row(llama_bin, models[key], text, ctx, chunks, args.reps)
                rows.append((label + ", wall clock incl. start-up", r["llmtune"],
                             f"llama.cpp {fmt(r['llama.cpp'])} ({r['llama.cpp setting']})",
                             r["llmtune"] / r["llama.cpp"]))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end\n")
    print("| workload | llmtune tokens/s | peer tokens/s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, ours, peer, ratio in rows:
        print(f"| {label} | {fmt(ours)} | {peer} | {ratio:.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        side, path, ctx, batch, ubatch, threads = sys.argv[2:8]
        worker(side, path, int(ctx), int(batch), int(ubatch), int(threads))
    else:
        main(sys.argv[1:])
