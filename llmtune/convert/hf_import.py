"""`llmtune import HF_DIR -o MODEL.gguf`: a local Hugging Face model folder as a GGUF model, as llama.cpp's
convert_hf_to_gguf.py writes it (same tensors, types, bytes and metadata; bench/check_hf_import.py).

The folder: config.json, model.safetensors (or model-*.safetensors with model.safetensors.index.json),
a SentencePiece tokenizer.model or a byte-level BPE tokenizer.json (hf_vocab.py, hf_spm.py). The
tensors are renamed by the family's HF table (arch/hf_names.py; llama's q/k rows permuted back,
LlamaModel.permute; gemma's norms + 1: hf_config's norm_offset), the hyper-parameters read by
arch/hf_config.py's table, and the file is written one piece of one tensor at a time
(write_gguf_streamed): memory holds a few pieces, whatever the model's size. The safetensors files are
checked with the `safetensors` library and their data read through a memory map (BF16 included,
which numpy cannot name). Never the network: a hub name is refused with the path form to use.
An image-text checkpoint (MULTIMODAL: Gemma3ForConditionalGeneration) is imported as its text model,
as the converter's TextModel reads it (text_model_config, text_tensor_name); its vision part (the
converter's --mmproj file) is not written.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType as QT, GGUFValueType as VT

from llmtune.arch import check_tensors, get_family, read_hparams
from llmtune.arch.hf_config import TEXT_DEFAULTS, gguf_hparams, hf_config_of, rope_param
from llmtune.backends.cpu import to_f16
from llmtune.convert.export import tensor_plans
from llmtune.convert.hf_rope import llama3_rope_factors
from llmtune.convert.hf_vocab import SPECIAL_TYPES, read_json, vocab_metadata
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import (
    GGUF_KIND,
    MetaValue,
    TensorSlot,
    check_output_path,
    metadata_nbytes,
    write_gguf_streamed,
)
from llmtune.quant import blocks as quants
from llmtune.quant.plan import export_type
from llmtune.resources import check_disk_space

PIECE_ELEMENTS = 1 << 22  # values read, converted and written at a time (16 MiB as float32)
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py's --outtype; the others: llmtune export's
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}
_SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")  # prepare_tensors drops these
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class SourceTensor:
    """One safetensors tensor: file, HF name, GGUF name, dtype, GGUF shape, byte offset of its data, and
    whether the file holds it transposed (a Conv1D weight, [n_in, n_out]: GPT2Model's transpose)."""

    path: Path
    hf_name: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    transposed: bool = False


def import_hf(folder: str | os.PathLike, out_path: str | os.PathLike, type: str = "f16", force: bool = False,
              progress: Progress | None = None) -> Path:
    """Write the HF model in `folder` to `out_path` with its matrices as `type`: f32, f16, bf16, q8_0 as the
    converter's --outtype (1-D tensors and norms F32); any other `llmtune export` type as import to f32
    followed by `llmtune export --type` (llama-quantize's per-tensor policy), in one pass."""
    xt = export_type(type)
    folder = _check_folder(folder)
    out = check_output_path(out_path, folder / "config.json", replaces=GGUF_KIND, force=force)
    raw = _config(folder)
    arch = _family_arch(folder, raw)
    config = text_model_config(raw, arch)
    first_meta, generated = longrope(config, arch, folder / "config.json")
    hparam_meta = gguf_hparams(config, arch, extra=False, where=str(folder))
    extra_meta = gguf_hparams(config, arch, extra=True, where=str(folder))
    generated.update(llama3_freqs(config, arch, folder / "config.json"))
    _refuse_rope_scaling(config, arch, bool(generated), folder / "config.json")
    sources = read_sources(folder, get_family(arch).hf, _SKIPPED + _NOT_READ.get(arch, ()))
    vocab = vocab_metadata(folder, config, arch)
    plain = {"general.architecture": arch, **{k: v for k, (v, _) in {**hparam_meta, **extra_meta}.items()},
             **{k: mv.value for k, mv in first_meta.items()},
             "tokenizer.ggml.tokens": vocab["tokenizer.ggml.tokens"].value}
    shapes = {**{name: arr.shape for name, arr in generated.items()}, **{s.name: s.shape for s in sources}}
    hp = read_hparams(plain, set(shapes), str(folder / "config.json"))
    files = ", ".join(sorted({s.path.name for s in sources}))
    check_tensors(hp, shapes, f"{folder / 'config.json'} and {files}")
    plans = tensor_plans(xt, {name: (shape, QT.F32) for name, shape in shapes.items()}, plain)
    slots = [TensorSlot(name, arr.shape, QT.F32) for name, arr in generated.items()]  # the converter's first
    slots += [TensorSlot(s.name, s.shape, _stored_type(s, plans[s.name].dst_type)) for s in sources]
    general = general_metadata(folder, arch, sum(math.prod(shape) for shape in shapes.values()))
    meta = {
        "general.architecture": general.pop("general.architecture"),
        **first_meta,  # added while the converter prepares the tensors, before its other keys
        **general,
        **{k: MetaValue(v, t) for k, (v, t) in hparam_meta.items()},
        "general.file_type": MetaValue(int(xt.ftype), VT.UINT32),
        **{k: MetaValue(v, t) for k, (v, t) in extra_meta.items()},
        "general.quantization_version": MetaValue(GGML_QUANT_VERSION, VT.UINT32),
        **vocab,
    }
    if arch == "llama" and config.get("vocab_size", 32000) == 49152:  # LlamaModel.set_vocab: "granite small models"
        meta["tokenizer.ggml.add_bos_token"] = MetaValue(False, VT.BOOL)
    check_disk_space(out.parent, metadata_nbytes(meta) + sum(slot.n_bytes for slot in slots),
                     f"the imported model's {len(slots)} tensors ({type})")
    by_name = {s.name: s for s in sources}
    rows = _row_order(get_family(arch).hf, hp)
    norm_offset = hf_config_of(arch).norm_offset  # gemma: HF stores w, llama.cpp 1 + w

    done = iter(range(1, len(slots) + 1))
    on_written = None if progress is None else lambda name: progress(next(done), len(slots), name)
    ring = _Ring()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="import") as pool:

        def pieces(slot: TensorSlot) -> Iterator[np.ndarray]:
            if slot.name in generated:
                yield generated[slot.name]
                return
            src = by_name[slot.name]
            offset = norm_offset if src.hf_name.endswith("norm.weight") else 0.0
            yield from _pieces(src, slot.type, rows(slot.name, slot.shape), pool, offset, ring)

        return write_gguf_streamed(out, arch, meta, slots, pieces, inputs=[s.path for s in sources],
                                   progress=on_written)


