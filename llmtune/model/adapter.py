"""LoRA adapters as a part of a model: llama.cpp's adapter GGUF (read, checked against a base,
written), PEFT's initialisation, the merge, and the graph terms `BuildContext.mm` adds.

The file (llama.cpp's convert_lora_to_gguf.py / src/llama-adapter.cpp):
- metadata general.architecture (the base's), general.type = "adapter", adapter.type = "lora",
  adapter.lora.alpha (float32; 0 or absent: the scale is the user's scale alone);
- per adapted base tensor W ("blk.0.attn_q.weight", numpy [n_out, n_in]) two tensors
  "<W name>.lora_a" (GGUF ne [n_in, r], numpy A [r, n_in]) and "<W name>.lora_b" (ne [r, n_out],
  numpy B [n_out, r]), F32 as the converter writes them by default (F16/BF16/Q8_0 read too);
- token_embd (numpy [n_vocab, n_embd], applied by row lookup): A and B flipped, "lora_a" holds
  numpy [n_vocab, r] and "lora_b" numpy [n_embd, r] (llm_build_inp_embd);
- "*_norm.weight" tensors (mergekit-extract-lora) are skipped, as llama.cpp skips them.

Applied (build_lora_mm): y = x W^T + s (x A^T) B^T for every adapter in order, with
s = user_scale * alpha / r when alpha != 0, else user_scale (r = B's last numpy axis, the rank);
token_embd: rows = W[t] + s A[t] B^T. Merged (llama-export-lora): W + s B A (token_embd: W + s A B^T).

Variants (PEFT's, for training; docs/finetune.md "LoRA variants"):
- rsLoRA: s = alpha / sqrt(r); the file stores alpha * sqrt(r), so llama.cpp's alpha / r is that scale;
- DoRA: a magnitude m [n_out] per matrix, W' = m * (W + s B A) / ||W + s B A||_row with the norm
  detached (PEFT's DoraLinearLayer); llama.cpp has no DoRA, so a DoRA adapter is written merged;
- PiSSA: A, B from W's top-r singular triplets and the base replaced by the residual W - s B A
  (PEFT's pissa_init); written as the rank-2r plain adapter [A; A0], [B, -B0] of the original base
  (PEFT's path_initial_model_for_weight_conversion), which llama.cpp loads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType as QT, GGUFValueType as VT

from llmtune.arch.context import Batch, BuildContext
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import GGUFFile, MetaValue, load_gguf, write_gguf
from llmtune.graph import ops

# annotations name model/loaded.py's Model, which imports this module (no import here: no circle)

A, B = "lora_a", "lora_b"
MAGNITUDE = "lora_magnitude"  # DoRA's per-row magnitude (graph/trainer key only: no llama.cpp file holds one)
EMBD = "token_embd.weight"  # the one target applied by row lookup (A and B flipped)
# attention q/k/v/o and the FFN matrices, fused attn_qkv / ffn_up (gate+up) included
DEFAULT_TARGETS = r"\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down))\.weight$"
_SKIPPED_SUFFIX = "_norm.weight"  # llama.cpp: "TODO: add support for norm vector"


def tensor_key(base: str, part: str, index: int = 0) -> str:
    """Graph/trainer name of adapter `index`'s A or B for base tensor `base`: the file's own name
    ("blk.0.attn_q.weight.lora_a") for the first adapter, "...lora_a#1" for the next ones."""
    return f"{base}.{part}" if index == 0 else f"{base}.{part}#{index}"


@dataclass
class LoraPair:
    a: np.ndarray  # float32 [r, n_in] (token_embd: [n_vocab, r])
    b: np.ndarray  # float32 [n_out, r] (token_embd: [n_embd, r])

    @property
    def rank(self) -> int:
        return int(self.b.shape[-1])  # llama.cpp: b->ne[0]


@dataclass
class LoraAdapter:
    """One LoRA adapter: pairs by base tensor name (in the order they are written), alpha, the
    user's scale, and what a rewrite keeps of the file it came from."""

    arch: str
    alpha: float
    pairs: dict[str, LoraPair]
    scale: float = 1.0  # --lora-scale
    path: Optional[Path] = None
    meta: dict[str, MetaValue] = field(default_factory=dict)  # the file's metadata, in order
    types: dict[str, QT] = field(default_factory=dict)  # stored type per tensor name (default F32)
    order: list[str] = field(default_factory=list)  # the file's tensor names in order (extras included)
    extra: dict[str, tuple[np.ndarray, QT]] = field(default_factory=dict)  # skipped tensors, kept verbatim
    magnitudes: dict[str, np.ndarray] = field(default_factory=dict)  # DoRA: float32 [n_out] per pair
    initial: dict[str, LoraPair] = field(default_factory=dict)  # PiSSA: A0, B0 (taken out of the base)

    @property
    def ranks(self) -> set[int]:
        return {p.rank for p in self.pairs.values()}

    def weight_scale(self, name: str) -> float:
        """llama_adapter_lora_weight::get_scale, in float32 as llama.cpp computes it."""
        user, alpha = np.float32(self.scale), np.float32(self.alpha)
        if not alpha:
            return float(user)
        return float(user * alpha / np.float32(self.pairs[name].rank))

    def delta(self, name: str) -> np.ndarray:
        """The change this adapter makes to base tensor `name` (float32, the base's numpy shape),
        as llama-export-lora computes it: scale * (B A), or scale * (A B^T) for token_embd."""
        p = self.pairs[name]
        d = p.a @ p.b.T if name == EMBD else p.b @ p.a
        return d * np.float32(self.weight_scale(name))

    def n_params(self) -> int:
        return sum(p.a.size + p.b.size for p in self.pairs.values()) + sum(m.size for m in self.magnitudes.values())

    def tensors(self, index: int = 0) -> dict[str, np.ndarray]:
        """Graph tensors by trainer key (tensor_key), A then B (then DoRA's magnitude) per pair."""
        out = {}
        for name, p in self.pairs.items():
            out[tensor_key(name, A, index)] = p.a
            out[tensor_key(name, B, index)] = p.b
            if name in self.magnitudes:
                out[tensor_key(name, MAGNITUDE, index)] = self.magnitudes[name]
        return out

    def with_tensors(self, values: dict[str, np.ndarray]) -> "LoraAdapter":
        """A copy whose A/B (and magnitudes) come from `values` (keys as `tensors()`, e.g. the trainer's result)."""
        f32 = lambda n, part: np.asarray(values[tensor_key(n, part)], np.float32)  # noqa: E731
        pairs = {n: LoraPair(f32(n, A), f32(n, B)) for n in self.pairs}
        return dataclasses.replace(self, pairs=pairs, meta=dict(self.meta), magnitudes={n: f32(n, MAGNITUDE) for n in self.magnitudes})

    def dora_merged(self, name: str, base) -> np.ndarray:
        """DoRA's merged matrix m * (W + s B A) / ||W + s B A||_row (float32; PEFT's
        DoraLinearLayer merge), `base` the W the adapter was trained on."""
        w, norm = self.dora_weight(name, base)
        return (w * (self.magnitudes[name][:, None] / norm[:, None])).astype(np.float32)

    def dora_weight(self, name: str, base) -> tuple[np.ndarray, np.ndarray]:
        """W + s B A (float32) and its row norms (float64): what DoRA's magnitude divides."""
        w = np.asarray(base, np.float32) + self.delta(name)
        return w, np.linalg.norm(w.astype(np.float64), axis=1)

    def as_plain(self) -> "LoraAdapter":
        """The adapter as llama.cpp applies it to the original base: itself, or for PiSSA the
        rank-2r pairs [A; A0], [B, -B0] with alpha doubled (the same scale), so the change is
        s (B A - B0 A0) (PEFT's conversion at save_pretrained)."""
        if self.magnitudes:
            raise LlmtuneError("a DoRA adapter has no llama.cpp form; write the merged model (finetune does with --dora)")
        if not self.initial:
            return self
        pairs = {n: LoraPair(np.concatenate([p.a, self.initial[n].a]), np.concatenate([p.b, -self.initial[n].b], axis=1))
                 for n, p in self.pairs.items()}
        meta = dict(self.meta)
        return dataclasses.replace(self, alpha=2 * self.alpha, pairs=pairs, meta=meta, initial={})


