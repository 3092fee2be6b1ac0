"""A family's hyper-parameters in a Hugging Face config.json, both ways: import and export --hf.

One table of rows (`ROWS`, plus a family's `EXTRA` rows), each a GGUF key suffix, the config.json
keys llama.cpp's convert_hf_to_gguf.py find_hparam tries in order, the value type and the HParams
field it carries (row order: the converter's key order):
- `gguf_hparams` (import): config.json -> `{arch}.*` keys, as the converter's
  TextModel.set_gguf_parameters writes them;
- `COMMON` (export --hf), derived from the same rows: config.json key -> the HParams field an
  export reads; `FAMILIES` says, per family, what its config.json adds (qwen2's disabled sliding
  window, gemma's softcaps, Llama 3.1's rope scaling recovered from rope_freqs.weight:
  `llama3_rope`), how its stored values differ from transformers' (`norm_offset`: gemma's norm
  weights are stored +1) and what has no exact config.json form (refused in one line naming the
  file and the reason).

Names of the tensors are arch/hf_names.py's (`Family.hf`); this module is the hyper-parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
from gguf import GGUFValueType as VT

from llmtune.arch.hparams import HParams
from llmtune.errors import LlmtuneError

ALL = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2")  # the families import reads config.json for


def _linear_factor(config: dict) -> Optional[float]:
    """rope_parameters' (its full_attention's) factor when the rope type is linear, else None."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    kind = rope.get("rope_type", rope.get("type"))
    return None if kind != "linear" or rope.get("factor") is None else float(rope["factor"])


@dataclass(frozen=True)
class Row:
    key: str  # GGUF key after "{arch}."
    hf: tuple[str, ...]  # config.json keys, the first present wins (find_hparam)
    vtype: VT
    families: tuple[str, ...] = ALL
    required: bool = False
    hparam: Optional[str] = None  # the HParams field it carries (export --hf reads it), None: not exported
    compute: Optional[Callable[[dict], Any]] = None  # the value from config.json when not one key's (None: absent)