def _refuse_rope_scaling(config: dict, arch: str, factors_done: bool, where: Path) -> None:
    """Rope scaling other than linear (hf_config's rows), phi3's LongRoPE and llama's llama3 factors (yarn:
    keys and a rope tensor the converter writes) is refused rather than written without it."""
    kind = _rope_kind(config)
    if kind not in ("default", "linear") and not ((arch, kind) in _FACTOR_TENSORS and factors_done):
        raise LlmtuneError(f"{where}: rope scaling {kind!r}; llmtune import does not write it yet (convert with "
                           f"llama.cpp's convert_hf_to_gguf.py)")


_FACTOR_TENSORS = {("phi3", "su"), ("phi3", "longrope"), ("phi3", "yarn"), ("llama", "llama3")}


def _rope_kind(config: dict) -> str:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    return str(rope.get("rope_type") or rope.get("type") or "default").lower()


def llama3_freqs(config: dict, arch: str, where: Path) -> dict[str, np.ndarray]:
    """LlamaModel.generate_extra_tensors: a "llama3" rope config's rope_freqs.weight (head dim / 2 factors,
    float32, computed as torch does: hf_rope.py), the only thing the converter writes for it; else nothing.
    Its defaults: rope_theta 10000, factor 8, low / high frequency factors 1 / 4, original context 8192."""
    if arch != "llama" or _rope_kind(config) != "llama3":
        return {}
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)

    def param(name, default, mirrored=False):  # TextModel mirrors some of the config's own keys into it
        value = rope.get(name, config.get(name) if mirrored else None)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise LlmtuneError(f"{where}: llama3 rope scaling's {name} must be a positive number (got {value!r})")
        return value

    dim = config.get("head_dim")
    if dim is None:
        dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
    factors = llama3_rope_factors(param("rope_theta", 10000.0, True), int(dim), param("factor", 8.0),
                                  param("low_freq_factor", 1.0), param("high_freq_factor", 4.0),
                                  param("original_max_position_embeddings", 8192, True))
    return {"rope_freqs.weight": factors}


