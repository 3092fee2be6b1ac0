"""The adapter terms of a graph (llama.cpp's build_lora_mm, PEFT's DoRA forward) that
BuildContext.mm and the embedding lookup add, and the dropout masks a training pass feeds them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmtune.graph import ops
from llmtune.model.adapter.core import MAGNITUDE, A, B, LoraAdapter, tensor_key


@dataclass(frozen=True)
class LoraTerm:
    a: object  # Node
    b: object  # Node
    scale: float
    key: str  # names the term's dropout mask input ("<A key>.dropout")
    magnitude: object = None  # DoRA: Node [n_out]
    weight: object = None  # DoRA: the base matrix's Node


class LoraGraph:
    """The adapter terms of one graph, by base tensor name; BuildContext.mm calls `apply`, the
    embedding lookup `apply_rows`. dropout > 0 (training only, as PEFT): the input of each term is
    multiplied by a mask fed as the graph input "<A key>.dropout" (see dropout_masks)."""

    def __init__(self, terms: dict[str, list[LoraTerm]], dropout: float = 0.0, round_x: bool = True):
        self.terms, self.dropout, self.round_x = terms, float(dropout), round_x  # round_x: as BuildContext's

    @classmethod
    def of(cls, adapters: list[LoraAdapter], nodes: dict, dropout: float = 0.0, round_x: bool = True) -> "LoraGraph":
        terms: dict[str, list[LoraTerm]] = {}
        for i, adapter in enumerate(adapters):
            for name in adapter.pairs:
                key = tensor_key(name, A, i)
                dora = name in adapter.magnitudes
                terms.setdefault(name, []).append(
                    LoraTerm(nodes[key], nodes[tensor_key(name, B, i)], adapter.weight_scale(name), key,
                             nodes[tensor_key(name, MAGNITUDE, i)] if dora else None, nodes[name] if dora else None))
        return cls(terms, dropout, round_x)

    def apply(self, x, y, name: str):
        """y + sum of scale * (x A^T) B^T (llama.cpp adds each to the base product in turn).
        Evaluation scales the product as llama.cpp's build_lora_mm does, after B; a training graph
        (round_x False) scales the rank-r product x A^T instead, n_out / r times less work forward
        and backward, the same value up to float32 rounding, as one op (ops.lora) where the term is
        plain LoRA."""
        for t in self.terms.get(name, ()):
            xin = x
            if self.dropout > 0:
                xin = ops.mul(x, ops.input(x.shape, name=f"{t.key}.dropout"))
            if not self.round_x and t.magnitude is None:
                y = ops.lora(y, xin, t.a, t.b, t.scale)
                continue
            if self.round_x:
                term = ops.scale(ops.linear(ops.linear(xin, t.a), t.b), t.scale)
            else:
                term = ops.linear(ops.scale(ops.linear(xin, t.a), t.scale), t.b)
            y = ops.add(y, term) if t.magnitude is None else self._dora(t, xin, y, term)
        return y

    def _dora(self, t: LoraTerm, xin, y, term):
        """PEFT's DoraLinearLayer.forward: with g = m / ||W + s B A||_row (norm detached), y + (g - 1)
        base(xin) + g s lora(xin); without dropout xin is x and base(x) is y: g (y + s lora(x))."""
        weight = ops.add(t.weight, ops.scale(ops.matmul(t.b, t.a), t.scale))
        g = ops.mul(t.magnitude, ops.row_rnorm(weight, detach=True))
        if self.dropout <= 0:
            return ops.mul(ops.add(y, term), g)
        base = ops.linear(xin, t.weight, self.round_x)
        return ops.add(y, ops.add(ops.mul(base, ops.add(g, ops.const(-1.0, g.shape))), ops.mul(term, g)))

    def apply_rows(self, tokens, x, name: str):
        """Embedding rows x = W[tokens] plus scale * A[tokens] B^T (no dropout: PEFT's Embedding)."""
        for t in self.terms.get(name, ()):
            y = ops.linear(ops.get_rows(t.a, tokens), t.b)
            x = ops.add(x, ops.scale(y, t.scale))
        return x


def dropout_masks(shapes: dict[str, tuple], p: float, seed: int, step: int, seqs: range) -> dict[str, np.ndarray]:
    """Masks for the dropout inputs of one micro-batch holding sequences `seqs` (indices within the
    optimizer step): keep with probability 1 - p, scaled by 1 / (1 - p) (torch.nn.Dropout). Each
    sequence draws from its own generator (seed, step, sequence), so the masks, and the result, do
    not depend on how a step is cut into micro-batches."""
    names = sorted(shapes)
    n_seq = len(seqs)
    keep = np.float32(1.0 / (1.0 - p))
    parts: dict[str, list] = {n: [] for n in names}
    for s in seqs:
        rng = np.random.default_rng([seed, step, s])
        for n in names:
            rows, cols = shapes[n]
            parts[n].append((rng.random((rows // n_seq, cols), dtype=np.float32) >= p) * keep)
    return {n: np.concatenate(parts[n]) for n in names}
