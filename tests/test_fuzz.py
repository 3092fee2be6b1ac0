"""Seeded mutation fuzzing of everything that reads a GGUF file.

Mutants of two base files, stories260K.gguf (a model with an SPM tokenizer) and a small
byte-level BPE vocabulary cut from ggml-vocab-gpt-2.gguf, go through the library calls the
command line makes: `load_gguf` and reading every tensor, `Tokenizer.from_gguf` (plus a short
encode / decode / llama-tokenize listing), the `info` renderer printed to a strict UTF-8
stream, and `load_model` with a graph build. The only acceptable outcomes are success or
`LlmtuneError`: any other exception, a mutant running past MUTANT_TIMEOUT_S, or an allocation
past MEMORY_HEADROOM (a huge count must fail, not allocate) is a finding.

Mutants are made with a structural understanding of the format: the base file is parsed into
header, metadata entries and tensor descriptors (with the byte offset of every field), then
  - fields are patched in place (counts, string lengths, value and tensor types, n_dims,
    dims, data offsets) with boundary values (0, 2^32 - 1, 2^63, 2^64 - 1, off by one, ...);
  - the file is re-serialized with one entry changed consistently: a value of the wrong type
    (tokenizer.ggml.bos_token_id as a string, context_length 0 or a float, ...), array
    elements changed, dropped or retyped, invalid UTF-8 in keys, values, tokens and tensor
    names, n_dims > 4, unknown tensor type ids, huge or overflowing dims, tensors sharing or
    overlapping data, misaligned or out-of-file data offsets, duplicate keys and tensors;
  - raw bytes are truncated, bit-flipped or overwritten (mostly in the header region).
A CATALOG of hand-picked mutants (the cases issue 15 names, and sizes the model loader must
check before it allocates) runs first, whatever the seed.

Everything is derived from SEED and the mutant's index, so a failure report names the mutant
("stories#123 [what was changed] -> stage: exception (at file:line)") and
`python tests/test_fuzz.py --base stories --index 123` (or `--catalog 4`) replays it with the
full traceback; `--keep FILE` also writes the mutant out. LLMTUNE_FUZZ_SEED and LLMTUNE_FUZZ_N
change the seed and the number of mutants per base for a longer run (`python tests/test_fuzz.py
-n 5000` runs the fuzzer without pytest and lists every finding).

Failures raised from llmtune/arch/, llmtune/model/ or llmtune/graph/ (hyper-parameters,
families, graph building) are reported by a test of their own, so a finding names its room.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import pytest
from gguf import GGUFValueType as VT
from rich.console import Console

import llmtune
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf
from llmtune.model.loaded import load_model
from llmtune.tokenizer import Tokenizer, format_ids, format_pieces
from llmtune.ui.info import render_info

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
GPT2_VOCAB = DATA / "vocab" / "ggml-vocab-gpt-2.gguf"
LLMTUNE_DIR = Path(llmtune.__file__).resolve().parent

SEED = int(os.environ.get("LLMTUNE_FUZZ_SEED", "15"))
N_PER_BASE = {"stories": 600, "bpe": 500}
if os.environ.get("LLMTUNE_FUZZ_N"):
    N_PER_BASE = {base: int(os.environ["LLMTUNE_FUZZ_N"]) for base in N_PER_BASE}
MUTANT_TIMEOUT_S = 2.0  # a mutant normally takes 5-50 ms
MEMORY_HEADROOM = 1 << 30  # address space a mutant may add to the process (RLIMIT_AS)

# where an exception's innermost llmtune frame is decides whose it is
LEAD_OWNED = ("arch/", "model/", "graph/")  # model-loading code, reported by its own test
SAMPLE_TEXT = "Hello world, <s> once upon a time\n the cat's 12 <|endoftext|> naïve ▁ \t end."

# -- the format: parse with field offsets, serialize ------------------------------------------

SCALAR_FMT = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}


@dataclass
class Field:
    """A fixed-size number in the base file that can be patched in place."""

    group: str  # header / kv / element / tensor
    label: str
    offset: int
    size: int  # 4 or 8 (1 or 2 for small scalars)
    value: int | float
    fmt: str


@dataclass
class KV:
    key: bytes
    vtype: int
    value: object  # bytes (string), number, or (sub_type, [items]) for arrays


@dataclass
class TensorDesc:
    name: bytes
    ne: list[int]
    ttype: int
    offset: int


@dataclass
class Layout:
    version: int
    kvs: list[KV]
    tensors: list[TensorDesc]
    data: bytes  # the data section: bytes from the aligned end of the descriptors to the end
    alignment: int
    fields: list[Field]
    blob: bytes
    header_end: int  # end of the tensor descriptors (start of the padding)


class _Reader:
    def __init__(self, blob: bytes):
        self.blob, self.pos = blob, 0

    def num(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def field(self, fields: list, group: str, label: str, fmt: str):
        offset = self.pos
        v = self.num(fmt)
        fields.append(Field(group, label, offset, struct.calcsize(fmt), v, fmt))
        return v

    def string(self, fields, group, label) -> bytes:
        n = self.field(fields, group, label + " length", "<Q")
        s = self.blob[self.pos : self.pos + n]
        self.pos += n
        return s

    def value(self, fields, group, label, vtype):
        if vtype == VT.STRING:
            return self.string(fields, group, label)
        if vtype == VT.ARRAY:
            sub = self.field(fields, group, label + " array type", "<I")
            count = self.field(fields, group, label + " array count", "<Q")
            items = [self.value(fields, "element", f"{label}[{i}]", sub) for i in range(count)]
            return (sub, items)
        return self.field(fields, group, label, SCALAR_FMT[VT(vtype)])


def parse(blob: bytes) -> Layout:
    r, fields = _Reader(blob), []
    r.pos = 4
    version = r.field(fields, "header", "version", "<I")
    n_tensors = r.field(fields, "header", "tensor count", "<Q")
    n_kv = r.field(fields, "header", "metadata count", "<Q")
    kvs = []
    for i in range(n_kv):
        key = r.string(fields, "kv", f"key {i}")
        vtype = r.field(fields, "kv", f"{key.decode()} type", "<I")
        kvs.append(KV(key, vtype, r.value(fields, "kv", key.decode(), vtype)))
    tensors = []
    for i in range(n_tensors):
        name = r.string(fields, "tensor", f"tensor {i} name")
        label = name.decode()
        n_dims = r.field(fields, "tensor", f"{label} n_dims", "<I")
        ne = [r.field(fields, "tensor", f"{label} ne[{j}]", "<Q") for j in range(n_dims)]
        ttype = r.field(fields, "tensor", f"{label} type", "<I")
        offset = r.field(fields, "tensor", f"{label} offset", "<Q")
        tensors.append(TensorDesc(name, ne, ttype, offset))
    alignment = next((kv.value for kv in kvs if kv.key == b"general.alignment"), 32)
    data_start = -(-r.pos // alignment) * alignment
    return Layout(version, kvs, tensors, blob[data_start:], alignment, fields, blob, r.pos)


def pack_value(vtype: int, value) -> bytes:
    if vtype == VT.STRING:
        return struct.pack("<Q", len(value)) + value
    if vtype == VT.ARRAY:
        sub, items = value
        return struct.pack("<IQ", sub, len(items)) + b"".join(pack_value(sub, item) for item in items)
    return struct.pack(SCALAR_FMT[VT(vtype)], value)


def serialize(layout: Layout, kvs=None, tensors=None, *, alignment=None, data=None, version=None) -> bytes:
    kvs = layout.kvs if kvs is None else kvs
    tensors = layout.tensors if tensors is None else tensors
    alignment = layout.alignment if alignment is None else alignment
    data = layout.data if data is None else data
    head = [b"GGUF", struct.pack("<IQQ", layout.version if version is None else version, len(tensors), len(kvs))]
    for kv in kvs:
        head.append(pack_value(VT.STRING, kv.key) + struct.pack("<I", kv.vtype) + pack_value(kv.vtype, kv.value))
    for t in tensors:
        head.append(pack_value(VT.STRING, t.name) + struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.ttype,
                                                                t.offset))
    header = b"".join(head)
    return header + bytes(-len(header) % alignment) + data


# -- mutations -------------------------------------------------------------------------------

U64_EDGES = [0, 1, 2, 3, 4, 31, 32, 33, 64, 255, 256, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1,
             2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]  # fmt: skip
U32_EDGES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 28, 30, 31, 32, 33, 34, 36, 39, 40,
             41, 42, 100, 255, 256, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]  # fmt: skip
INVALID_UTF8 = [b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"abc\xe2\x82", b"\x80\x80", b"\xc0\xaf"]
NAN, INF = float("nan"), float("inf")

# (type, value) pairs a metadata entry is replaced with: wrong types and boundary values
TYPED_VALUES = [
    (VT.STRING, b"1"), (VT.STRING, b"abc"), (VT.STRING, b""), (VT.STRING, b"\xff\xfe"), (VT.STRING, b"llama"),
    (VT.STRING, b"gpt2"), (VT.STRING, b"\xed\xa0\x80x"), (VT.FLOAT32, 0.0), (VT.FLOAT32, 1.5), (VT.FLOAT32, -1.0),
    (VT.FLOAT32, NAN), (VT.FLOAT32, INF), (VT.FLOAT32, -INF), (VT.FLOAT32, 1e30), (VT.FLOAT32, 8.0),
    (VT.FLOAT64, 2048.0), (VT.FLOAT64, NAN), (VT.FLOAT64, 1e300), (VT.BOOL, 1), (VT.BOOL, 0), (VT.BOOL, 7),
    (VT.INT8, -1), (VT.INT8, 0), (VT.INT16, -32768), (VT.INT32, -1), (VT.INT32, 0), (VT.INT32, -(2**31)),
    (VT.INT64, -(2**63)), (VT.INT64, 2**63 - 1), (VT.UINT64, 2**64 - 1), (VT.UINT64, 2**32), (VT.UINT32, 0),
    (VT.UINT32, 1), (VT.UINT32, 3), (VT.UINT32, 2**31), (VT.UINT32, 2**32 - 1), (VT.UINT16, 65535),
    (VT.UINT8, 255), (VT.ARRAY, (VT.UINT32, [])), (VT.ARRAY, (VT.UINT32, [1, 2])),
    (VT.ARRAY, (VT.INT32, [-1])), (VT.ARRAY, (VT.STRING, [b"a"])), (VT.ARRAY, (VT.STRING, [b"\xff"])),
    (VT.ARRAY, (VT.FLOAT32, [NAN])), (VT.ARRAY, (VT.ARRAY, [(VT.INT32, [1]), (VT.STRING, [b"x"])])),
    (VT.ARRAY, (VT.ARRAY, [(VT.ARRAY, [(VT.ARRAY, [])])])), (VT.ARRAY, (VT.BOOL, [1, 0])),
]  # fmt: skip

EXTRA_KEYS = [
    "general.alignment", "general.architecture", "general.name", "general.file_type",
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
    "{arch}.context_length", "{arch}.embedding_length", "{arch}.block_count", "{arch}.feed_forward_length",
    "{arch}.attention.head_count", "{arch}.attention.head_count_kv", "{arch}.attention.key_length",
    "{arch}.attention.value_length", "{arch}.rope.dimension_count", "{arch}.rope.freq_base",
    "{arch}.rope.scaling.type", "{arch}.rope.scaling.factor", "{arch}.vocab_size",
    "{arch}.attention.layer_norm_rms_epsilon", "{arch}.attention.layer_norm_epsilon",
    "{arch}.attention.sliding_window", "{arch}.attn_logit_softcapping", "{arch}.final_logit_softcapping",
]  # fmt: skip


@dataclass
class Mutant:
    name: str  # base#index
    description: str
    blob: bytes


def _pick_field(rng: random.Random, layout: Layout, groups=None) -> Field:
    groups = groups or sorted({f.group for f in layout.fields})
    group = rng.choice(groups)
    return rng.choice([f for f in layout.fields if f.group == group])


def _edge_for(rng: random.Random, f: Field):
    if f.fmt in ("<f", "<d"):
        return rng.choice([0.0, -0.0, 1.0, -1.0, 0.5, NAN, INF, -INF, 1e-45, 3.4e38, f.value * 2])
    bits = 8 * f.size
    signed = f.fmt in ("<b", "<h", "<i", "<q")
    edges = U64_EDGES if f.size == 8 else U32_EDGES if f.size == 4 else [0, 1, 2, 127, 128, 255, 2**16 - 1]
    candidates = [*edges, f.value + 1, f.value - 1, f.value * 2, f.value // 2, f.value ^ (1 << rng.randrange(bits))]
    v = rng.choice(candidates) % (1 << bits)
    if signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def mutate_field(rng, layout: Layout):
    """Patch one number of the base file in place (the rest of the file is unchanged)."""
    f = _pick_field(rng, layout)
    v = _edge_for(rng, f)
    blob = bytearray(layout.blob)
    struct.pack_into(f.fmt, blob, f.offset, v)
    return f"field {f.label} @{f.offset}: {f.value!r} -> {v!r}", bytes(blob)


def mutate_truncate(rng, layout: Layout):
    if rng.random() < 0.3:  # at or next to a field boundary
        f = _pick_field(rng, layout)
        n = f.offset + rng.randrange(-1, f.size + 2)
    elif rng.random() < 0.7:
        n = rng.randrange(layout.header_end + 64)
    else:
        n = rng.randrange(len(layout.blob))
    n = max(0, min(n, len(layout.blob) - 1))
    return f"truncate to {n} of {len(layout.blob)} bytes", layout.blob[:n]


def mutate_bitflip(rng, layout: Layout):
    blob = bytearray(layout.blob)
    end = layout.header_end if rng.random() < 0.9 else len(blob)
    flips = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        pos, bit = rng.randrange(4, end), rng.randrange(8)
        blob[pos] ^= 1 << bit
        flips.append(f"{pos}.{bit}")
    return f"bit flips at {', '.join(flips)}", bytes(blob)


def mutate_overwrite(rng, layout: Layout):
    blob = bytearray(layout.blob)
    n = rng.choice([1, 2, 4, 8, 16, 64])
    pos = rng.randrange(4, layout.header_end)
    fill = rng.choice([b"\xff", b"\x00", b"\x80", None])
    chunk = bytes(rng.randrange(256) for _ in range(n)) if fill is None else fill * n
    blob[pos : pos + n] = chunk[: len(blob) - pos]
    return f"overwrite {n} bytes at {pos} with {chunk[:8].hex()}{'...' if n > 8 else ''}", bytes(blob)


def _arch(layout: Layout) -> str:
    kv = next((kv for kv in layout.kvs if kv.key == b"general.architecture"), None)
    return kv.value.decode() if kv else "llama"


def mutate_kv_value(rng, layout: Layout):
    """Replace (or add) one metadata entry with a value of another type or a boundary value."""
    keys = [kv.key.decode() for kv in layout.kvs] + [k.format(arch=_arch(layout)) for k in EXTRA_KEYS]
    key = rng.choice(keys).encode()
    vtype, value = rng.choice(TYPED_VALUES)
    if rng.random() < 0.3:  # same type as now, boundary value
        old = next((kv for kv in layout.kvs if kv.key == key), None)
        if old is not None and old.vtype in SCALAR_FMT and old.vtype not in (VT.FLOAT32, VT.FLOAT64, VT.BOOL):
            vtype, value = old.vtype, rng.choice([0, 1, 2, 3, 7, 64, 255, 511, 512, 513, 2**15, 2**31 - 1])
            if struct.calcsize(SCALAR_FMT[VT(vtype)]) >= 4:
                value = rng.choice([value, 2**31, 2**32 - 1])
            if vtype in (VT.INT8, VT.UINT8):
                value &= 0x7F
    new = KV(key, vtype, value)
    kvs = [new if kv.key == key else kv for kv in layout.kvs]
    if new not in kvs:
        kvs.insert(rng.randrange(len(kvs) + 1), new)
    return f"metadata {key.decode()} = {VT(vtype).name} {value!r}"[:300], serialize(layout, kvs)


def mutate_kv_structure(rng, layout: Layout):
    """Drop, duplicate or rename a metadata entry."""
    kvs = list(layout.kvs)
    i = rng.randrange(len(kvs))
    op = rng.choice(["drop", "duplicate", "rename-utf8", "rename-empty", "rename-long"])
    if op == "drop":
        del kvs[i]
    elif op == "duplicate":
        kvs.insert(rng.randrange(len(kvs) + 1), kvs[i])
    elif op == "rename-utf8":
        kvs[i] = replace(kvs[i], key=kvs[i].key + rng.choice(INVALID_UTF8))
    elif op == "rename-empty":
        kvs[i] = replace(kvs[i], key=b"")
    else:
        kvs[i] = replace(kvs[i], key=b"k" * 70000)
    return f"metadata {op} of {kvs[min(i, len(kvs) - 1)].key[:60]!r}", serialize(layout, kvs)


def mutate_array(rng, layout: Layout):
    """Change the elements of one metadata array (tokens, scores, token types, merges, ...)."""
    arrays = [kv for kv in layout.kvs if kv.vtype == VT.ARRAY]
    kv = rng.choice(arrays)
    sub, items = kv.value
    items = list(items)
    n = len(items)
    op = rng.choice(["shrink", "grow", "element", "element", "retype", "retype", "nest"])
    if op == "shrink":
        k = rng.choice([0, 1, 2, n // 2, n - 1])
        items = items[:k]
        what = f"cut to {k}"
    elif op == "grow":
        items = items + items[: rng.choice([1, 10])]
        what = "grown by repeating its first elements"
    elif op == "element":
        i = rng.randrange(n)
        if sub == VT.STRING:
            new = rng.choice([b"", b" ", b"\xe2\x96\x81", items[rng.randrange(n)], b"<0xZZ>", b"<0x>", b"<0x1",
                              b"x" * 100000, b"a b c", b"ab", b" a", b"a ", *INVALID_UTF8])  # fmt: skip
        elif sub in (VT.FLOAT32, VT.FLOAT64):
            new = rng.choice([NAN, INF, -INF, -1e30, 0.0])
        elif sub == VT.BOOL:
            new = rng.choice([0, 1, 2, 255])
        else:
            fmt = SCALAR_FMT[VT(sub)]
            bits = 8 * struct.calcsize(fmt)
            new = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 100, -1, 2 ** (bits - 1) - 1, -(2 ** (bits - 1))])
            if fmt[1].isupper():
                new %= 1 << bits
        items[i] = new
        what = f"[{i}] = {new[:20] if isinstance(new, bytes) else new!r}"
    elif op == "retype":
        new_sub = rng.choice([VT.INT32, VT.UINT64, VT.FLOAT32, VT.STRING, VT.BOOL, VT.INT8, VT.FLOAT64])
        items = [_convert(item, sub, new_sub, rng) for item in items]
        what = f"as {VT(new_sub).name}"
        sub = new_sub
    else:
        k = rng.choice([1, 2, n])
        items = [(sub, items[i : i + k]) for i in range(0, min(n, 4 * k), k)]
        what = f"as an array of arrays of {k}"
        sub = VT.ARRAY
    kvs = [replace(kv, value=(sub, items)) if other is kv else other for other in layout.kvs]
    return f"array {kv.key.decode()} {what}", serialize(layout, kvs)


def _convert(item, sub, new_sub, rng):
    if new_sub == VT.STRING:
        return item if isinstance(item, bytes) else str(item).encode()
    if new_sub in (VT.FLOAT32, VT.FLOAT64):
        return float(len(item)) if isinstance(item, bytes) else float(item)
    if new_sub == VT.BOOL:
        return 1 if item else 0
    fmt = SCALAR_FMT[VT(new_sub)]
    bits = 8 * struct.calcsize(fmt)
    v = len(item) if isinstance(item, bytes) else int(item) if math.isfinite(item) else 0
    if new_sub == VT.UINT64 and rng.random() < 0.5:
        v = rng.choice([2**64 - 1, 2**63])
    v %= 1 << bits
    if fmt[1].islower() and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def mutate_tensor(rng, layout: Layout):
    """Change one tensor descriptor and re-lay the file out consistently."""
    tensors = [replace(t, ne=list(t.ne)) for t in layout.tensors]
    if not tensors:  # a tokenizer-only file: give it tensors first
        tensors = [TensorDesc(b"token_embd.weight", [4, 8], 0, 0), TensorDesc(b"output_norm.weight", [4], 0, 128)]
        data = bytes(256)
    else:
        data = layout.data
    i = rng.randrange(len(tensors))
    t, other = tensors[i], tensors[rng.randrange(len(tensors))]
    align = layout.alignment
    op = rng.choice(["dims>4", "no dims", "dim", "dim", "overflow", "type", "type", "share offset", "overlap",
                     "misalign", "offset", "offset", "swap offsets", "duplicate name", "name", "drop", "extra",
                     "requant", "requant"])  # fmt: skip
    if op == "dims>4":
        t.ne += [1] * rng.randrange(5 - len(t.ne), 9 - len(t.ne))
    elif op == "no dims":
        t.ne = []
    elif op == "dim":
        j = rng.randrange(len(t.ne))
        t.ne[j] = rng.choice([0, 1, 2, t.ne[j] * 2, t.ne[j] // 2 or 1, t.ne[j] + 1, *U64_EDGES])
    elif op == "overflow":
        t.ne = rng.choice([[2**32, 2**32], [2**62, 4], [2**63, 1], [0, 2**64 - 1], [2**64 - 1, 0], [2**21] * 4])
    elif op == "type":
        t.ttype = rng.choice(U32_EDGES)
    elif op == "share offset":
        t.offset = other.offset
    elif op == "overlap":
        t.offset = max(0, other.offset + rng.choice([-align, align, 2 * align]))
    elif op == "misalign":
        t.offset += rng.choice([1, 2, 4, 8, 16, -1])
        t.offset %= 1 << 64
    elif op == "offset":
        t.offset = rng.choice([len(data), len(data) - align, *U64_EDGES]) % (1 << 64)
    elif op == "swap offsets":
        t.offset, other.offset = other.offset, t.offset
    elif op == "duplicate name":
        t.name = other.name if other is not t else tensors[0].name
        if len(tensors) == 1:
            tensors.append(replace(t))
    elif op == "name":
        t.name = rng.choice([b"", b"x" * 200, t.name + rng.choice(INVALID_UTF8), b"blk.999.attn_q.weight", b"\x00"])
    elif op == "drop":
        del tensors[i]
    elif op == "requant":  # any GGML type, consistently sized, its blocks random bytes at the end of the data
        t.ttype = rng.choice(sorted(gguf.GGML_QUANT_SIZES))
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ttype)]
        t.ne = [block * rng.choice([1, 2]), rng.choice([1, 3])]
        n_bytes = t.ne[0] // block * type_size * t.ne[1]
        t.offset = -(-len(data) // align) * align
        data = data + bytes(t.offset - len(data)) + rng.randbytes(n_bytes)
    else:
        tensors.append(TensorDesc(b"extra.weight", [rng.choice([1, 32, 64])], rng.choice([0, 1, 8]), len(data)))
        data = data + bytes(256)
    blob = serialize(layout, tensors=tensors, data=data)
    return f"tensor {op}: {layout.tensors[i].name.decode() if layout.tensors else 'new'} -> {_show(t)}", blob


def _show(t: TensorDesc) -> str:
    return f"name={t.name[:40]!r} ne={t.ne} type={t.ttype} offset={t.offset}"


def mutate_alignment(rng, layout: Layout):
    """general.alignment changed (or retyped), the data laid out with the old or the new one."""
    vtype, value = rng.choice([(VT.UINT32, 0), (VT.UINT32, 1), (VT.UINT32, 3), (VT.UINT32, 8), (VT.UINT32, 64),
                               (VT.UINT32, 48), (VT.UINT32, 2**31), (VT.UINT32, 2**32 - 1), (VT.UINT64, 32),
                               (VT.STRING, b"32"), (VT.INT32, -32), (VT.FLOAT32, 32.0)])  # fmt: skip
    kvs = [kv for kv in layout.kvs if kv.key != b"general.alignment"] + [KV(b"general.alignment", vtype, value)]
    lay_out_with = value if vtype == VT.UINT32 and value in (1, 8, 64) and rng.random() < 0.5 else layout.alignment
    desc = f"general.alignment = {VT(vtype).name} {value!r}, data aligned to {lay_out_with}"
    return desc, serialize(layout, kvs, alignment=lay_out_with)


def mutate_version(rng, layout: Layout):
    v = rng.choice([0, 1, 2, 4, 2**16 * 3, 2**32 - 1])
    return f"version {v}", serialize(layout, version=v)


MUTATORS = [  # (weight, function)
    (6, mutate_truncate), (12, mutate_bitflip), (4, mutate_overwrite), (22, mutate_field),
    (16, mutate_kv_value), (5, mutate_kv_structure), (12, mutate_array), (18, mutate_tensor),
    (3, mutate_alignment), (1, mutate_version),
]  # fmt: skip


def with_kv(layout: Layout, key: str, vtype: int, value) -> bytes:
    """The base file with metadata `key` set to (vtype, value), added at the end when absent."""
    new = KV(key.encode(), vtype, value)
    kvs = [new if kv.key == new.key else kv for kv in layout.kvs]
    return serialize(layout, kvs if new in kvs else kvs + [new])


def _kv(layout: Layout, key: str):
    return next(kv.value for kv in layout.kvs if kv.key == key.encode())


def with_tensor(layout: Layout, which: str, **changes) -> bytes:
    """The base file with tensor `which`'s descriptor changed (`offset_from`: another tensor's offset)."""
    by_name = {t.name.decode(): t for t in layout.tensors}
    if "offset_from" in changes:
        other, delta = changes.pop("offset_from")
        changes["offset"] = by_name[other].offset + delta
    tensors = [replace(t, **changes) if t.name == which.encode() else t for t in layout.tensors]
    return serialize(layout, tensors=tensors)


# Hand-picked mutants run on every seed: the cases issue 15 names, and the sizes the model
# loader must check before it allocates anything.
U32, U64, F32, STR, ARR = VT.UINT32, VT.UINT64, VT.FLOAT32, VT.STRING, VT.ARRAY
CATALOG = [
    ("stories", "bos_token_id stored as a string", lambda l: with_kv(l, "tokenizer.ggml.bos_token_id", STR, b"1")),
    ("stories", "bos_token_id stored as a float", lambda l: with_kv(l, "tokenizer.ggml.bos_token_id", F32, 1.0)),
    ("bpe", "eos_token_id stored as a string", lambda l: with_kv(l, "tokenizer.ggml.eos_token_id", STR, b"x")),
    ("stories", "add_bos_token stored as a string", lambda l: with_kv(l, "tokenizer.ggml.add_bos_token", STR, b"no")),
    ("stories", "tokens stored as int32",
     lambda l: with_kv(l, "tokenizer.ggml.tokens", ARR, (VT.INT32, list(range(512))))),
    ("stories", "token_type stored as strings",
     lambda l: with_kv(l, "tokenizer.ggml.token_type", ARR, (STR, [b"1"] * 512))),
    ("bpe", "merges as arrays of strings",
     lambda l: with_kv(l, "tokenizer.ggml.merges", ARR, (ARR, [(STR, [b"a", b"b"])]))),
    ("bpe", "pre-tokenizer name stored as a number", lambda l: with_kv(l, "tokenizer.ggml.pre", U32, 2)),
    ("stories", "general.name with invalid UTF-8",
     lambda l: with_kv(l, "general.name", STR, b"st\xffories\xed\xa0\x80")),
    ("stories", "general.architecture as an array",
     lambda l: with_kv(l, "general.architecture", ARR, (STR, [b"llama"]))),
    ("stories", "context_length 0", lambda l: with_kv(l, "llama.context_length", U32, 0)),
    ("stories", "context_length a float", lambda l: with_kv(l, "llama.context_length", F32, 1.5)),
    ("stories", "context_length 2^64 - 1", lambda l: with_kv(l, "llama.context_length", U64, 2**64 - 1)),
    ("stories", "rope.dimension_count 64 > head_dim 8", lambda l: with_kv(l, "llama.rope.dimension_count", U32, 64)),
    ("stories", "rope.dimension_count odd", lambda l: with_kv(l, "llama.rope.dimension_count", U32, 7)),
    ("stories", "block_count 2^32 - 1", lambda l: with_kv(l, "llama.block_count", U32, 2**32 - 1)),
    ("stories", "head_count 0", lambda l: with_kv(l, "llama.attention.head_count", U32, 0)),
    ("stories", "head_count_kv 3 (8 heads)", lambda l: with_kv(l, "llama.attention.head_count_kv", U32, 3)),
    ("stories", "embedding_length 2^63", lambda l: with_kv(l, "llama.embedding_length", U64, 2**63)),
    ("stories", "feed_forward_length 2^32 - 1", lambda l: with_kv(l, "llama.feed_forward_length", U32, 2**32 - 1)),
    ("stories", "vocab_size 2^32 - 1", lambda l: with_kv(l, "llama.vocab_size", U32, 2**32 - 1)),
    ("stories", "attention.key_length 2^31", lambda l: with_kv(l, "llama.attention.key_length", U32, 2**31)),
    ("stories", "norm epsilon NaN", lambda l: with_kv(l, "llama.attention.layer_norm_rms_epsilon", F32, NAN)),
    ("stories", "rope.freq_base -1", lambda l: with_kv(l, "llama.rope.freq_base", F32, -1.0)),
    ("stories", "rope.scaling.factor 0 (linear)",
     lambda l: serialize(l, l.kvs + [KV(b"llama.rope.scaling.type", STR, b"linear"),
                                     KV(b"llama.rope.scaling.factor", F32, 0.0)])),
    ("stories", "rope.scaling.type an array", lambda l: with_kv(l, "llama.rope.scaling.type", ARR, (U32, [1]))),
    ("stories", "sliding_window 2^32 - 1", lambda l: with_kv(l, "llama.attention.sliding_window", U32, 2**32 - 1)),
    ("stories", "attn_logit_softcapping NaN", lambda l: with_kv(l, "llama.attn_logit_softcapping", F32, NAN)),
    ("stories", "two tensors share one data offset",
     lambda l: with_tensor(l, "blk.0.attn_k.weight", offset_from=("blk.0.attn_q.weight", 0))),
    ("stories", "tensor data overlaps the previous tensor's",
     lambda l: with_tensor(l, "blk.0.attn_k.weight", offset_from=("blk.0.attn_q.weight", 64))),
    ("stories", "misaligned tensor data offset",
     lambda l: with_tensor(l, "blk.0.attn_k.weight", offset_from=("blk.0.attn_k.weight", 4))),
    ("stories", "n_dims 5", lambda l: with_tensor(l, "output_norm.weight", ne=[64, 1, 1, 1, 1])),
    ("stories", "unknown tensor type id 4", lambda l: with_tensor(l, "blk.1.ffn_up.weight", ttype=4)),
    ("stories", "unknown tensor type id 2^32 - 1", lambda l: with_tensor(l, "blk.1.ffn_up.weight", ttype=2**32 - 1)),
    ("stories", "tensor dims overflow int64", lambda l: with_tensor(l, "output_norm.weight", ne=[2**32, 2**32])),
    ("stories", "tensor dims 2^64 - 1 and 0", lambda l: with_tensor(l, "output_norm.weight", ne=[2**64 - 1, 0])),
    ("stories", "tensor name with invalid UTF-8",
     lambda l: with_tensor(l, "output_norm.weight", name=b"output\xff.weight")),
    ("stories", "token with invalid UTF-8",
     lambda l: with_kv(l, "tokenizer.ggml.tokens", ARR,
                       (STR, [b"<unk>", b"<s>\xff"] + _kv(l, "tokenizer.ggml.tokens")[1][2:]))),
    ("stories", "a normal token typed as a byte token",
     lambda l: with_kv(l, "tokenizer.ggml.token_type", ARR, (VT.INT32, [2, 3, 3] + [6] * 509))),
]  # fmt: skip


def catalog_mutants(layouts: dict[str, Layout]) -> list[Mutant]:
    return [Mutant(f"catalog#{i}", f"{base}: {desc}", make(layouts[base]))
            for i, (base, desc, make) in enumerate(CATALOG)]


def make_mutant(base: str, layout: Layout, index: int, seed: int = SEED) -> Mutant:
    rng = random.Random(f"{seed}:{base}:{index}")
    weights, funcs = zip(*MUTATORS)
    func = rng.choices(funcs, weights)[0]
    description, blob = func(rng, layout)
    if rng.random() < 0.05:  # now and then a second, raw mutation on top
        second = rng.choice([mutate_bitflip, mutate_truncate, mutate_overwrite])
        desc2, blob = second(rng, replace(layout, blob=blob, header_end=min(layout.header_end, len(blob) - 1)))
        description += f"; then {desc2}"
    return Mutant(f"{base}#{index}", f"{func.__name__.removeprefix('mutate_')}: {description}", blob)


# -- base files ------------------------------------------------------------------------------


def small_bpe_vocab(path: Path, n_tokens: int = 1000) -> Path:
    """The first n_tokens of GPT-2's vocabulary (byte tokens and the merges that make the rest),
    plus <|endoftext|> as BOS/EOS: a real byte-level BPE tokenizer that loads in ~1 ms."""
    layout = parse(GPT2_VOCAB.read_bytes())
    kvs = []
    for kv in layout.kvs:
        if kv.key == b"tokenizer.ggml.tokens":
            kv = replace(kv, value=(VT.STRING, kv.value[1][:n_tokens] + [b"<|endoftext|>"]))
        elif kv.key == b"tokenizer.ggml.token_type":
            kv = replace(kv, value=(VT.INT32, kv.value[1][:n_tokens] + [3]))
        elif kv.key == b"tokenizer.ggml.merges":
            kv = replace(kv, value=(VT.STRING, kv.value[1][: n_tokens - 256]))
        elif kv.key in (b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id"):
            kv = replace(kv, value=n_tokens)
        kvs.append(kv)
    path.write_bytes(serialize(layout, kvs))
    return path


def base_layouts(tmp: Path) -> dict[str, Layout]:
    return {"stories": parse(STORIES.read_bytes()), "bpe": parse(small_bpe_vocab(tmp / "bpe-1k.gguf").read_bytes())}


# -- running one mutant through the library ---------------------------------------------------


class MutantTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` swallows it."""


