"""What every architecture family provides, as llama.cpp's load_hparams / load_tensors /
build_graph trio does for each `LLM_ARCH_*`: how its hyper-parameters are read from GGUF
metadata (and written back by `init`), its tensors with their shapes and initialisers, and its
graph. A family is one subclass in one module, registered with `@register`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from gguf import GGUFValueType as VT

from llmtune.arch.hf_names import HFNames
from llmtune.arch.hparams import HParams, MetaKeys
from llmtune.errors import LlmtuneError

if TYPE_CHECKING:
    from llmtune.arch.context import BuildContext
    from llmtune.graph.node import Node


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a family: GGUF name, numpy shape (GGUF ne reversed), whether a file may
    omit it, and how `init` fills it: "normal" (std), "residual" (std / sqrt(2 n_layer), for the
    projections that write into the residual stream), "ones" (norm weights), "zeros" (biases) or
    "factors" (rope frequency factors)."""

    name: str
    shape: tuple[int, ...]
    init: str = "normal"
    optional: bool = False


class Family:
    """Base family: a pre-norm decoder with llama's metadata keys. Subclasses override what differs."""

    name: str = ""
    # what is fixed for the whole family (HParams fields), whatever the file's shape
    traits: dict = {}
    # HParams fields an `init` config's [model] table may set for this family (name -> type name)
    config_keys: dict = {}
    # its tensors' names in Hugging Face transformers checkpoints (arch/hf_names.py); None: not mapped
    hf: Optional[HFNames] = None

    def make_hparams(self, **fields) -> HParams:
        """HParams of this family: its traits, then the given fields."""
        return HParams(**{"arch": self.name, **self.traits, **fields})

    # ------------------------------------------------------------------ hyper-parameters
    def read_hparams(self, keys: MetaKeys, n_vocab_default: int, tensor_names: set[str] | None) -> HParams:
        """llama.cpp's load_hparams: the keys every decoder has, llama.cpp's defaults for optional ones."""
        n_embd = keys.int("embedding_length")
        n_head = keys.int("attention.head_count")
        head_dim = keys.int("attention.key_length", None)
        default_head_dim = head_dim or (n_embd // n_head if n_head > 0 else 0)
        return self.make_hparams(
            arch=keys.arch,
            n_vocab=keys.int("vocab_size", n_vocab_default),
            n_ctx_train=keys.int("context_length", 2048),
            n_embd=n_embd,
            n_layer=keys.int("block_count"),
            n_head=n_head,
            n_head_kv=keys.int("attention.head_count_kv", n_head),
            n_ff=keys.int("feed_forward_length"),
            n_rot=keys.int("rope.dimension_count", default_head_dim),
            head_dim_kq=head_dim,
            rope_freq_base=keys.float("rope.freq_base", 10000.0),
            rope_freq_scale=rope_freq_scale(keys),
            # RMSNorm families store layer_norm_rms_epsilon; LayerNorm ones layer_norm_epsilon
            norm_eps=keys.float("attention.layer_norm_rms_epsilon", keys.float("attention.layer_norm_epsilon", 1e-5)),
            tied_output=tensor_names is not None and "output.weight" not in tensor_names,
        )

    def write_hparams(self, hp: HParams) -> dict:
        """The `{arch}.*` keys (value, GGUF type) that read_hparams reads back as `hp` (for `init`)."""
        u32 = lambda v: (int(v), VT.UINT32)  # noqa: E731
        f32 = lambda v: (float(v), VT.FLOAT32)  # noqa: E731
        keys = {
            "vocab_size": u32(hp.n_vocab),
            "context_length": u32(hp.n_ctx_train),
            "embedding_length": u32(hp.n_embd),
            "feed_forward_length": u32(hp.n_ff),
            "block_count": u32(hp.n_layer),
            "attention.head_count": u32(hp.n_head),
            "attention.head_count_kv": u32(hp.n_head_kv),
            "rope.dimension_count": u32(hp.n_rot),
            "rope.freq_base": f32(hp.rope_freq_base),
            "attention.layer_norm_rms_epsilon" if hp.norm_kind == "rms"
                else "attention.layer_norm_epsilon": f32(hp.norm_eps),
        }
        if hp.head_dim_kq is not None:
            keys["attention.key_length"] = keys["attention.value_length"] = u32(hp.head_dim_kq)
        return {f"{hp.arch}.{k}": v for k, v in keys.items()}

    # ------------------------------------------------------------------ tensors
    def tensors(self, hp: HParams) -> list[TensorSpec]:
        """Every tensor of a model with these hyper-parameters, in llama.cpp's file order."""
        raise NotImplementedError

    # ------------------------------------------------------------------ graph
    def build(self, ctx: "BuildContext") -> "Node":
        """Logits [n_seq * (n_tok - logits_start), n_vocab] for the batch of `ctx`."""
        raise NotImplementedError


ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's LLAMA_ROPE_SCALING_TYPES


def rope_freq_scale(keys: MetaKeys) -> float:
    """The rotary frequency scale as llama.cpp's load_hparams and context set it: 1 / rope.scaling.factor
    (or the older rope.scale_linear; absent or 0: 1) whatever rope.scaling.type says (default
    "linear"), except "none", which never scales. Llama 3's "llama3" scaling is no type: the converter
    writes its factors as rope_freqs.weight. YaRN's ramp is not implemented: a yarn file that scales is
    refused rather than run wrong."""
    kind = keys.get("rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise LlmtuneError(f"{keys.source}: {keys.arch}.rope.scaling.type {kind!r} is not one llama.cpp knows "
                           f"({', '.join(ROPE_SCALING_TYPES)})")
    factor = keys.float("rope.scaling.factor", keys.float("rope.scale_linear", 0.0))
    if factor < 0:
        raise LlmtuneError(f"{keys.source}: {keys.arch}.rope.scaling.factor must be positive, got {factor}")
    if factor == 0 or kind == "none":
        return 1.0
    if kind == "yarn" and factor != 1:
        raise LlmtuneError(f"{keys.source}: YaRN rope scaling ({keys.arch}.rope.scaling.factor {factor}) "
                           "is not supported")
    return 1.0 / factor


def output_tensors(hp: HParams, norm_bias: bool = False) -> list[TensorSpec]:
    """token_embd, the final norm and, unless tied to token_embd, the vocabulary projection."""
    specs = [TensorSpec("token_embd.weight", (hp.n_vocab, hp.n_embd)),
             TensorSpec("output_norm.weight", (hp.n_embd,), "ones")]
    if norm_bias:
        specs.append(TensorSpec("output_norm.bias", (hp.n_embd,), "zeros"))
    if not hp.tied_output:
        specs.append(TensorSpec("output.weight", (hp.n_vocab, hp.n_embd)))
    return specs
