"""llama (llama.cpp's LLM_ARCH_LLAMA, src/models/llama.cpp): pre-norm decoder, RMSNorm, RoPE on
adjacent pairs, grouped-query attention, SwiGLU feed-forward. Mistral files are llama too.

Llama 3.1+ files carry rope_freqs.weight (n_rot/2 factors, the converter's "llama3" rope scaling):
each rotary frequency is divided by its factor (ggml_rope_ext's c argument); llama.cpp marks it
TENSOR_NOT_REQUIRED, so Llama 2 / Mistral files without it run as before. rope.dimension_count
must equal the head size, as llama.cpp checks ("invalid n_rot")."""

from __future__ import annotations

from llmtune.arch import register
from llmtune.arch.context import BuildContext
from llmtune.arch.family import Family, TensorSpec, output_tensors
from llmtune.arch.hf_names import HFNames
from llmtune.errors import LlmtuneError

# transformers' names (gguf-py's tensor_mapping for LLM_ARCH_LLAMA); qwen2 and qwen3 share them
HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}


@register
class Llama(Family):
    name = "llama"
    # q/k rows: the converter's LlamaModel.permute (HF rotates halves of a head, llama.cpp adjacent pairs)
    hf = HFNames("LlamaForCausalLM", "llama", HF_NAMES, rope_rows=True)

    def read_hparams(self, keys, n_vocab_default, tensor_names):
        hp = super().read_hparams(keys, n_vocab_default, tensor_names)
        if hp.n_head > 0 and hp.n_rot != hp.head_dim:
            raise LlmtuneError(f"{keys.source}: {keys.arch}.rope.dimension_count {hp.n_rot} must equal the head size "
                               f"{hp.head_dim} (llama.cpp: invalid n_rot)")
        return hp

    def tensors(self, hp):
        # the converter writes rope_freqs first (generate_extra_tensors); one tensor for all layers
        specs = [TensorSpec("rope_freqs.weight", (hp.n_rot // 2,), "factors", optional=True)]
        specs += output_tensors(hp)
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            specs += [
                TensorSpec(p + "attn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "attn_q.weight", (hp.n_embd_q, hp.n_embd)),
                TensorSpec(p + "attn_k.weight", (hp.n_embd_kv, hp.n_embd)),
                TensorSpec(p + "attn_v.weight", (hp.n_embd_kv, hp.n_embd)),
                TensorSpec(p + "attn_output.weight", (hp.n_embd, hp.n_embd_q), "residual"),
                TensorSpec(p + "ffn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "ffn_gate.weight", (hp.n_ff, hp.n_embd)),
                TensorSpec(p + "ffn_up.weight", (hp.n_ff, hp.n_embd)),
                TensorSpec(p + "ffn_down.weight", (hp.n_embd, hp.n_ff), "residual"),
            ]
        return specs

    def build(self, ctx: BuildContext):
        return ctx.output(ctx.layers(ctx.inp_embd()))  # llm_build_llama: the pre-norm stack of ctx.layers
