"""An adapter in memory: its pairs (A, B) by base tensor, alpha and scale, what its file held, and
what the variants add (DoRA's magnitudes, PiSSA's initial pairs); the change it makes to a base
tensor, as llama.cpp computes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from gguf import GGMLQuantizationType as QT

from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue

A, B = "lora_a", "lora_b"
MAGNITUDE = "lora_magnitude"  # DoRA's per-row magnitude (graph/trainer key only: no llama.cpp file holds one)
EMBD = "token_embd.weight"  # the one target applied by row lookup (A and B flipped)
# attention q/k/v/o and the FFN matrices, fused attn_qkv / ffn_up (gate+up) included
DEFAULT_TARGETS = r"\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down))\.weight$"
_SKIPPED_SUFFIX = "_norm.weight"  # llama.cpp: "TODO: add support for norm vector"


def rslora_alpha(alpha: float, rank: int) -> float:
    """The file alpha of an rsLoRA adapter (PEFT's use_rslora: scale alpha / sqrt(r)): alpha * sqrt(r)
    in float32, so llama.cpp's file alpha / r is that scale."""
    return float(np.float32(alpha) * np.sqrt(np.float32(rank)))


def tensor_key(base: str, part: str, index: int = 0) -> str:
    """Graph/trainer name of adapter `index`'s A or B for base tensor `base`: the file's own name
    ("blk.0.attn_q.weight.lora_a") for the first adapter, "...lora_a#1" for the next ones."""
    return f"{base}.{part}" if index == 0 else f"{base}.{part}#{index}"


@dataclass
class LoraPair:
    a: np.ndarray  # float32 [r, n_in] (token_embd: [n_vocab, r])
    b: np.ndarray  # float32 [n_out, r] (token_embd: [n_embd, r])

    @property
    def rank(self) -> int:
        return int(self.b.shape[-1])  # llama.cpp: b->ne[0]


@dataclass
class LoraAdapter:
    """One LoRA adapter: pairs by base tensor name (in the order they are written), alpha, the
    user's scale, and what a rewrite keeps of the file it came from."""

    arch: str
    alpha: float
    pairs: dict[str, LoraPair]
    scale: float = 1.0  # --lora-scale
    path: Optional[Path] = None
    meta: dict[str, MetaValue] = field(default_factory=dict)  # the file's metadata, in order
    types: dict[str, QT] = field(default_factory=dict)  # stored type per tensor name (default F32)
    order: list[str] = field(default_factory=list)  # the file's tensor names in order (extras included)
    extra: dict[str, tuple[np.ndarray, QT]] = field(default_factory=dict)  # skipped tensors, kept verbatim
    magnitudes: dict[str, np.ndarray] = field(default_factory=dict)  # DoRA: float32 [n_out] per pair
    initial: dict[str, LoraPair] = field(default_factory=dict)  # PiSSA: A0, B0 (taken out of the base)
    # the variant (provenance.py's llmtune.lora.* keys): how A and B started (kaiming, gaussian,
    # pissa; "" unknown: another tool's file), and whether alpha holds alpha * sqrt(r) (rsLoRA)
    init: str = ""
    rslora: bool = False

    @property
    def ranks(self) -> set[int]:
        return {p.rank for p in self.pairs.values()}

    def weight_scale(self, name: str) -> float:
        """llama_adapter_lora_weight::get_scale, in float32 as llama.cpp computes it."""
        user, alpha = np.float32(self.scale), np.float32(self.alpha)
        if not alpha:
            return float(user)
        return float(user * alpha / np.float32(self.pairs[name].rank))

    def delta(self, name: str) -> np.ndarray:
        """The change this adapter makes to base tensor `name` (float32, the base's numpy shape),
        as llama-export-lora computes it: scale * (B A), or scale * (A B^T) for token_embd."""
        p = self.pairs[name]
        d = p.a @ p.b.T if name == EMBD else p.b @ p.a
        return d * np.float32(self.weight_scale(name))

    def n_params(self) -> int:
        return sum(p.a.size + p.b.size for p in self.pairs.values()) + sum(m.size for m in self.magnitudes.values())

    def tensors(self, index: int = 0) -> dict[str, np.ndarray]:
        """Graph tensors by trainer key (tensor_key), A then B (then DoRA's magnitude) per pair."""
        out = {}
        for name, p in self.pairs.items():
            out[tensor_key(name, A, index)] = p.a
            out[tensor_key(name, B, index)] = p.b
            if name in self.magnitudes:
                out[tensor_key(name, MAGNITUDE, index)] = self.magnitudes[name]
        return out

    def with_tensors(self, values: dict[str, np.ndarray]) -> "LoraAdapter":
        """A copy whose A/B (and magnitudes) come from `values` (keys as `tensors()`, e.g. the trainer's result)."""
        f32 = lambda n, part: np.asarray(values[tensor_key(n, part)], np.float32)  # noqa: E731
        pairs = {n: LoraPair(f32(n, A), f32(n, B)) for n in self.pairs}
        return dataclasses.replace(self, pairs=pairs, meta=dict(self.meta),
                                   magnitudes={n: f32(n, MAGNITUDE) for n in self.magnitudes})

    def dora_merged(self, name: str, base) -> np.ndarray:
        """DoRA's merged matrix m * (W + s B A) / ||W + s B A||_row (float32; PEFT's
        DoraLinearLayer merge), `base` the W the adapter was trained on."""
        w, norm = self.dora_weight(name, base)
        return (w * (self.magnitudes[name][:, None] / norm[:, None])).astype(np.float32)

    def dora_weight(self, name: str, base) -> tuple[np.ndarray, np.ndarray]:
        """W + s B A (float32) and its row norms (float64): what DoRA's magnitude divides."""
        w = np.asarray(base, np.float32) + self.delta(name)
        return w, np.linalg.norm(w.astype(np.float64), axis=1)

    def as_plain(self) -> "LoraAdapter":
        """The adapter as llama.cpp applies it to the original base: itself, or for PiSSA the
        rank-2r pairs [A; A0], [B, -B0] with alpha doubled (the same scale), so the change is
        s (B A - B0 A0) (PEFT's conversion at save_pretrained)."""
        if self.magnitudes:
            raise LlmtuneError("a DoRA adapter has no llama.cpp form; write the merged model (finetune "
                               "does with --dora)")
        if not self.initial:
            return self
        pairs = {n: LoraPair(np.concatenate([p.a, self.initial[n].a]),
                             np.concatenate([p.b, -self.initial[n].b], axis=1))
                 for n, p in self.pairs.items()}
        meta = dict(self.meta)
        return dataclasses.replace(self, alpha=2 * self.alpha, pairs=pairs, meta=meta, initial={})
