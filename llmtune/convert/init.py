"""`llmtune init`: a new, randomly initialised model to train from scratch.

The shape comes from a TOML file (a `[model]` table, see configs/llama-15m.toml), the
tokenizer (every `tokenizer.*` key) from an existing GGUF, so the new model tokenizes
exactly like that one. Initialisation follows GPT-2 / llama2.c: every matrix ~ normal(0, std),
the two projections that write into the residual stream (attn_output, ffn_down) scaled by
1/sqrt(2 * n_layer) so the residual's variance does not grow with depth, norm weights 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT, LlamaFileType

from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue, load_gguf, write_gguf
from llmtune.model.hparams import SUPPORTED_ARCHS, HParams

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib

RESIDUAL_PROJECTIONS = ("attn_output.weight", "ffn_down.weight")


@dataclass(frozen=True)
class ModelShape:
    """The `[model]` table of an init config; defaults are llama.cpp's for missing keys."""

    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    architecture: str = "llama"
    name: str = ""
    n_ctx: int = 2048
    n_head_kv: int | None = None  # None: n_head (no grouped-query attention)
    n_rot: int | None = None  # None: head_dim (rotate the whole head)
    rope_freq_base: float = 10000.0
    norm_eps: float = 1e-5
    tied_output: bool = False

    def hparams(self, n_vocab: int) -> HParams:
        head_dim = self.n_embd // self.n_head
        return HParams(
            arch=self.architecture,
            n_vocab=n_vocab,
            n_ctx_train=self.n_ctx,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv or self.n_head,
            n_ff=self.n_ff,
            n_rot=self.n_rot or head_dim,
            rope_freq_base=self.rope_freq_base,
            norm_eps=self.norm_eps,
            tied_output=self.tied_output,
        )


@dataclass(frozen=True)
class InitConfig:
    model: ModelShape
    std: float = 0.02


# -- config file -------------------------------------------------------------------------------


def load_init_config(path: str | os.PathLike) -> InitConfig:
    """Parse and validate an init config; every problem names the file and the key."""
    path = Path(path)
    doc = _read_toml(path)
    unknown = set(doc) - {"model", "init"}
    if unknown:
        raise LlmtuneError(f"{path}: unknown table(s) {', '.join(sorted(unknown))} (expected [model] and [init])")
    if not isinstance(doc.get("model"), dict):
        raise LlmtuneError(f"{path}: missing the [model] table")
    shape = ModelShape(**_typed_table(path, "model", doc["model"], ModelShape))
    init = _typed_table(path, "init", doc.get("init", {}), InitConfig, skip=("model",))
    config = InitConfig(shape, **init)
    _validate(path, config)
    return config