@dataclass
class Failure:
    mutant: str
    description: str
    stage: str
    error: str  # "Type: message"
    origin: str  # innermost llmtune frame: path:line in function
    owner: str  # "loader" (gguf/, tokenizer/, ui/) or "lead" (arch/, model/, graph/)
    trace: str = field(default="", repr=False)

    def __str__(self) -> str:
        return f"{self.mutant} [{self.description}] -> {self.stage}: {self.error} (at {self.origin})"


def _origin(exc: BaseException) -> tuple[str, str]:
    """(path:line in function, owner) of the innermost traceback frame inside llmtune/."""
    origin, owner = "outside llmtune", "loader"
    for frame, line in traceback.walk_tb(exc.__traceback__):
        file = Path(frame.f_code.co_filename)
        if LLMTUNE_DIR in file.parents:
            rel = file.relative_to(LLMTUNE_DIR).as_posix()
            origin = f"llmtune/{rel}:{line} in {frame.f_code.co_name}"
            owner = "lead" if rel.startswith(LEAD_OWNED) else "loader"
    return origin, owner


def _stages(path: Path):
    """(name, callable) for each library call the CLI makes on a model file."""


    state = {}

    def load():
        gf = load_gguf(path)
        state["gf"] = gf
        for name in gf.tensors:
            gf.tensor(name)

    def tokenizer():
        tok = Tokenizer.from_gguf(state["gf"])
        ids = tok.encode(SAMPLE_TEXT, add_special=True, parse_special=True)
        ids += tok.encode(SAMPLE_TEXT, add_special=False, parse_special=False)
        tok.decode(ids, remove_special=True)
        tok.decode(ids, unparse_special=True)
        format_pieces(tok, ids)
        format_ids(ids)

    def info():
        # stdout as the CLI has it: UTF-8, strict (a lone surrogate cannot be printed)
        stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
        Console(file=stream, width=100, color_system=None, force_terminal=False).print(render_info(path))
        stream.flush()

    def model():
        m = load_model(path)
        m.build(1, 4)

    return [("load_gguf", load), ("tokenizer", tokenizer), ("info", info), ("load_model", model)]


