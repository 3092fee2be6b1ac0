"""Tiny Hugging Face model folders for `llmtune import`, rebuilt from a small record (tests/data/hf/).

A record holds config.json (as transformers' config class saved it), the dtype and seed of the weights (and,
for a Gemma3ForConditionalGeneration saved by transformers 4, "layout": "v4": its tensor names) and,
from llama.cpp's convert_hf_to_gguf.py run by bench/check_hf_import.py on the same folder, every metadata key
(long arrays as a sha256) and every tensor's type, shape and sha256. The weights are drawn here with numpy
(seeded, so the folder is the same every time) and written as safetensors, BF16 included, in the format's
own layout (8-byte header length, JSON header in name order, then the data), the way transformers saves it.
The tokenizer is SmolLM2's (tokenizer.json, gzipped, with tokenizer_config.json and chat_template.jinja),
or with "tokenizer": "spm" a small SentencePiece model (spm-tokenizer.model, trained by the bench script,
with its tokenizer_config.json and added_tokens.json, as Llama 2 / TinyLlama folders hold them), or with
"tokenizer": "gpt2" GPT-2's (tokenizer.json, tokenizer_config.json, special_tokens_map.json written from
llama.cpp's ggml-vocab-gpt-2.gguf by tokenizer/hf_files.py, as `llmtune export --hf` writes them).
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np

from llmtune.arch.hf_config import TEXT_DEFAULTS
from llmtune.gguf.file import load_gguf
from llmtune.tokenizer import Tokenizer
from llmtune.tokenizer.hf_files import tokenizer_files

DATA = Path(__file__).parent / "data" / "hf"
TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja")
SPM_FILES = ("tokenizer.model", "tokenizer_config.json", "added_tokens.json")
_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<f4"}
GPT2_VOCAB = DATA.parent / "vocab" / "ggml-vocab-gpt-2.gguf"


def gpt2_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GPT2LMHeadModel's safetensors (transformers' save_pretrained names; Conv1D weights [n_in, n_out])."""
    d, n_vocab, n_ctx = config["n_embd"], config["vocab_size"], config["n_positions"]
    n_ff = config.get("n_inner") or 4 * d
    shapes = {"transformer.wte.weight": (n_vocab, d), "transformer.wpe.weight": (n_ctx, d),
              "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (n_vocab, d)
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}."
        for module, (n_in, n_out) in (("attn.c_attn", (d, 3 * d)), ("attn.c_proj", (d, d)), ("mlp.c_fc", (d, n_ff)),
                                      ("mlp.c_proj", (n_ff, d))):
            shapes.update({p + module + ".weight": (n_in, n_out), p + module + ".bias": (n_out,)})
        shapes.update({p + f"ln_{k}.{x}": (d,) for k in (1, 2) for x in ("weight", "bias")})
    return dict(sorted(shapes.items()))


