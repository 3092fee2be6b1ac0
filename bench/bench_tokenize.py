"""Tokenizer speed: the whole WikiText-2 test text with stories260K, checked against llama.cpp.

    python bench/bench_tokenize.py [--repeat N]

Reports the vocabulary build time, the first (cold: empty memo) and a warm encode of the whole
text, and the reference whole-text SPM algorithm without chunking, each with tokens/s; then the
time to build each test vocabulary (up to 65k tokens + merges) from already-loaded metadata and
to encode the same text with it.
Exits non-zero if the ids differ from llama-tokenize's (tests/data/...stories260K.ids.npz).
"""

from __future__ import annotations

import blas_env  # first, before numpy: its OpenBLAS at its best kernel, named (bench/blas_env.py)

blas_env.at_its_best()

import argparse
import gzip
import sys
import time
from pathlib import Path

import numpy as np

from llmtune.gguf.file import load_gguf
from llmtune.tokenizer import SPACE_ESCAPE, Tokenizer

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="warm encodes to time (best is reported)")
    args = ap.parse_args()

    text = gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()).decode("utf-8")
    expected = np.load(DATA / "wikitext-2-raw-test.stories260K.ids.npz")["ids"].astype(np.int64)
    gf = load_gguf(DATA / "stories260K.gguf")

    tok, t_build = timed(lambda: Tokenizer.from_gguf(gf))
    ids, t_cold = timed(lambda: tok.encode(text, add_special=True))
    t_warm = min(timed(lambda: tok.encode(text, add_special=True))[1] for _ in range(args.repeat))
    whole, t_whole = timed(lambda: tok._encoder.encode_whole(SPACE_ESCAPE + text.replace(" ", SPACE_ESCAPE)))

    exact = np.array_equal(np.asarray(ids), expected)
    exact_whole = np.array_equal(np.asarray([tok.bos_id] + whole), expected)
    n = len(ids)
    print(f"text: {len(text):,} chars, {len(text.encode()):,} bytes -> {n:,} tokens (llama.cpp: {len(expected):,})")
    print(f"build tokenizer        {t_build * 1e3:8.1f} ms")
    print(f"encode, cold memo      {t_cold:8.3f} s   {n / t_cold:>12,.0f} tok/s")
    print(f"encode, warm memo      {t_warm:8.3f} s   {n / t_warm:>12,.0f} tok/s   (best of {args.repeat})")
    print(f"whole-text reference   {t_whole:8.3f} s   {n / t_whole:>12,.0f} tok/s   (no chunking)")
    print(f"ids identical to llama.cpp: chunked {exact}, whole-text {exact_whole}")
    print("other vocabularies: build from loaded metadata; encode the same text (cold memo)")
    for path in sorted((DATA / "vocab").glob("ggml-vocab-*.gguf")):
        md = load_gguf(path).metadata
        vocab, t = timed(lambda: Tokenizer.from_metadata(md, source=path.name))
        ids, t_enc = timed(lambda: vocab.encode(text))
        name = path.name[len("ggml-vocab-") : -len(".gguf")]
        print(f"  {name:15s} {vocab.kind} {vocab.n_vocab:6d} tokens  build {t * 1e3:6.1f} ms"
              f"  encode {t_enc:6.3f} s ({len(ids):,} tokens)")
    return 0 if exact and exact_whole else 1


if __name__ == "__main__":
    sys.exit(main())