def run_mutant(mutant: Mutant, tmp: Path, limits: "_Limits | None" = None) -> tuple[list[Failure], dict[str, str]]:
    """All stages on one mutant: (failures, stage -> 'ok' | 'error' | 'crash' | 'skipped').

    With `limits`, each stage runs under its own MUTANT_TIMEOUT_S alarm."""

    path = tmp / f"{mutant.name.replace('#', '-')}.gguf"
    path.write_bytes(mutant.blob)
    failures, outcome = [], {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # damaged weights dequantize to inf / nan
            for stage, call in _stages(path):
                if stage == "tokenizer" and outcome.get("load_gguf") != "ok":
                    outcome[stage] = "skipped"  # needs the loaded file (info and load_model load it themselves)
                    continue
                try:
                    if limits is not None:
                        limits.arm()
                    try:
                        call()
                    finally:
                        if limits is not None:
                            limits.disarm()
                    outcome[stage] = "ok"
                except LlmtuneError as exc:
                    outcome[stage] = "error"
                    message = str(exc)
                    if "\n" in message or not message.startswith(f"{path}: "):
                        origin, owner = _origin(exc)
                        error = f"LlmtuneError not one line naming the file: {message!r}"
                        failures.append(Failure(mutant.name, mutant.description, stage, error, origin, owner))
                except (Exception, MutantTimeout) as exc:  # noqa: BLE001 - every other exception is a finding
                    # first drop the frames' locals: after a MemoryError they hold the runaway allocation
                    traceback.clear_frames(exc.__traceback__)
                    outcome[stage] = "crash"
                    origin, owner = _origin(exc)
                    error = f"{type(exc).__name__}: {str(exc)[:200]}"
                    trace = "".join(traceback.format_exception(exc))
                    failures.append(Failure(mutant.name, mutant.description, stage, error, origin, owner, trace))
                    del exc
    finally:
        path.unlink(missing_ok=True)
    return failures, outcome


class _Limits:
    """A per-mutant alarm and an address-space cap for the duration of the run."""

    def __enter__(self):
        self.active = threading.current_thread() is threading.main_thread()  # (signals: main thread only)
        if not self.active:
            return self
        self.old_handler = signal.signal(signal.SIGALRM, self._alarm)
        self.old_as = resource.getrlimit(resource.RLIMIT_AS)
        vm = _vm_size()
        if vm:
            soft = vm + MEMORY_HEADROOM
            if self.old_as[0] == resource.RLIM_INFINITY or soft < self.old_as[0]:
                resource.setrlimit(resource.RLIMIT_AS, (soft, self.old_as[1]))
        return self

    @staticmethod
    def _alarm(signum, frame):
        raise MutantTimeout(f"still running after {MUTANT_TIMEOUT_S} s")

    def arm(self):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, MUTANT_TIMEOUT_S)

    def disarm(self):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def __exit__(self, *exc):
        if not self.active:
            return
        self.disarm()
        resource.setrlimit(resource.RLIMIT_AS, self.old_as)
        signal.signal(signal.SIGALRM, self.old_handler)


