"""Cross-check llmtune's tokenizers against llama.cpp's llama-tokenize on every ggml-vocab file.

    python bench/check_tokenizers.py --llama-cpp PATH/TO/llama.cpp [--text FILE] [--unicode]
                                     [--write-fixtures]

For each `models/ggml-vocab-*.gguf` of the llama.cpp tree, tokenizes the text (default
tests/data/vocab/mixed.txt: many scripts, code, emoji, odd whitespace, special-token strings) with

    llama-tokenize -m VOCAB -f TEXT --ids --log-disable --no-escape
    llmtune tokenize VOCAB TEXT --ids

(both: BOS as the vocabulary asks, special-token strings parsed; llama-tokenize loads only the
vocabulary) and prints a markdown table: identical ids or not, identical `id -> 'piece'` listings
(the same commands without --ids: llama.cpp's token_to_piece) or not, and how many of
llama.cpp's own test vectors (VOCAB.inp / .out) llmtune reproduces.

--unicode         also compare llmtune/tokenizer/unicode_data.py with llama.cpp's src/unicode-data.cpp
                  (categories, whitespace, lower-case and NFD maps, for every code point).
--write-fixtures  (re)write tests/data/vocab/: for each vocabulary with test vectors that is not
                  there yet, a slim copy (ggml-vocab-NAME.gguf.gz) with its .inp/.out, and
                  mixed.ids.json.gz, llama-tokenize's ids of mixed.txt for every fixture.

A slim copy keeps every token id (so ids are llama.cpp's), but empties the text of the normal
tokens that neither the test vectors nor mixed.txt use (llama.cpp, like llmtune, names an empty
token [EMPTY_<id>]), keeps only the merges they look up, and drops the chat template and the
scores (unused by BPE and WordPiece); gzip then shrinks it to tens of kB. Other texts may
tokenize differently with a slim copy: the test suite compares ids only for these texts. Each
slim copy is checked here: llmtune passes its vectors, and llama-tokenize gives the same ids of
mixed.txt as with the full vocabulary.

Exits non-zero if llmtune differs from llama.cpp on a vocabulary it supports (one it refuses
with "unsupported tokenizer model", e.g. t5 / UGM, is listed but not a failure).

No llama.cpp code is part of llmtune: build llama-tokenize yourself, e.g. from the llama.cpp
sources vendored in PyPI's llama-cpp-python sdist: `cmake -B build -DLLAMA_CURL=OFF
-DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-tokenize -j2`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB_DATA = ROOT / "tests" / "data" / "vocab"
MIXED = VOCAB_DATA / "mixed.txt"
MIXED_IDS = VOCAB_DATA / "mixed.ids.json.gz"
SEPARATOR = "\n__ggml_vocab_test__\n"


def read_vectors(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of VOCAB.inp/.out, read as llama.cpp's tests/test-tokenizer-0 does."""
    raw = Path(f"{gguf}.inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = Path(f"{gguf}.out").read_text(encoding="utf-8").splitlines()
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def llama_tokenize(binary: Path, vocab: Path, text: Path, *extra: str) -> list[int] | str:
    """llama-tokenize's ids, or its last error line."""
    cmd = [str(binary), "-m", str(vocab), "-f", str(text), "--ids", "--log-disable", "--no-escape", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("["):
        err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"exit {proc.returncode}: {err}"
    return json.loads(lines[-1])


def llmtune_tokenize(vocab: Path, text: Path) -> list[int] | str:
    """`llmtune tokenize --ids`'s ids, or its error line."""
    cmd = [sys.executable, "-m", "llmtune", "tokenize", str(vocab), str(text), "--ids"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['(no output)'])[-1]}"
    return json.loads(proc.stdout)


def pieces_identical(binary: Path, vocab: Path, text: Path) -> bool:
    """Both tools' default listing (one `id -> 'piece'` line per token) byte for byte."""
    ref = subprocess.run([str(binary), "-m", str(vocab), "-f", str(text), "--log-disable", "--no-escape"],
                         capture_output=True, timeout=600)  # fmt: skip
    ours = subprocess.run([sys.executable, "-m", "llmtune", "tokenize", str(vocab), str(text)],
                          capture_output=True, timeout=600)  # fmt: skip
    return ref.returncode == ours.returncode == 0 and ref.stdout == ours.stdout


def load_tokenizer(vocab: Path):
    from llmtune.gguf.file import load_gguf
    from llmtune.tokenizer import Tokenizer

    return Tokenizer.from_gguf(load_gguf(vocab))


def vector_score(vocab: Path, vectors: Path | None = None) -> str:
    """How many of the test vectors (vectors.inp/.out, default vocab's own) llmtune reproduces."""
    vectors = vectors or vocab
    if not Path(f"{vectors}.inp").exists():
        return "-"
    try:
        tok = load_tokenizer(vocab)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"({type(exc).__name__})"
    cases = read_vectors(vectors)
    ok = sum(tok.encode(t, add_special=False, parse_special=False) == ids for t, ids in cases)
    return f"{ok}/{len(cases)}"


def compare(llama_cpp: Path, text: Path) -> bool:
    from llmtune.gguf.file import load_gguf

    binary = llama_cpp / "build" / "bin" / "llama-tokenize"
    vocabs = sorted((llama_cpp / "models").glob("ggml-vocab-*.gguf"))
    print(f"llama-tokenize: {binary}\ntext: {text} ({len(text.read_bytes()):,} bytes)\n")
    columns = ["vocabulary", "tokenizer (model / pre)", "llama.cpp tokens", "identical ids", "identical pieces",
               "test vectors"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    all_ok = True
    for vocab in vocabs:
        md = load_gguf(vocab).metadata
        kind = f"{md.get('tokenizer.ggml.model')} / {md.get('tokenizer.ggml.pre', '-')}"
        ref = llama_tokenize(binary, vocab, text)
        ours = llmtune_tokenize(vocab, text)
        if isinstance(ref, str):
            verdict, n = f"llama.cpp failed: {ref}", "-"
        elif isinstance(ours, str):  # e.g. "exit 2: error: PATH: unsupported tokenizer model 't5' (...)"
            status, _, message = ours.partition(": ")
            verdict, n = f"no, {status}: {message.split('.gguf: ')[-1].split(' (')[0]}", f"{len(ref):,}"
        else:
            n = f"{len(ref):,}"
            first = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
            verdict = "yes" if ref == ours else f"no (first difference at token {first})"
        pieces = "-" if verdict != "yes" else "yes" if pieces_identical(binary, vocab, text) else "no"
        # (a model llmtune does not implement, refused with its one-line error, is no failure here)
        all_ok &= (verdict == "yes" and pieces == "yes") or "unsupported tokenizer model" in verdict
        name = vocab.name[len("ggml-vocab-") : -len(".gguf")]
        print(f"| {name} | {kind} | {n} | {verdict} | {pieces} | {vector_score(vocab)} |")
    return all_ok


# -- unicode table check ---------------------------------------------------------------------------


def check_unicode(llama_cpp: Path) -> bool:
    from llmtune.tokenizer import unicode_data as ud

    src = (llama_cpp / "src" / "unicode-data.cpp").read_text()

    def block(name: str) -> str:
        b = src[src.index(name) :]
        return b[b.index("{") + 1 : b.index("};")]

    pair = r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}"
    flags = [(int(a, 16), int(b, 16)) for a, b in re.findall(pair, block("unicode_ranges_flags"))]
    whitespace = {int(x, 16) for x in re.findall(r"0x([0-9A-F]+)", block("unicode_set_whitespace"))}
    lower = {int(a, 16): int(b, 16) for a, b in re.findall(pair, block("unicode_map_lowercase"))}
    nfd = re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+), 0x([0-9A-F]+)\}", block("unicode_ranges_nfd"))
    letter = {1: "U", 2: "N", 4: "L", 8: "Z", 16: "M", 32: "P", 64: "S", 128: "C"}
    bad_cat = bad_lower = bad_nfd = 0
    for (start, flag), (end, _) in zip(flags, flags[1:]):
        bad_cat += sum(ud.category(cp) != letter[flag] for cp in range(start, end))
    nfd_map = {cp: int(c, 16) for a, b, c in nfd for cp in range(int(a, 16), int(b, 16) + 1)}
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        ch = chr(cp)
        bad_lower += ord(ud.tolower(ch)) != lower.get(cp, cp)
        bad_nfd += ord(ud.nfd_first(ch)) != nfd_map.get(cp, cp)
    ok = not (bad_cat or bad_lower or bad_nfd) and whitespace == set(ud.WHITESPACE)
    print(f"\nunicode_data vs llama.cpp src/unicode-data.cpp: categories {bad_cat} code points differ, "
          f"whitespace {'same' if whitespace == set(ud.WHITESPACE) else 'DIFFERENT'}, lower-case {bad_lower}, "
          f"NFD {bad_nfd} -> {'identical' if ok else 'DIFFERENT'}")  # fmt: skip
    return ok


