"""llama.cpp's adapter GGUF: read and checked against a base as llama_adapter_lora_init does,
written as convert_lora_to_gguf.py writes it, and attached to a model."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

from llmtune.errors import LlmtuneError, LlmtuneWarning
from llmtune.gguf.file import GGUFFile, MetaValue, load_gguf, write_gguf
from llmtune.model.adapter.core import _SKIPPED_SUFFIX, EMBD, A, B, LoraAdapter, LoraPair
from llmtune.model.adapter.peft import load_peft
from llmtune.model.adapter.provenance import INIT, RSLORA, BaseFingerprint, check_base
from llmtune.model.adapter.targets import adaptable, pair_fits, refusal
from llmtune.quant import blocks as quants

# annotations name model/loaded.py's Model, which imports this package (no import here: no circle)


def _fail(flag: str, path, msg: str) -> LlmtuneError:
    return LlmtuneError(f"{flag} {path}: {msg}")


def _meta_str(gf: GGUFFile, key: str) -> str:
    v = gf.get(key)
    return v if isinstance(v, str) else ""


def load_adapter(path, model: "Model", scale: float = 1.0, flag: str = "--lora") -> LoraAdapter:
    """An adapter GGUF checked against `model` as llama_adapter_lora_init does (and a little more:
    every pair must be applied by the graph), or a folder: PEFT's adapter (peft.py). Errors are one
    line naming `flag` and the file. An adapter carrying its base's fingerprint (provenance.py)
    loaded on another base says so in one line: appended to the error when the adapter does not
    fit, else a LlmtuneWarning."""
    if not np.isfinite(scale):
        raise LlmtuneError(f"--lora-scale: must be a finite number, got {scale}")
    if Path(path).is_dir():
        return load_peft(path, model, scale, flag)
    gf = _adapter_gguf(path, flag)
    other_base, other_shapes = check_base(BaseFingerprint.read(gf.meta), model.gguf, Path(path).name)
    try:
        adapter = _read(gf, path, flag, model, scale)
    except LlmtuneError as exc:
        if other_shapes:  # the adapter was made for another model: say which
            raise LlmtuneError(f"{exc}; {other_base}") from None
        raise
    if other_base:
        fits = "; its matrices fit this one's, so it is applied, but it means little here" if other_shapes else ""
        warnings.warn(f"{flag} {path}: {other_base}{fits}", LlmtuneWarning, stacklevel=2)
    return adapter


def read_adapter(path, flag: str = "adapter") -> LoraAdapter:
    """An adapter GGUF read without a base (`export --peft`): the checks of load_adapter that need
    none (its kind, alpha, whole 2-D pairs of matching ranks)."""
    return _read(_adapter_gguf(path, flag), path, flag)


def _adapter_gguf(path, flag: str) -> GGUFFile:
    gf = load_gguf(path)
    kind = _meta_str(gf, "general.type")
    if kind != "adapter":
        found = f"general.type is {kind!r}" if kind else "it has no general.type"
        raise _fail(flag, path, f"not a LoRA adapter ({found}; an adapter has 'adapter'): give one written by "
                                "llmtune finetune --lora-rank or llama.cpp's convert_lora_to_gguf.py")
    if _meta_str(gf, "adapter.type") != "lora":
        raise _fail(flag, path, f"adapter.type is {_meta_str(gf, 'adapter.type') or 'missing'!r}, expected 'lora'")
    return gf


def _read(gf: GGUFFile, path, flag: str, model: Optional["Model"] = None, scale: float = 1.0) -> LoraAdapter:
    """The adapter of an adapter GGUF, every tensor checked against `model` (load_adapter), or
    without a base only for what a pair must be by itself (read_adapter)."""
    arch = _meta_str(gf, "general.architecture")
    if model is not None and arch != model.hp.arch:
        raise _fail(flag, path,
                    f"adapter for architecture {arch or 'missing'!r}, but {model.path.name} is {model.hp.arch!r}")
    alpha_mv = gf.meta.get("adapter.lora.alpha")
    if alpha_mv is not None and alpha_mv.type != VT.FLOAT32:
        raise _fail(flag, path, f"adapter.lora.alpha must be a float32 (it is {alpha_mv.type.name})")
    alpha = float(alpha_mv.value) if alpha_mv is not None else 0.0
    if not np.isfinite(alpha):
        raise _fail(flag, path, f"adapter.lora.alpha is {alpha}")
    halves: dict[str, dict[str, str]] = {}
    extra = {}
    for name in gf.tensors:
        for part in (A, B):
            if name.endswith("." + part):
                halves.setdefault(name[: -len(part) - 1], {})[part] = name
                break
        else:
            if not name.endswith(_SKIPPED_SUFFIX):
                raise _fail(flag, path, f"tensor {name!r} is neither a .lora_a nor a .lora_b tensor")
            extra[name] = (np.asarray(gf.tensors[name].raw), gf.tensors[name].type)
    if not halves:
        raise _fail(flag, path, "holds no LoRA tensors")
    known = model.weights if model is not None else {}
    ok = adaptable(model) if model is not None else {}
    pairs = {}
    for base in [n for n in known if n in halves] + [n for n in halves if n not in known]:
        found = halves[base]
        if len(found) < 2:
            raise _fail(flag, path, f"tensor pair for {base!r} lacks its {B if A in found else A} half")
        if model is not None and (why := refusal(model, base, ok)):
            raise _fail(flag, path, f"adapts {base!r}, {why}")
        a, b = (_float_tensor(gf, found[p], flag, path) for p in (A, B))
        if model is not None:
            _check_pair_shape(base, model.weights[base].shape, a, b, flag, path)
        elif (a.T if base == EMBD else a).shape[0] != b.shape[1] or min(a.shape + b.shape) < 1:
            raise _fail(flag, path, f"{base}: lora_a ne {list(a.shape[::-1])} and lora_b ne {list(b.shape[::-1])} "
                                    "do not share a rank")
        pairs[base] = LoraPair(a, b)
    types = {n: info.type for n, info in gf.tensors.items()}
    return LoraAdapter(arch, alpha, pairs, float(scale), Path(path), dict(gf.meta), types, list(gf.tensors), extra,
                       init=_meta_str(gf, INIT), rslora=gf.get(RSLORA) is True)


@dataclasses.dataclass
class AdapterFacts:
    """What an adapter file says about itself, read without a base (`llmtune info`)."""

    alpha: float  # adapter.lora.alpha (0: absent, the scale is the user's alone)
    ranks: dict[str, int]  # adapted base tensor -> rank (B's last numpy axis, as LoraPair.rank), file order
    n_params: int
    init: str  # llmtune.lora.init ("" when absent)
    rslora: bool
    base: Optional[BaseFingerprint]  # None: no fingerprint (an older llmtune's file, or another tool's)


def adapter_facts(gf: GGUFFile) -> AdapterFacts:
    """The facts of an adapter GGUF, tolerating what load_adapter refuses (a lone half is left out)."""
    names = set(gf.tensors)
    ranks = {}
    for name, info in gf.tensors.items():
        base = name[: -len(B) - 1]
        if name.endswith("." + B) and f"{base}.{A}" in names and len(info.shape) == 2:
            ranks[base] = int(info.shape[-1])
    alpha = gf.get("adapter.lora.alpha")
    return AdapterFacts(float(alpha) if isinstance(alpha, (int, float)) else 0.0, ranks, gf.n_params(),
                        _meta_str(gf, INIT), gf.get(RSLORA) is True, BaseFingerprint.read(gf.meta))


def _float_tensor(gf: GGUFFile, name: str, flag: str, path) -> np.ndarray:
    info = gf.tensors[name]
    if len(info.shape) != 2:
        raise _fail(flag, path, f"tensor {name!r} has {len(info.shape)} dimensions, expected 2")
    try:
        return np.array(gf.tensor(name), dtype=np.float32)
    except LlmtuneError:
        raise _fail(flag, path, f"tensor {name!r} has unsupported type {info.type.name}") from None


def _check_pair_shape(base: str, w_shape, a: np.ndarray, b: np.ndarray, flag: str, path) -> None:
    """llama.cpp's checks, in the file's terms (GGUF ne: numpy shapes reversed)."""
    n_out, n_in = w_shape
    if not pair_fits(base, w_shape, a, b):
        want = (f"lora_a ne [r, {n_out}] and lora_b ne [r, {n_in}]" if base == EMBD
                else f"lora_a ne [{n_in}, r] and lora_b ne [r, {n_out}]")
        got = f"lora_a ne {list(a.shape[::-1])}, lora_b ne {list(b.shape[::-1])}"
        raise _fail(flag, path, f"{base} has the wrong shape for this base ({got}; expected {want})")
    if min(a.shape + b.shape) < 1:
        raise _fail(flag, path, f"{base} has rank 0")


def adapter_tensors(adapter: LoraAdapter) -> Iterable[tuple[str, np.ndarray, QT]]:
    """The tensors to write: the source file's order and types when the adapter came from one
    (extras verbatim), else A then B per pair in F32."""
    values = {}
    for name, p in adapter.pairs.items():
        values[f"{name}.{A}"], values[f"{name}.{B}"] = p.a, p.b
    order = [n for n in adapter.order if n in values or n in adapter.extra]
    order += [n for n in values if n not in order]
    for name in order:
        if name in adapter.extra:
            data, qtype = adapter.extra[name]
            yield name, data, qtype
            continue
        qtype = adapter.types.get(name, QT.F32)
        try:
            yield name, quants.quantize(values[name], qtype), qtype
        except (NotImplementedError, ValueError) as exc:
            raise LlmtuneError(f"{adapter.path}: cannot re-encode {name} as {qtype.name} ({exc})") from None


def write_adapter(path, adapter: LoraAdapter, inputs: Iterable = (), base: Optional[GGUFFile] = None) -> Path:
    """Write `adapter` as llama.cpp's adapter GGUF (atomically); the metadata of the file it came
    from is kept, with adapter.lora.alpha set to the adapter's alpha (PiSSA: its plain rank-2r
    form, as_plain). `base`: the model file it was trained on (finetune's); its fingerprint and
    the adapter's variant are written under llmtune.* (provenance.py), replacing any it had."""
    adapter = adapter.as_plain()
    meta = dict(adapter.meta)
    meta["adapter.lora.alpha"] = MetaValue(float(adapter.alpha), VT.FLOAT32)
    if base is not None:
        meta.update(BaseFingerprint.of(base).meta())
        if adapter.init:
            meta[INIT] = MetaValue(adapter.init, VT.STRING)
            meta[RSLORA] = MetaValue(bool(adapter.rslora), VT.BOOL)
    return write_gguf(path, adapter.arch, meta, adapter_tensors(adapter), inputs=list(inputs))


def attach(model: "Model", paths, scales=None, flag: str = "--lora") -> "Model":
    """A copy of `model` with the adapters in `paths` applied (each with its --lora-scale: one
    value for all, or one per adapter)."""
    paths = [paths] if isinstance(paths, (str, Path, LoraAdapter)) else list(paths or [])
    scales = [] if scales is None else [scales] if isinstance(scales, (int, float)) else list(scales)
    if not paths:
        if scales:
            raise LlmtuneError(f"--lora-scale: needs {flag} (the adapter it scales)")
        return model
    scales = [float(s) for s in scales] or [1.0]
    if len(scales) == 1:
        scales = scales * len(paths)
    if len(scales) != len(paths):
        raise LlmtuneError(f"--lora-scale: give one value, or one per --lora ({len(paths)} adapters, "
                           f"{len(scales)} scales)")
    loaded = [p if isinstance(p, LoraAdapter) else load_adapter(p, model, s, flag) for p, s in zip(paths, scales)]
    return dataclasses.replace(model, adapters=list(model.adapters) + loaded)
