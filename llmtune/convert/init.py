"""`llmtune init`: a new, randomly initialised model to train from scratch.

The shape comes from a TOML file (a `[model]` table, see configs/llama-15m.toml), the
tokenizer (every `tokenizer.*` key) from an existing GGUF, so the new model tokenizes
exactly like that one. Initialisation follows GPT-2 / llama2.c: every matrix ~ normal(0, std),
the two projections that write into the residual stream (attn_output, ffn_down) scaled by
1/sqrt(2 * n_layer) so the residual's variance does not grow with depth, norm weights 1.

The file is streamed: its header first, then every tensor drawn, encoded (--type, with export's
per-tensor plan and quantizers) and written a piece of rows at a time, so memory stays at one piece
whatever the model's size (a 7B-class shape is 30 GB of float32).
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT, LlamaFileType

from llmtune.arch import get_family, supported
from llmtune.arch.family import TensorSpec
from llmtune.arch.hparams import HParams
from llmtune.convert.export import Progress, export_metadata, tensor_plans
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import (
    GGUF_KIND,
    MetaValue,
    TensorSlot,
    check_output_path,
    load_gguf,
    metadata_nbytes,
    plain_metadata,
    write_gguf_streamed,
)
from llmtune.quant import blocks as quants
from llmtune.quant.plan import ExportType, export_type
from llmtune.resources import available_memory, check_disk_space
from llmtune.tomlfile import read_toml


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
    head_dim: int | None = None  # None: n_embd / n_head (attention.key_length when set)
    extra: dict = field(default_factory=dict)  # the family's own keys (Family.config_keys)
    rope_freq_base: float = 10000.0
    norm_eps: float = 1e-5
    tied_output: bool = False

    def hparams(self, n_vocab: int) -> HParams:
        """The family's hyper-parameters for this shape (the family fixes rope mode, norm kind...)."""
        head_dim = self.head_dim or self.n_embd // self.n_head
        return get_family(self.architecture).make_hparams(
            n_vocab=n_vocab,
            n_ctx_train=self.n_ctx,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv or self.n_head,
            n_ff=self.n_ff,
            n_rot=self.n_rot or head_dim,
            head_dim_kq=self.head_dim,
            rope_freq_base=self.rope_freq_base,
            norm_eps=self.norm_eps,
            tied_output=self.tied_output,
            **self.extra,
        )


@dataclass(frozen=True)
class InitConfig:
    model: ModelShape
    std: float = 0.02


# -- config file -------------------------------------------------------------------------------


def load_init_config(path: str | os.PathLike) -> InitConfig:
    """Parse and validate an init config; every problem names the file and the key."""
    path = Path(path)
    doc = read_toml(path)
    unknown = set(doc) - {"model", "init"}
    if unknown:
        raise LlmtuneError(f"{path}: unknown table(s) {', '.join(sorted(unknown))} (expected [model] and [init])")
    if not isinstance(doc.get("model"), dict):
        raise LlmtuneError(f"{path}: missing the [model] table")
    shape = _model_shape(path, doc["model"])
    init_types = {f.name: str(f.type) for f in fields(InitConfig) if f.name != "model"}
    init = _typed_table(path, "init", doc.get("init", {}), init_types)
    config = InitConfig(shape, **init)
    _validate(path, config)
    return config


def _model_shape(path: Path, values: dict) -> ModelShape:
    """The [model] table: ModelShape's keys, plus the keys the chosen family adds (its
    `config_keys`, HParams fields such as sliding_window or attn_softcap)."""
    arch = values.get("architecture", "llama") if isinstance(values, dict) else "llama"
    family_keys = get_family(arch, str(path)).config_keys if arch in supported() else {}
    known = {f.name: str(f.type) for f in fields(ModelShape) if f.name != "extra"}
    checked = _typed_table(path, "model", values, {**known, **family_keys}, required=_required(ModelShape))
    extra = {k: checked.pop(k) for k in list(checked) if k in family_keys}
    return ModelShape(**checked, extra=extra)


def _required(cls) -> set[str]:
    return {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}


