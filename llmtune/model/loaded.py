"""A GGUF model ready for graphs: hyper-parameters, float32 weights, the architecture's builder."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.arch import get_arch
from llmtune.graph.layers import Batch
from llmtune.gguf.file import GGUFFile, load_gguf
from llmtune.model.hparams import HParams


@dataclass
class Model:
    path: Path
    gguf: GGUFFile
    hp: HParams
    weights: dict[str, np.ndarray]  # float32, numpy shape, in the architecture's tensor order
    _tokenizer: object = field(default=None, repr=False)

    @property
    def arch(self):
        return get_arch(self.hp.arch)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from llmtune.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    def n_params(self) -> int:
        return sum(w.size for w in self.weights.values())

    def select(self, pattern: str | None) -> list[str]:
        """Tensor names matched by a regex (re.search); all tensors when pattern is None."""
        if pattern is None:
            return list(self.weights)
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise LlmtuneError(f"--params: invalid regular expression {pattern!r} ({exc})") from None
        names = [n for n in self.weights if rx.search(n)]
        if not names:
            raise LlmtuneError(f"--params: {pattern!r} matches no tensor of {self.path.name}")
        return names

    def build(self, n_seq: int, n_tok: int, *, logits_start: int = 0, trainable=()):
        """Forward graph for n_seq x n_tok tokens -> (batch inputs, weight nodes by name, logits)."""
        trainable = set(trainable)
        nodes = {name: ops.param(w.shape, name=name, requires_grad=name in trainable) for name, w in self.weights.items()}
        batch = Batch.make(n_seq, n_tok)
        logits = self.arch.build(self.hp, nodes, batch, logits_start)
        return batch, nodes, logits


def load_model(path) -> Model:
    gf = load_gguf(path)
    hp = HParams.from_gguf(gf)
    expected = get_arch(hp.arch).tensor_shapes(hp)
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        info = gf.tensors.get(name)
        if info is None:
            raise LlmtuneError(f"{gf.path}: missing tensor {name}")
        if tuple(info.shape) != tuple(shape):
            raise LlmtuneError(f"{gf.path}: tensor {name} has shape {info.shape}, expected {shape}")
        weights[name] = gf.tensor(name)  # F32: a read-only view of the memory map, no second copy
    if hp.n_vocab != weights["token_embd.weight"].shape[0]:
        raise LlmtuneError(f"{gf.path}: vocab size {hp.n_vocab} does not match token_embd rows")
    return Model(Path(path), gf, hp, weights)
