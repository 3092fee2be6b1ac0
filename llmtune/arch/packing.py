"""Packed windows: several training examples in one window, each attending only to itself.

A packed window of n_tok tokens holds examples back to back (then padding). As TRL's
padding_free (DataCollatorWithFlattening and the attention kernels' position_ids / cu_seqlens),
every example sees only itself and its positions restart at 0, so its loss and gradients are the
ones it has alone in a window of its own:

- positions are given per token at run time, pos [n_seq, n_tok] (rope and learned position
  embeddings read them);
- attention is block-diagonal causal: query i of a window sees key j <= i of the same segment,
  through a run-time mask [n_seq, n_tok, n_tok] of 0 / -inf (ops.softmax_masked, the shared-prefix
  passes' op: llama.cpp's KQ mask); on sliding-window layers also only keys less than the window
  back (a second mask);
- padding is a segment of its own (it sees only padding; its targets carry no loss).

The attention is the plain composition (arch/context.py masked_attention) at every length, so
past PLAIN_ATTENTION_MAX_T its [n_tok, n_tok] scores cost what blockwise attention would not.
"""

from __future__ import annotations

import numpy as np

from llmtune.arch.context import masked_attention
from llmtune.arch.hparams import HParams
from llmtune.arch.prefix import _additive
from llmtune.graph import ops
from llmtune.graph.node import Node


class Packing:
    """The graph side: the run-time masks and the attention of packed windows."""

    def __init__(self, n_seq: int, n_tok: int, swa: bool = False):
        shape = (n_seq, n_tok, n_tok)
        self.mask = ops.input(shape, name="pack_mask")
        self.mask_swa = ops.input(shape, name="pack_mask_swa") if swa else None

    def attention(self, q: Node, k: Node, v: Node, kq_scale: float, softcap: float = 0.0, window: int = 0) -> Node:
        """q [B, T, H, d], k/v [B, T, Hkv, d] -> [B, T, H, d], each segment attending to itself."""
        return masked_attention(q, k, v, kq_scale, self.mask_swa if window else self.mask, softcap)


def segment_positions(segments: np.ndarray) -> np.ndarray:
    """Each token's position within its segment: segments int [n_seq, n_tok] of non-decreasing
    segment numbers per window -> int32 [n_seq, n_tok] restarting at 0 where a segment starts."""
    seg = np.asarray(segments)
    idx = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    starts = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return (idx - first).astype(np.int32)


def packing_inputs(hp: HParams, segments: np.ndarray) -> dict[str, np.ndarray]:
    """The run-time inputs of packed windows besides the tokens: positions and masks."""
    seg = np.asarray(segments)
    pos = segment_positions(seg)
    i = np.arange(seg.shape[1])
    visible = (seg[:, :, None] == seg[:, None, :]) & (i[None, None, :] <= i[None, :, None])
    return _feed(hp, pos, visible)


def pair_inputs(hp: HParams, parts: np.ndarray) -> dict[str, np.ndarray]:
    """The run-time inputs of preference pairs laid out one per window (train/preference.py):
    parts int [n_seq, n_tok] of 0 (the prompt less its last token: the trunk), 1 and 2 (the chosen
    and rejected branches, each starting with the prompt's last token), 3 (padding). A branch sees
    the trunk and itself, causally, at the positions it has after the trunk alone; the trunk and
    the padding see themselves. Each completion's logits are then those of prompt + completion in a
    window of its own, with the prompt computed once (arch/prefix.py's layout, within a window)."""
    parts = np.asarray(parts)
    within = segment_positions(parts)  # parts are non-decreasing along a window
    branch = (parts == 1) | (parts == 2)
    trunk_len = (parts == 0).sum(axis=1, keepdims=True)
    pos = (within + np.where(branch, trunk_len, 0)).astype(np.int32)
    i = np.arange(parts.shape[1])
    causal = i[None, None, :] <= i[None, :, None]
    sees = (parts[:, :, None] == parts[:, None, :]) | (branch[:, :, None] & (parts[:, None, :] == 0))
    return _feed(hp, pos, causal & sees)


def _feed(hp: HParams, pos: np.ndarray, visible: np.ndarray) -> dict[str, np.ndarray]:
    """Positions and additive masks (and, on sliding-window layers, the keys within the window)."""
    feed = {"pos": pos, "pack_mask": _additive(visible)}
    if hp.has_swa:
        feed["pack_mask_swa"] = _additive(visible & (pos[:, :, None] - pos[:, None, :] < hp.sliding_window))
    return feed

