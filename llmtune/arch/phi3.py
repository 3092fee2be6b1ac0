"""phi3 (llama.cpp's LLM_ARCH_PHI3, src/models/phi3.cpp; Phi-3, Phi-3.5, Phi-4-mini): llama's
pre-norm RMSNorm decoder with fused projections, NEOX RoPE and optional LongRoPE factors.

- attn_qkv holds [q (n_head * D) | k | v (n_head_kv * D each)] rows; ffn_up holds the gate and
  the up projection (2 * n_ff rows): down(silu(first half) * second half).
- RoPE (NEOX, halves) covers the first rope.dimension_count dims of a head; the rest pass through.
- rope_factors_long / rope_factors_short (n_rot / 2 each) divide the rotary frequencies: the long
  ones when the context is longer than rope.scaling.original_context_length, as llama.cpp's
  get_rope_factors chooses; rope.scaling.attn_factor scales the rotated dims.
- phi3.attention.sliding_window is written by the converter but llama.cpp disables it: ignored.
"""

from __future__ import annotations

from gguf import GGUFValueType as VT

from llmtune.arch import register
from llmtune.arch.context import BuildContext
from llmtune.arch.family import Family, TensorSpec, output_tensors
from llmtune.arch.hf_names import HFNames
from llmtune.errors import LlmtuneError


@register
class Phi3(Family):
    name = "phi3"
    # transformers' names (gguf-py's tensor_mapping): the fused matrices are HF's own fused ones
    hf = HFNames("Phi3ForCausalLM", "phi3", {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
        "blk.{bid}.attn_qkv": "model.layers.{bid}.self_attn.qkv_proj",
        "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
        "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
        "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.gate_up_proj",
        "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
    })
    traits = {"rope_mode": "neox", "norm_kind": "rms", "activation": "silu", "ffn_gated": True}
    config_keys = {"n_ctx_orig": "int", "rope_attn_factor": "float"}

    def read_hparams(self, keys, n_vocab_default, tensor_names):
        hp = super().read_hparams(keys, n_vocab_default, tensor_names)
        hp.n_ctx_orig = keys.int("rope.scaling.original_context_length", hp.n_ctx_train)
        hp.rope_attn_factor = keys.float("rope.scaling.attn_factor", 1.0)
        return hp

    def write_hparams(self, hp):
        """The keys convert_hf_to_gguf.py's Phi3MiniModel writes."""
        if hp.head_dim_kq is not None:  # llama.cpp's phi3 has attn_output n_embd x n_embd
            raise LlmtuneError("phi3: head_dim cannot be set (the head size is n_embd / n_head)")
        keys = super().write_hparams(hp)
        del keys["phi3.vocab_size"]
        p = "phi3."
        keys[p + "rope.scaling.original_context_length"] = (int(hp.n_ctx_orig or hp.n_ctx_train), VT.UINT32)
        keys[p + "attention.sliding_window"] = (0, VT.UINT32)
        if hp.rope_attn_factor != 1.0:  # written with the long/short factors (LongRoPE models)
            keys[p + "rope.scaling.attn_factor"] = (float(hp.rope_attn_factor), VT.FLOAT32)
        return keys

    def tensors(self, hp):
        specs = output_tensors(hp)
        specs += [
            TensorSpec("rope_factors_long.weight", (hp.n_rot // 2,), "factors", optional=True),
            TensorSpec("rope_factors_short.weight", (hp.n_rot // 2,), "factors", optional=True),
        ]
        n_qkv = hp.n_embd_q + 2 * hp.n_embd_kv
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            specs += [
                TensorSpec(p + "attn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "attn_qkv.weight", (n_qkv, hp.n_embd)),
                TensorSpec(p + "attn_qkv.bias", (n_qkv,), "zeros", optional=True),
                # legacy files: separate biases beside the fused matrix (used when all three exist)
                TensorSpec(p + "attn_q.bias", (hp.n_embd_q,), "zeros", optional=True),
                TensorSpec(p + "attn_k.bias", (hp.n_embd_kv,), "zeros", optional=True),
                TensorSpec(p + "attn_v.bias", (hp.n_embd_kv,), "zeros", optional=True),
                TensorSpec(p + "attn_output.weight", (hp.n_embd, hp.n_embd_q), "residual"),
                TensorSpec(p + "ffn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "ffn_up.weight", (2 * hp.n_ff, hp.n_embd)),  # [gate | up]
                TensorSpec(p + "ffn_down.weight", (hp.n_embd, hp.n_ff), "residual"),
            ]
        return specs

    def build(self, ctx: BuildContext):
        # llama's stack: ctx.qkv splits the fused qkv, ctx.rope the partial NEOX rope, ctx.ffn the fused gate+up
        return ctx.output(ctx.layers(ctx.inp_embd()))