def _typed_table(path: Path, table: str, values: dict, types: dict[str, str], required=()) -> dict:
    """`values` checked against `types` (key -> type name): known keys, right types, required ones present."""
    if not isinstance(values, dict):
        raise LlmtuneError(f"{path}: [{table}] must be a table")
    for key, value in values.items():
        type_name = types.get(key)
        if type_name is None:
            raise LlmtuneError(f"{path}: unknown key {key!r} in [{table}] (known: {', '.join(types)})")
        if not _has_type(value, type_name):
            raise LlmtuneError(f"{path}: [{table}] {key} = {value!r} should be {_type_words(type_name)}")
    for name in required:
        if name not in values:
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
    if m.architecture not in supported():
        raise LlmtuneError(
            f"{path}: unsupported architecture {m.architecture!r} (supported: {', '.join(supported())})"
        )
    for key in ("n_embd", "n_layer", "n_head", "n_ff", "n_ctx", "n_head_kv", "n_rot", "head_dim"):
        value = getattr(m, key)
        if value is not None and value <= 0:
            raise LlmtuneError(f"{path}: [model] {key} must be positive, got {value}")
    for key, value in (("rope_freq_base", m.rope_freq_base), ("norm_eps", m.norm_eps), ("std", config.std)):
        if not value > 0:
            raise LlmtuneError(f"{path}: {key} must be positive, got {value}")
    n_head_kv = m.n_head_kv or m.n_head
    if (m.head_dim is None and m.n_embd % m.n_head) or m.n_head % n_head_kv:
        raise LlmtuneError(
            f"{path}: n_embd ({m.n_embd}) must be a multiple of n_head ({m.n_head}), "
            f"and n_head a multiple of n_head_kv ({n_head_kv})"
        )
    head_dim = m.head_dim or m.n_embd // m.n_head
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
    """The general.* keys and the family's {arch}.* keys llama.cpp writes for an all-F32 model."""
    meta = {
        "general.architecture": MetaValue(hp.arch, VT.STRING),
        "general.name": MetaValue(name, VT.STRING),
        "general.file_type": MetaValue(int(LlamaFileType.ALL_F32), VT.UINT32),
    }
    for key, (value, vtype) in get_family(hp.arch).write_hparams(hp).items():
        meta[key] = MetaValue(value, vtype)
    return meta


PIECE_ELEMENTS = 1 << 22  # values drawn, encoded and written at a time (16 MiB as float32)


def init_specs(hp: HParams, optional=()) -> list[TensorSpec]:
    """The tensors init writes, in file order: the family's required ones plus the `optional` named."""
    return [spec for spec in get_family(hp.arch).tensors(hp) if not spec.optional or spec.name in optional]


def init_tensors(hp: HParams, std: float, seed: int, test_weights: bool = False, optional=()):
    """(name, float32 array, F32) for every required tensor of the family, drawn in file order.

    test_weights: every tensor random, for cross-checks against other implementations, so that
    leaving out any feature moves the numbers: norm weights 1 + normal(0, 0.1), biases
    normal(0, 0.1), frequency factors uniform(1, 8). `optional`: names of optional tensors to
    write as well (e.g. "rope_freqs.weight")."""
    for spec, pieces in init_pieces(hp, std, seed, test_weights, optional, piece_elements=None):
        yield spec.name, next(pieces).reshape(spec.shape), QT.F32


def init_pieces(hp: HParams, std: float, seed: int, test_weights: bool = False, optional=(), *,
                piece_elements: int | None) -> Iterator[tuple[TensorSpec, Iterator[np.ndarray]]]:
    """(spec, pieces) for every tensor of init_tensors, in the same order and from the same random
    stream: `pieces` yields the tensor's float32 values as consecutive blocks of rows, (rows,
    n_cols), each of at most `piece_elements` values (or one row; None: the whole tensor at once).
    numpy's generators fill an array one value after the other, so drawing a tensor in blocks gives
    exactly the values of drawing it whole. Consume each `pieces` before asking for the next tensor."""
    rng = np.random.default_rng(seed)
    stds = {"normal": std, "residual": std if test_weights else std / math.sqrt(2 * hp.n_layer)}
    for spec in init_specs(hp, optional):
        yield spec, _draw_rows(rng, spec.init, spec.shape, stds, test_weights, piece_elements)


