"""A family's hyper-parameters in a Hugging Face config.json, and the GGUF keys they become.

One table (`ROWS`, plus a family's `EXTRA` rows) read in both directions: `gguf_hparams` (config.json
-> `{arch}.*` keys, as llama.cpp's convert_hf_to_gguf.py TextModel.set_gguf_parameters writes them)
and `hf_config_values` (GGUF keys -> config.json values, for an export to an HF folder). A row is
(GGUF key suffix, the config keys the converter's find_hparam tries in order, value type, and which
families write it); the row order is the converter's key order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gguf import GGUFValueType as VT

from llmtune.errors import LlmtuneError

ALL = ("llama", "qwen2", "qwen3")  # the families import reads config.json for


@dataclass(frozen=True)
class Row:
    key: str  # GGUF key after "{arch}."
    hf: tuple[str, ...]  # config.json keys, the first present wins (find_hparam)
    vtype: VT
    families: tuple[str, ...] = ALL
    required: bool = False


ROWS: tuple[Row, ...] = (
    Row("block_count", ("num_hidden_layers", "n_layer"), VT.UINT32, required=True),
    Row("context_length", ("max_position_embeddings", "n_ctx", "n_positions"), VT.UINT32),
    Row("embedding_length", ("hidden_size", "n_embd"), VT.UINT32, required=True),
    Row("feed_forward_length", ("intermediate_size", "n_inner"), VT.UINT32, required=True),
    Row("attention.head_count", ("num_attention_heads", "n_head"), VT.UINT32, required=True),
    Row("attention.head_count_kv", ("num_key_value_heads", "n_kv_heads"), VT.UINT32),
    Row("rope.freq_base", ("rope_theta",), VT.FLOAT32),  # or rope_parameters.rope_theta (transformers >= 5)
    Row("attention.layer_norm_rms_epsilon", ("rms_norm_eps",), VT.FLOAT32, required=True),
    Row("attention.key_length", ("head_dim",), VT.UINT32),
    Row("attention.value_length", ("head_dim",), VT.UINT32),
)
# written after general.file_type by the family's own set_gguf_parameters (LlamaModel)
EXTRA: tuple[Row, ...] = (
    Row("vocab_size", ("vocab_size",), VT.UINT32, families=("llama",), required=True),
    Row("rope.dimension_count", ("head_dim",), VT.UINT32, families=("llama",)),  # else hidden / heads
)
_CASTS = {VT.UINT32: int, VT.FLOAT32: float}


def config_value(config: dict, row: Row) -> Optional[Any]:
    """The row's value in `config` (None when absent), as the converter reads it."""
    if row.key == "rope.freq_base":
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope = rope.get("full_attention", rope)
        theta = rope.get("rope_theta", config.get("rope_theta"))
        return None if theta is None else float(theta)
    if row.key == "rope.dimension_count" and config.get("head_dim") is None:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    for name in row.hf:
        if config.get(name) is not None:
            return _CASTS[row.vtype](config[name])
    return None


def rows(arch: str, extra: bool) -> list[Row]:
    return [r for r in (EXTRA if extra else ROWS) if arch in r.families]


def gguf_hparams(config: dict, arch: str, extra: bool, where: str) -> dict[str, tuple[Any, VT]]:
    """`{arch}.*` keys -> (value, type) from config.json; a required key missing raises naming `where`."""
    out = {}
    for row in rows(arch, extra):
        value = config_value(config, row)
        if value is None:
            if row.required:
                raise LlmtuneError(f"{where}: config.json has no {' / '.join(row.hf)} (needed for {arch}.{row.key})")
            continue
        out[f"{arch}.{row.key}"] = (value, row.vtype)
    return out


def hf_config_values(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The other direction: config.json values from a GGUF's plain metadata (the first HF name of each row)."""
    out = {}
    for row in (*ROWS, *EXTRA):
        if arch in row.families and f"{arch}.{row.key}" in meta and row.key != "rope.dimension_count":
            out[row.hf[0]] = meta[f"{arch}.{row.key}"]
    return out