def longrope(config: dict, arch: str, where: Path) -> tuple[dict[str, MetaValue], dict[str, np.ndarray]]:
    """Phi3MiniModel.generate_extra_tensors: a LongRoPE config's rope.scaling.attn_factor and its
    rope_factors_long / rope_factors_short tensors (float32, rope dims / 2 each); nothing otherwise."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    long, short = rope.get("long_factor"), rope.get("short_factor")
    if arch != "phi3" or not long:
        return {}, {}
    n_embd, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    rope_dims = int(float(rope_param(config, "partial_rotary_factor") or 1.0) * n_embd) // n_head
    orig = rope_param(config, "original_max_position_embeddings")
    n_ctx = config.get("n_positions") or config.get("max_position_embeddings")
    kind = str(rope.get("rope_type", rope.get("type")) or "").lower()
    if orig is None or n_ctx is None or kind not in ("su", "longrope", "yarn"):
        raise LlmtuneError(f"{where}: LongRoPE factors need max_position_embeddings, original_max_position_embeddings "
                           f"and a rope type su / longrope / yarn (got {kind or 'none'})")
    if short is None or len(long) != len(short) or len(long) != rope_dims / 2:
        raise LlmtuneError(f"{where}: long_factor / short_factor must hold {rope_dims // 2} values each "
                           f"(rope dims / 2)")
    scale = n_ctx / orig
    if scale <= 1.0:
        attn = 1.0
    elif kind == "yarn":
        attn = 0.1 * math.log(scale) + 1.0
    else:
        attn = math.sqrt(1 + math.log(scale) / math.log(orig))
    return ({f"{arch}.rope.scaling.attn_factor": MetaValue(attn, VT.FLOAT32)},
            {"rope_factors_long.weight": np.asarray(long, np.float32),
             "rope_factors_short.weight": np.asarray(short, np.float32)})


def _check_folder(folder) -> Path:
    path = Path(folder)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LlmtuneError(f"{path}: no config.json (a Hugging Face model folder holds config.json, "
                               f"*.safetensors and the tokenizer's files)")
        return path
    if not path.exists() and _HUB_NAME.match(str(folder)):
        raise LlmtuneError(f"{folder}: not a local folder; llmtune never downloads (fetch it first, e.g. "
                           f"huggingface-cli download {folder} --local-dir DIR, then: llmtune import DIR -o OUT.gguf)")
    raise LlmtuneError(f"{folder}: not a folder (llmtune import reads a local Hugging Face model folder)")


def _config(folder: Path) -> dict:
    config = read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise LlmtuneError(f"{folder / 'config.json'}: not a JSON object")
    if "text_config" in config and not isinstance(config["text_config"], dict):
        raise LlmtuneError(f"{folder / 'config.json'}: text_config is not a JSON object")
    return config


def text_model_config(config: dict, arch: str) -> dict:
    """TextModel.__init__'s hparams: a multimodal config's text_config (with the defaults AutoConfig fills in,
    hf_config.TEXT_DEFAULTS) over its root keys; the special token ids as SpecialVocab reads config.json:
    the root's, else text_config's. A config without text_config is its own."""
    text = config.get("text_config")
    if text is None:
        return config
    merged = {**config, **TEXT_DEFAULTS.get(arch, {}), **text}
    for typ in SPECIAL_TYPES:
        if config.get(f"{typ}_token_id") is not None:
            merged[f"{typ}_token_id"] = config[f"{typ}_token_id"]
    return merged


def _family_arch(folder: Path, config: dict) -> str:
    """The GGUF architecture of config.json's "architectures"[0] (text_config's when it names one:
    get_model_architecture), by the imported families' HF tables and MULTIMODAL."""
    text = config.get("text_config") or {}
    names = text.get("architectures") or config.get("architectures") or []
    hf_arch = names[0] if isinstance(names, list) and names else None
    imported = {**{get_family(a).hf.architecture: a for a in IMPORTED}, **MULTIMODAL}
    if hf_arch in imported:
        return imported[hf_arch]
    raise LlmtuneError(f"{folder / 'config.json'}: {hf_arch!r} is not an architecture llmtune imports; import reads "
                       f"{', '.join(sorted(imported))}")


# the families whose config and converter rules import covers (every family with an HF table, arch/hf_names.py)
IMPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2")
# image-text checkpoints whose text model the converter writes as the family's (Gemma3Model is registered for
# both names); their vision tower and projector go to an --mmproj file, which import does not write
MULTIMODAL = {"Gemma3ForConditionalGeneration": "gemma3"}
_NOT_READ = {"gemma2": ("lm_head.weight",),  # Gemma2Model.filter_tensors: llama.cpp never loads it
             "gpt2": (".attn.bias", ".attn.masked_bias")}  # GPT2Model.modify_tensors: causal-mask buffers


