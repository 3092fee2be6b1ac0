"""`llmtune import` against llama.cpp's convert_hf_to_gguf.py: same tensors (bytes, types, shapes), same keys.

    python bench/check_hf_import.py --record            # tiny llama (3.1 / 3.2 rope too) / qwen / gemma / phi3
                                                        # -> tests/data/hf/ (--only NAME: just that one)
    python bench/check_hf_import.py --real DIR          # a real folder (SmolLM2-135M-Instruct, made from its GGUF
                                                        # by transformers when DIR is missing), f32 / f16 / q8_0,
                                                        # timings and peak RSS, then llama-tokenize on both files
    python bench/check_hf_import.py --gpt2-small DIR       # GPT-2 small's shape (124M, seeded weights), three types
    python bench/check_hf_import.py --spm-gguf tests/data/vocab/ggml-vocab-llama-spm.gguf --llama-tokenize PATH
                                                        # a real SentencePiece vocabulary (as tokenizer.model)

Each tiny folder (tests/hf_fixture.py: config.json saved by transformers' config class, seeded numpy weights
in safetensors, SmolLM2's tokenizer) is converted by both; every difference is printed (none expected) and
the converter's keys and tensor digests are recorded for tests/test_hf_import.py. The converter runs with
the vendored gguf-py (PYTHONPATH) and needs torch, transformers and sentencepiece (its llama vocab path
imports it even for a BPE folder); llmtune import needs none of them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import hf_compare  # noqa: E402
import hf_fixture  # noqa: E402

LLAMA_CPP = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
BIN = LLAMA_CPP / "build-isa" / "bin"
GGUF_SOURCE = Path("/work/models/SmolLM2-135M-Instruct.Q4_1.gguf")
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
MIXED = ROOT / "tests" / "data" / "vocab" / "mixed.txt"

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
# GPT2Config's own names (its attribute_map would take SMALL's, but GPT-2's config.json holds these); n_ctx as
# GPT-2's config.json has it (GPT2Model.set_gguf_parameters reads it; transformers 5 no longer writes it)
GPT2_SMALL = dict(vocab_size=50257, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_ctx=256,
                  layer_norm_epsilon=1e-5, bos_token_id=50256, eos_token_id=50256)
# name: (transformers config class, its extra arguments, safetensors dtype, the --type values checked)
TINY = {
    "llama-tiny": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0), "F32", ("f32", "f16", "q8_0")),
    "qwen2-tiny": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0), "BF16", ("bf16", "f32")),
    "qwen3-tiny": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0), "F16",
                   ("f16", "q8_0")),
    # SentencePiece (tokenizer.model, no tokenizer.json): 640 pieces, added tokens in ids 640-642, [PAD643]
    "llama-spm-tiny": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0, vocab_size=644), "BF16",
                       ("f32", "f16")),
    # gemma2: its own key order, softcaps, sliding window, norms + 1 rounded to BF16, add_space_prefix false
    "gemma2-spm-tiny": ("Gemma2Config", dict(head_dim=16, vocab_size=644, sliding_window=512), "BF16",
                        ("bf16", "f32")),
    # gemma3 (text): q/k norms + 1, the global / local rope bases
    "gemma3-spm-tiny": ("Gemma3TextConfig", dict(head_dim=16, vocab_size=644, sliding_window=512, rms_norm_eps=1e-6),
                        "BF16", ("bf16", "q8_0")),
    # Gemma3ForConditionalGeneration as transformers 5 saves it (text_config in full, model.language_model.*, a
    # SigLIP tower and projector the converter leaves out of the text model)
    "gemma3mm-spm-tiny": ("Gemma3Config", dict(head_dim=16, vocab_size=644, sliding_window=512, rms_norm_eps=1e-6),
                          "BF16", ("f32", "f16", "q8_0")),
    # as transformers 4 saved Gemma 3 4B / 12B / 27B: text_config holds only what differs from Gemma3TextConfig's
    # defaults (GEMMA3_V4_TEXT; heads, head_dim, context, epsilon, rope bases from AutoConfig's defaults), a linear
    # rope scaling, eos_token_id [1, 106] at the root, language_model.model.* names
    "gemma3mm-v4-spm-tiny": ("Gemma3Config", None, "BF16", ("f16", "q8_0")),
    # phi3: fused qkv / gate_up, its own keys, its own added-token rules; untied output
    "phi3-spm-tiny": ("Phi3Config", dict(vocab_size=644, original_max_position_embeddings=2048, pad_token_id=None,
                                         tie_word_embeddings=False), "F16", ("f16", "f32")),
    # Llama 3.1 / 3.2 rope scaling ("llama3"): the converter's rope_freqs.weight first, computed in torch float32
    # (SLEEF's powf: convert/hf_rope.py); 3.1: head_dim 64 (so 32 factors), factor 8; 3.2: head_dim 128, factor 32
    "llama31-tiny": ("LlamaConfig", dict(tie_word_embeddings=False, head_dim=64, max_position_embeddings=131072,
                                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                                              original_max_position_embeddings=8192)),
                     "BF16", ("f32", "f16", "q8_0")),
    "llama32-tiny": ("LlamaConfig", dict(tie_word_embeddings=True, head_dim=128, max_position_embeddings=131072,
                                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                                              original_max_position_embeddings=8192)),
                     "F32", ("f32", "f16", "q8_0")),
    # phi3 LongRoPE (Phi-3-128k / 3.5): rope.scaling.attn_factor first, rope_factors_long / short tensors first
    "phi3-longrope-spm-tiny": ("Phi3Config", dict(
        vocab_size=644, max_position_embeddings=8192, original_max_position_embeddings=2048, pad_token_id=None,
        tie_word_embeddings=False, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=1.0, original_max_position_embeddings=2048,
            long_factor=[1.0 + i / 10 for i in range(8)], short_factor=[1.0 + i / 100 for i in range(8)])),
        "BF16", ("f16",)),
    # gpt2: Conv1D weights transposed, learned positions (F32 at every type), biases, GPT-2's own tokenizer
    # (tests/data/vocab/ggml-vocab-gpt-2.gguf as tokenizer.json: pre-tokenizer "gpt-2" by its own hash)
    "gpt2-tiny": ("GPT2Config", dict(tie_word_embeddings=True), "F32", ("f32", "f16", "q8_0")),
}
# a tiny SigLIP tower without its pooling head (Gemma 3's vision_use_head false): 4 patches of 14 x 14
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14, vision_use_head=False)
# google/gemma-3-4b-it's text_config (the 4.50 save) at a tiny width; vocab_size given (the default is 262,208)
GEMMA3_V4_TEXT = {"hidden_size": 64, "intermediate_size": 96, "model_type": "gemma3_text", "num_hidden_layers": 2,
                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 512, "vocab_size": 644}
# the image tokens of the tiny vocabulary (Gemma 3: <start_of_image>, <end_of_image>, <image_soft_token>)
GEMMA3_MM = dict(boi_token_index=640, eoi_token_index=641, image_token_index=642, mm_tokens_per_image=4)
SPM_PIECES = 640
# tokenizer_config.json and added_tokens.json as a Llama 2 style folder holds them, with the overrides the
# converter applies: a special added token (CONTROL), a non-special one with U+2581 (USER_DEFINED, a space),
# added_tokens.json's (USER_DEFINED); add_prefix_space (LlamaModel.set_vocab's add_space_prefix)
SPM_CONFIG = {
    "add_bos_token": True, "add_eos_token": False, "add_prefix_space": False, "legacy": False,
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
    "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": sp}
                             for i, c, sp in ((0, "<unk>", True), (1, "<s>", True), (2, "</s>", True),
                                              (640, "<|im_start|>", True), (641, "\u2581hello", False))},
    "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}</s>{% endfor %}",
    "model_max_length": 2048, "tokenizer_class": "LlamaTokenizer",
}
SPM_ADDED = {"<extra_0>": 642}


def train_spm() -> None:
    """tests/data/hf/spm-*: a BPE SentencePiece model (byte fallback, identity normalisation as Llama's) trained
    on WikiText-2's first 300,000 characters and the repo's mixed-script text, and its two JSON files."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "train.txt"
        text.write_text(WIKITEXT.read_text(encoding="utf-8")[:300_000] + MIXED.read_text(encoding="utf-8"),
                        encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(Path(tmp) / "m"), vocab_size=SPM_PIECES,
                                       model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                       normalization_rule_name="identity", num_threads=1, minloglevel=2)
        shutil.copy(Path(tmp) / "m.model", hf_fixture.DATA / "spm-tokenizer.model")
    (hf_fixture.DATA / "spm-tokenizer_config.json").write_text(json.dumps(SPM_CONFIG, indent=2) + "\n")
    (hf_fixture.DATA / "spm-added_tokens.json").write_text(json.dumps(SPM_ADDED) + "\n")


# transformers 5's AutoTokenizer builds Qwen2Tokenizer for any qwen2 / qwen3 config and swaps in Qwen2's split
# regex whatever tokenizer.json says; with SmolLM2's vocabulary (no real Qwen tokenizer is on this machine) the
# converter's check-text hash is then none it knows. For those folders its get_vocab_base_pre is given the
# name of the tokenizer.json it reads ("smollm"); every other key and tensor is the converter's own.
_PATCHED = """import runpy, sys
sys.path.insert(0, {dir!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def converter(folder: Path, out: Path, outtype: str, pre: str | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    script = str(LLAMA_CPP / "convert_hf_to_gguf.py")
    argv = [script, str(folder), "--outfile", str(out), "--outtype", outtype]
    cmd = [sys.executable, *argv] if pre is None else \
        [sys.executable, "-c", _PATCHED.format(dir=str(LLAMA_CPP), pre=pre, argv=argv, script=script)]
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {folder}: {res.stderr[-1500:]}")
    return time.perf_counter() - start


def llmtune_import(folder: Path, out: Path, outtype: str) -> tuple[float, int]:
    """Seconds and peak RSS (KiB, GNU time) of `llmtune import`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        env.pop(var, None)
    start = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "llmtune", "import", str(folder), "-o",
                          str(out), "--type", outtype, "--force"], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if res.returncode:
        raise SystemExit(f"llmtune import failed: {res.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1))
    return seconds, rss


def tiny_config(name: str) -> dict:
    import transformers

    cls_name, extra, _, _ = TINY[name]
    if cls_name == "Gemma3Config":
        return gemma3_mm_config(extra)
    gpt2 = cls_name == "GPT2Config"
    cfg = getattr(transformers, cls_name)(**{**(GPT2_SMALL if gpt2 else SMALL), **extra})
    cfg.architectures = ["GPT2LMHeadModel" if gpt2 else
                         cls_name.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def gemma3_mm_config(text: dict | None) -> dict:
    """A Gemma3ForConditionalGeneration config.json: saved by transformers' Gemma3Config from SMALL + `text`, or
    (`text` None) as transformers 4 saved Gemma 3 4B's, with GEMMA3_V4_TEXT as its text_config."""
    import transformers

    vision = transformers.SiglipVisionConfig(**GEMMA3_VISION)
    if text is None:
        return {"architectures": ["Gemma3ForConditionalGeneration"], **GEMMA3_MM, "eos_token_id": [1, 106],
                "initializer_range": 0.02, "model_type": "gemma3", "text_config": GEMMA3_V4_TEXT,
                "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
                "vision_config": {k: v for k, v in vision.to_dict().items() if k in (*GEMMA3_VISION, "model_type")}}
    cfg = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**{**SMALL, **text}).to_dict(),
                                    vision_config=vision.to_dict(), **GEMMA3_MM)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        return json.loads((Path(tmp) / "config.json").read_text())