def _vm_size() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class FuzzRun:
    n_mutants: int
    seconds: float
    failures: list[Failure]
    outcomes: dict[str, dict[str, int]]  # stage -> outcome -> count


def all_mutants(layouts: dict[str, Layout], n_per_base: dict[str, int], seed: int):
    """The catalog, then n_per_base random mutants of each base (made one at a time)."""
    yield from catalog_mutants(layouts)
    for base, count in n_per_base.items():
        for index in range(count):
            yield make_mutant(base, layouts[base], index, seed)


def fuzz(tmp: Path, n_per_base: dict[str, int] = N_PER_BASE, seed: int = SEED) -> FuzzRun:
    layouts = base_layouts(tmp)
    failures, outcomes, n = [], {}, 0
    start = time.perf_counter()
    with _Limits() as limits:
        for mutant in all_mutants(layouts, n_per_base, seed):
            found, outcome = run_mutant(mutant, tmp, limits)
            failures += found
            for stage, result in outcome.items():
                counts = outcomes.setdefault(stage, {})
                counts[result] = counts.get(result, 0) + 1
            n += 1
    return FuzzRun(n, time.perf_counter() - start, failures, outcomes)


# -- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory) -> FuzzRun:
    run = fuzz(tmp_path_factory.mktemp("fuzz"))
    print(f"\nfuzz: {run.n_mutants} mutants (seed {SEED}) in {run.seconds:.1f} s, "
          f"{run.n_mutants / run.seconds:.0f}/s; outcomes {run.outcomes}")  # fmt: skip
    return run