# ------------------------------------------------------------------------------------ targets
class _Recorder:
    """A stand-in for LoraGraph that records which weights the family's graph applies where."""

    def __init__(self):
        self.mm: list[str] = []
        self.rows: list[str] = []

    def apply(self, x, y, name):
        self.mm.append(name)
        return y

    def apply_rows(self, tokens, x, name):
        self.rows.append(name)
        return x


def adaptable(model: "Model") -> dict[str, str]:
    """Base tensors an adapter can change -> "mm" (applied by BuildContext.mm) or "rows"
    (token_embd's lookup), found by building the family's graph once. token_embd is left out
    when it is also the output matrix (tied): llama.cpp would apply the flipped pair there too."""
    rec = _Recorder()
    nodes = {n: ops.param(w.shape, name=n, requires_grad=False) for n, w in model.weights.items()}
    model.family.build(BuildContext(model.hp, nodes, Batch.make(1, 4), lora=rec))
    out = {n: "mm" for n in rec.mm if n in model.weights and model.weights[n].ndim == 2}
    if "output.weight" in model.weights:
        out.update({n: "rows" for n in rec.rows if n in model.weights})
    return {n: out[n] for n in model.weights if n in out}  # the file's order


def _tied_note(model: "Model", name: str) -> str:
    if name == EMBD and "output.weight" not in model.weights:
        return " (it is also this model's output matrix, tied; llama.cpp cannot apply an adapter to it)"
    return ""


