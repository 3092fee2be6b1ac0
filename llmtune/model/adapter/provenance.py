"""What llmtune records in an adapter it writes, beside llama.cpp's keys: the base it was trained
on (its fingerprint) and how it was made (the LoRA variant). All under the "llmtune." metadata
namespace, which llama.cpp's adapter loader (llama_adapter_lora_init) ignores, as it ignores every
key it does not read; an adapter without these keys (an older llmtune's, convert_lora_to_gguf.py's)
loads as before.

The base's fingerprint (BaseFingerprint.of):
- llmtune.base.name     string: the base's general.name, or its file name when it has none;
- llmtune.base.file     string: the base's file name (no folder);
- llmtune.base.tensors  string array: every tensor of the base in file order as "NAME:NE0,NE1,...:TYPE"
                        (GGUF ne order, ggml type name), e.g. "blk.0.attn_q.weight:64,64:F32";
- llmtune.base.sha256   string: hex sha256 of, for each of HASHED present in the base, in that order,
                        the bytes "NAME\\0TYPE\\0NE0,NE1,...\\0" then the raw stored bytes of its first
                        HASH_ROWS rows (numpy axis 0, i.e. the first HASH_ROWS token rows of
                        token_embd, quantized blocks as stored; all of output_norm). Cheap (a few KB
                        read), deterministic, and any change of those bytes or of their type changes it.
- llmtune.base.head_count, llmtune.base.head_count_kv   uint32: the base's attention heads (absent
                        when it has none or one per layer): the row order of q/k in Hugging Face's
                        layout (arch/hf_names.py), so `export --peft` needs no base. Optional: a
                        fingerprint without them (an older llmtune's) reads as before.

The variant (how the adapter's A and B started and are scaled):
- llmtune.lora.init     string: kaiming | gaussian | pissa (--lora-init-method; pissa: the file holds
                        the plain rank-2r form, core.LoraAdapter.as_plain);
- llmtune.lora.rslora   bool: adapter.lora.alpha holds alpha * sqrt(r) (--rslora).
DoRA adapters are never written as adapters (llama.cpp has none): finetune writes the merged model.

Loading an adapter on a base (check_base): the fingerprint decides what is said about a base
other than the one it was trained on, one line naming both: other tensor shapes (a pair that does
not fit fails in files.py; one that fits warns), the same shapes in other types (a requantized copy
of the base, e.g. trained on the Q4_1 file and applied to the F32 export: warned, applied), the same
shapes and types with other bytes (another finetune of the same architecture: warned, applied).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np
from gguf import GGUFValueType as VT

from llmtune.gguf.file import GGUFFile, MetaValue

HASHED = ("token_embd.weight", "output_norm.weight")  # the tensors the content hash reads, in order
HASH_ROWS = 16  # rows of each read (output_norm has one)
NAME, FILE, TENSORS, SHA256 = "llmtune.base.name", "llmtune.base.file", "llmtune.base.tensors", "llmtune.base.sha256"
HEADS, HEADS_KV = "llmtune.base.head_count", "llmtune.base.head_count_kv"
INIT, RSLORA = "llmtune.lora.init", "llmtune.lora.rslora"
SHORT = 12  # hex digits of the hash shown to people


def _ne(shape) -> str:
    return ",".join(str(n) for n in reversed(shape))


@dataclass(frozen=True)
class BaseFingerprint:
    name: str
    file: str
    tensors: tuple[str, ...]  # "NAME:NE0,NE1:TYPE", file order
    sha256: str
    n_head: int = 0  # 0: not recorded
    n_head_kv: int = 0

    @classmethod
    def of(cls, gf: GGUFFile) -> "BaseFingerprint":
        """The fingerprint of a base model file (see the module docstring)."""
        digest = hashlib.sha256()
        for name in HASHED:
            info = gf.tensors.get(name)
            if info is None:
                continue
            digest.update(f"{name}\0{info.type.name}\0{_ne(info.shape)}\0".encode())
            digest.update(np.ascontiguousarray(info.raw[:HASH_ROWS]).tobytes())
        title = gf.get("general.name")
        arch = gf.get("general.architecture")
        n_head = gf.get(f"{arch}.attention.head_count")
        n_head_kv = gf.get(f"{arch}.attention.head_count_kv", n_head)
        heads = (n_head, n_head_kv) if all(isinstance(h, int) and h > 0 for h in (n_head, n_head_kv)) else (0, 0)
        return cls(title if isinstance(title, str) and title else gf.path.name, gf.path.name,
                   tuple(f"{n}:{_ne(t.shape)}:{t.type.name}" for n, t in gf.tensors.items()), digest.hexdigest(),
                   *heads)

    @classmethod
    def read(cls, meta: dict[str, MetaValue]) -> Optional["BaseFingerprint"]:
        """The fingerprint an adapter's metadata holds; None when it holds none (or a damaged one)."""
        values = [meta.get(k) for k in (NAME, FILE, TENSORS, SHA256)]
        if any(v is None for v in values):
            return None
        name, file, tensors, sha = (v.value for v in values)
        if not (isinstance(name, str) and isinstance(file, str) and isinstance(sha, str) and isinstance(tensors, list)
                and all(isinstance(t, str) for t in tensors)):
            return None
        heads = [meta[k].value if k in meta else 0 for k in (HEADS, HEADS_KV)]
        return cls(name, file, tuple(tensors), sha, *(h if isinstance(h, int) and h > 0 else 0 for h in heads))

    def meta(self) -> dict[str, MetaValue]:
        out = {NAME: MetaValue(self.name, VT.STRING), FILE: MetaValue(self.file, VT.STRING),
               TENSORS: MetaValue(list(self.tensors), VT.ARRAY, VT.STRING), SHA256: MetaValue(self.sha256, VT.STRING)}
        if self.n_head:
            out.update({HEADS: MetaValue(self.n_head, VT.UINT32), HEADS_KV: MetaValue(self.n_head_kv, VT.UINT32)})
        return out

    @property
    def label(self) -> str:
        """'NAME' (FILE, fingerprint 0123456789ab)."""
        file = f"{self.file}, " if self.file != self.name else ""
        return f"{self.name!r} ({file}fingerprint {self.sha256[:SHORT]})"

    def shapes(self) -> dict[str, str]:
        """Tensor name -> its ne ("64,512")."""
        return {t.split(":")[0]: t.split(":")[1] for t in self.tensors if t.count(":") == 2}

    def types(self) -> dict[str, str]:
        """Tensor name -> its type name."""
        return {t.split(":")[0]: t.split(":")[2] for t in self.tensors if t.count(":") == 2}

    def main_type(self) -> str:
        """The type most of the base's matrices are stored in (how one names a GGUF: 'Q4_1', 'F32')."""
        counts = Counter(t.split(":")[2] for t in self.tensors if t.count(":") == 2 and "," in t.split(":")[1])
        return counts.most_common(1)[0][0] if counts else "?"


