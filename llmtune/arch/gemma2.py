"""gemma2 (llama.cpp's LLM_ARCH_GEMMA2, src/models/gemma2.cpp): a pre-norm decoder whose
embeddings are scaled by sqrt(n_embd), with RMS norms after each branch too (post_attention_norm,
post_ffw_norm, applied before the residual add), NEOX RoPE, a GELU-tanh gated FFN (geglu),
attention scores and logits softcapped (cap * tanh(s / cap)), and a sliding window on every
other layer (layer il is local when il % 2 < 1). The output projection is always token_embd.

Norm weights are stored with gemma's +1 already added (the converter does it): they multiply
directly. The shared gemma pieces (norm-sandwich block, sliding-window pattern, query scale)
live here; gemma3.py extends them.
"""

from __future__ import annotations

import dataclasses
import math

from gguf import GGUFValueType as VT

from llmtune.arch import register
from llmtune.arch.context import BuildContext
from llmtune.arch.family import Family, TensorSpec, output_tensors
from llmtune.arch.hf_names import HFNames
from llmtune.arch.hparams import MetaKeys
from llmtune.errors import LlmtuneError
from llmtune.graph import ops


def swa_pattern(n_layer: int, n_pattern: int) -> tuple:
    """llama_hparams::set_swa_pattern: layer il is local when il % n < n - 1 (0: every layer)."""
    return tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer))


def read_swa_layers(keys: MetaKeys, n_layer: int, default_pattern: int) -> tuple:
    """llama_model_base::load_swa_pattern: `attention.sliding_window_pattern` is either one flag
    per layer or the period n of the pattern (default: the family's)."""
    raw = keys.get("attention.sliding_window_pattern", None)
    if isinstance(raw, list):
        if len(raw) != n_layer:
            raise LlmtuneError(f"{keys.source}: {keys.arch}.attention.sliding_window_pattern has {len(raw)} "
                               f"entries for {n_layer} layers")
        return tuple(bool(v) for v in raw)
    n_pattern = keys.int("attention.sliding_window_pattern", default_pattern)
    if n_pattern < 0:
        raise LlmtuneError(f"{keys.source}: {keys.arch}.attention.sliding_window_pattern must be 0 or more")
    return swa_pattern(n_layer, n_pattern)


# transformers' names (gguf-py's tensor_mapping); the norms' values differ by the +1 above
HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.pre_feedforward_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
    "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm",
}


