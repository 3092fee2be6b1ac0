"""Compare two GGUF files key by key and tensor by tensor (bytes, type, shape): bench/check_hf_import.py's oracle
check of `llmtune import` against llama.cpp's convert_hf_to_gguf.py, and tests/test_hf_import.py's record."""

from __future__ import annotations

import hashlib

import numpy as np
from gguf import GGUFReader, GGUFValueType as VT


def plain_fields(path) -> dict:
    """Every metadata key -> (type name, value) with gguf-py's reader (the file's own layout, not llmtune's)."""
    out = {}
    for key, field in GGUFReader(path).fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = VT(field.types[0])
        if vtype == VT.ARRAY:
            sub = VT(field.types[1])
            vals = [field.parts[i] for i in field.data]
            value = [bytes(v).decode("utf-8", "surrogateescape") if sub == VT.STRING else v.item() for v in vals]
            out[key] = (f"ARRAY[{sub.name}]", value)
        elif vtype == VT.STRING:
            out[key] = ("STRING", bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape"))
        else:
            out[key] = (vtype.name, field.parts[field.data[0]].item())
    return out


def tensor_digests(path) -> dict:
    """name -> (type name, GGUF shape, sha256 of the stored bytes), in file order."""
    return {t.name: (t.tensor_type.name, [int(n) for n in t.shape], hashlib.sha256(np.ascontiguousarray(t.data)
                                                                                  .view(np.uint8)).hexdigest())
            for t in GGUFReader(path).tensors}


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