ROWS: tuple[Row, ...] = (
    Row("block_count", ("num_hidden_layers", "n_layer"), VT.UINT32, required=True, hparam="n_layer"),
    Row("context_length", ("max_position_embeddings", "n_ctx", "n_positions"), VT.UINT32, hparam="n_ctx_train"),
    Row("embedding_length", ("hidden_size", "n_embd"), VT.UINT32, required=True, hparam="n_embd"),
    Row("feed_forward_length", ("intermediate_size", "n_inner"), VT.UINT32, required=True, hparam="n_ff"),
    Row("attention.head_count", ("num_attention_heads", "n_head"), VT.UINT32, required=True, hparam="n_head"),
    Row("attention.head_count_kv", ("num_key_value_heads", "n_kv_heads"), VT.UINT32, hparam="n_head_kv"),
    # TextModel.set_gguf_parameters' linear rope scaling (Gemma 3 4B+): when a factor is given
    Row("rope.scaling.type", (), VT.STRING, compute=lambda c: "linear" if _linear_factor(c) is not None else None),
    Row("rope.scaling.factor", (), VT.FLOAT32, compute=_linear_factor),
    # or rope_parameters.rope_theta (transformers >= 5)
    Row("rope.freq_base", ("rope_theta",), VT.FLOAT32, hparam="rope_freq_base"),
    Row("rope.freq_base_swa", (), VT.FLOAT32),  # rope_parameters.sliding_attention.rope_theta (gemma3)
    Row("attention.layer_norm_rms_epsilon", ("rms_norm_eps",), VT.FLOAT32, required=True, hparam="norm_eps"),
    Row("attention.key_length", ("head_dim",), VT.UINT32, hparam="head_dim"),
    Row("attention.value_length", ("head_dim",), VT.UINT32),
    # Phi3MiniModel.set_gguf_parameters' own keys (ORDER)
    Row("rope.scaling.original_context_length", ("original_max_position_embeddings",), VT.UINT32,
        families=("phi3",), required=True, compute=lambda c: rope_param(c, "original_max_position_embeddings")),
    Row("rope.dimension_count", ("hidden_size", "num_attention_heads"), VT.UINT32, families=("phi3",),
        compute=lambda c: int(float(rope_param(c, "partial_rotary_factor") or 1.0) * int(c["hidden_size"]))
        // int(c["num_attention_heads"])),  # int(partial_rotary_factor * n_embd) // n_head
    # GPT2Model.set_gguf_parameters: the feed-forward is 4 * n_embd whatever n_inner says (a checkpoint
    # whose c_fc is another width is then refused by its shape), LayerNorm's epsilon
    Row("feed_forward_length", ("n_embd",), VT.UINT32, families=("gpt2",), required=True,
        compute=lambda c: 4 * int(c["n_embd"]) if c.get("n_embd") is not None else None),
    Row("attention.layer_norm_epsilon", ("layer_norm_epsilon",), VT.FLOAT32, families=("gpt2",), required=True),
)
# written after general.file_type by the family's own set_gguf_parameters (LlamaModel)
EXTRA: tuple[Row, ...] = (
    Row("vocab_size", ("vocab_size",), VT.UINT32, families=("llama",), required=True, hparam="n_vocab"),
    Row("rope.dimension_count", ("head_dim",), VT.UINT32, families=("llama",)),  # else hidden / heads
    # Gemma2Model.set_gguf_parameters: config.json's values, required (hparams[...])
    Row("attn_logit_softcapping", ("attn_logit_softcapping",), VT.FLOAT32, families=("gemma2",), required=True),
    Row("final_logit_softcapping", ("final_logit_softcapping",), VT.FLOAT32, families=("gemma2",), required=True),
    Row("final_logit_softcapping", ("final_logit_softcapping",), VT.FLOAT32, families=("gemma3",)),  # when set
    # gemma3: unless sliding_window_pattern is 1 (every layer global)
    Row("attention.sliding_window", ("sliding_window",), VT.UINT32, families=("gemma2", "gemma3"), required=True),
    Row("attention.sliding_window", ("sliding_window",), VT.UINT32, families=("phi3",),
        compute=lambda c: int(c.get("sliding_window") or 0)),  # 0: none (Phi-4), llama.cpp disables it for phi3
)
# a family whose converter writes its own set_gguf_parameters (not TextModel's): its ROWS in its order
ORDER: dict[str, tuple[str, ...]] = {
    "gemma2": ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
               "attention.value_length"),  # Gemma2Model: no rope.freq_base, head_dim required
    "phi3": ("context_length", "rope.scaling.original_context_length", "embedding_length", "feed_forward_length",
             "block_count", "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
             "rope.dimension_count", "rope.freq_base"),
    "gpt2": ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.layer_norm_epsilon"),  # GPT2Model: its six keys (context_length: n_ctx, else n_positions)
}
# keys the family's converter writes with its own default when config.json lacks them (after the others,
# in another order): refused instead, naming the key
_REQUIRED = {"gemma2": ("context_length", "attention.key_length"),
             "gemma3": ("context_length", "attention.head_count", "attention.head_count_kv",
                        "attention.layer_norm_rms_epsilon", "attention.key_length", "attention.value_length"),
             "phi3": ("context_length", "attention.head_count_kv", "rope.freq_base"),  # find_hparam's KeyError
             "gpt2": ("context_length",)}  # GPT2Model: hparams["n_ctx"]
# transformers' Gemma3TextConfig defaults, which AutoConfig fills into a multimodal config's text_config before
# convert_hf_to_gguf.py reads it: transformers 4 saved a nested config's differences from its defaults only
# (Gemma 3 4B / 12B / 27B's text_config: no head counts, head_dim, epsilon, context, rope bases). The *_token_id
# defaults are not among them: SpecialVocab reads config.json itself.
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
               "attn_logit_softcapping": None},
}
_CASTS = {VT.UINT32: int, VT.FLOAT32: float, VT.STRING: str}
_LOCAL_THETA = ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq")