def siglip_tensor_shapes(vision: dict, n_embd_text: int) -> dict[str, tuple[int, ...]]:
    """Gemma3ForConditionalGeneration's SigLIP vision tower (no pooling head, as Gemma 3's) and projector,
    under transformers 5's names (model.vision_tower.*, model.multi_modal_projector.*)."""
    d, n_ff, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    p = "model.vision_tower."
    shapes = {p + "embeddings.patch_embedding.weight": (d, vision.get("num_channels", 3), patch, patch),
              p + "embeddings.patch_embedding.bias": (d,),
              p + "embeddings.position_embedding.weight": ((vision["image_size"] // patch) ** 2, d),
              p + "post_layernorm.weight": (d,), p + "post_layernorm.bias": (d,),
              "model.multi_modal_projector.mm_input_projection_weight": (d, n_embd_text),
              "model.multi_modal_projector.mm_soft_emb_norm.weight": (d,)}
    for i in range(vision["num_hidden_layers"]):
        q = f"{p}encoder.layers.{i}."
        for module, shape in (("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (d, d)), ("self_attn.v_proj", (d, d)),
                              ("self_attn.out_proj", (d, d)), ("mlp.fc1", (n_ff, d)), ("mlp.fc2", (d, n_ff))):
            shapes.update({q + module + ".weight": shape, q + module + ".bias": shape[:1]})
        shapes.update({q + f"layer_norm{k}.{x}": (d,) for k in (1, 2) for x in ("weight", "bias")})
    return shapes


def v4_name(name: str) -> str:
    """transformers 4's name of a Gemma3ForConditionalGeneration tensor (its checkpoints on the Hub:
    language_model.model.layers.0..., vision_tower.vision_model..., multi_modal_projector...)."""
    for v5, v4 in (("model.language_model.", "language_model.model."),
                   ("model.vision_tower.", "vision_tower.vision_model.")):
        if name.startswith(v5):
            return v4 + name[len(v5):]
    return name[len("model."):] if name.startswith("model.") else "language_model." + name


def hf_tensor_shapes(config: dict, layout: str = "v5") -> dict[str, tuple[int, ...]]:
    """The safetensors of a llama / qwen2 / qwen3 / gemma2 / gemma3 / phi3 causal LM with `config` (HF names,
    torch shapes), or of a Gemma3ForConditionalGeneration: its text model's under model.language_model, its
    vision tower's and projector's (layout "v4": transformers 4's names)."""
    arch = config["architectures"][0]
    if arch == "GPT2LMHeadModel":
        return gpt2_tensor_shapes(config)
    if arch == "Gemma3ForConditionalGeneration":
        # a text_config saved by transformers 4 holds what differs from the defaults only
        text = hf_tensor_shapes({**TEXT_DEFAULTS["gemma3"], **config["text_config"],
                                 "architectures": ["Gemma3ForCausalLM"],
                                 "tie_word_embeddings": config.get("tie_word_embeddings", True)})
        shapes = {**siglip_tensor_shapes(config["vision_config"], text["model.norm.weight"][0]),
                  **{n.replace("model.", "model.language_model.", 1): shape for n, shape in text.items()}}
        return dict(sorted((v4_name(n) if layout == "v4" else n, shape) for n, shape in shapes.items()))
    d, n_ff, n_vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or d // heads
    shapes = {"model.embed_tokens.weight": (n_vocab, d), "model.norm.weight": (d,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (n_vocab, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if arch == "Phi3ForCausalLM":  # HF's own fused q/k/v and gate/up
            shapes.update({
                p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * head_dim, d),
                p + "self_attn.o_proj.weight": (d, heads * head_dim),
                p + "mlp.gate_up_proj.weight": (2 * n_ff, d), p + "mlp.down_proj.weight": (d, n_ff),
            })
            continue
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (heads * head_dim, d), p + "self_attn.k_proj.weight": (kv * head_dim, d),
            p + "self_attn.v_proj.weight": (kv * head_dim, d), p + "self_attn.o_proj.weight": (d, heads * head_dim),
            p + "mlp.gate_proj.weight": (n_ff, d), p + "mlp.up_proj.weight": (n_ff, d),
            p + "mlp.down_proj.weight": (d, n_ff),
        })
        if arch == "Qwen2ForCausalLM":
            shapes.update({p + f"self_attn.{x}_proj.bias": (n * head_dim,) for x, n in (("q", heads), ("k", kv),
                                                                                     ("v", kv))})
        if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):  # the norm sandwich around the MLP
            shapes.update({p + "pre_feedforward_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)})
        if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
    return dict(sorted(shapes.items()))


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], draw, dtype: str) -> None:
    """Tensors of `shapes`, each `draw(shape)` (float32, asked in order, one held at a time), stored as `dtype`
    (F32, F16, BF16: the upper 16 bits, rounded to nearest even)."""
    header, offset = {}, 0
    width = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * width
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        for shape in shapes.values():
            arr = draw(shape)
            if dtype == "BF16":
                bits = np.ascontiguousarray(arr, dtype="<f4").view("<u4")
                fh.write(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes())
            else:
                fh.write(np.ascontiguousarray(arr, dtype=_ST_DTYPES[dtype]).tobytes())
            del arr


def make_folder(record: dict, folder: Path) -> Path:
    """The record's HF folder: config.json, model.safetensors (seeded weights), the tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(record["config"], indent=2) + "\n", encoding="utf-8")
    rng = np.random.default_rng(record["seed"])
    write_safetensors(folder / "model.safetensors", hf_tensor_shapes(record["config"], record.get("layout", "v5")),
                      lambda shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05), record["dtype"])
    if record.get("tokenizer") == "gpt2":
        gf = load_gguf(GPT2_VOCAB)
        files = tokenizer_files(Tokenizer.from_gguf(gf), gf.metadata, record["config"]["n_positions"], str(GPT2_VOCAB))
        for name, obj in files.items():
            (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return folder
    if record.get("tokenizer") == "spm":
        for name in SPM_FILES:
            shutil.copy(DATA / f"spm-{name}", folder / name)
        return folder
    with gzip.open(DATA / "smollm2-tokenizer.json.gz", "rb") as src, open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    for name in TOKENIZER_FILES:
        shutil.copy(DATA / f"smollm2-{name}", folder / name)
    return folder


def load_record(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
