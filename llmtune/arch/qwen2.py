"""qwen2 (llama.cpp's LLM_ARCH_QWEN2, src/models/qwen2.cpp): llama's block with biases on the q, k
and v projections and NEOX rotary embedding (dim i pairs with i + head_dim/2; q/k rows are stored
unpermuted). The vocabulary adds no BOS (the tokenizer's flags say so; nothing here).

The q/k/v biases are required here although llama.cpp's shared create_tensor_qkv loads them as
TENSOR_NOT_REQUIRED: every Qwen2 / Qwen2.5 checkpoint has them, and `init` must write them.
`output.bias` is optional (llama.cpp adds it to the logits, tied output or not)."""

from __future__ import annotations

from llmtune.arch import register
from llmtune.arch.family import TensorSpec
from llmtune.arch.hf_names import HFNames
from llmtune.arch.llama import HF_NAMES, Llama
from llmtune.graph import ops

QKV = ("attn_q.weight", "attn_k.weight", "attn_v.weight")


def with_qkv_biases(specs: list[TensorSpec], optional: bool) -> list[TensorSpec]:
    """`specs` with a bias (init zeros) after each q/k/v projection weight."""
    out = []
    for spec in specs:
        out.append(spec)
        if spec.name.endswith(QKV):
            out.append(TensorSpec(spec.name.replace(".weight", ".bias"), spec.shape[:1], "zeros", optional))
    return out


def without_rope_freqs(specs: list[TensorSpec]) -> list[TensorSpec]:
    return [s for s in specs if s.name != "rope_freqs.weight"]  # qwen passes no factors to ggml_rope_ext


@register
class Qwen2(Llama):
    name = "qwen2"
    traits = {"rope_mode": "neox"}
    hf = HFNames("Qwen2ForCausalLM", "qwen2", HF_NAMES)  # NEOX: rows as HF keeps them

    def tensors(self, hp):
        specs = with_qkv_biases(without_rope_freqs(super().tensors(hp)), optional=False)
        at = next(i for i, s in enumerate(specs) if s.name.startswith("blk."))
        return specs[:at] + [TensorSpec("output.bias", (hp.n_vocab,), "zeros", optional=True)] + specs[at:]

    def build(self, ctx):
        logits = super().build(ctx)
        bias = ctx.opt("output.bias")
        if bias is not None and ctx.opt("output.weight") is None:  # ctx.output adds it only with output.weight
            logits = ops.add(logits, bias)
        return logits
