"""qwen3 (llama.cpp's LLM_ARCH_QWEN3, src/models/qwen3.cpp): qwen2 without biases, plus a per-head
RMSNorm of q and k (attn_q_norm / attn_k_norm: one weight per head dim, the model's eps) before
the NEOX rotary embedding. The head size is attention.key_length and may differ from
n_embd / n_head: attn_q then maps n_embd -> n_head * key_length and attn_output maps back.

llama.cpp's shared create_tensor_qkv also accepts q/k/v biases (TENSOR_NOT_REQUIRED): so does this."""

from __future__ import annotations

from llmtune.arch import register
from llmtune.arch.family import TensorSpec
from llmtune.arch.hf_names import HFNames
from llmtune.arch.llama import HF_NAMES, Llama
from llmtune.arch.qwen2 import with_qkv_biases, without_rope_freqs


@register
class Qwen3(Llama):
    name = "qwen3"
    traits = {"rope_mode": "neox"}
    hf = HFNames("Qwen3ForCausalLM", "qwen3", {**HF_NAMES,
                                               "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
                                               "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm"})

    def tensors(self, hp):
        specs = []
        for spec in with_qkv_biases(without_rope_freqs(super().tensors(hp)), optional=True):
            specs.append(spec)
            if spec.name.endswith(".attn_output.weight"):  # llama.cpp's order: after wo
                blk = spec.name[: -len("attn_output.weight")]
                specs += [TensorSpec(blk + "attn_k_norm.weight", (hp.head_dim,), "ones"),
                          TensorSpec(blk + "attn_q_norm.weight", (hp.head_dim,), "ones")]
        return specs
