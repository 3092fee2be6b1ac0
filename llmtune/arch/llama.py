"""llama: pre-norm decoder, RMSNorm, RoPE (adjacent pairs), grouped-query attention, SwiGLU FFN."""

from __future__ import annotations

from llmtune.graph import layers as L
from llmtune.graph.node import Node


def tensor_shapes(hp) -> dict[str, tuple[int, ...]]:
    """Every tensor of the architecture with its numpy shape (GGUF ne reversed)."""
    shapes = {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output_norm.weight": (hp.n_embd,)}
    if not hp.tied_output:
        shapes["output.weight"] = (hp.n_vocab, hp.n_embd)
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (hp.n_embd,),
            p + "attn_q.weight": (hp.n_head * hp.head_dim, hp.n_embd),
            p + "attn_k.weight": (hp.n_embd_kv, hp.n_embd),
            p + "attn_v.weight": (hp.n_embd_kv, hp.n_embd),
            p + "attn_output.weight": (hp.n_embd, hp.n_head * hp.head_dim),
            p + "ffn_norm.weight": (hp.n_embd,),
            p + "ffn_gate.weight": (hp.n_ff, hp.n_embd),
            p + "ffn_up.weight": (hp.n_ff, hp.n_embd),
            p + "ffn_down.weight": (hp.n_embd, hp.n_ff),
        })
    return shapes


def build(hp, w: dict[str, Node], batch: L.Batch, logits_start: int = 0) -> Node:
    """Logits [n_seq * (n_tok - logits_start), n_vocab] for positions logits_start.. of each sequence."""
    spec = L.AttnSpec(hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_mode)
    x = L.build_inp_embd(w["token_embd.weight"], batch)
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        h = L.build_norm(x, w[p + "attn_norm.weight"], hp.norm_eps)
        h = L.build_attn(h, w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"],
                         w[p + "attn_output.weight"], spec, batch)
        if i == hp.n_layer - 1:  # rows that produce no logits need no more work
            h, x = L.select_positions(h, batch, logits_start), L.select_positions(x, batch, logits_start)
        x = L.ops.add(x, h)
        h = L.build_norm(x, w[p + "ffn_norm.weight"], hp.norm_eps)
        x = L.ops.add(x, L.build_ffn_swiglu(h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"]))
    out_w = w.get("output.weight", w["token_embd.weight"])
    return L.build_output(x, w["output_norm.weight"], out_w, hp.norm_eps)
