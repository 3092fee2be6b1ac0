"""gpt2 (llama.cpp's LLM_ARCH_GPT2, src/models/gpt2.cpp): the original GPT-2 block.

Learned absolute positions (position_embd, context_length rows) added to the token embeddings,
no RoPE; pre-norm LayerNorm with weight and bias; a fused attn_qkv [q | k | v] projection;
a bias on every linear; a sequential GELU (tanh) feed-forward. No grouped-query attention
(there is no head_count_kv key). The output projection is usually tied to token_embd.

In Hugging Face checkpoints (GPT2LMHeadModel) the four matrices are transformers' Conv1D weights,
stored [n_in, n_out]: convert_hf_to_gguf.py's GPT2Model transposes c_attn, c_proj and c_fc (`conv1d`
in the table); the fused c_attn keeps llama.cpp's [q | k | v] order. The attn.bias / attn.masked_bias
buffers older checkpoints hold are causal masks, not weights (not read).
"""

from __future__ import annotations

from gguf import GGUFValueType as VT

from llmtune.arch import register
from llmtune.arch.context import BuildContext
from llmtune.arch.family import Family, TensorSpec, output_tensors
from llmtune.arch.hf_names import HFNames
from llmtune.errors import LlmtuneError
from llmtune.graph import ops

# gguf-py's tensor_mapping for GPT2LMHeadModel (its "transformer." names: what save_pretrained writes; GPT-2's
# own files, saved from GPT2Model, lack the prefix: bare_prefix reads those too)
HF_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "transformer.h.{bid}.ln_1",
    "blk.{bid}.attn_qkv": "transformer.h.{bid}.attn.c_attn",
    "blk.{bid}.attn_output": "transformer.h.{bid}.attn.c_proj",
    "blk.{bid}.ffn_norm": "transformer.h.{bid}.ln_2",
    "blk.{bid}.ffn_up": "transformer.h.{bid}.mlp.c_fc",
    "blk.{bid}.ffn_down": "transformer.h.{bid}.mlp.c_proj",
}

@register
class GPT2(Family):
    name = "gpt2"
    traits = {"rope_mode": None, "norm_kind": "layer", "activation": "gelu", "ffn_gated": False}
    hf = HFNames("GPT2LMHeadModel", "gpt2", HF_NAMES, conv1d=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
                 bare_prefix="transformer.")

    def write_hparams(self, hp):
        """The keys convert_hf_to_gguf.py's GPT2Model writes (no vocab, rope or head_count_kv keys)."""
        if hp.n_head_kv != hp.n_head or hp.head_dim_kq is not None:
            raise LlmtuneError("gpt2: n_head_kv and head_dim cannot be set "
                               "(no grouped-query attention, head size n_embd / n_head)")
        u32 = lambda v: (int(v), VT.UINT32)  # noqa: E731
        keys = {
            "block_count": u32(hp.n_layer),
            "context_length": u32(hp.n_ctx_train),
            "embedding_length": u32(hp.n_embd),
            "feed_forward_length": u32(hp.n_ff),
            "attention.head_count": u32(hp.n_head),
            "attention.layer_norm_epsilon": (float(hp.norm_eps), VT.FLOAT32),
        }
        return {f"gpt2.{k}": v for k, v in keys.items()}

    def tensors(self, hp):
        specs = output_tensors(hp, norm_bias=True)
        specs.insert(1, TensorSpec("position_embd.weight", (hp.n_ctx_train, hp.n_embd)))
        n_qkv = hp.n_embd_q + 2 * hp.n_embd_kv
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            specs += [
                TensorSpec(p + "attn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "attn_norm.bias", (hp.n_embd,), "zeros"),
                TensorSpec(p + "attn_qkv.weight", (n_qkv, hp.n_embd)),
                TensorSpec(p + "attn_qkv.bias", (n_qkv,), "zeros"),
                TensorSpec(p + "attn_output.weight", (hp.n_embd, hp.n_embd_q), "residual"),
                TensorSpec(p + "attn_output.bias", (hp.n_embd,), "zeros"),
                TensorSpec(p + "ffn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "ffn_norm.bias", (hp.n_embd,), "zeros"),
                TensorSpec(p + "ffn_up.weight", (hp.n_ff, hp.n_embd)),
                TensorSpec(p + "ffn_up.bias", (hp.n_ff,), "zeros"),
                TensorSpec(p + "ffn_down.weight", (hp.n_embd, hp.n_ff), "residual"),
                TensorSpec(p + "ffn_down.bias", (hp.n_embd,), "zeros"),
            ]
        return specs

    def build(self, ctx: BuildContext):
        hp, b = ctx.hp, ctx.batch
        if ctx.n_ctx > hp.n_ctx_train:
            raise LlmtuneError(f"gpt2: a context of {ctx.n_ctx} tokens is longer than the "
                               f"{hp.n_ctx_train} learned positions")
        # token embeddings + learned position embeddings (position_embd rows at the batch positions)
        x = ops.reshape(ctx.inp_embd(), (b.n_seq, b.n_tok, hp.n_embd))
        x = ops.add(x, ops.get_rows(ctx.tensor("position_embd.weight"), b.pos))
        x = ctx.cb(ops.reshape(x, (b.n_seq * b.n_tok, hp.n_embd)), "inpL")
        return ctx.output(ctx.layers(x))  # layer norms, fused qkv with bias and no rope, gelu MLP: hp