def select_targets(model: "Model", pattern: Optional[str], rank: int) -> list[str]:
    """Base tensors matched by --lora-targets (re.search over GGUF names; default: attention and
    FFN matrices) that take an adapter, each checked to allow `rank`."""
    if rank < 1:
        raise LlmtuneError(f"--lora-rank: must be at least 1, got {rank}")
    try:
        rx = re.compile(pattern or DEFAULT_TARGETS)
    except re.error as exc:
        raise LlmtuneError(f"--lora-targets: invalid regular expression {pattern!r} ({exc})") from None
    ok = adaptable(model)
    matched = [n for n in model.weights if rx.search(n)]
    names = [n for n in matched if n in ok]
    if not names:
        if pattern is None:
            raise LlmtuneError(f"{model.path}: no attention or FFN matrix to adapt; choose tensors with --lora-targets")
        refused = [n for n in matched if model.weights[n].ndim == 2]
        why = f" ({refused[0]} takes no adapter{_tied_note(model, refused[0])})" if refused else ""
        raise LlmtuneError(f"--lora-targets: {pattern!r} matches no matrix of {model.path.name} that takes an adapter{why}")
    for n in names:
        limit = min(model.weights[n].shape)
        if rank > limit:
            rows, cols = model.weights[n].shape
            raise LlmtuneError(f"--lora-rank: {rank} is larger than {n} allows ({rows} x {cols}: at most {limit})")
    return names