def _shape_difference(trained: BaseFingerprint, here: BaseFingerprint) -> str:
    """The first difference of tensor names and shapes, in words ('' when there is none)."""
    a, b = trained.shapes(), here.shapes()
    for name in list(a) + [n for n in b if n not in a]:
        if name not in b:
            return f"{name} is missing here"
        if name not in a:
            return f"{name} is new here"
        if a[name] != b[name]:
            return f"{name} is ne [{a[name].replace(',', ', ')}] there, [{b[name].replace(',', ', ')}] here"
    return ""


def check_base(trained: Optional[BaseFingerprint], base: GGUFFile, adapter_name: str) -> tuple[str, bool]:
    """(the one line saying how `base` differs from the base the adapter was trained on, whether
    the tensor shapes differ); ('', False) when it is that base or the adapter has no fingerprint."""
    if trained is None:
        return "", False
    here = BaseFingerprint.of(base)
    both = f"{adapter_name} was trained on base {trained.label}; {base.path.name} is {here.label}"
    if (shapes := _shape_difference(trained, here)):
        return f"{both}: another model ({shapes})", True
    if trained.types() != here.types():
        return (f"{both}: the same tensor shapes stored as {here.main_type()} where the adapter's base was "
                f"{trained.main_type()}, a requantized copy of that base? The adapter is applied; its effect "
                f"differs a little from the one it was trained for"), False
    if trained.sha256 != here.sha256:
        return (f"{both}: the same tensor shapes and types with other weights (another finetune of that "
                f"model?); the adapter is applied, but it was not trained for these weights"), False
    return "", False
