"""New adapters as PEFT initialises them: kaiming / gaussian A with B = 0, PiSSA's SVD split of
the base, DoRA's magnitudes."""

from __future__ import annotations

from typing import Optional

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFValueType as VT

from llmtune.backends.cpu import cpu_workers, run_in_order
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue
from llmtune.model.adapter.core import EMBD, LoraAdapter, LoraPair, rslora_alpha
from llmtune.model.adapter.targets import select_targets

# annotations name model/loaded.py's Model, which imports this package (no import here: no circle)


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
        alpha = rslora_alpha(alpha, rank)
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
    return LoraAdapter(model.hp.arch, alpha, pairs, meta=new_metadata(model, alpha), init=method, rslora=rslora)


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
    _refuse_embd(adapter, "--lora-init-method pissa")

    def split(_, name):
        pair, s = adapter.pairs[name], adapter.weight_scale(name)
        w = np.asarray(model.weights[name], np.float32).astype(np.float64)
        v, sv, uh = np.linalg.svd(w, full_matrices=False)
        root = np.sqrt(sv[: pair.rank] / s)
        a = (root[:, None] * uh[: pair.rank]).astype(np.float32)
        b = (v[:, : pair.rank] * root[None, :]).astype(np.float32)
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


def new_metadata(model: "Model", alpha: float) -> dict[str, MetaValue]:
    """A new adapter's metadata for `model`: convert_lora_to_gguf.py's keys in its order
    (general.architecture first, set by the writer)."""
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