# -- slim test fixtures ---------------------------------------------------------------------------


class _Recorder(dict):
    """A dict that remembers which keys were found through .get()."""

    def __init__(self, *args):
        super().__init__(*args)
        self.hits: set = set()

    def get(self, key, default=None):
        value = dict.get(self, key)
        if value is None:
            return default
        self.hits.add(key)
        return value


def slim_vocab(vocab: Path, out: Path, texts: list[str], mixed: str) -> None:
    """Write `out` (.gguf.gz): `vocab` with only what tokenizing `texts` and `mixed` looks up."""
    from gguf import GGUFValueType as VT

    from llmtune.gguf.file import MetaValue, load_gguf, write_gguf
    from llmtune.tokenizer import tokenizer as tk

    gf = load_gguf(vocab)
    tok = tk.Tokenizer.from_gguf(gf)
    enc = tok._encoder
    enc._token_to_id = _Recorder(enc._token_to_id)
    ranks = getattr(enc, "_ranks", None)
    if ranks is not None:
        enc._ranks = _Recorder(ranks)
    used: set[int] = set()
    for text in texts:
        used.update(tok.encode(text, add_special=False, parse_special=False))
    used.update(tok.encode(mixed, add_special=tok.add_bos, parse_special=True))

    md = gf.metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    keep = {tok._token_to_id[t] for t in enc._token_to_id.hits} | used
    keep |= {i for i, t in enumerate(types) if t != 1}
    keep |= {i for i in getattr(enc, "_byte_tokens", []) if i is not None}
    keep |= {i for i in tok._special.values() if i is not None}
    named = set(tk._EOG_TEXTS) | set(tk._EOT_TEXTS) | set(tk._FORCED_USER_DEFINED) | {"<mask>", "[MASK]"}
    named |= {t for texts_ in tk._FIM_TEXTS.values() for t in texts_}
    keep |= {i for i, t in enumerate(tokens) if t in named}
    slim_tokens = [t if i in keep else "" for i, t in enumerate(tokens)]

    meta = dict(gf.meta)
    meta.pop("tokenizer.chat_template", None)
    if tok.kind != "spm":  # (only SPM uses the scores)
        meta.pop("tokenizer.ggml.scores", None)
    meta["tokenizer.ggml.tokens"] = MetaValue(slim_tokens, VT.ARRAY, VT.STRING)
    if ranks is not None:
        merges = [m for m in md["tokenizer.ggml.merges"] if m in enc._ranks.hits]
        meta["tokenizer.ggml.merges"] = MetaValue(merges, VT.ARRAY, VT.STRING)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / vocab.name
        write_gguf(plain, gf.arch, meta, [])
        out.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=9, mtime=0))


