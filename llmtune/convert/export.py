"""`llmtune export`: rewrite a GGUF model with its weights stored in another type (f16, q8_0, q4_k_m, ...).

The library call is `export(model_path, out_path, type, progress=None) -> ExportSummary`. Which tensor
gets which type follows llama.cpp (see quant/plan.py); the block encodings come from quant/blocks.py.
All metadata is kept; general.file_type and general.quantization_version are set as llama-quantize
sets them.

With `lora` (adapter GGUFs, llama.cpp's llama-export-lora): each adapted tensor is merged in float32,
W + scale * B A per adapter in order (model/adapter/merge.py), then stored as `type` like any other: one
command from a trained adapter to a deployable quantized file.

`export_peft(path, folder, lora=None)`: an adapter GGUF written as PEFT's adapter folder
(model/adapter/peft.py), alone or checked against its base (BASE.gguf with `lora`).

`export_hf(path, folder, dtype, lora=None)`: a model (with adapters merged first, as above) written as
a Hugging Face transformers folder (convert/hf_export.py).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType as QT, GGUFValueType as VT

from llmtune.convert.hf_export import HFWritten, write_hf
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import (
    GGUF_KIND,
    GGUFFile,
    MetaValue,
    TensorSpec,
    check_output_path,
    load_gguf,
    write_gguf,
)
from llmtune.model.adapter import BaseFingerprint, attach, merged_weight, read_adapter, write_peft
from llmtune.model.adapter.peft import PeftWritten
from llmtune.model.loaded import Model, check_model
from llmtune.quant import blocks as quants
from llmtune.quant.plan import ExportType, ModelFacts, TensorPlan, export_type, plan_types

# llama-quantize drops these: the output is always a single file.
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")

Progress = Callable[[int, int, str], None]  # (tensors done, total, name of the tensor just done)


@dataclass(frozen=True)
class TensorExport(TensorPlan):
    """A planned tensor with the bytes it took before and after the export."""

    src_bytes: int = 0
    dst_bytes: int = 0


@dataclass
class ExportSummary:
    model_path: Path
    out_path: Path
    type: str
    file_type: int
    tensors: list[TensorExport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bytes_in(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def bytes_out(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return self.out_path.stat().st_size

    @property
    def bpw_out(self) -> float:
        return 8.0 * self.bytes_out / max(self.n_params, 1)

    @property
    def quantized_bpw(self) -> float:
        """Bits per weight over the tensors the type converts (what llama.cpp's type names describe)."""
        conv = [t for t in self.tensors if t.quantizable]
        n = sum(t.n_elements for t in conv)
        return 8.0 * sum(t.dst_bytes for t in conv) / max(n, 1)

    @property
    def n_fallback(self) -> int:
        return sum(t.fallback for t in self.tensors)

    def type_counts(self) -> Counter:
        return Counter(t.dst_type.name for t in self.tensors)


def export(model_path: str | os.PathLike, out_path: str | os.PathLike, type: str,
           progress: Progress | None = None, lora=None, lora_scale=None, force: bool = False) -> ExportSummary:
    """Write `model_path` to `out_path` with its weights stored as `type` (a name in EXPORT_TYPES);
    `lora`: adapter GGUF path(s) merged into the weights first (`lora_scale`: one scale for all or
    one per adapter, default 1); `force`: replace an existing `out_path` that is not a GGUF (--force)."""
    xt = export_type(type)
    lora = [lora] if isinstance(lora, (str, os.PathLike)) else list(lora or [])
    gf = load_gguf(model_path)
    if gf.get("general.type") == "adapter":
        raise LlmtuneError(f"{model_path}: is a LoRA adapter, not a model; to merge it: "
                           f"llmtune export BASE.gguf --lora {model_path} --type {type} -o OUT.gguf (or to write "
                           f"it as PEFT's adapter folder: --peft DIR)")
    out = check_output_path(out_path, model_path, *lora, replaces=GGUF_KIND, force=force)
    if lora_scale is not None and not lora and (isinstance(lora_scale, (int, float)) or list(lora_scale)):
        raise LlmtuneError("--lora-scale: needs --lora (the adapter it scales)")
    merged = _merger(gf, lora, lora_scale) if lora else None
    return write_converted(gf, out, xt, merged, inputs=[model_path, *lora], progress=progress)


def export_plans(gf: GGUFFile, xt: ExportType) -> dict[str, TensorPlan]:
    """The type every tensor of `gf` gets as `xt` (llama-quantize's per-tensor policy, quant/plan.py)."""
    return tensor_plans(xt, {n: (t.shape, t.type) for n, t in gf.tensors.items()}, gf.metadata)


def tensor_plans(xt: ExportType, tensors: dict[str, tuple[tuple[int, ...], QT]],
                 metadata: dict) -> dict[str, TensorPlan]:
    """export_plans for a model not yet written (`llmtune init --type`): `tensors` maps name -> (shape,
    stored type), `metadata` holds the plain values of its metadata."""
    return plan_types(xt, tensors, ModelFacts.from_metadata(metadata))


def write_converted(gf: GGUFFile, out: Path, xt: ExportType, changed: Callable[[str], np.ndarray | None] | None,
                    inputs: list, progress: Progress | None = None) -> ExportSummary:
    """`gf` written to `out` with its weights stored as `xt`; `changed(name)`: a tensor's new
    float32 values (merged adapters, finetuned weights), or None to convert the stored ones."""
    start = time.perf_counter()
    plans = export_plans(gf, xt)
    ordered = [plans[name] for name in gf.tensors]  # keep the input file's tensor order
    summary = ExportSummary(Path(gf.path), out, xt.name, int(xt.ftype))
    write_gguf(out, gf.arch, export_metadata(gf.meta, xt), _converted(gf, ordered, summary, progress, changed),
               inputs=inputs)
    summary.seconds = time.perf_counter() - start
    return summary


def export_metadata(meta: dict[str, MetaValue], xt: ExportType) -> dict[str, MetaValue]:
    """A model's metadata once its weights are stored as `xt` (as llama-quantize writes it)."""
    meta = {k: v for k, v in meta.items() if k not in _SPLIT_KEYS}
    meta["general.quantization_version"] = MetaValue(GGML_QUANT_VERSION, VT.UINT32)
    meta["general.file_type"] = MetaValue(int(xt.ftype), VT.UINT32)
    return meta


def _merger(gf: GGUFFile, lora: list, lora_scale) -> Callable[[str], np.ndarray | None]:
    """name -> the merged float32 tensor when an adapter changes it, else None. The adapters are
    checked against the model's shapes; each base tensor is decoded only when it is merged."""

    model = attach(_shapes_only(gf), lora, lora_scale)
    adapted = {n for a in model.adapters for n in a.pairs}
    return lambda name: merged_weight(model, name, gf.tensor(name)) if name in adapted else None


def _shapes_only(gf: GGUFFile) -> Model:
    """The model of `gf` with zero-stride stand-ins for its tensors: enough to check adapters against."""
    hp, present = check_model(gf)
    return Model(gf.path, gf, hp, {s.name: np.broadcast_to(np.float32(0), gf.tensors[s.name].shape) for s in present})


def export_peft(path: str | os.PathLike, folder: str | os.PathLike, lora=None) -> PeftWritten:
    """`path`, an adapter GGUF, written as PEFT's adapter folder `folder`; or `path` a base model
    and `lora` the one adapter, checked against it first. llama's q/k rows need the base's head
    counts: the adapter's fingerprint has them (llmtune's since the PEFT export), or the base."""
    lora = [lora] if isinstance(lora, (str, os.PathLike)) else list(lora or [])
    gf = load_gguf(path)
    if gf.get("general.type") == "adapter":
        if lora:
            raise LlmtuneError(f"--lora: {path} is the adapter itself; to check it against its base: "
                               f"llmtune export BASE.gguf --lora {path} --peft {folder}")
        adapter = read_adapter(path, flag="export")
        fp = BaseFingerprint.read(adapter.meta)
        heads = (fp.n_head, fp.n_head_kv) if fp is not None and fp.n_head else None
        n_layer = len({t.split(".")[1] for t in fp.tensors if t.startswith("blk.")}) if fp is not None else None
        return write_peft(adapter, folder, heads, n_layer, fp.name if fp is not None else "")
    if not lora:
        raise LlmtuneError(f"--peft: {path} is a model, not an adapter; give the adapter (llmtune export "
                           f"ADAPTER.gguf --peft {folder}), or the base with its adapter (--lora ADAPTER.gguf)")
    if len(lora) > 1:
        raise LlmtuneError(f"--peft: writes one adapter, given {len(lora)} with --lora")
    model = attach(_shapes_only(gf), lora)
    adapter = model.adapters[0]
    fp = BaseFingerprint.read(adapter.meta) or BaseFingerprint.of(gf)
    return write_peft(adapter, folder, (model.hp.n_head, model.hp.n_head_kv), model.hp.n_layer, fp.name)


def export_hf(path: str | os.PathLike, folder: str | os.PathLike, dtype: str = "f32", lora=None,
              lora_scale=None, progress: Progress | None = None) -> HFWritten:
    """`path`, a model, as transformers' folder `folder` (safetensors as `dtype`: f32, bf16, f16);
    `lora`: adapter GGUFs merged into the weights first, as `export` merges them."""
    lora = [lora] if isinstance(lora, (str, os.PathLike)) else list(lora or [])
    gf = load_gguf(path)
    if gf.get("general.type") == "adapter":
        raise LlmtuneError(f"{path}: is a LoRA adapter, not a model; give its base with --lora {path} (merged "
                           f"into the folder), or write the adapter as PEFT's folder: --peft DIR")
    if lora_scale is not None and not lora and (isinstance(lora_scale, (int, float)) or list(lora_scale)):
        raise LlmtuneError("--lora-scale: needs --lora (the adapter it scales)")
    merged = _merger(gf, lora, lora_scale) if lora else None
    return write_hf(gf, folder, dtype, merged, progress=progress)


def _converted(gf: GGUFFile, plans: list[TensorPlan], summary: ExportSummary,
               progress: Progress | None,
               merged: Callable[[str], np.ndarray | None] | None = None) -> Iterator[TensorSpec]:
    for i, plan in enumerate(plans):
        info = gf.tensors[plan.name]
        w = merged(plan.name) if merged is not None else None
        if w is not None:  # changed (by an adapter, by training): always re-encoded
            data = quants.quantize(w, plan.dst_type)
        elif plan.dst_type == info.type:  # nothing to convert: copy the stored bytes, no requantization loss
            data = np.asarray(info.raw)
        else:
            data = quants.quantize(gf.tensor(plan.name), plan.dst_type)
        summary.tensors.append(TensorExport(**vars(plan), src_bytes=info.n_bytes,
                                            dst_bytes=quants.nbytes(plan.shape, plan.dst_type)))
        if progress is not None:
            progress(i + 1, len(plans), plan.name)
        yield plan.name, data, plan.dst_type
