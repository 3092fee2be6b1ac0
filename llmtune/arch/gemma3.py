"""gemma3 (llama.cpp's LLM_ARCH_GEMMA3, src/models/gemma3.cpp): gemma2's block (embeddings x
sqrt(n_embd), post-branch norms, NEOX RoPE, geglu FFN) with per-head RMS q/k norms before RoPE
(weights stored +1, like every gemma norm), no attention softcap, a final softcap only when the
file has the key, and a sliding window on five layers of six (il % 6 < 5) when
`attention.sliding_window` is set; local layers use `rope.freq_base_swa` (default 10000),
global ones `rope.freq_base`. output.weight is optional (absent: token_embd).
"""

from __future__ import annotations

import dataclasses

from gguf import GGUFValueType as VT

from llmtune.arch import register
from llmtune.arch.gemma2 import HF_NAMES, GemmaBase, read_swa_layers
from llmtune.arch.hf_names import HFNames


@register
class Gemma3(GemmaBase):
    name = "gemma3"
    # the text model's names (Gemma3ForCausalLM); the multimodal one nests them under model.language_model
    hf = HFNames("Gemma3ForCausalLM", "gemma3_text", {**HF_NAMES, "output": "lm_head",
                                                      "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
                                                      "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm"})
    config_keys = {"sliding_window": "int", "final_softcap": "float", "rope_freq_base_swa": "float"}
    swa_period = 6
    n_layer_27b = 62
    qk_norm = True

    def make_hparams(self, **fields):
        if fields.get("rope_freq_base_swa") is None:
            fields["rope_freq_base_swa"] = 10000.0  # llama_hparams' default, not rope.freq_base
        return super().make_hparams(**fields)

    def read_hparams(self, keys, n_vocab_default, tensor_names):
        """llama_model_gemma3::load_arch_hparams: no sliding window unless the key is set (> 0)."""
        hp = super().read_hparams(keys, n_vocab_default, tensor_names)
        window = keys.int("attention.sliding_window", 0)
        return dataclasses.replace(
            hp,
            sliding_window=max(window, 0),
            swa_layers=read_swa_layers(keys, hp.n_layer, self.swa_period),  # used only with a window
            attn_softcap=0.0,
            final_softcap=keys.float("final_logit_softcapping", 0.0),
            rope_freq_base_swa=keys.float("rope.freq_base_swa", 10000.0),
        )

    def write_hparams(self, hp):
        """The converter's keys (TextModel + Gemma3Model.set_gguf_parameters)."""
        f32 = lambda v: (float(v), VT.FLOAT32)  # noqa: E731
        keys = self._common_keys(hp)
        keys["rope.freq_base"] = f32(hp.rope_freq_base)
        if hp.rope_freq_base_swa is not None:
            keys["rope.freq_base_swa"] = f32(hp.rope_freq_base_swa)
        if hp.final_softcap:
            keys["final_logit_softcapping"] = f32(hp.final_softcap)
        if hp.sliding_window > 0:
            keys["attention.sliding_window"] = (int(hp.sliding_window), VT.UINT32)
        return {f"{hp.arch}.{k}": v for k, v in keys.items()}