def _draw_rows(rng, init: str, shape: tuple[int, ...], stds: dict, test_weights: bool, piece_elements: int | None):
    n_cols = shape[-1]
    n_rows = math.prod(shape[:-1])
    step = n_rows if piece_elements is None else max(1, piece_elements // n_cols)
    for start in range(0, n_rows, step):
        yield _draw(rng, init, (min(step, n_rows - start), n_cols), stds, test_weights)


def _draw(rng, init: str, shape: tuple[int, ...], stds: dict, test_weights: bool) -> np.ndarray:
    """The next values of one tensor (init: its TensorSpec.init) from `rng`."""
    if init in stds:
        data = rng.standard_normal(shape, dtype=np.float32)
        data *= stds[init]
    elif not test_weights:
        data = np.full(shape, 1.0 if init == "ones" else 0.0, dtype=np.float32)
    elif init == "factors":
        data = rng.uniform(1.0, 8.0, shape).astype(np.float32)
    else:
        data = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
        data += np.float32(1.0 if init == "ones" else 0.0)
    return data


def init_model(
    config_path: str | os.PathLike,
    vocab_from: str | os.PathLike,
    out_path: str | os.PathLike,
    seed: int = 0,
    *,
    type: str = "f32",
    test_weights: bool = False,
    optional=(),
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Write a new model shaped by `config_path` with the tokenizer of `vocab_from`.

    The same config, vocabulary and seed give a byte-identical file. `type` (an export type, f32
    by default) stores the weights as `llmtune export --type` would: the file is byte for byte
    `init` followed by `export --type TYPE` (f32: init's own file, which has no
    general.quantization_version). The tensors are drawn, encoded and written PIECE_ELEMENTS
    values at a time (write_gguf_streamed), so memory holds one piece whatever the model's size.
    test_weights/optional: see init_tensors (random-everything models for cross-checks). force:
    replace an existing `out_path` that is not a GGUF (--force). progress(done, total, name): called
    after each tensor is written."""
    if seed < 0:
        raise LlmtuneError(f"--seed: must be 0 or more, got {seed}")
    xt = export_type(type)
    config = load_init_config(config_path)
    out_path = check_output_path(out_path, config_path, vocab_from, replaces=GGUF_KIND, force=force)
    hp, meta, slots = init_layout(config_path, config, vocab_from, xt, optional)
    _check_resources(config_path, out_path, slots, meta, xt.name)
    tensors = init_pieces(hp, config.std, seed, test_weights, optional, piece_elements=PIECE_ELEMENTS)

    def encoded(slot: TensorSlot) -> Iterator[np.ndarray]:
        spec, rows = next(tensors)
        assert spec.name == slot.name, (spec.name, slot.name)
        for block in rows:
            piece = quants.quantize(block, slot.type)
            del block  # the next block is drawn with only this piece held
            yield piece
            del piece

    done = iter(range(1, len(slots) + 1))
    on_written = None if progress is None else lambda name: progress(next(done), len(slots), name)
    return write_gguf_streamed(out_path, hp.arch, meta, slots, encoded, inputs=[config_path, vocab_from],
                               progress=on_written)


def init_layout(config_path, config: InitConfig, vocab_from: str | os.PathLike, xt: ExportType,
                optional=()) -> tuple[HParams, dict[str, MetaValue], list[TensorSlot]]:
    """What init writes before any tensor is drawn: the hyper-parameters, the metadata and every
    tensor's slot (name, shape, and the type `llmtune export --type` gives it)."""
    tok_meta = tokenizer_metadata(vocab_from)
    hp = config.model.hparams(n_vocab=len(tok_meta["tokenizer.ggml.tokens"].value))
    meta = {**model_metadata(hp, config.model.name or Path(config_path).stem), **tok_meta}
    specs = init_specs(hp, optional)
    plans = tensor_plans(xt, {spec.name: (spec.shape, QT.F32) for spec in specs}, plain_metadata(meta))
    if xt.name != "f32":  # f32: init's own file, as before --type existed
        meta = export_metadata(meta, xt)
    return hp, meta, [TensorSlot(spec.name, spec.shape, plans[spec.name].dst_type) for spec in specs]


def _check_resources(config_path, out_path: Path, slots: list[TensorSlot], meta: dict[str, MetaValue],
                     type_name: str) -> None:
    """Refuse, before drawing any tensor, a model whose largest piece does not fit in memory or
    whose file does not fit on the output's disk. Memory holds the header (its parts, then joined)
    and one piece: its float32 values, their encoding and, for a quantized type, the quantizer's
    scratch (at most another float32 piece: gguf's Q8_0 needs ~3 bytes a value, the K-quants ~40 a
    value of their 512-block chunk)."""
    n_params = sum(math.prod(slot.shape) for slot in slots)
    header = metadata_nbytes(meta) + sum(64 + len(slot.name) for slot in slots)
    piece, what = max((_piece_bytes(slot) for slot in slots), default=(0, ""))
    need = 2 * header + piece
    avail = available_memory()
    if avail is not None and need > avail:
        raise LlmtuneError(
            f"{config_path}: writing a model of {n_params:,} parameters needs about {need / 2**20:,.0f} MiB of memory "
            f"(the header and {what}) but only {avail / 2**20:,.0f} MiB is available"
        )
    file_bytes = header + sum(slot.n_bytes for slot in slots)
    check_disk_space(out_path.parent, file_bytes, f"the new model's {n_params:,} parameters ({type_name})")


def _piece_bytes(slot: TensorSlot) -> tuple[int, str]:
    """The bytes one piece of `slot` takes to draw, encode and write, and what the piece is."""
    n_cols = slot.shape[-1]
    rows = min(math.prod(slot.shape[:-1]), max(1, PIECE_ELEMENTS // n_cols))
    values = rows * n_cols * 4
    if slot.type == QT.F32:
        return values, f"{rows:,} rows of {slot.name}"
    encoded = TensorSlot(slot.name, (rows, n_cols), slot.type).n_bytes
    return 2 * values + encoded, f"{rows:,} rows of {slot.name} as {slot.type.name}"