# ------------------------------------------------------------------------------------ new adapters
def init_adapter(model: "Model", rank: int, alpha: Optional[float] = None, targets: Optional[str] = None,
                 seed: int = 0, method: str = "kaiming", rslora: bool = False) -> LoraAdapter:
    """A new adapter as PEFT initialises one (init_lora_weights): kaiming (PEFT's True), A ~
    kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(n_in), 1/sqrt(n_in)); gaussian, A ~ N(0, 1/r);
    B = 0 either way, so the model starts exactly at its base (token_embd: PEFT's embedding init,
    A = 0 and B ~ N(0, 1)). pissa: see pissa_init (the caller swaps in the residual base).
    alpha defaults to the rank (scale 1); rslora stores alpha * sqrt(r) (scale alpha / sqrt(r))."""
    names = select_targets(model, targets, rank)
    alpha = float(rank if alpha is None else alpha)
    if not np.isfinite(alpha) or alpha < 0:
        raise LlmtuneError(f"--lora-alpha: must be a number >= 0, got {alpha}")
    if rslora:  # PEFT's use_rslora: scaling = alpha / sqrt(r); llama.cpp applies file alpha / r
        alpha = float(np.float32(alpha) * np.sqrt(np.float32(rank)))
    rng = np.random.default_rng(seed)
    pairs = {}
    for n in names:
        n_out, n_in = model.weights[n].shape
        if n == EMBD:
            a = np.zeros((n_out, rank), np.float32)
            b = rng.standard_normal((n_in, rank)).astype(np.float32)
        else:
            if method == "gaussian":
                a = (rng.standard_normal((rank, n_in)) / rank).astype(np.float32)
            else:
                bound = 1.0 / np.sqrt(n_in)
                a = rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32)
            b = np.zeros((n_out, rank), np.float32)
        pairs[n] = LoraPair(a, b)
    return LoraAdapter(model.hp.arch, alpha, pairs, meta=_new_metadata(model, alpha))


def _refuse_embd(adapter: LoraAdapter, flag: str) -> None:
    if EMBD in adapter.pairs:
        raise LlmtuneError(f"{flag}: applies to matrices multiplied by the input, not to {EMBD} (a row lookup); "
                           f"leave it out of --lora-targets")


def pissa_init(model: "Model", adapter: LoraAdapter) -> dict[str, np.ndarray]:
    """PEFT's pissa_init for every pair: W = V S U^T (float64 SVD of W decoded to float32),
    A = sqrt(S_r / s) U_r^T, B = V_r sqrt(S_r / s); returns the residual bases W - s B A (float32,
    in memory instead of the stored, maybe quantized, W: PEFT dequantizes too) so the model starts
    unchanged. A0, B0 are kept (adapter.initial) for the written form (as_plain). The SVDs run one
    per core with single-threaded BLAS (threads.run_in_order): one LAPACK call on a busy machine
    is ~15x slower with OpenBLAS's own threads, and single-threaded it gives the same bits on resume."""
    from llmtune.backends.threads import cpu_workers, run_in_order

    _refuse_embd(adapter, "--lora-init-method pissa")

    def split(_, name):
        pair, s = adapter.pairs[name], adapter.weight_scale(name)
        w = np.asarray(model.weights[name], np.float32).astype(np.float64)
        v, sv, uh = np.linalg.svd(w, full_matrices=False)
        root = np.sqrt(sv[: pair.rank] / s)
        a, b = (root[:, None] * uh[: pair.rank]).astype(np.float32), (v[:, : pair.rank] * root[None, :]).astype(np.float32)
        return a, b, (w - s * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)

    names = list(adapter.pairs)
    residual = {}
    for name, (a, b, rest) in zip(names, run_in_order(split, lambda: None, names, cpu_workers(None, len(names)))):
        adapter.pairs[name].a[...], adapter.pairs[name].b[...] = a, b
        adapter.initial[name] = LoraPair(a.copy(), b.copy())
        residual[name] = rest
    return residual


def dora_init(model: "Model", adapter: LoraAdapter) -> None:
    """PEFT's DoraLinearLayer.update_layer: each magnitude starts at ||W + s B A||_row, so the
    model starts where the plain adapter would (after pissa_init: the residual base's)."""
    _refuse_embd(adapter, "--dora")
    for name in adapter.pairs:
        adapter.magnitudes[name] = adapter.dora_weight(name, model.weights[name])[1].astype(np.float32)