class GemmaBase(Family):
    """What gemma2 and gemma3 share: hyper-parameter defaults, tensors, the norm-sandwich block."""

    traits = dict(rope_mode="neox", norm_kind="rms", activation="gelu", ffn_gated=True)
    swa_period = 2  # load_swa_pattern's default
    n_layer_27b = 0  # the 27B model's n_layer (llama.cpp's LLM_TYPE_27B), whose query scale is 1/sqrt(n_embd / n_head)
    qk_norm = False

    def make_hparams(self, **fields):
        """Derived fields, as load_arch_hparams sets them: the sliding-window layers from the
        family's pattern, and the query scale (1/sqrt(head_dim); 27B: 1/sqrt(n_embd / n_head))."""
        n_layer, n_embd, n_head = fields.get("n_layer", 0), fields.get("n_embd", 0), fields.get("n_head", 0)
        if fields.get("swa_layers") is None and n_layer:
            fields["swa_layers"] = swa_pattern(n_layer, self.swa_period)
        if fields.get("attn_scale") is None and n_head:
            head_dim = fields.get("head_dim_kq") or n_embd // n_head
            size = n_embd // n_head if n_layer == self.n_layer_27b else head_dim
            fields["attn_scale"] = 1.0 / math.sqrt(float(size)) if size > 0 else None
        return super().make_hparams(**fields)

    # ------------------------------------------------------------------ tensors
    def tensors(self, hp):
        specs = output_tensors(hp)  # output.weight only when untied (never for gemma2)
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            specs += [
                TensorSpec(p + "attn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "attn_q.weight", (hp.n_embd_q, hp.n_embd)),
                TensorSpec(p + "attn_k.weight", (hp.n_embd_kv, hp.n_embd)),
                TensorSpec(p + "attn_v.weight", (hp.n_embd_kv, hp.n_embd)),
            ]
            if self.qk_norm:
                specs += [
                    TensorSpec(p + "attn_q_norm.weight", (hp.head_dim,), "ones"),
                    TensorSpec(p + "attn_k_norm.weight", (hp.head_dim,), "ones"),
                ]
            specs += [
                TensorSpec(p + "attn_output.weight", (hp.n_embd, hp.n_embd_q), "residual"),
                TensorSpec(p + "post_attention_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "ffn_norm.weight", (hp.n_embd,), "ones"),
                TensorSpec(p + "ffn_gate.weight", (hp.n_ff, hp.n_embd)),
                TensorSpec(p + "ffn_up.weight", (hp.n_ff, hp.n_embd)),
                TensorSpec(p + "ffn_down.weight", (hp.n_embd, hp.n_ff), "residual"),
                TensorSpec(p + "post_ffw_norm.weight", (hp.n_embd,), "ones"),
            ]
        return specs

    # ------------------------------------------------------------------ graph
    def build(self, ctx: BuildContext):
        hp = ctx.hp
        x = ctx.cb(ops.scale(ctx.inp_embd(), math.sqrt(hp.n_embd)), "inp_scaled")
        # q/k norms, sliding window and softcap come from hp; each branch normed again (post norms)
        x = ctx.layers(x, post_norms=True)
        return ctx.output(x)  # final norm, token_embd projection, final softcap when set

    # ------------------------------------------------------------------ helpers for write_hparams
    @staticmethod
    def _common_keys(hp) -> dict:
        """The keys both gemma converters write (convert_hf_to_gguf.py, conversion/gemma.py)."""
        u32 = lambda v: (int(v), VT.UINT32)  # noqa: E731
        return {
            "context_length": u32(hp.n_ctx_train),
            "embedding_length": u32(hp.n_embd),
            "block_count": u32(hp.n_layer),
            "feed_forward_length": u32(hp.n_ff),
            "attention.head_count": u32(hp.n_head),
            "attention.head_count_kv": u32(hp.n_head_kv),
            "attention.layer_norm_rms_epsilon": (float(hp.norm_eps), VT.FLOAT32),
            "attention.key_length": u32(hp.head_dim),
            "attention.value_length": u32(hp.head_dim),
            # not written by the converters (rotary over the whole head); kept when it differs
            **({"rope.dimension_count": u32(hp.n_rot)} if hp.n_rot != hp.head_dim else {}),
        }


@register
class Gemma2(GemmaBase):
    name = "gemma2"
    traits = dict(GemmaBase.traits, tied_output=True)  # llama.cpp never loads an output.weight
    hf = HFNames("Gemma2ForCausalLM", "gemma2", HF_NAMES)
    config_keys = {"sliding_window": "int", "attn_softcap": "float", "final_softcap": "float",
                   "rope_freq_base_swa": "float"}
    swa_period = 2
    n_layer_27b = 46

    def make_hparams(self, **fields):
        fields["tied_output"] = True
        fields.setdefault("sliding_window", 4096)  # llama.cpp's default for gemma 2
        fields.setdefault("attn_softcap", 50.0)
        fields.setdefault("final_softcap", 30.0)
        return super().make_hparams(**fields)

    def read_hparams(self, keys, n_vocab_default, tensor_names):
        """llama_model_gemma2::load_arch_hparams. rope.freq_base is absent from converted files (10000)."""
        hp = super().read_hparams(keys, n_vocab_default, tensor_names)
        return dataclasses.replace(
            hp,
            tied_output=True,
            sliding_window=keys.int("attention.sliding_window", 4096),
            swa_layers=read_swa_layers(keys, hp.n_layer, self.swa_period),
            attn_softcap=keys.float("attn_logit_softcapping", 50.0),
            final_softcap=keys.float("final_logit_softcapping", 30.0),
            rope_freq_base_swa=keys.float("rope.freq_base_swa", hp.rope_freq_base),
        )

    def write_hparams(self, hp):
        """Exactly the converter's keys (Gemma2Model.set_gguf_parameters); rope bases only
        when they differ from what llama.cpp assumes without them."""
        f32 = lambda v: (float(v), VT.FLOAT32)  # noqa: E731
        keys = self._common_keys(hp)
        keys["attn_logit_softcapping"] = f32(hp.attn_softcap)
        keys["final_logit_softcapping"] = f32(hp.final_softcap)
        keys["attention.sliding_window"] = (int(hp.sliding_window), VT.UINT32)
        if hp.rope_freq_base != 10000.0:
            keys["rope.freq_base"] = f32(hp.rope_freq_base)
        if hp.rope_freq_base_swa is not None and hp.rope_freq_base_swa != hp.rope_freq_base:
            keys["rope.freq_base_swa"] = f32(hp.rope_freq_base_swa)
        return {f"{hp.arch}.{k}": v for k, v in keys.items()}
