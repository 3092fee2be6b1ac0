"""Which storage type each tensor gets when a model is exported (llama.cpp's llama-quant.cpp policy).

An export type names a default tensor type plus, for the llama.cpp "mixes" (Q4_K_M, Q5_K_M, and the
output-tensor rule every quantized type has), the tensors that get more bits. The rules here are the
subset of llama_tensor_get_type that applies to the types llmtune writes:

- only weights with >= 2 dimensions whose name ends in "weight" are converted; norms, biases and other
  1-D tensors keep their type (F32);
- output.weight (and token_embd.weight when the output is tied to it) -> Q6_K for every quantized
  type except Q8_0; Q8_0 when its rows do not split into blocks;
- Q4_K_M / Q5_K_M: attn_v and ffn_down -> Q6_K in the first and last eighth of the layers and in
  every third layer between (llama.cpp's use_more_bits);
- a tensor whose row length is not a multiple of the block size falls back as llama.cpp does
  (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and to F16 when even that does not fit (llama.cpp
  refuses such a tensor for the legacy types; F16 is its own last resort for unusual shapes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT, LlamaFileType as FT

from llmtune.errors import LlmtuneError
from llmtune.quant.blocks import row_fits


@dataclass(frozen=True)
class ExportType:
    name: str  # as typed on the command line
    ftype: FT  # value written to general.file_type
    default: QT  # type of an ordinary quantizable weight
    pure: bool = False  # True: no llama.cpp mix, every quantizable weight gets `default`
    help: str = ""

    @property
    def quantized(self) -> bool:
        return self.default not in (QT.F32, QT.F16, QT.BF16)


EXPORT_TYPES: dict[str, ExportType] = {
    t.name: t
    for t in (
        ExportType("f32", FT.ALL_F32, QT.F32, help="32-bit float"),
        ExportType("f16", FT.MOSTLY_F16, QT.F16, help="16-bit float"),
        ExportType("bf16", FT.MOSTLY_BF16, QT.BF16, help="bfloat16"),
        ExportType("q8_0", FT.MOSTLY_Q8_0, QT.Q8_0, help="8.5 bpw"),
        ExportType("q4_0", FT.MOSTLY_Q4_0, QT.Q4_0, help="4.5 bpw"),
        ExportType("q4_1", FT.MOSTLY_Q4_1, QT.Q4_1, help="5.0 bpw"),
        ExportType("q5_0", FT.MOSTLY_Q5_0, QT.Q5_0, help="5.5 bpw"),
        ExportType("q5_1", FT.MOSTLY_Q5_1, QT.Q5_1, help="6.0 bpw"),
        # Plain K-quants: every quantizable weight in that one type (llama-quantize --pure). A file that
        # is mostly Q4_K / Q5_K is what llama.cpp's loader reports as Q4_K_M / Q5_K_M.
        ExportType("q4_k", FT.MOSTLY_Q4_K_M, QT.Q4_K, pure=True, help="4.5 bpw, all Q4_K"),
        ExportType("q5_k", FT.MOSTLY_Q5_K_M, QT.Q5_K, pure=True, help="5.5 bpw, all Q5_K"),
        ExportType("q6_k", FT.MOSTLY_Q6_K, QT.Q6_K, help="6.56 bpw"),
        ExportType("q4_k_m", FT.MOSTLY_Q4_K_M, QT.Q4_K, help="llama.cpp mix, ~4.8 bpw"),
        ExportType("q5_k_m", FT.MOSTLY_Q5_K_M, QT.Q5_K, help="llama.cpp mix, ~5.7 bpw"),
    )
}


def export_type(name: str) -> ExportType:
    xt = EXPORT_TYPES.get(name.lower())
    if xt is None:
        raise LlmtuneError(f"--type {name}: unknown type (choose from {', '.join(EXPORT_TYPES)})")
    return xt


# --- tensor categories (llama-quant.cpp tensor_get_category) -------------------------------------------

OUTPUT, TOKEN_EMBD, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT, FFN_UP, FFN_GATE, FFN_DOWN, OTHER = (
    "output", "token_embd", "attn_v", "attn_k", "attn_q", "attn_output", "ffn_up", "ffn_gate", "ffn_down", "other"
)

# (substring, category) checked in llama.cpp's order; attn_qkv / attn_kv_b count as attn_v.
_CATEGORY_PATTERNS = (
    ("attn_qkv.weight", ATTN_V),
    ("attn_kv_b.weight", ATTN_V),
    ("attn_v.weight", ATTN_V),
    ("attn_k.weight", ATTN_K),
    ("attn_q.weight", ATTN_Q),
    ("attn_output.weight", ATTN_OUTPUT),
    ("ffn_up", FFN_UP),
    ("ffn_gate", FFN_GATE),
    ("ffn_down", FFN_DOWN),
)


def tensor_category(name: str) -> str:
    if name == "output.weight":
        return OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return TOKEN_EMBD
    for pattern, category in _CATEGORY_PATTERNS:
        if pattern in name:
            return category
    return OTHER


# Weights llama.cpp never quantizes although they are 2-D (small, or index tables, or positional).
_NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "position_embd.weight", "token_types.weight", "ssm_conv1d",
    "shortconv.conv.weight", "attn_rel_b.weight", "time_mix_",
)


def ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml's dimension count: trailing (GGUF-order) sizes of 1 do not count."""
    ne = list(reversed(shape))
    return max([i + 1 for i, n in enumerate(ne) if n > 1], default=1)


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """llama-quant.cpp tensor_allows_quantization: 2-D+ weights other than norms and a few special ones."""
    if ggml_n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(part in name for part in _NEVER_QUANTIZED)