def _new_metadata(model: "Model", alpha: float) -> dict[str, MetaValue]:
    """convert_lora_to_gguf.py's keys in its order (general.architecture first, set by the writer)."""
    meta = {
        "general.architecture": MetaValue(model.hp.arch, VT.STRING),
        "general.type": MetaValue("adapter", VT.STRING),
        "adapter.type": MetaValue("lora", VT.STRING),
    }
    name = model.gguf.get("general.name")
    if isinstance(name, str) and name:
        meta["general.name"] = MetaValue(f"{name} LoRA", VT.STRING)
    meta["adapter.lora.alpha"] = MetaValue(float(alpha), VT.FLOAT32)
    meta["general.quantization_version"] = MetaValue(GGML_QUANT_VERSION, VT.UINT32)
    return meta


# ------------------------------------------------------------------------------------ files
def _fail(flag: str, path, msg: str) -> LlmtuneError:
    return LlmtuneError(f"{flag} {path}: {msg}")


def _meta_str(gf: GGUFFile, key: str) -> str:
    v = gf.get(key)
    return v if isinstance(v, str) else ""


def load_adapter(path, model: "Model", scale: float = 1.0, flag: str = "--lora") -> LoraAdapter:
    """An adapter GGUF checked against `model` as llama_adapter_lora_init does (and a little more:
    every pair must be applied by the graph). Errors are one line naming `flag` and the file."""
    if not np.isfinite(scale):
        raise LlmtuneError(f"--lora-scale: must be a finite number, got {scale}")
    gf = load_gguf(path)
    kind = _meta_str(gf, "general.type")
    if kind != "adapter":
        found = f"general.type is {kind!r}" if kind else "it has no general.type"
        raise _fail(flag, path, f"not a LoRA adapter ({found}; an adapter has 'adapter'): give one written by "
                                "llmtune finetune --lora-rank or llama.cpp's convert_lora_to_gguf.py")
    if _meta_str(gf, "adapter.type") != "lora":
        raise _fail(flag, path, f"adapter.type is {_meta_str(gf, 'adapter.type') or 'missing'!r}, expected 'lora'")
    arch = _meta_str(gf, "general.architecture")
    if arch != model.hp.arch:
        raise _fail(flag, path, f"adapter for architecture {arch or 'missing'!r}, but {model.path.name} is {model.hp.arch!r}")
    alpha_mv = gf.meta.get("adapter.lora.alpha")
    if alpha_mv is not None and alpha_mv.type != VT.FLOAT32:
        raise _fail(flag, path, f"adapter.lora.alpha must be a float32 (it is {alpha_mv.type.name})")
    alpha = float(alpha_mv.value) if alpha_mv is not None else 0.0
    if not np.isfinite(alpha):
        raise _fail(flag, path, f"adapter.lora.alpha is {alpha}")
    ok = adaptable(model)
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
    pairs = {}
    for base in [n for n in model.weights if n in halves] + [n for n in halves if n not in model.weights]:
        found = halves[base]
        if len(found) < 2:
            raise _fail(flag, path, f"tensor pair for {base!r} lacks its {B if A in found else A} half")
        if base not in model.weights:
            raise _fail(flag, path, f"adapts {base!r}, which {model.path.name} does not have (adapter for another model?)")
        if base not in ok:
            raise _fail(flag, path, f"adapts {base!r}, which takes no adapter in {model.path.name}{_tied_note(model, base)}")
        a, b = (_float_tensor(gf, found[p], flag, path) for p in (A, B))
        _check_pair_shape(base, model.weights[base].shape, a, b, flag, path)
        pairs[base] = LoraPair(a, b)
    types = {n: info.type for n, info in gf.tensors.items()}
    return LoraAdapter(arch, alpha, pairs, float(scale), Path(path), dict(gf.meta), types, list(gf.tensors), extra)


def _float_tensor(gf: GGUFFile, name: str, flag: str, path) -> np.ndarray:
    info = gf.tensors[name]
    if len(info.shape) != 2:
        raise _fail(flag, path, f"tensor {name!r} has {len(info.shape)} dimensions, expected 2")
    try:
        return np.array(gf.tensor(name), dtype=np.float32)
    except LlmtuneError:
        raise _fail(flag, path, f"tensor {name!r} has unsupported type {info.type.name}") from None


