"""A family's tensor names in Hugging Face transformers checkpoints, and the row order HF keeps.

Each family module sets its table beside its tensors (`Family.hf`, an HFNames; None: the family
has none, and what needs one refuses it naming the family). The table is what llama.cpp's
convert_hf_to_gguf.py (gguf-py's tensor_mapping) renames, read in both directions:

- names: GGUF stem -> HF module path, "{bid}" for the block number ("blk.{bid}.attn_q" ->
  "model.layers.{bid}.self_attn.q_proj"); the suffix (".weight", ".bias") passes through;
- rope_rows: llama's q and k rows are stored permuted (convert_hf_to_gguf.py's LlamaModel.permute:
  HF rotates halves of each head, llama.cpp adjacent pairs), so anything with rows in HF's order
  (an HF matrix, a PEFT adapter's B) is reordered per head (`hf_rows`);
- conv1d: the GGUF stems (their last part: "attn_qkv") whose HF matrices are transformers' Conv1D
  weights, stored [n_in, n_out] (GPT-2's c_attn, c_proj, c_fc): convert_hf_to_gguf.py's GPT2Model
  transposes them (`transposed`); a PEFT adapter of such a module keeps A [r, n_in] and B [n_out, r]
  and says fan_in_fan_out;
- bare_prefix: a prefix some checkpoints of the family lack (GPT-2's own files, saved from GPT2Model:
  "h.0.attn.c_attn.weight", no "transformer."), read either way (gguf-py maps both), written with it;
- architecture, model_type: config.json's "architectures"[0] and "model_type".

Names and row order only: value changes (gemma's norms stored +1) are the family's docstring's.
PEFT adapters (model/adapter/peft.py) and `llmtune import` (convert/hf_import.py) map with it;
arch/hf_config.py holds the config.json side (hyper-parameters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError

SUFFIXES = (".weight", ".bias")


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{bid}"), r"(\d+)") + r"$")


@dataclass(frozen=True)
class HFNames:
    architecture: str  # config.json "architectures"[0], e.g. "LlamaForCausalLM"
    model_type: str  # config.json "model_type"
    names: dict[str, str]  # GGUF stem -> HF module path ("{bid}": the block)
    rope_rows: bool = False  # q/k rows permuted per head between HF and GGUF (llama)
    conv1d: tuple[str, ...] = ()  # stems whose HF weight is a Conv1D's [n_in, n_out] (gpt2)
    bare_prefix: str = ""  # a prefix of `names` some checkpoints leave out ("transformer.": GPT-2's own files)
    _to_hf: list = field(init=False, repr=False, compare=False)
    _to_gguf: list = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_to_hf", [(_pattern(g), h) for g, h in self.names.items()])
        object.__setattr__(self, "_to_gguf", [(_pattern(h), g) for g, h in self.names.items()])

    @staticmethod
    def _rename(table: list, name: str) -> Optional[str]:
        for rx, template in table:
            if (m := rx.match(name)) is not None:
                return template.replace("{bid}", m.group(1)) if m.groups() else template
        return None

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        for suffix in SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)], suffix
        return name, ""

    def hf_module(self, gguf_name: str) -> Optional[str]:
        """The HF module of a GGUF tensor ("blk.0.attn_q.weight" -> "model.layers.0.self_attn.q_proj");
        None when the table has none."""
        return self._rename(self._to_hf, self._split(gguf_name)[0])

    def hf_name(self, gguf_name: str) -> Optional[str]:
        """A GGUF tensor's HF name ("blk.0.attn_q.weight" -> "model.layers.0.self_attn.q_proj.weight")."""
        stem, suffix = self._split(gguf_name)
        module = self._rename(self._to_hf, stem)
        return None if module is None else module + suffix

    def gguf_name(self, hf_name: str) -> Optional[str]:
        """An HF tensor's GGUF name (or an HF module's GGUF stem); None when the table has none."""
        stem, suffix = self._split(hf_name)
        gguf = self._rename(self._to_gguf, stem)
        if gguf is None and self.bare_prefix and not stem.startswith(self.bare_prefix):
            gguf = self._rename(self._to_gguf, self.bare_prefix + stem)
        return None if gguf is None else gguf + suffix

    def module_names(self) -> list[str]:
        """The table's HF module paths, "{bid}" kept (what PEFT's target_modules may name)."""
        return list(self.names.values())

    def transposed(self, gguf_name: str) -> bool:
        """Whether the HF tensor is the GGUF matrix transposed (a Conv1D weight, [n_in, n_out])."""
        stem, suffix = self._split(gguf_name)
        return suffix == ".weight" and stem.rsplit(".", 1)[-1] in self.conv1d

    def hf_shape(self, gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape of GGUF tensor `gguf_name` of numpy shape `shape` (and back: the same rule)."""
        return tuple(shape[::-1]) if self.transposed(gguf_name) else tuple(shape)

    def permuted(self, gguf_name: str) -> bool:
        """Whether the tensor's rows are in another order in HF (llama's q/k: hf_rows)."""
        stem = self._split(gguf_name)[0]
        return self.rope_rows and stem.startswith("blk.") and stem.rsplit(".", 1)[-1] in ("attn_q", "attn_k")

    def hf_rows(self, gguf_name: str, n_rows: int, n_head: int, n_head_kv: int) -> Optional[np.ndarray]:
        """Where a GGUF matrix's (or a B's) `n_rows` rows go in HF: rows_hf = rows_gguf[hf_rows(...)],
        rows_gguf = rows_hf[np.argsort(hf_rows(...))]; None when the order is the same. llama's q/k:
        the inverse of LlamaModel.permute, gguf = hf.reshape(heads, 2, d / 2).swapaxes(1, 2)."""
        if not self.permuted(gguf_name):
            return None
        heads = n_head_kv if self._split(gguf_name)[0].endswith("attn_k") else n_head
        if heads < 1 or n_rows % (2 * heads):
            raise LlmtuneError(f"{gguf_name}: {n_rows} rows do not split into {heads} heads of an even size")
        permuted = np.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(n_rows)
        return np.argsort(permuted)
