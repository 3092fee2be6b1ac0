"""The KV cache of a forward graph (llama.cpp's llama_kv_cache, one sequence stream per batch row).

Each layer owns two persistent buffers, K [n_seq, n_head_kv, n_ctx, head_dim] and V likewise,
bound to the graph as frozen leaves. A cached graph processes n_tok new tokens at run-time
positions `pos` (the batch's position input): attention writes their k/v rows into the buffers
at those positions (ops.cache_write) and attends over the first `n_kv` cache positions, masking
every key after the query's position (softmax_causal with run-time positions). So one compiled
program serves every decode step whose positions stay below n_kv: the generator compiles one per
(n_tok, n_kv bucket), never one per step.

A cache of n_seq > 1 sequences (batched decode, eval/generate.py BatchGenerator) takes positions
per sequence pos [n_seq, n_tok]: sequence b writes and reads its own buffer row b at its own
positions (cache_write and softmax_causal read pos[b]), so sequences of different lengths step
together in one program.

Rows past a query's position may hold stale values (a longer earlier sequence, or the padding of
a prefill): they are always masked, and are overwritten before any later query can see them, since
position p is written by the step that processes position p.

This lives in the architecture machinery (BuildContext.attn_out calls `attention`), so every
family gets the cache without code of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmtune.arch.hparams import HParams
from llmtune.graph import ops
from llmtune.graph.node import Node


@dataclass(frozen=True)
class CacheShape:
    """The buffers of a cache: n_seq sequences of up to n_ctx positions."""

    n_layer: int
    n_seq: int
    n_head_kv: int
    n_ctx: int
    head_dim: int

    @classmethod
    def of(cls, hp: HParams, n_ctx: int, n_seq: int = 1) -> "CacheShape":
        return cls(hp.n_layer, n_seq, hp.n_head_kv, n_ctx, hp.head_dim)

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.n_seq, self.n_head_kv, self.n_ctx, self.head_dim)

    def names(self) -> list[str]:
        """Leaf names of every buffer: cache.k.<il>, cache.v.<il>."""
        return [f"cache.{kv}.{il}" for il in range(self.n_layer) for kv in ("k", "v")]

    def nbytes(self, itemsize: int = 4) -> int:
        return 2 * self.n_layer * int(np.prod(self.layer_shape)) * itemsize

    def allocate(self, backend) -> dict[str, object]:
        """Zeroed backend buffers by leaf name (allocated once per generation session)."""
        return {name: backend.zeros(self.layer_shape) for name in self.names()}


class KVCache:
    """The cache as one graph sees it: leaf nodes for the buffers, and the number of positions
    attention reads (n_kv <= n_ctx: the positions of the run must stay below it)."""

    def __init__(self, shape: CacheShape, n_kv: int):
        if not 0 < n_kv <= shape.n_ctx:
            raise ValueError(f"KVCache: n_kv {n_kv} outside 1..{shape.n_ctx}")
        self.shape, self.n_kv = shape, n_kv
        self.nodes = {name: ops.param(shape.layer_shape, name=name, requires_grad=False) for name in shape.names()}

    @property
    def n_ctx(self) -> int:
        return self.shape.n_ctx

    def attention(self, q: Node, k: Node, v: Node, il: int, pos: Node, kq_scale: float, softcap: float = 0.0,
                  window: int = 0) -> Node:
        """causal_attention for new tokens at positions pos ([T], or [B, T] per sequence): q [B, T, H, d],
        k/v [B, T, Hkv, d] -> [B, T, H, d], reading the cache's first n_kv positions after writing k/v into it."""
        B, T, H, d = q.shape
        Hkv = k.shape[2]
        group = H // Hkv
        kc = ops.cache_write(self.nodes[f"cache.k.{il}"], k, pos)  # [B, Hkv, n_ctx, d], with the new rows
        vc = ops.cache_write(self.nodes[f"cache.v.{il}"], v, pos)
        kt = kc if self.n_kv == self.n_ctx else ops.slice_axis(kc, 2, 0, self.n_kv)
        vt = vc if self.n_kv == self.n_ctx else ops.slice_axis(vc, 2, 0, self.n_kv)
        # one new token (a decode step): [B, 1, H, d] is already [B, Hkv, group, d] in memory, no copy
        qg = ops.reshape(q, (B, Hkv, group, d)) if T == 1 else ops.reshape(ops.permute(q, (0, 2, 1, 3)),
                                                                           (B, Hkv, group * T, d))
        scores = ops.matmul(qg, kt, tb=True)  # [B, Hkv, group*T, n_kv]
        if softcap:
            scores, kq_scale = ops.softcap(ops.scale(scores, kq_scale), softcap), 1.0
        probs = ops.softmax_causal(scores, kq_scale, n_kv=self.n_kv, n_q=T, window=window, pos=pos)
        out = ops.matmul(probs, vt)  # [B, Hkv, group*T, d]
        if T == 1:
            return ops.reshape(out, (B, 1, H, d))
        return ops.permute(ops.reshape(out, (B, H, T, d)), (0, 2, 1, 3))
