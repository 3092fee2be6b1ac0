"""Cross-check llmtune against a llama.cpp build on the same machine, in the same run.

    python bench/check_llamacpp.py --bin PATH/TO/llama.cpp/build/bin [speed] [files] [quant]

speed  llama-perplexity vs llmtune perplexity tokens/s (stories260K ctx 128 whole file; the 15M
       shape ctx 256, 200 chunks). llama.cpp's time is (wall of N chunks - wall of a few chunks),
       which removes model load and tokenization; its best of -b ctx and -b 2048 is kept.
files  llama.cpp loads and evaluates what llmtune writes: a finetuned stories260K and exports,
       with the final PPL of both tools on the same file (ctx 128, 40 chunks).
quant  llmtune export vs llama-quantize on the same input: tensor types and bytes compared.

No llama.cpp code is part of llmtune: build one yourself, e.g. from the llama.cpp sources vendored
in PyPI's llama-cpp-python sdist: `cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
-DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-perplexity llama-quantize -j2`.
Where the CPU lists AMX but the machine (a VM) does not enable it, a native build dies with SIGILL
in ggml's AMX Q8_0 product (tinygemm_kernel_amx, seen on this project's Xeon VMs): list the ISA
instead, `-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON`
(the flags of /proc/cpuinfo, AMX left out).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import gzip
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
CHECK_MODEL = """[model]
architecture = "llama"
name = "llama-256-check"
n_ctx = 256
n_embd = 256
n_layer = 2
n_head = 4
n_head_kv = 2
n_ff = 512
[init]
std = 0.02
"""


def llama_ppl(bin_dir: Path, model: Path, text: Path, ctx: int, batch: int, chunks: int | None) -> tuple[float, float]:
    """(final PPL, wall seconds) of one llama-perplexity run."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(batch), "-t",
           "2"]
    if chunks:
        cmd += ["--chunks", str(chunks)]
    for _ in range(3):  # llama.cpp's asynchronous logger can drop the last lines at exit: run again
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
        if m:
            return float(m.group(1)), wall
    why = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    raise RuntimeError(f"llama-perplexity failed on {model} ({why}):\n{(done.stdout + done.stderr)[-2000:]}")


def llama_tokens_per_s(bin_dir, model, text, ctx, chunks) -> float:
    best = 0.0
    for batch in (ctx, 2048):
        _, small = llama_ppl(bin_dir, model, text, ctx, batch, 8)
        _, big = llama_ppl(bin_dir, model, text, ctx, batch, chunks)
        best = max(best, (chunks - 8) * ctx / (big - small))
    return best


def speed(bin_dir: Path, text: Path, tmp: Path) -> None:
    import llmtune
    from llmtune.convert.init import init_model

    m15 = init_model(ROOT / "configs" / "llama-15m.toml", DATA / "vocab" / "ggml-vocab-llama-spm.gguf",
                     tmp / "m15.gguf")
    print("| model | ctx | chunks | llama.cpp tokens/s | llmtune tokens/s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    n_stories = len(llmtune.perplexity(STORIES, text, ctx=128).chunks)
    for name, model, ctx, chunks in (("stories260K", STORIES, 128, n_stories), ("llama-15m", m15, 256, 200)):
        theirs = llama_tokens_per_s(bin_dir, model, text, ctx, chunks)
        ours = max(llmtune.perplexity(model, text, ctx=ctx, chunks=chunks).tokens_per_s for _ in range(2))
        print(f"| {name} | {ctx} | {chunks} | {theirs:,.0f} | {ours:,.0f} | {ours / theirs:.2f}x |", flush=True)


def files(bin_dir: Path, text: Path, tmp: Path) -> None:
    import llmtune
    from llmtune.convert.init import init_model

    ft = tmp / "stories-ft.gguf"
    llmtune.finetune(STORIES, ROOT / "data" / "wikitext-100k.txt", ft, ctx=128, epochs=1, lr=1e-4)
    cfg = tmp / "m256.toml"
    cfg.write_text(CHECK_MODEL)
    m256 = tmp / "m256.gguf"
    init_model(cfg, STORIES, tmp / "m256-init.gguf", seed=1)
    llmtune.finetune(tmp / "m256-init.gguf", ROOT / "data" / "wikitext-100k.txt", m256, ctx=128, batch=512,
                     ubatch=128, epochs=1, lr=1e-3)
    cases = [("stories260K finetuned by llmtune", ft), ("256-wide model trained by llmtune", m256)]
    for t in ("f16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"):
        out = tmp / f"m256-{t}.gguf"
        llmtune.export(m256, out, t)
        cases.append((f"  exported {t}", out))
    print("| file | llama.cpp PPL | llmtune PPL | difference |")
    print("| --- | ---: | ---: | ---: |")
    for name, path in cases:
        theirs, _ = llama_ppl(bin_dir, path, text, 128, 128, 40)
        ours = llmtune.perplexity(path, text, ctx=128, chunks=40).ppl
        print(f"| {name} | {theirs:.4f} | {ours:.4f} | {100 * (ours - theirs) / theirs:+.3f} % |", flush=True)


def quant(bin_dir: Path, tmp: Path) -> None:
    import llmtune
    from llmtune.convert.init import init_model
    from llmtune.gguf.file import load_gguf

    cfg = tmp / "m256.toml"
    cfg.write_text(CHECK_MODEL)
    inputs = {
        "256-wide": init_model(cfg, STORIES, tmp / "q256.gguf", seed=3),
        "llama-15m (288-wide)": init_model(ROOT / "configs" / "llama-15m.toml",
                                           DATA / "vocab" / "ggml-vocab-llama-spm.gguf", tmp / "q15.gguf", seed=3),
    }
    print("| input | type | tensors | same type | byte-identical | file bytes llmtune / llama.cpp |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for name, src in inputs.items():
        for t in ("q8_0", "q4_k_m", "q5_k_m", "q6_k"):
            ours, theirs = tmp / f"ours-{t}.gguf", tmp / f"theirs-{t}.gguf"
            llmtune.export(src, ours, t)
            subprocess.run([str(bin_dir / "llama-quantize"), str(src), str(theirs), t.upper(), "2"],
                           check=True, capture_output=True)
            a, b = load_gguf(ours), load_gguf(theirs)
            same_type = sum(a.tensors[n].type == b.tensors[n].type for n in a.tensors)
            same_bytes = sum(np.array_equal(np.asarray(a.tensors[n].raw).view(np.uint8),
                                            np.asarray(b.tensors[n].raw).view(np.uint8)) for n in a.tensors)
            print(f"| {name} | {t} | {len(a.tensors)} | {same_type} | {same_bytes} | "
                  f"{ours.stat().st_size:,} / {theirs.stat().st_size:,} |", flush=True)
            ours.unlink()
            theirs.unlink()


def main() -> None:
    from llmtune.resources import prefer_small_pages

    prefer_small_pages()  # llmtune measured as its commands run (cli.main)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="*", choices=["speed", "files", "quant", []], default=[])
    ap.add_argument("--bin", required=True, type=Path, help="folder holding llama-perplexity and llama-quantize")
    args = ap.parse_args()
    what = args.what or ["speed", "files", "quant"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "wiki.test.raw"
        text.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
        for part in what:
            print(f"\n## {part}")
            {"speed": lambda: speed(args.bin, text, tmp), "files": lambda: files(args.bin, text, tmp),
             "quant": lambda: quant(args.bin, tmp)}[part]()


if __name__ == "__main__":
    sys.exit(main())