def gunzipped(path: Path, tmp: Path) -> Path:
    if path.suffix != ".gz":
        return path
    plain = tmp / path.name[: -len(".gz")]
    plain.write_bytes(gzip.decompress(path.read_bytes()))
    return plain


def write_fixtures(llama_cpp: Path) -> bool:
    binary = llama_cpp / "build" / "bin" / "llama-tokenize"
    mixed = MIXED.read_bytes().decode("utf-8")  # (read_text would turn \r\n into \n)
    ok = True
    for vocab in sorted((llama_cpp / "models").glob("ggml-vocab-*.gguf")):
        if not Path(f"{vocab}.inp").exists() or (VOCAB_DATA / vocab.name).exists():
            continue
        try:
            load_tokenizer(vocab)
        except Exception as exc:  # noqa: BLE001
            print(f"{vocab.name}: skipped ({exc})")
            continue
        out = VOCAB_DATA / f"{vocab.name}.gz"
        slim_vocab(vocab, out, [t for t, _ in read_vectors(vocab)], mixed)
        for ext in (".inp", ".out"):
            shutil.copyfile(f"{vocab}{ext}", VOCAB_DATA / f"{vocab.name}{ext}")
        print(f"{out.relative_to(ROOT)}: {out.stat().st_size:,} bytes (full vocabulary {vocab.stat().st_size:,})")

    expected: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in sorted(VOCAB_DATA.glob("ggml-vocab-*.gguf*")):
            if fixture.suffix not in (".gguf", ".gz"):
                continue
            name = fixture.name.split(".gguf")[0][len("ggml-vocab-") :]
            full = llama_cpp / "models" / f"ggml-vocab-{name}.gguf"
            ref = llama_tokenize(binary, full, MIXED)
            slim = llama_tokenize(binary, gunzipped(fixture, Path(tmp)), MIXED)
            vectors = vector_score(gunzipped(fixture, Path(tmp)), VOCAB_DATA / f"ggml-vocab-{name}.gguf")
            same = ref == slim
            ok &= same and not isinstance(ref, str) and vectors.split("/")[0] == vectors.split("/")[-1]
            print(f"  {fixture.name}: llama-tokenize on it == on the full vocabulary: {same}; vectors {vectors}")
            if not isinstance(ref, str):
                expected[name] = ref
    MIXED_IDS.write_bytes(gzip.compress(json.dumps(expected, separators=(",", ":")).encode(), mtime=0))
    print(f"{MIXED_IDS.relative_to(ROOT)}: {len(expected)} vocabularies, {MIXED_IDS.stat().st_size:,} bytes")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP"),
                    help="llama.cpp source tree with models/ and build/bin/llama-tokenize (env LLAMA_CPP)")  # fmt: skip
    ap.add_argument("--text", type=Path, default=MIXED, help="text to tokenize (default: tests/data/vocab/mixed.txt)")
    ap.add_argument("--unicode", action="store_true", help="also check the Unicode table against llama.cpp's")
    ap.add_argument("--write-fixtures", action="store_true", help="(re)write tests/data/vocab/ fixtures")
    args = ap.parse_args()
    if args.llama_cpp is None:
        ap.error("give --llama-cpp DIR (or set LLAMA_CPP)")
    ok = True
    if args.write_fixtures:
        ok &= write_fixtures(args.llama_cpp)
    ok &= compare(args.llama_cpp, args.text)
    if args.unicode:
        ok &= check_unicode(args.llama_cpp)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
