"""Shared prefixes: several continuations of one prompt in a forward pass, the prompt computed once.

llama.cpp scores a multiple-choice task by decoding the question once into its KV cache and then
each answer as a sequence that shares those cache cells (perplexity.cpp's multiple_choice_score,
hellaswag_score). This is the same within one forward graph. A pass holds n_trunk prompts (trunks,
each padded to trunk_len tokens) and n_branch continuations (branches, each padded to branch_len),
all as one flat sequence of n_tok = n_trunk * trunk_len + n_branch * branch_len tokens: everything
but attention works token by token, so only attention knows the layout. There,

- each trunk attends causally to itself (ops.flash_attn or the plain composition, as any batch);
- each branch attends to the keys of its trunk (trunk_of[b], gathered) followed by its own,
  under a run-time mask [n_branch, branch_len, trunk_len + branch_len]: the trunk's real tokens
  and its own tokens up to itself (and, on sliding-window layers, only keys within the window).

A branch starts with its trunk's last prompt token, so every logit a task scores comes from a
branch row, and the logits are computed for the branch rows only. Positions are given per token
at run time (a branch of a trunk of n tokens continues at position n), so rope and learned
position embeddings see the positions each sequence would have alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmtune.arch.context import causal_attention, masked_attention
from llmtune.arch.hparams import HParams
from llmtune.graph import ops
from llmtune.graph.node import Node


@dataclass(frozen=True)
class PrefixShape:
    """The static layout of a pass (one compiled program per shape)."""

    n_trunk: int
    trunk_len: int
    n_branch: int
    branch_len: int

    @property
    def n_tok(self) -> int:
        return self.n_trunk * self.trunk_len + self.n_branch * self.branch_len

    @property
    def branch_start(self) -> int:
        """Index of the first branch token in the flat sequence (where the logits start)."""
        return self.n_trunk * self.trunk_len

    @property
    def seq_len(self) -> int:
        """The longest sequence a trunk and one of its branches can form."""
        return self.trunk_len + self.branch_len


class SharedPrefix:
    """The graph side: the layout's run-time inputs (trunk_of, the branch masks) and attention."""

    def __init__(self, shape: PrefixShape, swa: bool = False):
        self.shape = shape
        s = shape
        self.trunk_of = ops.input((s.n_branch,), "i32", name="trunk_of")
        mask_shape = (s.n_branch, s.branch_len, s.trunk_len + s.branch_len)
        self.mask = ops.input(mask_shape, name="branch_mask")
        self.mask_swa = ops.input(mask_shape, name="branch_mask_swa") if swa else None

    def attention(self, q: Node, k: Node, v: Node, kq_scale: float, softcap: float = 0.0, window: int = 0) -> Node:
        """q [1, n_tok, H, d], k/v [1, n_tok, Hkv, d] of the flat sequence -> [1, n_tok, H, d]."""
        s = self.shape
        trunk_out = causal_attention(*(self._trunks(x) for x in (q, k, v)), kq_scale, softcap, window)
        keys = [ops.concat([self._gather(self._trunks(x)), self._branches(x)], axis=1) for x in (k, v)]
        mask = self.mask_swa if window else self.mask
        branch_out = masked_attention(self._branches(q), *keys, kq_scale, mask, softcap)
        H, d = q.shape[2:]
        parts = [ops.reshape(trunk_out, (1, s.branch_start, H, d)),
                 ops.reshape(branch_out, (1, s.n_tok - s.branch_start, H, d))]
        return ops.concat(parts, axis=1)

    def _trunks(self, x: Node) -> Node:
        s = self.shape
        return ops.reshape(ops.slice_axis(x, 1, 0, s.branch_start), (s.n_trunk, s.trunk_len) + x.shape[2:])

    def _branches(self, x: Node) -> Node:
        s = self.shape
        return ops.reshape(ops.slice_axis(x, 1, s.branch_start, s.n_tok), (s.n_branch, s.branch_len) + x.shape[2:])

    def _gather(self, trunks: Node) -> Node:
        """Each branch's trunk [n_branch, trunk_len, heads, d] (rows of the trunks by trunk_of)."""
        flat = ops.reshape(trunks, (trunks.shape[0], -1))
        return ops.reshape(ops.get_rows(flat, self.trunk_of), (self.shape.n_branch,) + trunks.shape[1:])


def prefix_inputs(hp: HParams, shape: PrefixShape, trunk_lens: np.ndarray,
                  trunk_of: np.ndarray) -> dict[str, np.ndarray]:
    """The run-time inputs of a pass besides the tokens: per-token positions, trunk_of and the
    branch masks, for trunks of trunk_lens[t] real tokens and branch b continuing trunk trunk_of[b]
    (its first token at position trunk_lens[trunk_of[b]])."""
    s = shape
    trunk_lens = np.asarray(trunk_lens, dtype=np.int64)
    trunk_of = np.asarray(trunk_of, dtype=np.int64)
    start = trunk_lens[trunk_of]  # position of each branch's first token
    pos = np.concatenate([np.tile(np.arange(s.trunk_len), s.n_trunk),
                          (start[:, None] + np.arange(s.branch_len)).reshape(-1)])
    i = np.arange(s.branch_len)[None, :, None]  # query index within its branch
    j = np.arange(s.trunk_len + s.branch_len)[None, None, :]  # key index: trunk, then own branch
    in_trunk = j < s.trunk_len
    visible = np.where(in_trunk, j < start[:, None, None], j - s.trunk_len <= i)
    feed = {"pos": pos.astype(np.int32), "trunk_of": trunk_of.astype(np.int32),
            "branch_mask": _additive(visible)}
    if hp.has_swa:
        qpos = start[:, None, None] + i
        kpos = np.where(in_trunk, j, start[:, None, None] + j - s.trunk_len)
        feed["branch_mask_swa"] = _additive(visible & (qpos - kpos < hp.sliding_window))
    return feed


def _additive(visible: np.ndarray) -> np.ndarray:
    return np.where(visible, np.float32(0), np.float32(-np.inf))