def rope_param(config: dict, name: str) -> Optional[Any]:
    """TextModel's rope_parameters[name], the config's own key mirrored into it when rope_parameters lacks it."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get(name, config.get(name))


def config_value(config: dict, row: Row) -> Optional[Any]:
    """The row's value in `config` (None when absent), as the converter reads it."""
    if row.compute is not None:
        value = row.compute(config)
        return None if value is None else _CASTS[row.vtype](value)
    if row.key == "rope.freq_base":
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope = rope.get("full_attention", rope)
        theta = rope.get("rope_theta", config.get("rope_theta"))
        return None if theta is None else float(theta)
    if row.key == "rope.freq_base_swa":
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "full_attention" in rope or "sliding_attention" in rope:
            theta = (rope.get("sliding_attention") or {}).get("rope_theta")
        else:  # TextModel's mirror of the older keys (gemma3's rope_local_base_freq)
            theta = next((config[k] for k in _LOCAL_THETA if config.get(k) is not None), None)
        return None if theta is None else float(theta)
    if row.key == "rope.dimension_count" and config.get("head_dim") is None:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    for name in row.hf:
        if config.get(name) is not None:
            return _CASTS[row.vtype](config[name])
    return None


def rows(arch: str, extra: bool) -> list[Row]:
    """The family's rows in the converter's order (ORDER's, else the table's), _REQUIRED's required."""
    found = [r for r in (EXTRA if extra else ROWS) if arch in r.families]
    if not extra and arch in ORDER:
        by_key = {}
        for r in found:  # a family's own row wins over the shared one of the same key (gpt2's feed_forward_length)
            if r.key not in by_key or r.families == (arch,):
                by_key[r.key] = r
        found = [by_key[k] for k in ORDER[arch]]
    must = _REQUIRED.get(arch, ())
    return [Row(r.key, r.hf, r.vtype, (arch,), True) if r.key in must else r for r in found]


def gguf_hparams(config: dict, arch: str, extra: bool, where: str) -> dict[str, tuple[Any, VT]]:
    """`{arch}.*` keys -> (value, type) from config.json; a required key missing raises naming `where`."""
    out = {}
    for row in rows(arch, extra):
        if _unwritten(config, arch, row):
            continue
        value = config_value(config, row)
        if value is None:
            if row.required:
                raise LlmtuneError(f"{where}: config.json has no {' / '.join(row.hf)} (needed for {arch}.{row.key})")
            continue
        out[f"{arch}.{row.key}"] = (value, row.vtype)
    return out


def _unwritten(config: dict, arch: str, row: Row) -> bool:
    """Gemma3Model.set_gguf_parameters' conditions: no softcap key when 0 / null, no window with a pattern
    of 1 (every layer global)."""
    if arch != "gemma3":
        return False
    if row.key == "final_logit_softcapping":
        return not config.get("final_logit_softcapping")
    return row.key == "attention.sliding_window" and config.get("sliding_window_pattern") == 1


# config.json key -> the HParams field it carries, for every family export --hf maps (transformers'
# PretrainedConfig names): the rows' first config key, every family's (a family drops what it lacks)
COMMON: dict[str, str] = {
    **{row.hf[0]: row.hparam for row in (*ROWS, *EXTRA) if row.hparam},  # head_dim: a property (key_length)
    "tie_word_embeddings": "tied_output",  # no GGUF key: the file has no output.weight
}
ACTIVATIONS = {"silu": "silu", "gelu": "gelu_pytorch_tanh"}  # HParams.activation -> config.json hidden_act


