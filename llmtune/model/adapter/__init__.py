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

PEFT's adapter folder (peft.py): adapter_config.json + adapter_model.safetensors, the same pairs
under the HF model's names (arch/hf_names.py), read by load_adapter when given a folder and written
by write_peft (`llmtune export ADAPTER.gguf --peft DIR`).

llmtune's own keys (provenance.py, under "llmtune.", which llama.cpp ignores): the base's fingerprint
(llmtune.base.*) and the variant (llmtune.lora.init, llmtune.lora.rslora), written by finetune.

The package: core.py (the adapter in memory), targets.py (which tensors take one), initialise.py
(PEFT's initialisations), files.py (llama.cpp's adapter GGUF), peft.py (PEFT's adapter folder, read
and written), provenance.py (the base's fingerprint and the variant), merge.py, terms.py (graph terms).
"""

from __future__ import annotations

from llmtune.model.adapter.core import DEFAULT_TARGETS, EMBD, MAGNITUDE, A, B, LoraAdapter, LoraPair, tensor_key
from llmtune.model.adapter.files import (
    adapter_facts,
    adapter_tensors,
    attach,
    load_adapter,
    read_adapter,
    write_adapter,
)
from llmtune.model.adapter.initialise import dora_init, init_adapter, pissa_init
from llmtune.model.adapter.merge import merged_weight
from llmtune.model.adapter.peft import is_peft_folder, load_peft, peft_files, write_peft
from llmtune.model.adapter.provenance import BaseFingerprint
from llmtune.model.adapter.targets import adaptable, select_targets
from llmtune.model.adapter.terms import LoraGraph, LoraTerm, dropout_masks

__all__ = ["A", "B", "DEFAULT_TARGETS", "EMBD", "MAGNITUDE", "BaseFingerprint", "LoraAdapter", "LoraGraph",
           "LoraPair", "LoraTerm", "adaptable", "adapter_facts", "adapter_tensors", "attach", "dora_init",
           "dropout_masks", "init_adapter", "is_peft_folder", "load_adapter", "load_peft", "merged_weight",
           "peft_files", "pissa_init", "read_adapter", "select_targets", "tensor_key", "write_adapter", "write_peft"]