def _report(failures: list[Failure], limit: int = 40) -> str:
    lines = [f"{len(failures)} failures in {len({f.mutant for f in failures})} mutants (seed {SEED}):"]
    lines += [str(f) for f in failures[:limit]]
    if len(failures) > limit:
        lines.append(f"... and {len(failures) - limit} more")
    lines.append("replay one with: python tests/test_fuzz.py --base BASE --index N (or --catalog N)")
    return "\n".join(lines)


def test_fuzz_mutants_are_many_and_varied(fuzz_run):
    assert fuzz_run.n_mutants >= 1000
    load = fuzz_run.outcomes["load_gguf"]
    # the mutants reach every stage: many load, many are rejected, and some fail later on
    assert load.get("ok", 0) > 0.2 * fuzz_run.n_mutants and load.get("error", 0) > 0.2 * fuzz_run.n_mutants, load
    assert fuzz_run.outcomes["tokenizer"].get("error", 0) > 20, fuzz_run.outcomes
    assert fuzz_run.outcomes["info"].get("ok", 0) > 0.2 * fuzz_run.n_mutants, fuzz_run.outcomes
    assert fuzz_run.outcomes["load_model"].get("ok", 0) > 20, fuzz_run.outcomes


def test_fuzz_loader_tokenizer_and_info_raise_only_user_errors(fuzz_run):
    """gguf/, tokenizer/ and ui/: every mutant loads or gives a one-line LlmtuneError."""
    failures = [f for f in fuzz_run.failures if f.owner == "loader"]
    assert not failures, _report(failures)