def _check_pair_shape(base: str, w_shape, a: np.ndarray, b: np.ndarray, flag: str, path) -> None:
    """llama.cpp's checks, in numpy terms (GGUF ne reversed)."""
    n_out, n_in = w_shape
    if base == EMBD:  # A [n_vocab, r], B [n_embd, r]
        good = a.shape[0] == n_out and b.shape[0] == n_in and a.shape[1] == b.shape[1]
        want = f"lora_a ne [r, {n_out}] and lora_b ne [r, {n_in}]"
    else:  # A [r, n_in], B [n_out, r]
        good = a.shape[1] == n_in and b.shape[0] == n_out and a.shape[0] == b.shape[1]
        want = f"lora_a ne [{n_in}, r] and lora_b ne [r, {n_out}]"
    if not good:
        got = f"lora_a ne {list(a.shape[::-1])}, lora_b ne {list(b.shape[::-1])}"
        raise _fail(flag, path, f"{base} has the wrong shape for this base ({got}; expected {want})")
    if min(a.shape + b.shape) < 1:
        raise _fail(flag, path, f"{base} has rank 0")


def adapter_tensors(adapter: LoraAdapter) -> Iterable[tuple[str, np.ndarray, QT]]:
    """The tensors to write: the source file's order and types when the adapter came from one
    (extras verbatim), else A then B per pair in F32."""
    from llmtune.quant import blocks as quants

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


def write_adapter(path, adapter: LoraAdapter, inputs: Iterable = ()) -> Path:
    """Write `adapter` as llama.cpp's adapter GGUF (atomically); the metadata of the file it came
    from is kept, with adapter.lora.alpha set to the adapter's alpha (PiSSA: its plain rank-2r
    form, as_plain)."""
    adapter = adapter.as_plain()
    meta = dict(adapter.meta)
    meta["adapter.lora.alpha"] = MetaValue(float(adapter.alpha), VT.FLOAT32)
    return write_gguf(path, adapter.arch, meta, adapter_tensors(adapter), inputs=list(inputs))


def attach(model: "Model", paths, scales=None, flag: str = "--lora") -> "Model":
    """A copy of `model` with the adapters in `paths` applied (each with its --lora-scale: one
    value for all, or one per adapter)."""
    import dataclasses

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
        raise LlmtuneError(f"--lora-scale: give one value, or one per --lora ({len(paths)} adapters, {len(scales)} scales)")
    loaded = [p if isinstance(p, LoraAdapter) else load_adapter(p, model, s, flag) for p, s in zip(paths, scales)]
    return dataclasses.replace(model, adapters=list(model.adapters) + loaded)


def merged_weight(model: "Model", name: str, base: Optional[np.ndarray] = None) -> np.ndarray:
    """Base tensor `name` (float32) plus every attached adapter's delta, in adapter order."""
    w = np.array(model.weights[name] if base is None else base, dtype=np.float32)
    for adapter in model.adapters:
        if name in adapter.pairs:
            w = adapter.delta(name) + w  # llama-export-lora: cur = delta + cur
    return w


# ------------------------------------------------------------------------------------ graph
@dataclass(frozen=True)
class LoraTerm:
    a: object  # Node
    b: object  # Node
    scale: float
    key: str  # names the term's dropout mask input ("<A key>.dropout")
    magnitude: object = None  # DoRA: Node [n_out]
    weight: object = None  # DoRA: the base matrix's Node


