"""Compare two GGUF files key by key and tensor by tensor (bytes, type, shape): bench/check_hf_import.py's oracle
check of `llmtune import` against llama.cpp's convert_hf_to_gguf.py, and tests/test_hf_import.py's record."""

from __future__ import annotations

import hashlib

import numpy as np
from gguf import GGUFValueType as VT

from llmtune.gguf.file import load_gguf


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def plain_fields(path) -> dict:
    """Every metadata key -> (type name, value): arrays as lists of python values, in file order."""
    out = {}
    for key, mv in load_gguf(path).meta.items():
        if mv.type == VT.ARRAY:
            out[key] = (f"ARRAY[{VT(mv.sub_type).name}]", [_plain(v) for v in mv.value])
        else:
            out[key] = (VT(mv.type).name, _plain(mv.value))
    return out


def tensor_digests(path) -> dict:
    """name -> (type name, GGUF shape (ne), sha256 of the stored bytes), in file order."""
    return {name: (t.type.name, list(reversed(t.shape)), hashlib.sha256(np.ascontiguousarray(t.raw).view(np.uint8))
                   .hexdigest()) for name, t in load_gguf(path).tensors.items()}


def metadata_digest(fields: dict) -> dict:
    """key -> [type, value] with long arrays as their sha256 (a small record of a tokenizer's metadata)."""
    out = {}
    for key, (vtype, value) in fields.items():
        if isinstance(value, list) and len(value) > 16:
            value = "sha256:" + hashlib.sha256(repr(value).encode("utf-8", "surrogateescape")).hexdigest()
        out[key] = [vtype, value]
    return out


def differences(a, b) -> list[str]:
    """One line per key or tensor that differs between GGUF files `a` (ours) and `b` (the reference)."""
    lines = []
    fa, fb = plain_fields(a), plain_fields(b)
    for key in sorted(set(fa) | set(fb)):
        if key not in fa:
            lines.append(f"key {key}: missing (reference: {str(fb[key])[:120]})")
        elif key not in fb:
            lines.append(f"key {key}: extra ({str(fa[key])[:120]})")
        elif fa[key] != fb[key]:
            lines.append(f"key {key}: {str(fa[key])[:120]} != reference {str(fb[key])[:120]}")
    ta, tb = tensor_digests(a), tensor_digests(b)
    if list(ta) != list(tb):
        lines.append(f"tensor order or names differ: {sorted(set(ta) ^ set(tb))[:8]}"
                     + ("" if set(ta) ^ set(tb) else " (same names, another order)"))
    for name in ta:
        if name in tb and ta[name] != tb[name]:
            lines.append(f"tensor {name}: {ta[name][:2]} {ta[name][2][:12]} != reference {tb[name][:2]} "
                         f"{tb[name][2][:12]}")
    return lines
