"""Reusable layer builders (the llm_build_* helpers of llama.cpp): an architecture file is a
short composition of these. Activations are 2-D [n_seq * n_tok, n_embd] between layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtune.graph import ops
from llmtune.graph.node import Node


@dataclass(frozen=True)
class Batch:
    """Symbolic inputs of one forward pass: n_seq sequences of n_tok tokens."""

    tokens: Node  # [n_seq, n_tok] int32
    pos: Node  # [n_tok] int32 positions (shared by all sequences)

    @property
    def n_seq(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_tok(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def make(cls, n_seq: int, n_tok: int) -> "Batch":
        return cls(ops.input((n_seq, n_tok), "i32", name="tokens"), ops.input((n_tok,), "i32", name="pos"))


def build_inp_embd(tok_embd: Node, batch: Batch) -> Node:
    x = ops.get_rows(tok_embd, batch.tokens)  # [n_seq, n_tok, n_embd]
    return ops.reshape(x, (batch.n_seq * batch.n_tok, tok_embd.shape[1]))


def build_norm(x: Node, weight: Node | None, eps: float) -> Node:
    """RMSNorm with an optional elementwise weight."""
    y = ops.rms_norm(x, eps)
    return y if weight is None else ops.mul(y, weight)


@dataclass(frozen=True)
class AttnSpec:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_mode: str = "norm"


def build_qkv_rope(x: Node, wq: Node, wk: Node, wv: Node, spec: AttnSpec, batch: Batch):
    """Project to q, k, v and rotate q, k. Returns q, k, v as [n_seq, n_tok, heads, head_dim]."""
    B, T, d = batch.n_seq, batch.n_tok, spec.head_dim

    def heads(w, n):
        return ops.reshape(ops.linear(x, w), (B, T, n, d))

    def rot(t):
        return ops.rope(t, batch.pos, spec.n_rot, spec.rope_base, spec.rope_freq_scale, spec.rope_mode)

    return rot(heads(wq, spec.n_head)), rot(heads(wk, spec.n_head_kv)), heads(wv, spec.n_head_kv)


def build_attn_core(q: Node, k: Node, v: Node, spec: AttnSpec, batch: Batch) -> Node:
    """Causal scaled-dot-product attention with grouped-query heads -> [n_seq * n_tok, n_head * head_dim].

    The n_head/n_head_kv query heads that share a KV head are stacked along rows, so one
    matmul per KV head serves the whole group and K/V are never copied per query head.
    """
    B, T, d = batch.n_seq, batch.n_tok, spec.head_dim
    group = spec.n_head // spec.n_head_kv
    qg = ops.reshape(ops.permute(q, (0, 2, 1, 3)), (B, spec.n_head_kv, group * T, d))
    # [B, Hkv, T, d], made contiguous: BLAS then runs the batched matmuls (strided stacks fall
    # back to numpy's slow loop), and the copy is small next to the scores
    kt = ops.cont(ops.permute(k, (0, 2, 1, 3)))
    vt = ops.cont(ops.permute(v, (0, 2, 1, 3)))
    scores = ops.matmul(qg, kt, tb=True)  # [B, Hkv, group*T, T]
    probs = ops.softmax_causal(scores, 1.0 / math.sqrt(d), n_kv=T, n_q=T)
    out = ops.matmul(probs, vt)  # [B, Hkv, group*T, d]
    out = ops.permute(ops.reshape(out, (B, spec.n_head, T, d)), (0, 2, 1, 3))
    return ops.reshape(out, (B * T, spec.n_head * d))


def build_attn(x: Node, wq: Node, wk: Node, wv: Node, wo: Node, spec: AttnSpec, batch: Batch) -> Node:
    q, k, v = build_qkv_rope(x, wq, wk, wv, spec, batch)
    return ops.linear(build_attn_core(q, k, v, spec, batch), wo)


def build_ffn_swiglu(x: Node, w_gate: Node, w_up: Node, w_down: Node) -> Node:
    return ops.linear(ops.swiglu(ops.linear(x, w_gate), ops.linear(x, w_up)), w_down)


def select_positions(x: Node, batch: Batch, start: int) -> Node:
    """Keep positions start..n_tok-1 of every sequence (rows of x are [seq, tok])."""
    if start == 0:
        return x
    x3 = ops.reshape(x, (batch.n_seq, batch.n_tok, x.shape[-1]))
    kept = ops.slice_rows(x3, 1, start, batch.n_tok)
    return ops.reshape(kept, (batch.n_seq * (batch.n_tok - start), x.shape[-1]))


def build_output(x: Node, norm_w: Node, out_w: Node, eps: float) -> Node:
    """Final norm and the vocabulary projection -> logits."""
    return ops.linear(build_norm(x, norm_w, eps), out_w)
