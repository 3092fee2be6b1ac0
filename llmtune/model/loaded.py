"""A GGUF model ready for graphs: its family, hyper-parameters and float32 weights."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmtune.arch import check_tensors, get_family, read_hparams
from llmtune.arch.context import Batch, BuildContext
from llmtune.arch.hparams import HParams
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import GGUFFile, load_gguf
from llmtune.graph import ops


@dataclass
class Model:
    path: Path
    gguf: GGUFFile
    hp: HParams
    weights: dict[str, np.ndarray]  # float32, numpy shape, in the family's tensor order
    _tokenizer: object = field(default=None, repr=False)

    @property
    def family(self):
        return get_family(self.hp.arch)

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
        logits = self.family.build(BuildContext(self.hp, nodes, batch, logits_start))
        return batch, nodes, logits


def hparams_of(gf: GGUFFile) -> HParams:
    """A GGUF file's hyper-parameters, read by its family."""
    return read_hparams(gf.metadata, set(gf.tensors), str(gf.path))


def check_model(gf: GGUFFile) -> tuple[HParams, list]:
    """What load_model accepts, without reading tensor data: (hparams, the tensors present)."""
    hp = hparams_of(gf)
    present = check_tensors(hp, {name: info.shape for name, info in gf.tensors.items()}, str(gf.path))
    if hp.n_vocab != gf.tensors["token_embd.weight"].shape[0]:
        raise LlmtuneError(f"{gf.path}: vocab size {hp.n_vocab} does not match token_embd rows")
    return hp, present


def load_model(path) -> Model:
    gf = load_gguf(path)
    hp, present = check_model(gf)
    # F32 tensors: read-only views of the memory map, no second copy of the file in RAM
    weights = {spec.name: gf.tensor(spec.name) for spec in present}
    return Model(Path(path), gf, hp, weights)