def record(work: Path, smol_dir: Path, only: list[str]) -> None:
    hf_fixture.DATA.mkdir(parents=True, exist_ok=True)
    if not only:
        record_smollm2(smol_dir)
    if not (hf_fixture.DATA / "spm-tokenizer.model").is_file():
        train_spm()
    for name, (_, _, dtype, types) in TINY.items():
        if only and name not in only:
            continue
        rec = {"config": tiny_config(name), "dtype": dtype, "seed": 41, "outputs": {}}
        if "spm" in name or name.startswith("gpt2"):
            rec["tokenizer"] = "spm" if "spm" in name else "gpt2"
        if "-v4-" in name:
            rec["layout"] = "v4"
        record_one(work, name, rec, dtype, types)


def record_smollm2(smol_dir: Path) -> None:
    with open(smol_dir / "tokenizer.json", "rb") as src, \
            gzip.GzipFile(hf_fixture.DATA / "smollm2-tokenizer.json.gz", "wb", mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    for name in hf_fixture.TOKENIZER_FILES:
        shutil.copy(smol_dir / name, hf_fixture.DATA / f"smollm2-{name}")


def record_one(work: Path, name: str, rec: dict, dtype: str, types: tuple[str, ...]) -> None:
    folder = hf_fixture.make_folder(rec, work / name)
    for outtype in types:
        ref, ours = work / f"{name}.{outtype}.ref.gguf", work / f"{name}.{outtype}.gguf"
        converter(folder, ref, outtype, pre=None if name.startswith(("llama", "gpt2")) else "smollm")
        llmtune_import(folder, ours, outtype)
        diff = hf_compare.differences(ours, ref)
        same = ours.read_bytes() == ref.read_bytes()
        print(f"{name} {dtype} -> {outtype}: {'byte-identical file' if same else 'files differ'}; "
              f"{len(diff)} differences", *diff, sep="\n  ")
        rec["outputs"][outtype] = {"metadata": hf_compare.metadata_digest(hf_compare.plain_fields(ref)),
                                   "tensors": hf_compare.tensor_digests(ref)}
    (hf_fixture.DATA / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    print(f"recorded tests/data/hf/{name}.json")


def make_real(folder: Path) -> None:
    """SmolLM2-135M-Instruct as transformers saves it from its GGUF (dequantised to float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GGUF_SOURCE.parent, gguf_file=GGUF_SOURCE.name)
    model = AutoModelForCausalLM.from_pretrained(GGUF_SOURCE.parent, gguf_file=GGUF_SOURCE.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy it out
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)


def tokenize_ids(tool: Path, model: Path, text_file: Path) -> list[int]:
    res = subprocess.run([str(tool), "-m", str(model), "-f", str(text_file), "--ids", "--log-disable",
                          "--no-bos"], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def real(folder: Path, work: Path, tool: Path, tokenize_only: bool) -> None:
    if not tokenize_only:
        convert_real(folder, work)
    wiki = work / "wikitext-slice.txt"
    wiki.write_text(WIKITEXT.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    for text in (wiki, MIXED):
        a, b = tokenize_ids(tool, work / "real.f32.gguf", text), tokenize_ids(tool, work / "real.f32.ref.gguf", text)
        print(f"llama-tokenize {text.name}: {len(a)} ids, {'same' if a == b else 'DIFFERENT'} on both files")


def against_converter(folder: Path, work: Path, stem: str, outtype: str, size: int) -> tuple[Path, Path]:
    """The converter's file and llmtune import's of `folder` at `outtype` (work/<stem>.<outtype>[.ref].gguf),
    compared byte for byte, with their times, import's rates and peak RSS printed; -> (ref, ours)."""
    ref, ours = work / f"{stem}.{outtype}.ref.gguf", work / f"{stem}.{outtype}.gguf"
    t_ref = converter(folder, ref, outtype)
    t_ours, rss = llmtune_import(folder, ours, outtype)
    diff = hf_compare.differences(ours, ref)
    same = ours.read_bytes() == ref.read_bytes()
    print(f"{folder.name} ({size / 2**20:.0f} MiB) -> {outtype}: {'byte-identical file' if same else 'files differ'}, "
          f"{len(diff)} differences; import {t_ours:.1f} s ({size / t_ours / 2**20:.0f} MiB/s read, "
          f"{ours.stat().st_size / t_ours / 2**20:.0f} MiB/s written), peak RSS {rss / 1024:.0f} MiB; "
          f"converter {t_ref:.1f} s", *diff, sep="\n  ")
    return ref, ours


def convert_real(folder: Path, work: Path) -> None:
    if not folder.is_dir():
        make_real(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    for outtype in ("f32", "f16", "q8_0"):
        against_converter(folder, work, "real", outtype, size)
    # a type the converter has not: import --type q4_k_m against import f32 + llmtune export (llama-quantize's twin)
    one, exported = work / "real.q4_k_m.gguf", work / "real.f32-export.q4_k_m.gguf"
    t_one, rss = llmtune_import(folder, one, "q4_k_m")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "llmtune", "export", str(work / "real.f32.gguf"), "--type", "q4_k_m", "-o",
                    str(exported), "--force"], env=env, check=True, capture_output=True)
    same = one.read_bytes() == exported.read_bytes()
    print(f"{folder.name} -> q4_k_m in {t_one:.1f} s (peak RSS {rss / 1024:.0f} MiB): "
          f"{'byte-identical to' if same else 'DIFFERS from'} import f32 + llmtune export --type q4_k_m")


def spm_model_from_gguf(gguf_path: Path, out: Path) -> tuple[int, dict]:
    """A SentencePiece tokenizer.model holding a GGUF's llama vocabulary (pieces, scores, types; the GGUF's
    token types are SentencePiece's), written with sentencepiece's protobuf module (bench only), and the
    special ids. Returns the number of pieces and {bos, eos, unk: id}."""
    from gguf import GGUFReader
    from sentencepiece import sentencepiece_model_pb2 as pb

    fields = GGUFReader(gguf_path).fields
    toks, scores, types = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    model = pb.ModelProto()
    for i in range(len(toks.data)):
        piece = model.pieces.add()
        piece.piece = bytes(toks.parts[toks.data[i]]).decode("utf-8")
        piece.score = float(scores.parts[scores.data[i]][0])
        piece.type = int(types.parts[types.data[i]][0])
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.vocab_size = len(toks.data)
    model.trainer_spec.byte_fallback = any(p.type == 6 for p in model.pieces)
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = False
    out.write_bytes(model.SerializeToString())
    special = {k: int(fields[f"tokenizer.ggml.{key}_token_id"].parts[-1][0])
               for k, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"))}
    return len(toks.data), special


def spm_real(gguf_path: Path, work: Path, tool: Path) -> None:
    """A tiny llama folder (seeded weights) with a real SentencePiece vocabulary taken from `gguf_path`
    (e.g. tests/data/vocab/ggml-vocab-llama-spm.gguf: Llama's 32,000 pieces): import against the converter,
    then llama-tokenize on the imported file against the GGUF the vocabulary came from."""
    folder = work / f"spm-{gguf_path.stem}"
    folder.mkdir(parents=True, exist_ok=True)
    n, special = spm_model_from_gguf(gguf_path, folder / "tokenizer.model")
    config = {**tiny_config("llama-tiny"), "vocab_size": n, "bos_token_id": special["bos"],
              "eos_token_id": special["eos"]}
    rng = np.random.default_rng(7)
    hf_fixture.write_safetensors(folder / "model.safetensors", hf_fixture.hf_tensor_shapes(config),
                                 lambda shape: rng.standard_normal(shape, dtype=np.float32), "F16")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": False}))
    ref, ours = work / f"{folder.name}.ref.gguf", work / f"{folder.name}.gguf"
    t_ref = converter(folder, ref, "f16")
    t_ours, rss = llmtune_import(folder, ours, "f16")
    diff = hf_compare.differences(ours, ref)
    same = ours.read_bytes() == ref.read_bytes()
    print(f"{folder.name} ({n} pieces) -> f16: {'byte-identical file' if same else 'files differ'}, {len(diff)} "
          f"differences; import {t_ours:.1f} s (peak RSS {rss / 1024:.0f} MiB), converter {t_ref:.1f} s",
          *diff, sep="\n  ")
    wiki = work / "wikitext-slice.txt"
    wiki.write_text(WIKITEXT.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    for text in (wiki, MIXED):
        a, b = tokenize_ids(tool, ours, text), tokenize_ids(tool, gguf_path, text)
        print(f"llama-tokenize {text.name}: {len(a)} ids, {'same' if a == b else 'DIFFERENT'} on the import and "
              f"on {gguf_path.name}")


# configs/llama-1b.toml's shape (Llama-3.2-1B) with SmolLM2's 49,152-token vocabulary, output untied: 1.07B
BIG = dict(SMALL, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
           num_key_value_heads=8, max_position_embeddings=131072)


def big(folder: Path, work: Path, with_converter: bool) -> None:
    """Speed and peak RSS on a 1B-class BF16 folder (seeded weights), as f16; the converter too if asked."""
    import transformers

    if not (folder / "model.safetensors").is_file():
        cfg = transformers.LlamaConfig(**BIG, tie_word_embeddings=False, rope_theta=500000.0)
        cfg.architectures = ["LlamaForCausalLM"]
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            config = json.loads((Path(tmp) / "config.json").read_text())
        start = time.perf_counter()
        hf_fixture.make_folder({"config": config, "dtype": "BF16", "seed": 1}, folder)
        print(f"made {folder} in {time.perf_counter() - start:.0f} s")
    size = (folder / "model.safetensors").stat().st_size
    ours = work / "big.f16.gguf"
    seconds, rss = llmtune_import(folder, ours, "f16")
    print(f"{folder.name}: {size / 2**30:.2f} GiB BF16 -> f16 {ours.stat().st_size / 2**30:.2f} GiB in {seconds:.1f} s "
          f"({ours.stat().st_size / seconds / 2**20:.0f} MiB/s written), peak RSS {rss / 1024:.0f} MiB")
    if with_converter:
        ref = work / "big.f16.ref.gguf"
        t_ref = converter(folder, ref, "f16")
        diff = hf_compare.differences(ours, ref)
        same = ours.read_bytes() == ref.read_bytes()
        print(f"converter {t_ref:.1f} s; {'byte-identical file' if same else 'files differ'}, {len(diff)} differences",
              *diff, sep="\n  ")
        ref.unlink()
    ours.unlink()


# GPT-2 small's shape (124M), GPT-2's vocabulary and context
GPT2_124M = dict(GPT2_SMALL, n_embd=768, n_layer=12, n_head=12, n_positions=1024, n_ctx=1024)


def gpt2_small(folder: Path, work: Path) -> None:
    """A GPT-2-small-shaped GPT2LMHeadModel folder (seeded F32 weights, made when missing): import against the
    converter at f32 / f16 / q8_0 (Conv1D matrices of 768 x 3072 transposed piece by piece), times and RSS."""
    import transformers

    if not (folder / "model.safetensors").is_file():
        cfg = transformers.GPT2Config(**GPT2_124M, tie_word_embeddings=True)
        cfg.architectures = ["GPT2LMHeadModel"]
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            config = json.loads((Path(tmp) / "config.json").read_text())
        hf_fixture.make_folder({"config": config, "dtype": "F32", "seed": 1, "tokenizer": "gpt2"}, folder)
    size = (folder / "model.safetensors").stat().st_size
    for outtype in ("f32", "f16", "q8_0"):
        for path in against_converter(folder, work, "gpt2-124m", outtype, size):
            path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="build, compare and record the tiny folders")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help=f"with --record: only this tiny folder (repeatable; SmolLM2's files kept): {', '.join(TINY)}")
    ap.add_argument("--real", type=Path, metavar="DIR", help="the real folder (made from the GGUF when missing)")
    ap.add_argument("--record-only", action="store_true", help="with --record: skip the real folder's checks")
    ap.add_argument("--tokenize-only", action="store_true", help="with --real: only llama-tokenize the files in --work")
    ap.add_argument("--llama-tokenize", type=Path, default=BIN / "llama-tokenize", metavar="PATH",
                    help="llama.cpp's llama-tokenize (build-isa has none: g++ tools/tokenize/tokenize.cpp against "
                         "build-isa/bin's libllama and libllama-common)")
    ap.add_argument("--spm-gguf", type=Path, metavar="GGUF", help="a tiny llama folder with this GGUF's SentencePiece "
                    "vocabulary: import against the converter, llama-tokenize against the GGUF")
    ap.add_argument("--big", type=Path, metavar="DIR", help="a 1B-class folder (made when missing): speed, RSS")
    ap.add_argument("--big-converter", action="store_true", help="with --big: run and compare the converter too")
    ap.add_argument("--gpt2-small", type=Path, metavar="DIR", help="a GPT-2-small-shaped folder (made when missing): "
                    "import against the converter at f32 / f16 / q8_0")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "check_hf_import")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.real is not None and not args.record_only:
        real(args.real, args.work, args.llama_tokenize, args.tokenize_only)
    if args.spm_gguf is not None:
        spm_real(args.spm_gguf, args.work, args.llama_tokenize)
    if args.big is not None:
        big(args.big, args.work, args.big_converter)
    if args.gpt2_small is not None:
        gpt2_small(args.gpt2_small, args.work)
    if args.record:
        record(args.work, args.real or args.work / "SmolLM2-135M-Instruct", args.only)
    print(f"peak RSS of this script: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