def test_fuzz_model_loading_raises_only_user_errors(fuzz_run):
    """arch/, model/ and graph/: hyper-parameters, tensor lists and graph building too."""
    failures = [f for f in fuzz_run.failures if f.owner == "lead"]
    assert not failures, "in arch/model/graph code: " + _report(failures)


# -- replaying a mutant by hand --------------------------------------------------------------------


def _main(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(description="Replay or extend the GGUF fuzzer.")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--base", choices=list(N_PER_BASE), help="only this base file")
    parser.add_argument("--index", type=int, help="replay this one mutant and print its tracebacks")
    parser.add_argument("--catalog", type=int, help="replay this catalog mutant and print its tracebacks")
    parser.add_argument("-n", type=int, help="mutants per base (default: as in the test)")
    parser.add_argument("--keep", type=Path, help="with --index / --catalog: also write the mutant to this path")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        layouts = base_layouts(tmp)
        mutant = None
        if args.catalog is not None:
            mutant = catalog_mutants(layouts)[args.catalog]
        elif args.index is not None:
            base = args.base or "stories"
            mutant = make_mutant(base, layouts[base], args.index, args.seed)
        if mutant is not None:
            print(f"{mutant.name}: {mutant.description}")
            if args.keep:
                args.keep.write_bytes(mutant.blob)
            with _Limits() as limits:
                failures, outcome = run_mutant(mutant, tmp, limits)
            print(outcome)
            for f in failures:
                print(f"--- {f.stage} ({f.owner}): {f.error} at {f.origin}\n{f.trace}")
            return 1 if failures else 0
        counts = {b: N_PER_BASE[b] if args.n is None else args.n for b in ([args.base] if args.base else N_PER_BASE)}
        run = fuzz(tmp, counts, args.seed)
        print(f"{run.n_mutants} mutants in {run.seconds:.1f} s ({run.n_mutants / run.seconds:.0f}/s); {run.outcomes}")
        for f in run.failures:
            print(f"[{f.owner}] {f}")
        return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
