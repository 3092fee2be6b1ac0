"""A GGUF model ready for graphs: its family, hyper-parameters, weights (float32, or matrices kept
in the file's quantized / 16-bit type: quant/qtensor.py) and the LoRA adapters applied to them
(model/adapter/)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmtune.arch import check_tensors, get_family, read_hparams
from llmtune.arch.context import Batch, BuildContext
from llmtune.arch.hparams import HParams
from llmtune.arch.packing import Packing
from llmtune.arch.prefix import PrefixShape, SharedPrefix
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import GGUFFile, load_gguf
from llmtune.graph import ops
from llmtune.graph.node import name_intermediates, topo_order
from llmtune.model.adapter import LoraGraph
from llmtune.quant.qtensor import stored
from llmtune.tokenizer import Tokenizer


@dataclass
class Model:
    path: Path
    gguf: GGUFFile
    hp: HParams
    # numpy shape, in the family's tensor order: float32, or a QTensor for a matrix kept in its file
    # type (quant/qtensor.py: frozen, it stays that way in memory and in the graph)
    weights: dict[str, np.ndarray]
    _tokenizer: object = field(default=None, repr=False)
    adapters: list = field(default_factory=list)  # LoraAdapter, applied in order (llama.cpp --lora)

    @property
    def family(self):
        return get_family(self.hp.arch)

    @property
    def tokenizer(self):
        if self._tokenizer is None:

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model can hold: its learned positions (gpt2's position_embd
        rows), or None when positions are computed (rope) and only memory bounds the context."""
        return self.hp.n_ctx_train if "position_embd.weight" in self.weights else None

    def n_params(self) -> int:
        """Parameters of the base model (adapters not counted)."""
        return sum(w.size for w in self.weights.values())

    def tensors(self) -> dict[str, np.ndarray]:
        """Every graph leaf by name: the base weights, then each adapter's A/B (adapter.tensor_key)."""
        if not self.adapters:
            return self.weights
        out = dict(self.weights)
        for i, adapter in enumerate(self.adapters):
            out.update(adapter.tensors(i))
        return out

    def select(self, pattern: str | None) -> list[str]:
        """Trainable tensor names matched by a regex (re.search); all of them when pattern is None.
        Rope frequency factors never train: no gradient reaches them, and weight decay would
        shrink them silently."""
        factors = {s.name for s in self.family.tensors(self.hp) if s.init == "factors"}
        candidates = [n for n in self.weights if n not in factors]
        if pattern is None:
            return candidates
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise LlmtuneError(f"--params: invalid regular expression {pattern!r} ({exc})") from None
        names = [n for n in candidates if rx.search(n)]
        if not names:
            raise LlmtuneError(f"--params: {pattern!r} matches no tensor of {self.path.name}")
        return names

    def build(self, n_seq: int, n_tok: int, *, logits_start: int = 0, trainable=(), lora_dropout: float = 0.0,
              cache=None, prefix: PrefixShape | None = None, packed: bool = False, round_x: bool = True,
              n_out: int | None = None, plain_attention_max: int | None = None):
        """Forward graph for n_seq x n_tok tokens -> (batch inputs, tensor nodes by name, logits).
        Nodes cover `tensors()` (adapters included); lora_dropout > 0 (training) adds the adapters'
        dropout-mask inputs (adapter.dropout_masks). cache: an arch/kvcache.py KVCache (generation);
        its buffers are leaves of the graph too (in cache.nodes, not in the returned nodes).
        prefix: the layout of shared prefixes and their continuations (arch/prefix.py); the batch is
        then one flat sequence of prefix.n_tok tokens with run-time positions. packed: each of the
        n_seq windows holds several examples (arch/packing.py), positions [n_seq, n_tok] and the
        block-diagonal masks given at run time. round_x=False: products with weights kept in their
        file type leave the activations unrounded (training; arch/context.py BuildContext).
        n_out: only n_out rows, picked at run time by the input "out_ids", produce logits (a
        training pass's loss-carrying targets; Batch.out_ids); None or all rows: every row.
        plain_attention_max: the longest causal attention built as the plain composition (the
        backend's Backend.plain_attention_max; None: arch/context.py's default)."""
        if n_out is not None and (logits_start or prefix is not None or cache is not None):
            raise ValueError("build: n_out selects the logit rows itself (no logits_start, prefix or cache)")
        trainable = set(trainable)
        nodes = {name: ops.leaf(name, w, name in trainable) for name, w in self.tensors().items()}
        lora = LoraGraph.of(self.adapters, nodes, lora_dropout, round_x) if self.adapters else None
        # positions per sequence [n_seq, n_tok]: packed windows, and a cache of several sequences (a
        # batched decode: each sequence at its own position)
        batch = Batch.make(n_seq, n_tok, packed or (cache is not None and cache.shape.n_seq > 1), n_out)
        shared = None
        if prefix is not None:
            if (n_seq, n_tok) != (1, prefix.n_tok):
                raise ValueError(f"build: {n_seq} x {n_tok} tokens for the prefix layout {prefix}")
            shared = SharedPrefix(prefix, swa=self.hp.has_swa)
        packing = Packing(n_seq, n_tok, swa=self.hp.has_swa) if packed else None
        context = BuildContext(self.hp, nodes, batch, logits_start, lora=lora, cache=cache, prefix=shared,
                               packing=packing, round_x=round_x, plain_attention_max=plain_attention_max)
        logits = self.family.build(context)
        order = topo_order([logits])
        self._check_reached(nodes, order)
        name_intermediates(order)
        return batch, nodes, logits

    def _check_reached(self, nodes: dict, order: list) -> None:
        """Every required weight (the family's tensors not marked optional) is read by the graph: a
        name misspelled in a family's build (ctx.norm(x, "blk.0.ffn_nrom") looks its weight up as
        optional and skips it) fails here, naming the weight."""
        reached = {n.id for n in order if n.is_leaf}
        missed = [s.name for s in self.family.tensors(self.hp)
                  if not s.optional and s.name in nodes and nodes[s.name].id not in reached]
        if missed:
            more = f" (and {len(missed) - 1} more)" if len(missed) > 1 else ""
            raise LlmtuneError(f"{self.path}: the {self.hp.arch} graph never reads the required weight "
                               f"{missed[0]}{more} "
                               "(a misspelled name in the family's build?)")