@dataclass(frozen=True)
class HFConfig:
    """How one family's config.json is written (and, read backwards, what an import would read)."""

    extra: Callable[[HParams, set], dict] = lambda hp, tensors: {}  # family keys beyond COMMON
    norm_offset: float = 0.0  # GGUF norm weight = HF weight + norm_offset (gemma: 1)
    unmapped: dict = field(default_factory=dict)  # tensor ("attn_q.bias": in any block) -> why it has no HF form
    refuse: Callable[[HParams], Optional[str]] = lambda hp: None  # a reason the shape has no exact form
    drop: tuple[str, ...] = ()  # COMMON keys the family's config does not have
    in_config: tuple[str, ...] = ()  # tensors config.json carries instead of the weights (rope_freqs)


def _llama_extra(hp: HParams, tensors: set) -> dict:
    out = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}  # llama's tensors have no biases
    if hp.rope_freq_scale != 1.0:  # llama.cpp's rope.scaling.type linear: every frequency divided by factor
        out["rope_scaling"] = {"rope_type": "linear", "factor": 1.0 / hp.rope_freq_scale}
    return out


def _no_rope_scaling(hp: HParams) -> Optional[str]:
    if hp.rope_freq_scale != 1.0:
        return f"rope frequency scale {hp.rope_freq_scale:g}, which this family's transformers config does not take"
    return None


def _common_refusals(hp: HParams) -> Optional[str]:
    if hp.n_ctx_orig is not None and hp.n_ctx_orig != hp.n_ctx_train:
        return ("a rope scaling context (rope.scaling.original_context_length) below the training one, which has "
                "no exact config.json form")
    if hp.rope_attn_factor != 1.0:
        return "rope.scaling.attn_factor, which has no exact config.json form"
    if hp.sliding_window and not hp.arch.startswith("gemma"):
        return "a sliding attention window, which llmtune's export maps for gemma only"
    return None


def _gemma_extra(hp: HParams, tensors: set) -> dict:
    """gemma2 / gemma3: the query scale as query_pre_attn_scalar (scale = scalar^-1/2), the softcaps
    (0: None), the sliding window and which layers use it (layer_types)."""
    scalar = 1.0 / hp.kq_scale ** 2
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-9 * scalar else scalar,
        "attn_logit_softcapping": hp.attn_softcap or None,
        "final_logit_softcapping": hp.final_softcap or None,
        "sliding_window": hp.sliding_window or hp.n_ctx_train,
        "layer_types": ["sliding_attention" if hp.is_swa(il) else "full_attention" for il in range(hp.n_layer)],
        "attention_bias": False,
    }
    if hp.arch == "gemma3":  # local layers' own rope base
        out["rope_local_base_freq"] = hp.rope_freq_base_swa if hp.rope_freq_base_swa is not None else hp.rope_freq_base
    return out


def _gemma_refusals(hp: HParams) -> Optional[str]:
    if hp.n_rot != hp.head_dim:
        return f"a partial rotary dimension ({hp.n_rot} of {hp.head_dim}), which gemma's config does not take"
    if hp.arch == "gemma2" and hp.rope_freq_base_swa not in (None, hp.rope_freq_base):
        return "a separate rope base for sliding-window layers, which gemma2's config does not take"
    return _no_rope_scaling(hp)