class LoraGraph:
    """The adapter terms of one graph, by base tensor name; BuildContext.mm calls `apply`, the
    embedding lookup `apply_rows`. dropout > 0 (training only, as PEFT): the input of each term is
    multiplied by a mask fed as the graph input "<A key>.dropout" (see dropout_masks)."""

    def __init__(self, terms: dict[str, list[LoraTerm]], dropout: float = 0.0, round_x: bool = True):
        self.terms, self.dropout, self.round_x = terms, float(dropout), round_x  # round_x: as BuildContext's

    @classmethod
    def of(cls, adapters: list[LoraAdapter], nodes: dict, dropout: float = 0.0, round_x: bool = True) -> "LoraGraph":
        terms: dict[str, list[LoraTerm]] = {}
        for i, adapter in enumerate(adapters):
            for name in adapter.pairs:
                key = tensor_key(name, A, i)
                dora = name in adapter.magnitudes
                terms.setdefault(name, []).append(
                    LoraTerm(nodes[key], nodes[tensor_key(name, B, i)], adapter.weight_scale(name), key,
                             nodes[tensor_key(name, MAGNITUDE, i)] if dora else None, nodes[name] if dora else None))
        return cls(terms, dropout, round_x)

    def apply(self, x, y, name: str):
        """y + sum of scale * (x A^T) B^T (llama.cpp adds each to the base product in turn).
        Evaluation scales the product as llama.cpp's build_lora_mm does, after B; a training graph
        (round_x False) scales the rank-r product x A^T instead, n_out / r times less work forward
        and backward, the same value up to float32 rounding, as one op (ops.lora) where the term is
        plain LoRA."""
        for t in self.terms.get(name, ()):
            xin = x
            if self.dropout > 0:
                xin = ops.mul(x, ops.input(x.shape, name=f"{t.key}.dropout"))
            if not self.round_x and t.magnitude is None:
                y = ops.lora(y, xin, t.a, t.b, t.scale)
                continue
            if self.round_x:
                term = ops.scale(ops.linear(ops.linear(xin, t.a), t.b), t.scale)
            else:
                term = ops.linear(ops.scale(ops.linear(xin, t.a), t.scale), t.b)
            y = ops.add(y, term) if t.magnitude is None else self._dora(t, xin, y, term)
        return y

    def _dora(self, t: LoraTerm, xin, y, term):
        """PEFT's DoraLinearLayer.forward: with g = m / ||W + s B A||_row (norm detached), y + (g - 1)
        base(xin) + g s lora(xin); without dropout xin is x and base(x) is y: g (y + s lora(x))."""
        weight = ops.add(t.weight, ops.scale(ops.matmul(t.b, t.a), t.scale))
        g = ops.mul(t.magnitude, ops.row_rnorm(weight, detach=True))
        if self.dropout <= 0:
            return ops.mul(ops.add(y, term), g)
        base = ops.linear(xin, t.weight, self.round_x)
        return ops.add(y, ops.add(ops.mul(base, ops.add(g, ops.const(-1.0, g.shape))), ops.mul(term, g)))

    def apply_rows(self, tokens, x, name: str):
        """Embedding rows x = W[tokens] plus scale * A[tokens] B^T (no dropout: PEFT's Embedding)."""
        for t in self.terms.get(name, ()):
            y = ops.linear(ops.get_rows(t.a, tokens), t.b)
            x = ops.add(x, ops.scale(y, t.scale))
        return x


def dropout_masks(shapes: dict[str, tuple], p: float, seed: int, step: int, seqs: range) -> dict[str, np.ndarray]:
    """Masks for the dropout inputs of one micro-batch holding sequences `seqs` (indices within the
    optimizer step): keep with probability 1 - p, scaled by 1 / (1 - p) (torch.nn.Dropout). Each
    sequence draws from its own generator (seed, step, sequence), so the masks, and the result, do
    not depend on how a step is cut into micro-batches."""
    names = sorted(shapes)
    n_seq = len(seqs)
    keep = np.float32(1.0 / (1.0 - p))
    parts: dict[str, list] = {n: [] for n in names}
    for s in seqs:
        rng = np.random.default_rng([seed, step, s])
        for n in names:
            rows, cols = shapes[n]
            parts[n].append((rng.random((rows // n_seq, cols), dtype=np.float32) >= p) * keep)
    return {n: np.concatenate(parts[n]) for n in names}