def hparams_of(gf: GGUFFile) -> HParams:
    """A GGUF file's hyper-parameters, read by its family."""
    return read_hparams(gf.metadata, set(gf.tensors), str(gf.path))


def check_model(gf: GGUFFile, adapter_flag: str = "--lora") -> tuple[HParams, list]:
    """What load_model accepts, without reading tensor data: (hparams, the tensors present).
    `adapter_flag`: the command's flag that takes an adapter, named when `gf` is one (finetune's is
    --lora-init)."""
    if gf.get("general.type") == "adapter":
        raise LlmtuneError(f"{gf.path}: is a LoRA adapter, not a model; "
                           f"give its base model and the adapter with {adapter_flag}")
    hp = hparams_of(gf)
    present = check_tensors(hp, {name: info.shape for name, info in gf.tensors.items()}, str(gf.path))
    if hp.n_vocab != gf.tensors["token_embd.weight"].shape[0]:
        raise LlmtuneError(f"{gf.path}: vocab size {hp.n_vocab} does not match token_embd rows")
    return hp, present


def past_training(model, ctx: int) -> "str | None":
    """The warning for a --ctx beyond the model's training context (perplexity, generate and
    finetune give it in these words; llama.cpp warns too), None when ctx is within it."""
    if ctx <= model.hp.n_ctx_train:
        return None
    return (f"--ctx {ctx} is more than the {model.hp.n_ctx_train} tokens {model.path} was trained on "
            f"({model.hp.arch}.context_length): positions past it are untrained")


def load_model(path, quantized: bool = True, adapter_flag: str = "--lora") -> Model:
    """quantized: matrices stored in a quantized or 16-bit type stay as their bytes (QTensor; a
    frozen one is multiplied as llama.cpp multiplies it, activations rounded to its vec_dot type);
    False decodes every tensor to float32 (products in plain float32). adapter_flag: check_model's."""
    gf = load_gguf(path)
    hp, present = check_model(gf, adapter_flag)
    # read-only views of the memory map, no second copy of the file in RAM (F32, and kept types)
    weights = {}
    for spec in present:
        kept = stored(gf.tensors[spec.name], quantized)
        weights[spec.name] = kept if kept is not None else gf.tensor(spec.name)
    return Model(Path(path), gf, hp, weights)
