"""Hyper-parameters of any family (llama.cpp's llama_hparams, the subset llmtune builds graphs
from), and typed access to the `{arch}.*` metadata keys a family reads them from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from llmtune.errors import LlmtuneError

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_rot: int
    head_dim_kq: Optional[int] = None  # attention.key_length; None: n_embd / n_head
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_mode: Optional[str] = "norm"  # "norm": adjacent pairs (llama); "neox": halves; None: no rope
    norm_kind: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm)
    norm_eps: float = 1e-5
    activation: str = "silu"  # of the FFN: "silu" or "gelu" (tanh approximation)
    ffn_gated: bool = True  # down(act(gate x) * up x); False: down(act(up x))
    attn_scale: Optional[float] = None  # query scale; None: 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # 0: off; else scores -> c * tanh(scores / c)
    final_softcap: float = 0.0  # the same on the logits
    sliding_window: int = 0  # 0: full causal attention; else keys within this many positions
    swa_layers: Optional[tuple] = None  # per layer: uses the sliding window (None: every layer)
    rope_freq_base_swa: Optional[float] = None  # rope base of sliding-window layers (None: the same)
    n_ctx_orig: Optional[int] = None  # rope.scaling.original_context_length (n_ctx_orig_yarn); None: n_ctx_train
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor: rotated dims are scaled by it (phi3 LongRoPE)
    tied_output: bool = False  # no output.weight: the vocabulary projection reuses token_embd

    @property
    def head_dim(self) -> int:
        return self.head_dim_kq or self.n_embd // self.n_head

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def has_swa(self) -> bool:
        """Some layer attends through a sliding window."""
        return any(self.is_swa(il) for il in range(self.n_layer))

    def is_swa(self, il: int) -> bool:
        """Layer il attends through the sliding window (llama_hparams::is_swa)."""
        return self.sliding_window > 0 and (self.swa_layers is None or bool(self.swa_layers[il]))

    def rope_base(self, il: int) -> float:
        """llama_model::get_rope_freq_base: sliding-window layers may have a base of their own."""
        if self.is_swa(il) and self.rope_freq_base_swa is not None:
            return self.rope_freq_base_swa
        return self.rope_freq_base

    @property
    def kq_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def check(self, source: str) -> None:
        """Shapes a graph can be built from; every problem is a one-line user error."""
        sizes = dict(n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head, n_head_kv=self.n_head_kv,
                     n_ff=self.n_ff, n_ctx_train=self.n_ctx_train, head_dim=lambda: self.head_dim)
        for name, value in sizes.items():
            value = value() if callable(value) else value  # head_dim divides by n_head: checked first
            if value <= 0:
                raise LlmtuneError(f"{source}: {name} must be positive, got {value}")
        if self.n_layer > MAX_LAYERS:  # before anything builds a per-layer list
            raise LlmtuneError(f"{source}: block_count {self.n_layer} is more than llama.cpp's {MAX_LAYERS} layers")
        for name in ("attn_softcap", "final_softcap", "sliding_window"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise LlmtuneError(f"{source}: {name} must be 0 or more, got {value}")
        if self.n_head % self.n_head_kv or (self.head_dim_kq is None and self.n_embd % self.n_head):
            raise LlmtuneError(
                f"{source}: inconsistent heads (n_embd {self.n_embd}, n_head {self.n_head}, n_head_kv {self.n_head_kv})"
            )
        if self.rope_mode is not None and (self.n_rot <= 0 or self.n_rot % 2 or self.n_rot > self.head_dim):
            raise LlmtuneError(
                f"{source}: rope.dimension_count {self.n_rot} must be even, positive and at most "
                f"head_dim {self.head_dim}"
            )
        for name in ("norm_eps", "rope_freq_base", "rope_freq_scale"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise LlmtuneError(f"{source}: {name} must be a positive number, got {value}")


class MetaKeys:
    """Typed access to `{arch}.<key>` metadata; a bad or missing required value is a user error."""

    _REQUIRED = object()

    def __init__(self, md: dict, arch: str, source: str):
        self.md, self.arch, self.source = md, arch, source

    def get(self, key: str, default=_REQUIRED):
        full = f"{self.arch}.{key}"
        if full in self.md:
            return self.md[full]
        if default is self._REQUIRED:
            raise LlmtuneError(f"{self.source}: missing metadata key {full}")
        return default

    def int(self, key: str, default=_REQUIRED) -> int:
        value = self._number(key, default)
        if value is None:
            return value
        if isinstance(value, float):  # even 128.0: llama.cpp's get_key refuses a float for an integer key
            raise LlmtuneError(f"{self.source}: metadata key {self.arch}.{key} is not an integer ({value!r})")
        return int(value)

    def float(self, key: str, default=_REQUIRED) -> float:
        value = self._number(key, default)
        return value if value is None else float(value)

    def _number(self, key, default):
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, list) and value:  # per-layer arrays (llama.cpp's get_key_or_arr): layer 0
            value = value[0]
        if isinstance(value, (bool, str)) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LlmtuneError(f"{self.source}: metadata key {self.arch}.{key} is not a number ({value!r})")
        return value