def _phi3_extra(hp: HParams, tensors: set) -> dict:
    """phi3: partial rotary (rope.dimension_count of the head), no sliding window (llama.cpp disables it)."""
    return {"partial_rotary_factor": hp.n_rot / hp.head_dim, "original_max_position_embeddings": hp.n_ctx_train,
            "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def _gpt2_extra(hp: HParams, tensors: set) -> dict:
    """GPT2Config's own names (its attribute_map reads the common ones too, but these are what GPT-2's
    config.json holds); gelu_new is the tanh GELU llama.cpp's ggml_gelu computes; no dropout."""
    return {"n_embd": hp.n_embd, "n_layer": hp.n_layer, "n_head": hp.n_head, "n_positions": hp.n_ctx_train,
            "n_ctx": hp.n_ctx_train, "n_inner": hp.n_ff, "layer_norm_epsilon": hp.norm_eps,
            "activation_function": "gelu_new", "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


def _gpt2_refusals(hp: HParams) -> Optional[str]:
    if hp.n_head_kv != hp.n_head or hp.head_dim != hp.n_embd // hp.n_head:
        return "grouped-query attention or a head size other than n_embd / n_head, which GPT-2's config does not take"
    return None


OUTPUT_BIAS = {"output.bias": "an output bias (output.bias), which the checkpoint's lm_head has no place for"}
QKV_BIAS = ("q/k/v biases without an output projection bias, which transformers' attention_bias=True would add "
            "(Qwen3's o_proj)")
LONGROPE = ("LongRoPE factors (rope_factors_long/short), which transformers picks by each input's length and "
            "llama.cpp by the context size")

FAMILIES: dict[str, HFConfig] = {
    "llama": HFConfig(extra=_llama_extra, in_config=("rope_freqs.weight",)),  # llama3_rope
    "qwen2": HFConfig(extra=lambda hp, t: {"use_sliding_window": False, "sliding_window": None,
                                           "max_window_layers": hp.n_layer},
                      unmapped=OUTPUT_BIAS, refuse=_no_rope_scaling),
    "qwen3": HFConfig(extra=lambda hp, t: {"attention_bias": False, "use_sliding_window": False,
                                           "sliding_window": None, "max_window_layers": hp.n_layer},
                      unmapped={**OUTPUT_BIAS, "attn_q.bias": QKV_BIAS}, refuse=_no_rope_scaling),
    # LongRoPE: llama.cpp picks the long factors by the context size, transformers by each input's length
    "phi3": HFConfig(extra=_phi3_extra, drop=("head_dim",), refuse=_no_rope_scaling,
                     unmapped={"rope_factors_long.weight": LONGROPE, "rope_factors_short.weight": LONGROPE}),
    # gemma's norm weights (every RMSNorm, q/k norms too) are stored +1: HF computes x * (1 + w)
    "gemma2": HFConfig(extra=_gemma_extra, norm_offset=1.0, refuse=_gemma_refusals),
    "gemma3": HFConfig(extra=_gemma_extra, norm_offset=1.0, refuse=_gemma_refusals),
    # gpt2: GPT2Config's names instead of the common ones (vocab_size and tie_word_embeddings are its own)
    "gpt2": HFConfig(extra=_gpt2_extra, refuse=_gpt2_refusals,
                     drop=tuple(k for k in COMMON if k not in ("vocab_size", "tie_word_embeddings")) + ("hidden_act",)),
}


def llama3_factors(hp: HParams, factor: float, low: float, high: float, context: float) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3.1's per-frequency divisors
    (transformers' _compute_llama3_parameters divides the same frequencies by the same numbers)."""
    wavelen = 2 * np.pi * hp.rope_freq_base ** (np.arange(0, hp.n_rot, 2, dtype=np.float64) / hp.n_rot)
    with np.errstate(divide="ignore", invalid="ignore"):  # high == low: no medium wavelengths
        smooth = (context / wavelen - low) / (high - low)
        mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, mid))


def llama3_rope(factors: np.ndarray, hp: HParams) -> Optional[dict]:
    """The "llama3" rope_scaling whose factors are `factors` (rope_freqs.weight), or None when none
    gives them. The four numbers are recovered from the factors (only the wavelength thresholds
    matter: (context, low, high) scaled together give the same factors), then checked by recomputing."""
    f = np.asarray(factors, np.float64)
    wavelen = 2 * np.pi * hp.rope_freq_base ** (np.arange(0, hp.n_rot, 2, dtype=np.float64) / hp.n_rot)
    factor = float(f.max())
    if f.shape != wavelen.shape or not np.all(np.isfinite(f)) or f.min() < 1 - 1e-6:
        return None
    if factor <= 1 + 1e-6:
        return {} if np.allclose(f, 1.0, rtol=0, atol=1e-6) else None  # divisors of 1: no scaling at all
    short, long = f <= 1 + 1e-6, f >= factor * (1 - 1e-6)
    mid = ~short & ~long
    if mid.any():  # 1/f = (1 - s)/factor + s, s = (context/wavelen - low)/(high - low): a line in 1/wavelen
        s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        if mid.sum() >= 2:
            slope, intercept = np.polyfit(1 / wavelen[mid], s, 1)
        else:  # one point: Meta's ratio high/low = 4 (intercept -1/3) fixes the line
            intercept = -1 / 3
            slope = (s[0] - intercept) * wavelen[mid][0]
        if intercept >= 0 or slope <= 0:
            return None
        span = -1 / intercept  # with low 1: high - low
        low_wavelen, high_wavelen = slope * span, slope * span / (1 + span)
    elif mid.sum() == 0 and short.any() and long.any():  # thresholds anywhere between the two groups
        low_wavelen = float(np.sqrt(wavelen[short].max() * wavelen[long].min()))
        high_wavelen = float(np.sqrt(wavelen[short].max() * low_wavelen))
    else:
        return None
    context = float(round(low_wavelen)) if low_wavelen >= 1 else float(low_wavelen)
    exact = (factor, float(context / low_wavelen), float(context / high_wavelen), context)
    for numbers in (tuple(float(f"{x:.6g}") for x in exact), exact):  # the short spelling when it is as good
        if np.allclose(llama3_factors(hp, *numbers), f, rtol=1e-6, atol=0):
            factor, low, high, context = numbers
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(context) if context.is_integer() else context}
    return None


