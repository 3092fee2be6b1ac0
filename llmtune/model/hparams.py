"""Architecture hyper-parameters read from GGUF metadata (`{arch}.*` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtune.errors import LlmtuneError

# Architectures whose graph llmtune can build. Adding a family = a graph file + an entry here.
SUPPORTED_ARCHS = ("llama",)


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
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_mode: str = "norm"  # "norm": adjacent pairs (llama); "neox": halves
    norm_eps: float = 1e-5
    tied_output: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    @classmethod
    def from_gguf(cls, gf) -> "HParams":
        arch = gf.arch
        if arch not in SUPPORTED_ARCHS:
            raise LlmtuneError(
                f"{gf.path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        return cls.from_metadata(gf.metadata, tensor_names=set(gf.tensors), source=str(gf.path))

    @classmethod
    def from_metadata(cls, md: dict, tensor_names: set[str] | None = None, source: str = "") -> "HParams":
        """Hyper-parameters from `{arch}.*` keys, with llama.cpp's defaults for optional ones.

        `tensor_names` (when given) decides `tied_output`: no output.weight means the output
        projection reuses token_embd.weight, as llama.cpp does.
        """
        arch = md.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise LlmtuneError(f"{source}: missing general.architecture")
        keys = _ArchKeys(md, arch, source)
        n_embd = keys.int("embedding_length")
        n_head = keys.int("attention.head_count")
        tokens = md.get("tokenizer.ggml.tokens")
        scale_type = keys.get("rope.scaling.type", "none")
        scale_factor = keys.float("rope.scaling.factor", 1.0) if scale_type == "linear" else 1.0
        if scale_factor <= 0:
            raise LlmtuneError(f"{source}: {arch}.rope.scaling.factor must be positive, got {scale_factor}")
        hp = cls(
            arch=arch,
            n_vocab=keys.int("vocab_size", len(tokens) if tokens is not None else 0),
            n_ctx_train=keys.int("context_length", 2048),
            n_embd=n_embd,
            n_layer=keys.int("block_count"),
            n_head=n_head,
            n_head_kv=keys.int("attention.head_count_kv", n_head),
            n_ff=keys.int("feed_forward_length"),
            n_rot=keys.int("rope.dimension_count", n_embd // n_head if n_head > 0 else 0),
            rope_freq_base=keys.float("rope.freq_base", 10000.0),
            rope_freq_scale=1.0 / scale_factor,
            rope_mode="norm",
            # RMSNorm families store layer_norm_rms_epsilon; LayerNorm ones layer_norm_epsilon
            norm_eps=keys.float("attention.layer_norm_rms_epsilon", keys.float("attention.layer_norm_epsilon", 1e-5)),
            tied_output=tensor_names is not None and "output.weight" not in tensor_names,
        )
        hp._check(source)
        return hp

    def _check(self, source: str) -> None:
        sizes = dict(n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head, n_head_kv=self.n_head_kv, n_ff=self.n_ff)
        for name, value in sizes.items():
            if value <= 0:
                raise LlmtuneError(f"{source}: {name} must be positive, got {value}")
        if self.n_head % self.n_head_kv or self.n_embd % self.n_head:
            raise LlmtuneError(
                f"{source}: inconsistent heads (n_embd {self.n_embd}, n_head {self.n_head}, n_head_kv {self.n_head_kv})"
            )


class _ArchKeys:
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
        return self._convert(key, default, int)

    def float(self, key: str, default=_REQUIRED) -> float:
        return self._convert(key, default, float)

    def _convert(self, key, default, kind):
        value = self.get(key, default)
        if isinstance(value, list) and value:  # per-layer arrays exist for some families
            value = value[0]
        if isinstance(value, (bool, str)) or not isinstance(value, (int, float)):
            raise LlmtuneError(f"{self.source}: metadata key {self.arch}.{key} is not a number ({value!r})")
        return kind(value)
