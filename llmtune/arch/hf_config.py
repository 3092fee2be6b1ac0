"""A family's Hugging Face config.json, from the hyper-parameters llmtune reads out of a GGUF file.

One table (FAMILIES) says, per family, which config.json keys carry which HParams field (llama.cpp's
convert_hf_to_gguf.py read backwards: `TextModel.set_gguf_parameters` and each model's own
`set_gguf_parameters`), what each family adds (qwen2's disabled sliding window, qwen3's head_dim...),
how its stored values differ from transformers' (`norm_offset`: gemma's norm weights are stored +1)
and what has no exact config.json form (refused in one line naming the file and the reason).

Names of the tensors are arch/hf_names.py's (`Family.hf`); this module is the hyper-parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from llmtune.arch.hparams import HParams
from llmtune.errors import LlmtuneError

# config.json key -> the HParams value, for every family mapped (transformers' PretrainedConfig names)
COMMON: dict[str, Callable[[HParams], Any]] = {
    "hidden_size": lambda hp: hp.n_embd,
    "intermediate_size": lambda hp: hp.n_ff,
    "num_hidden_layers": lambda hp: hp.n_layer,
    "num_attention_heads": lambda hp: hp.n_head,
    "num_key_value_heads": lambda hp: hp.n_head_kv,
    "head_dim": lambda hp: hp.head_dim,
    "max_position_embeddings": lambda hp: hp.n_ctx_train,
    "vocab_size": lambda hp: hp.n_vocab,
    "rms_norm_eps": lambda hp: hp.norm_eps,
    "rope_theta": lambda hp: hp.rope_freq_base,
    "tie_word_embeddings": lambda hp: hp.tied_output,
    "hidden_act": lambda hp: {"silu": "silu", "gelu": "gelu_pytorch_tanh"}[hp.activation],
}


@dataclass(frozen=True)
class HFConfig:
    """How one family's config.json is written (and, read backwards, what an import would read)."""

    extra: Callable[[HParams, set], dict] = lambda hp, tensors: {}  # family keys beyond COMMON
    norm_offset: float = 0.0  # GGUF norm weight = HF weight + norm_offset (gemma: 1)
    unmapped: tuple[str, ...] = ()  # tensors whose presence has no config.json form
    refuse: Callable[[HParams], Optional[str]] = lambda hp: None  # a reason the shape has no exact form
    drop: tuple[str, ...] = field(default=())  # COMMON keys the family's config does not have


def _biases(tensors: set) -> bool:
    return "blk.0.attn_q.bias" in tensors


def _llama_extra(hp: HParams, tensors: set) -> dict:
    out = {"attention_bias": _biases(tensors), "mlp_bias": False, "pretraining_tp": 1}
    if hp.rope_freq_scale != 1.0:  # llama.cpp's rope.scaling.type linear: every frequency divided by factor
        out["rope_scaling"] = {"rope_type": "linear", "factor": 1.0 / hp.rope_freq_scale}
    return out


def _no_rope_scaling(hp: HParams) -> Optional[str]:
    if hp.rope_freq_scale != 1.0:
        return f"rope frequency scale {hp.rope_freq_scale:g}, which this family's transformers config does not take"
    return None


def _common_refusals(hp: HParams) -> Optional[str]:
    if hp.n_ctx_orig is not None and hp.n_ctx_orig != hp.n_ctx_train:
        return "YaRN-style rope scaling (rope.scaling.original_context_length), which has no exact config.json form"
    if hp.rope_attn_factor != 1.0:
        return "rope.scaling.attn_factor, which has no exact config.json form"
    if hp.sliding_window and hp.arch in ("llama", "qwen2", "qwen3"):
        return "a sliding attention window, which llmtune's export maps for gemma only"
    return None


FAMILIES: dict[str, HFConfig] = {
    "llama": HFConfig(extra=_llama_extra,
                      # Llama 3.1's factors: transformers derives them from four numbers the file no longer has
                      unmapped=("rope_freqs.weight",)),
    "qwen2": HFConfig(extra=lambda hp, t: {"use_sliding_window": False, "sliding_window": None,
                                           "max_window_layers": hp.n_layer},
                      unmapped=("output.bias",), refuse=_no_rope_scaling),
    "qwen3": HFConfig(extra=lambda hp, t: {"attention_bias": _biases(t), "use_sliding_window": False,
                                           "sliding_window": None, "max_window_layers": hp.n_layer},
                      unmapped=("output.bias",), refuse=_no_rope_scaling),
}


def hf_config_of(arch: str) -> HFConfig:
    return FAMILIES.get(arch)


def config_json(hp: HParams, hf_names, tensors: set, special: dict, source: str) -> dict:
    """config.json for a model of hyper-parameters `hp` and GGUF tensor names `tensors` (`hf_names`:
    the family's HFNames; `special`: bos/eos/pad ids or None). Unmappable models are refused naming
    `source` and the reason."""
    table = FAMILIES.get(hp.arch)
    if table is None:
        mapped = ", ".join(sorted(FAMILIES))
        raise LlmtuneError(f"{source}: the {hp.arch} family has no exact Hugging Face config mapping in llmtune "
                           f"(mapped: {mapped})")
    found = [t for t in table.unmapped if t in tensors]
    why = (f"holds {found[0]}, which the {hf_names.architecture} checkpoint has no place for" if found
           else _common_refusals(hp) or table.refuse(hp))
    if why:
        raise LlmtuneError(f"{source}: {why}; no exact Hugging Face export")
    config = {"architectures": [hf_names.architecture], "model_type": hf_names.model_type}
    config.update({k: f(hp) for k, f in COMMON.items() if k not in table.drop})
    config.update(table.extra(hp, tensors))
    config.update({f"{k}_token_id": v for k, v in special.items()})
    config.update({"torch_dtype": "float32", "use_cache": True, "attention_dropout": 0.0,
                   "initializer_range": 0.02})
    return config
