"""Which base tensors take an adapter: found by building the family's graph once with a recorder
in place of the adapter terms, and --lora-targets / --lora-rank checked against them."""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from llmtune.arch.context import Batch, BuildContext
from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.model.adapter.core import DEFAULT_TARGETS, EMBD

# annotations name model/loaded.py's Model, which imports this package (no import here: no circle)


class _Recorder:
    """A stand-in for LoraGraph that records which weights the family's graph applies where."""

    def __init__(self):
        self.mm: list[str] = []
        self.rows: list[str] = []

    def apply(self, x, y, name):
        self.mm.append(name)
        return y

    def apply_rows(self, tokens, x, name):
        self.rows.append(name)
        return x


def adaptable(model: "Model") -> dict[str, str]:
    """Base tensors an adapter can change -> "mm" (applied by BuildContext.mm) or "rows"
    (token_embd's lookup), found by building the family's graph once. token_embd is left out
    when it is also the output matrix (tied): llama.cpp would apply the flipped pair there too."""
    rec = _Recorder()
    nodes = {n: ops.param(w.shape, name=n, requires_grad=False) for n, w in model.weights.items()}
    model.family.build(BuildContext(model.hp, nodes, Batch.make(1, 4), lora=rec))
    out = {n: "mm" for n in rec.mm if n in model.weights and model.weights[n].ndim == 2}
    if "output.weight" in model.weights:
        out.update({n: "rows" for n in rec.rows if n in model.weights})
    return {n: out[n] for n in model.weights if n in out}  # the file's order


def refusal(model: "Model", name: str, ok: dict[str, str]) -> str:
    """Why base tensor `name` takes no adapter in `model` ('' when it takes one); `ok`: adaptable(model)."""
    if name not in model.weights:
        return f"which {model.path.name} does not have (adapter for another model?)"
    if name not in ok:
        return f"which takes no adapter in {model.path.name}{_tied_note(model, name)}"
    return ""


def pair_fits(name: str, w_shape, a: np.ndarray, b: np.ndarray) -> bool:
    """A pair in llmtune's layout (core.LoraPair) fits base tensor `name` of numpy shape `w_shape`:
    A [r, n_in] and B [n_out, r] (token_embd: A [n_vocab, r], B [n_embd, r])."""
    n_out, n_in = w_shape
    if a.ndim != 2 or b.ndim != 2:
        return False
    if name == EMBD:
        return a.shape[0] == n_out and b.shape[0] == n_in and a.shape[1] == b.shape[1]
    return a.shape[1] == n_in and b.shape[0] == n_out and a.shape[0] == b.shape[1]


def _tied_note(model: "Model", name: str) -> str:
    if name == EMBD and "output.weight" not in model.weights:
        return " (it is also this model's output matrix, tied; llama.cpp cannot apply an adapter to it)"
    return ""


def select_targets(model: "Model", pattern: Optional[str], rank: int) -> list[str]:
    """Base tensors matched by --lora-targets (re.search over GGUF names; default: attention and
    FFN matrices) that take an adapter, each checked to allow `rank`."""
    if rank < 1:
        raise LlmtuneError(f"--lora-rank: must be at least 1, got {rank}")
    try:
        rx = re.compile(pattern or DEFAULT_TARGETS)
    except re.error as exc:
        raise LlmtuneError(f"--lora-targets: invalid regular expression {pattern!r} ({exc})") from None
    ok = adaptable(model)
    matched = [n for n in model.weights if rx.search(n)]
    names = [n for n in matched if n in ok]
    if not names:
        if pattern is None:
            raise LlmtuneError(f"{model.path}: no attention or FFN matrix to adapt; choose tensors with --lora-targets")
        refused = [n for n in matched if model.weights[n].ndim == 2]
        why = f" ({refused[0]} takes no adapter{_tied_note(model, refused[0])})" if refused else ""
        raise LlmtuneError(f"--lora-targets: {pattern!r} matches no matrix of {model.path.name} that "
                           f"takes an adapter{why}")
    for n in names:
        limit = min(model.weights[n].shape)
        if rank > limit:
            rows, cols = model.weights[n].shape
            raise LlmtuneError(f"--lora-rank: {rank} is larger than {n} allows ({rows} x {cols}: at most {limit})")
    return names