def _read_toml(path: Path) -> dict:
    if not path.exists():
        raise LlmtuneError(f"{path}: no such file")
    if path.is_dir():
        raise LlmtuneError(f"{path}: is a directory, not a TOML config")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise LlmtuneError(f"{path}: invalid TOML ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmtuneError(f"{path}: cannot read ({exc})") from None


def _typed_table(path: Path, table: str, values: dict, cls, skip=()) -> dict:
    """`values` checked against the dataclass `cls`: known keys, right types, required ones present."""
    if not isinstance(values, dict):
        raise LlmtuneError(f"{path}: [{table}] must be a table")
    specs = {f.name: f for f in fields(cls) if f.name not in skip}
    for key, value in values.items():
        spec = specs.get(key)
        if spec is None:
            raise LlmtuneError(f"{path}: unknown key {key!r} in [{table}] (known: {', '.join(specs)})")
        if not _has_type(value, str(spec.type)):
            raise LlmtuneError(f"{path}: [{table}] {key} = {value!r} should be {_type_words(str(spec.type))}")
    for name, spec in specs.items():
        if name not in values and spec.default is MISSING:
            raise LlmtuneError(f"{path}: [{table}] needs {name}")
    return dict(values)


def _has_type(value, type_name: str) -> bool:
    if value is None:
        return False  # TOML has no null; a None here would be a bug, not a user value
    if isinstance(value, bool):
        return type_name.startswith("bool")
    if isinstance(value, int):
        return type_name.startswith(("int", "float"))
    if isinstance(value, float):
        return type_name.startswith("float")
    return isinstance(value, str) and type_name.startswith("str")


def _type_words(type_name: str) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[
        type_name.split(" ")[0]
    ]


def _validate(path: Path, config: InitConfig) -> None:
    m = config.model
    if m.architecture not in SUPPORTED_ARCHS:
        raise LlmtuneError(
            f"{path}: unsupported architecture {m.architecture!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    for key in ("n_embd", "n_layer", "n_head", "n_ff", "n_ctx", "n_head_kv", "n_rot"):
        value = getattr(m, key)
        if value is not None and value <= 0:
            raise LlmtuneError(f"{path}: [model] {key} must be positive, got {value}")
    for key, value in (("rope_freq_base", m.rope_freq_base), ("norm_eps", m.norm_eps), ("std", config.std)):
        if not value > 0:
            raise LlmtuneError(f"{path}: {key} must be positive, got {value}")
    n_head_kv = m.n_head_kv or m.n_head
    if m.n_embd % m.n_head or m.n_head % n_head_kv:
        raise LlmtuneError(
            f"{path}: n_embd ({m.n_embd}) must be a multiple of n_head ({m.n_head}), "
            f"and n_head a multiple of n_head_kv ({n_head_kv})"
        )
    head_dim = m.n_embd // m.n_head
    n_rot = m.n_rot or head_dim
    if n_rot % 2 or n_rot > head_dim:
        raise LlmtuneError(f"{path}: n_rot ({n_rot}) must be even and at most head_dim ({head_dim}) for RoPE")


# -- the model -----------------------------------------------------------------------------------


def tokenizer_metadata(vocab_from: str | os.PathLike) -> dict[str, MetaValue]:
    """Every `tokenizer.*` key of a GGUF, with its types, in file order."""
    gf = load_gguf(vocab_from)
    meta = {k: v for k, v in gf.meta.items() if k.startswith("tokenizer.")}
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or not tokens.value:
        raise LlmtuneError(f"{vocab_from}: has no tokenizer (tokenizer.ggml.tokens is missing)")
    return meta


def model_metadata(hp: HParams, name: str) -> dict[str, MetaValue]:
    """The general.* and {arch}.* keys llama.cpp writes for an all-F32 model of this shape."""
    u32 = lambda v: MetaValue(int(v), VT.UINT32)  # noqa: E731
    f32 = lambda v: MetaValue(float(v), VT.FLOAT32)  # noqa: E731
    a = hp.arch
    return {
        "general.architecture": MetaValue(a, VT.STRING),
        "general.name": MetaValue(name, VT.STRING),
        "general.file_type": u32(LlamaFileType.ALL_F32),
        f"{a}.vocab_size": u32(hp.n_vocab),
        f"{a}.context_length": u32(hp.n_ctx_train),
        f"{a}.embedding_length": u32(hp.n_embd),
        f"{a}.feed_forward_length": u32(hp.n_ff),
        f"{a}.block_count": u32(hp.n_layer),
        f"{a}.attention.head_count": u32(hp.n_head),
        f"{a}.attention.head_count_kv": u32(hp.n_head_kv),
        f"{a}.rope.dimension_count": u32(hp.n_rot),
        f"{a}.rope.freq_base": f32(hp.rope_freq_base),
        f"{a}.attention.layer_norm_rms_epsilon": f32(hp.norm_eps),
    }


def init_tensors(hp: HParams, std: float, seed: int):
    """(name, float32 array, F32) for every tensor of the architecture, drawn in file order."""
    from llmtune.arch import get_arch

    rng = np.random.default_rng(seed)
    residual_std = std / math.sqrt(2 * hp.n_layer)
    for name, shape in get_arch(hp.arch).tensor_shapes(hp).items():
        if name.endswith("norm.weight"):
            data = np.ones(shape, dtype=np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32)
            data *= residual_std if name.endswith(RESIDUAL_PROJECTIONS) else std
        yield name, data, QT.F32


def init_model(
    config_path: str | os.PathLike,
    vocab_from: str | os.PathLike,
    out_path: str | os.PathLike,
    seed: int = 0,
) -> Path:
    """Write a new model shaped by `config_path` with the tokenizer of `vocab_from`.

    The same config, vocabulary and seed give a byte-identical file.
    """
    if seed < 0:
        raise LlmtuneError(f"--seed: must be 0 or more, got {seed}")
    config = load_init_config(config_path)
    tok_meta = tokenizer_metadata(vocab_from)
    hp = config.model.hparams(n_vocab=len(tok_meta["tokenizer.ggml.tokens"].value))
    meta = {**model_metadata(hp, config.model.name or Path(config_path).stem), **tok_meta}
    tensors = init_tensors(hp, config.std, seed)
    return write_gguf(out_path, hp.arch, meta, tensors, inputs=[config_path, vocab_from])