def hf_config_of(arch: str) -> HFConfig:
    return FAMILIES.get(arch)


def config_json(hp: HParams, hf_names, tensors: set, special: dict, source: str,
                tensor: Callable[[str], np.ndarray] = None) -> dict:
    """config.json for a model of hyper-parameters `hp` and GGUF tensor names `tensors` (`hf_names`:
    the family's HFNames; `special`: bos/eos/pad ids or None; `tensor(name)`: a tensor's values, for
    rope_freqs). Unmappable models are refused naming `source` and the reason."""
    table = FAMILIES.get(hp.arch)
    if table is None:
        mapped = ", ".join(sorted(FAMILIES))
        raise LlmtuneError(f"{source}: the {hp.arch} family has no exact Hugging Face config mapping in llmtune "
                           f"(mapped: {mapped})")
    stems = {t.split(".", 2)[2] if t.startswith("blk.") else t for t in tensors}  # "attn_q.bias": any block's
    found = [why for t, why in table.unmapped.items() if t in stems]
    rope = llama3_rope(tensor("rope_freqs.weight"), hp) if "rope_freqs.weight" in tensors else {}
    if rope is None:
        found.append("rope frequency factors (rope_freqs.weight) that no Llama 3 rope scaling gives")
    why = found[0] if found else _common_refusals(hp) or table.refuse(hp)
    if why:
        raise LlmtuneError(f"{source}: holds {why}; no exact Hugging Face export" if found
                           else f"{source}: {why}; no exact Hugging Face export")
    config = {"architectures": [hf_names.architecture], "model_type": hf_names.model_type}
    config.update({k: getattr(hp, field) for k, field in COMMON.items() if k not in table.drop})
    if "hidden_act" not in table.drop:
        config["hidden_act"] = ACTIVATIONS[hp.activation]
    config.update(table.extra(hp, tensors))
    if rope:
        if "rope_scaling" in config:  # linear scaling on top: transformers takes one rope_scaling
            raise LlmtuneError(f"{source}: holds rope_freqs.weight and a linear rope scaling; no exact Hugging Face "
                               "export")
        config["rope_scaling"] = rope
    config.update({f"{k}_token_id": v for k, v in special.items()})
    config.update({"torch_dtype": "float32", "use_cache": True, "attention_dropout": 0.0,
                   "initializer_range": 0.02})
    return config