def llama_tensor_order(names) -> list[str]:
    """llama.cpp's weight order: non-layer tensors first, then by layer number, then by name."""

    def key(name: str):
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers llama.cpp's _M mixes give more bits: first and last eighth, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# --- the plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    src_type: QT
    dst_type: QT
    quantizable: bool  # converted by the export type (False: copied as is)
    fallback: bool = False  # the preferred type did not fit the row length

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class ModelFacts:
    """What the type rules need to know about the model."""

    arch: str
    n_layer: int
    n_head: int = 0
    n_head_kv: int = 0
    n_expert: int = 0

    @classmethod
    def from_metadata(cls, md: dict) -> "ModelFacts":
        arch = md.get("general.architecture", "")

        def first(key, default=0):
            v = md.get(f"{arch}.{key}", default)
            return int(v[0] if isinstance(v, list) and v else v or 0)

        n_head = first("attention.head_count")
        return cls(
            arch=arch,
            n_layer=first("block_count"),
            n_head=n_head,
            n_head_kv=first("attention.head_count_kv", n_head),
            n_expert=first("expert_count"),
        )

    @property
    def is_llama_70b(self) -> bool:  # llama.cpp's LLM_TYPE_70B: 80 layers with grouped-query attention
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv


class _MixState:
    """Counters llama.cpp keeps while walking the tensors in its order (quantize_state_impl)."""

    def __init__(self, xt: ExportType, facts: ModelFacts, names: list[str]):
        self.xt = xt
        self.facts = facts
        self.n_attention_wv = sum(tensor_category(n) == ATTN_V for n in names)
        self.i_attention_wv = 0
        self.i_ffn_down = 0
        self.tied_embeddings = "output.weight" not in names

    def mix_type(self, name: str, n_cols: int) -> QT:
        """llama_tensor_get_type_impl restricted to the export types llmtune writes."""
        new_type, cat, ftype, facts = self.xt.default, tensor_category(name), self.xt.ftype, self.facts
        mixes = (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M)
        if cat == OUTPUT or (self.tied_embeddings and cat == TOKEN_EMBD):
            if facts.arch == "falcon" or not row_fits(n_cols, new_type):
                return QT.Q8_0
            return new_type if new_type == QT.Q8_0 else QT.Q6_K
        if cat == ATTN_V:
            if ftype in mixes and use_more_bits(self.i_attention_wv, self.n_attention_wv):
                new_type = QT.Q6_K
            if facts.is_llama_70b and new_type in (QT.Q3_K, QT.Q4_K):
                new_type = QT.Q5_K  # its attn_v is 8x smaller than attn_q: more bits are cheap
            if facts.n_expert == 8:
                new_type = QT.Q8_0
            self.i_attention_wv += 1
        elif cat == ATTN_K and facts.n_expert == 8:
            new_type = QT.Q8_0
        elif cat == FFN_DOWN:
            i_layer = self._layer_of(name, self.i_ffn_down)
            n_layer = facts.n_layer
            if ftype == FT.MOSTLY_Q4_K_M:
                if facts.arch == "falcon":
                    new_type = (QT.Q6_K if i_layer < n_layer // 16
                                else QT.Q5_K if use_more_bits(i_layer, n_layer) else QT.Q4_K)
                elif use_more_bits(i_layer, n_layer):
                    new_type = QT.Q6_K
            elif ftype == FT.MOSTLY_Q5_K_M and use_more_bits(i_layer, n_layer):
                new_type = QT.Q6_K
            self.i_ffn_down += 1
        elif cat == ATTN_OUTPUT and facts.arch != "falcon" and facts.n_expert == 8 and ftype == FT.MOSTLY_Q4_K_M:
            new_type = QT.Q5_K
        return new_type

    def _layer_of(self, name: str, counter: int) -> int:
        if self.facts.n_expert <= 1:
            return counter
        m = re.match(r"blk\.(\d+)\.", name)  # expert tensors are not in layer order: read the name
        return int(m.group(1)) if m else counter


_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


def fallback_type(qtype: QT, n_cols: int) -> QT:
    """A type whose blocks fit rows of n_cols (llama-quant.cpp tensor_type_fallback)."""
    if row_fits(n_cols, qtype):
        return qtype
    alt = _FALLBACK.get(qtype, QT.F16)
    return alt if row_fits(n_cols, alt) else QT.F16


def plan_types(xt: ExportType, tensors: dict[str, tuple[tuple[int, ...], QT]],
               facts: ModelFacts) -> dict[str, TensorPlan]:
    """The storage type of every tensor, keyed by name; `tensors` maps name -> (shape, current type)."""
    names = llama_tensor_order(tensors)
    state = _MixState(xt, facts, names)
    plans = {}
    for name in names:
        shape, src = tensors[name]
        if not allows_quantization(name, shape):
            plans[name] = TensorPlan(name, shape, src, src, quantizable=False)
            continue
        n_cols = shape[-1]
        wanted = xt.default
        if xt.quantized and not xt.pure:
            wanted = state.mix_type(name, n_cols)
        dst = fallback_type(wanted, n_cols)
        plans[name] = TensorPlan(name, shape, src, dst, quantizable=True, fallback=dst != wanted)
    return plans
