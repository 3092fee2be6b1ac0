"""Benchmarks for `llmtune export` (results go to BENCHMARKS.md, section "Export").

    python bench/bench_export.py [rms] [speed] [ppl260k] [ppl15m]     (default: all)

rms      round-trip error of every type on synthetic data, and encoder throughput
speed    export of a 110M-shape model (configs/llama-110m.toml, 32000-token vocabulary) to q8_0
         and q4_k_m, timed through the command line as a user runs it
ppl260k  stories260K perplexity (wikitext-2 test, ctx 128, first 40 chunks): f32 vs f16 / q8_0 / ...
ppl15m   a 15M-shape model (configs/llama-15m.toml, random init, 32000-token vocabulary) as f32,
         q4_k_m, q6_k: perplexity on the same text and bits per weight of the quantized tensors;
         also the same shape with n_embd 256 (rows that split into K-quant super-blocks)
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import gzip
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
VOCAB_32K = DATA / "vocab" / "ggml-vocab-llama-spm.gguf"
TYPES = (QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def bench_rms() -> None:
    from llmtune.quant import blocks as quants

    n = 32 * 128
    cos_data = (0.1 + 2.0 * np.cos(np.arange(n, dtype=np.float32)).astype(np.float64)).astype(np.float32)
    gauss = np.random.default_rng(0).standard_normal((2048, 4096)).astype(np.float32)
    print("| type | bits/weight | ggml test-quantize-fns error (bound 0.002) | RMS error, N(0,1) | encode Mel/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for qtype in TYPES:
        y = quants.dequantize(quants.quantize(cos_data, qtype), qtype)
        ggml_err = np.sqrt(np.sum((cos_data.astype(np.float64) - y) ** 2)) / n
        start = time.perf_counter()
        q = quants.quantize(gauss, qtype)
        seconds = time.perf_counter() - start
        rms = np.sqrt(np.mean((quants.dequantize(q, qtype) - gauss) ** 2))
        bpw = 8 * quants.nbytes(gauss.shape, qtype) / gauss.size
        print(f"| {qtype.name} | {bpw:.4g} | {ggml_err:.6f} | {rms:.5f} | {gauss.size / seconds / 1e6:.1f} |")


def _cli_export(src: Path, out: Path, type_name: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llmtune", "export", str(src), "-o", str(out), "--type", type_name],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def bench_speed(tmp: Path) -> None:
    from llmtune.convert.export import export
    from llmtune.convert.init import init_model

    src = init_model(ROOT / "configs" / "llama-110m.toml", VOCAB_32K, tmp / "m110.gguf")
    print(f"source: {src.stat().st_size / 2**20:.1f} MiB F32")
    print("| type | `llmtune export` wall s | library export s | output MiB | quantized bits/weight |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for type_name in ("q8_0", "q4_k_m"):
        cli_s = _cli_export(src, tmp / f"m110-{type_name}-cli.gguf", type_name)
        summary = export(src, tmp / f"m110-{type_name}.gguf", type_name)
        print(f"| {type_name} | {cli_s:.1f} | {summary.seconds:.1f} | {summary.file_bytes / 2**20:.1f} | "
              f"{summary.quantized_bpw:.2f} |")


def _wikitext(tmp: Path) -> Path:
    path = tmp / "wikitext-2-raw-test.txt"
    if not path.exists():
        path.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    return path


def _ppl_rows(src: Path, types: list[str], tmp: Path, text: Path, label: str) -> None:
    import llmtune
    from llmtune.convert.export import export

    base = llmtune.perplexity(src, text, ctx=128, chunks=40)
    print(f"| {label} | f32 | {base.ppl:.4f} ± {base.ppl_err:.4f} | | | | 32 | 32 | |")
    for type_name in types:
        out = tmp / f"{src.stem}-{type_name}.gguf"
        summary = export(src, out, type_name)
        r = llmtune.perplexity(out, text, ctx=128, chunks=40, kl_base=src)
        mix = ", ".join(f"{k} {v}" for k, v in summary.type_counts().most_common())
        print(f"| {label} | {type_name} | {r.ppl:.4f} ± {r.ppl_err:.4f} | {100 * (r.ppl / base.ppl - 1):+.4f}% | "
              f"{r.kl:.6f} | {100 * r.same_top:.2f}% | {summary.quantized_bpw:.2f} | "
              f"{_layer_bpw(summary):.2f} | {mix} |")


def _layer_bpw(summary) -> float:
    """Bits per weight of the quantized tensors inside the transformer blocks (no embedding/output)."""
    layers = [t for t in summary.tensors if t.quantizable and t.name.startswith("blk.")]
    return 8 * sum(t.dst_bytes for t in layers) / sum(t.n_elements for t in layers)


_PPL_HEADER = ("| model | type | PPL (ctx 128, 40 chunks) | vs f32 | KL(f32 ‖ type) | same top token | "
               "quantized bits/weight | in blk.* | tensor types |\n| --- | --- | ---: | ---: | ---: | ---: | "
               "---: | ---: | --- |")


def bench_ppl260k(tmp: Path) -> None:
    print(_PPL_HEADER)
    _ppl_rows(STORIES, ["f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0"], tmp, _wikitext(tmp), "stories260K")


def bench_ppl15m(tmp: Path) -> None:
    from llmtune.convert.init import init_model

    config = ROOT / "configs" / "llama-15m.toml"
    aligned = tmp / "llama-15m-e256.toml"  # same shape with rows that split into 256-value super-blocks
    text = config.read_text().replace("n_embd = 288", "n_embd = 256").replace("n_head = 6 ", "n_head = 4 ")
    text = text.replace("n_head_kv = 6 ", "n_head_kv = 4 ")
    aligned.write_text(text.replace('name = "llama-15m"', 'name = "llama-15m-e256"'))
    print(_PPL_HEADER)
    for cfg, label in ((config, "llama-15m (n_embd 288)"), (aligned, "llama-15m, n_embd 256")):
        src = init_model(cfg, VOCAB_32K, tmp / f"{cfg.stem}.gguf")
        _ppl_rows(src, ["q4_k_m", "q6_k", "q8_0"], tmp, _wikitext(tmp), label)


def main(argv: list[str]) -> None:
    sections = argv or ["rms", "speed", "ppl260k", "ppl15m"]
    with tempfile.TemporaryDirectory(prefix="bench-export-") as d:
        tmp = Path(d)
        for name in sections:
            print(f"\n## {name}\n", flush=True)
            {"rms": lambda: bench_rms(), "speed": lambda: bench_speed(tmp), "ppl260k": lambda: bench_ppl260k(tmp),
             "ppl15m": lambda: bench_ppl15m(tmp)}[name]()
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
