"""Benchmarks for GGUF loading and `llmtune init` (results go to BENCHMARKS.md, "GGUF I/O and init").

    python bench/bench_gguf.py [load] [init]     (default: both)

load   median time to open a GGUF and parse all its metadata: llmtune's parser vs gguf.GGUFReader
       (the reference reader, with values decoded as llmtune needs them)
init   median wall time of `llmtune init` for the 15M and 110M configs (32000-token vocabulary),
       through the command line as a user runs it
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
VOCAB_32K = DATA / "vocab" / "ggml-vocab-llama-spm.gguf"


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reference_load(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    for field in reader.fields.values():
        field.contents()


def bench_load() -> None:
    from llmtune.gguf.file import load_gguf

    print("| file | tokens | llmtune | gguf.GGUFReader |")
    print("| --- | ---: | ---: | ---: |")
    for path in [DATA / "stories260K.gguf", VOCAB_32K, DATA / "vocab" / "ggml-vocab-gpt-2.gguf"]:
        n_tokens = len(load_gguf(path).get("tokenizer.ggml.tokens"))
        ours = median_seconds(lambda: load_gguf(path), 5)
        ref = median_seconds(lambda: reference_load(path), 3)
        print(f"| {path.name} | {n_tokens:,} | {ours * 1e3:.0f} ms | {ref * 1e3:.0f} ms |")


def bench_init() -> None:
    print("| config | parameters | file | wall time |")
    print("| --- | ---: | ---: | ---: |")
    for config in ["llama-15m", "llama-110m"]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "m.gguf"
            cmd = [sys.executable, "-m", "llmtune", "init", "--config", f"configs/{config}.toml",
                   "--vocab-from", str(VOCAB_32K), "-o", str(out)]

            def run():
                out.unlink(missing_ok=True)
                subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)

            seconds = median_seconds(run, 3)
            from llmtune.gguf.file import load_gguf
            from llmtune.ui.format import human_bytes, human_count

            gf = load_gguf(out)
            print(f"| {config} | {human_count(gf.n_params())} | {human_bytes(gf.file_size)} | {seconds:.1f} s |")


if __name__ == "__main__":
    which = set(sys.argv[1:]) or {"load", "init"}
    if "load" in which:
        bench_load()
    if "init" in which:
        bench_init()
