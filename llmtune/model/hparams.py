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
        arch = md["general.architecture"]

        def req(key):
            full = f"{arch}.{key}"
            if full not in md:
                raise LlmtuneError(f"{source}: missing metadata key {full}")
            return md[full]

        def opt(key, default):
            return md.get(f"{arch}.{key}", default)

        n_embd = int(req("embedding_length"))
        n_head = int(req("attention.head_count"))
        n_head_kv = opt("attention.head_count_kv", n_head)
        if isinstance(n_head_kv, list):  # per-layer arrays exist for some families
            n_head_kv = n_head_kv[0]
        n_ff = req("feed_forward_length")
        if isinstance(n_ff, list):
            n_ff = n_ff[0]
        tokens = md.get("tokenizer.ggml.tokens")
        n_vocab = int(opt("vocab_size", len(tokens) if tokens is not None else 0))
        scale_type = opt("rope.scaling.type", "none")
        freq_scale = 1.0
        if scale_type == "linear":
            freq_scale = 1.0 / float(opt("rope.scaling.factor", 1.0))
        hp = cls(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=int(opt("context_length", 2048)),
            n_embd=n_embd,
            n_layer=int(req("block_count")),
            n_head=n_head,
            n_head_kv=int(n_head_kv),
            n_ff=int(n_ff),
            n_rot=int(opt("rope.dimension_count", n_embd // n_head)),
            rope_freq_base=float(opt("rope.freq_base", 10000.0)),
            rope_freq_scale=freq_scale,
            rope_mode="norm",
            norm_eps=float(opt("attention.layer_norm_rms_epsilon", 1e-5)),
            tied_output=tensor_names is not None and "output.weight" not in tensor_names,
        )
        if hp.n_head % hp.n_head_kv or hp.n_embd % hp.n_head:
            raise LlmtuneError(f"{source}: inconsistent heads (n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv})")
        return hp