def general_metadata(folder: Path, arch: str, n_params: int) -> dict[str, MetaValue]:
    """general.* as the converter writes them: gguf-py's Metadata (name, basename, size label, ... from
    the folder's name, README.md and config.json), set_gguf_meta_model."""
    md = gguf.Metadata.load(None, folder, None, n_params)
    if md.name is None:
        md.name = folder.name
    if md.size_label is None and n_params > 0:
        md.size_label = gguf.size_label(n_params, 0, 0, 0)
    writer = gguf.GGUFWriter(None, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    md.set_gguf_meta_model(writer)
    meta = {"general.architecture": MetaValue(arch, VT.STRING)}
    for key, val in writer.kv_data[0].items():
        if key != "general.architecture":
            sub = val.sub_type if val.type == VT.ARRAY else None
            meta[key] = MetaValue(val.value, val.type, sub)
    return meta


def _stored_type(src: SourceTensor, planned: QT) -> QT:
    """prepare_tensors: 1-D tensors and norms F32, whatever the type."""
    return QT.F32 if len(src.shape) <= 1 or src.name.endswith("_norm.weight") else planned


# -- the safetensors files --------------------------------------------------------------------------------


def weight_files(folder: Path) -> list[Path]:
    """index_tensors' parts: the index's files (sorted), else model*.safetensors (sorted)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (read_json(index) or {}).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LlmtuneError(f"{index}: has no weight_map")
        files = [folder / n for n in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LlmtuneError(f"{index}: names {', '.join(missing)}, missing from the folder")
        return files
    files = sorted(p for p in folder.glob("model*.safetensors"))
    if not files:
        raise LlmtuneError(f"{folder}: no model.safetensors (nor an index of its parts); import reads safetensors "
                           f"weights only")
    return files


# TextModel.filter_tensors: a multimodal checkpoint's tensors that are not the text model's (vision tower,
# projector, audio ...), by name start and by part
_MM_STARTS = ("mlp", "vit.", "vpm.", "siglip2.", "conformer.", "merger.", "resampler.", "sound_encoder.",
              "sound_projection.", "speech_embeddings.")
_MM_PARTS = ("visual.", "vision.", "audio.", "talker.", "vision_", "audio_", "token2wav.", "code2wav.", "projector.",
             "pre_mm_projector_norm", "image_newline", "view_seperator", "patch_embed", "patch_embedding",
             "patch_merger.", "patch_merge_mlp.", "model.connector.")


def text_tensor_name(hf_name: str) -> str | None:
    """The name the converter maps (ModelBase.filter_tensors: "language_model." taken out, so transformers 5's
    "model.language_model.layers.0..." and 4's "language_model.model.layers.0..." are "model.layers.0...");
    None for a tensor TextModel.filter_tensors leaves out."""
    if hf_name.startswith(_MM_STARTS) or any(part in hf_name for part in _MM_PARTS):
        return None
    return hf_name.replace("language_model.", "")


def read_sources(folder: Path, names, skipped: tuple[str, ...] = _SKIPPED) -> list[SourceTensor]:
    """Every text-model weight of the folder's safetensors files but the `skipped` ones, in file then header
    order, with its GGUF name."""
    out = []
    for path in weight_files(folder):
        for hf_name, dtype, shape, offset in _header(path):
            text_name = text_tensor_name(hf_name)
            if text_name is None or hf_name.endswith(skipped):
                continue
            name = names.gguf_name(text_name)
            if name is None:
                raise LlmtuneError(f"{path}: tensor {hf_name!r} has no GGUF name in the {names.model_type} family")
            if dtype not in _DTYPES:
                raise LlmtuneError(f"{path}: tensor {hf_name!r} is {dtype}; import reads F32, F16, BF16, F64")
            out.append(SourceTensor(path, hf_name, name, dtype, names.hf_shape(name, shape), offset,
                                    names.transposed(name)))
    return out


def _header(path: Path) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, dtype, shape, absolute data offset) for each tensor, checked by the safetensors library
    (a damaged or truncated file is refused naming it) and against the file's size."""
    st = _safetensors()
    try:
        with st.safe_open(str(path), framework="np") as f:
            keys = set(f.keys())
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
    except Exception as exc:  # safetensors' SafetensorError (damaged, truncated), OSError, JSON
        raise LlmtuneError(f"{path}: not a readable safetensors file ({exc})") from None
    size = path.stat().st_size
    out = []
    for name, info in header.items():
        if name == "__metadata__" or name not in keys:
            continue
        start, end = info["data_offsets"]
        if 8 + n + end > size:
            raise LlmtuneError(f"{path}: truncated ({size:,} bytes; tensor {name!r} ends at {8 + n + end:,})")
        out.append((name, info["dtype"], tuple(info["shape"]), 8 + n + start))
    return out


def _safetensors():
    try:
        import safetensors  # noqa: PLC0415 - optional (the hf extra): only HF folders need it
    except ImportError:
        raise LlmtuneError("llmtune import needs the safetensors and tokenizers packages: pip install llmtune[hf]") \
            from None
    return safetensors


# -- the data --------------------------------------------------------------------------------------------


def _row_order(names, hp) -> Callable[[str, tuple[int, ...]], np.ndarray | None]:
    """GGUF row r comes from HF row order[r] (llama's q/k: LlamaModel.permute); None: the same order."""

    def order(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        hf_rows = names.hf_rows(name, shape[0], hp.n_head, hp.n_head_kv)
        return None if hf_rows is None else np.argsort(hf_rows)

    return order


class _Ring:
    """Three reused float16 buffers the F16 pieces are converted into, in turn: a fresh 8 MiB array a
    piece costs its pages' first-touch faults (sys time of the order of the conversion itself). Safe
    with _pieces' one-ahead pipeline: when piece k + 2 is converted, piece k has been written."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = [np.empty(0, np.float16)] * 3
        self.turn = 0

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        self.turn = (self.turn + 1) % 3
        n = math.prod(shape)
        if self.buffers[self.turn].size < n:
            self.buffers[self.turn] = np.empty(max(n, PIECE_ELEMENTS), np.float16)
        return self.buffers[self.turn][:n].reshape(shape)


def _pieces(src: SourceTensor, qtype: QT, order: np.ndarray | None, pool: ThreadPoolExecutor,
            offset: float = 0.0, ring: _Ring | None = None) -> Iterator[np.ndarray]:
    """The tensor's rows (+ `offset`) as `qtype`, PIECE_ELEMENTS values at a time, read through a memory
    map; the next piece is read and converted on `pool`'s thread while the writer writes this one (numpy,
    the native cast and file writes release the GIL), so reading, converting and writing overlap: memory
    holds three pieces. F32 / BF16 to F16 (the default --type): the native cast (F16C) into `ring`'s
    buffers, else numpy's astype."""
    count = math.prod(src.shape)
    data = np.memmap(src.path, dtype=_DTYPES[src.dtype], mode="r", offset=src.offset, shape=(count,))
    n_cols = src.shape[-1] if src.shape else 1
    # a transposed matrix: the GGUF rows are the file's columns (a strided view, gathered piece by piece)
    data = data.reshape(n_cols, -1).T if src.transposed else data.reshape(-1, n_cols)
    step = max(1, PIECE_ELEMENTS // n_cols)

    fast_f16 = ring is not None and qtype == QT.F16 and not offset and src.dtype in ("F32", "BF16")

    def convert(start: int) -> np.ndarray:
        rows = slice(start, start + step) if order is None else order[start:start + step]
        raw = np.ascontiguousarray(data[rows])
        if fast_f16:
            out = ring.take(raw.shape)
            if to_f16(out.reshape(-1), raw.reshape(-1), bf16=src.dtype == "BF16"):
                return out.reshape(-1) if len(src.shape) <= 1 else out
        if qtype == QT.BF16 and src.dtype == "BF16" and not offset:
            return bf16_kept(raw)
        piece = _as_float(raw, src.dtype, qtype, offset)
        return quants.quantize(piece.reshape(-1) if len(src.shape) <= 1 else piece, qtype)

    pending = pool.submit(convert, 0)
    try:
        for start in range(step, data.shape[0], step):
            ahead = pool.submit(convert, start)
            yield pending.result()
            pending = ahead
        yield pending.result()
    finally:
        pending.cancel()


def bf16_kept(raw: np.ndarray) -> np.ndarray:
    """BF16 values stored as BF16: the converter widens them to float32 and rounds back (gguf-py's
    BF16.quantize_blocks), which gives the same bits but for NaNs, made quiet; as uint8 blocks."""
    return np.where((raw & 0x7FFF) > 0x7F80, raw | np.uint16(0x40), raw).view(np.uint8)


def _as_float(raw: np.ndarray, dtype: str, qtype: QT, offset: float = 0.0) -> np.ndarray:
    """prepare_tensors' float: F16 kept for F16 output, everything else float32 (BF16: the upper half).
    `offset` (gemma's norms: modify_tensors' data_torch + 1) is added as torch adds it to what
    prepare_tensors hands over: float32 (BF16 widened first), F16 computed in float32 and rounded to F16."""
    if dtype == "BF16":
        wide = raw.astype(np.uint32)
        wide <<= 16
        return wide.view(np.float32) + np.float32(offset) if offset else wide.view(np.float32)
    if offset:
        raw = (raw.astype(np.float32) + np.float32(offset)).astype(raw.dtype)
    if dtype == "F16" and qtype == QT.F16:
        return raw
    return raw.astype(np.float32)
