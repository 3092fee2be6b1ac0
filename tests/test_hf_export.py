"""`llmtune export MODEL.gguf --hf DIR`: the Hugging Face folder (convert/hf_export.py).

transformers itself is the bench's oracle (bench/check_hf_export.py loads the folder and compares
logits and tokenization); here: the folder's files and keys, its tensors read back to the GGUF's
values, transformers' recorded logits of the exported stories260K (tests/data/hf_export), the
tokenizer.json against llama.cpp's own tokenizer test vectors (with the `tokenizers` library when
installed), and bad input.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import toy_family
from cli_helpers import run_cli
from conftest import DATA, REPO
from llmtune import arch
from llmtune.arch import hf_names
from llmtune.arch.hf_config import llama3_factors, llama3_rope
from llmtune.arch.hparams import HParams
from llmtune.backends.cpu import CPUBackend
from llmtune.convert.export import export_hf
from llmtune.convert.hf_export import encode, write_hf
from llmtune.convert.init import init_model
from llmtune.gguf.file import load_gguf
from llmtune.graph.planner import Program
from llmtune.model import adapter as lora
from llmtune.model.adapter.files import write_adapter
from llmtune.model.loaded import Model, check_model, load_model
from llmtune.tokenizer import Tokenizer
from llmtune.tokenizer.hf_files import tokenizer_files
from test_lora import random_adapter
from test_tokenizer import VOCAB_DIR, metadata, read_vocab_tests, tokenizer

FIXTURE = DATA / "hf_export" / "stories260K.json"  # bench/check_hf_export.py --record
FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
         "tokenizer_config.json"]


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The format read by hand (8-byte header length, JSON header, data), F32 / F16 / BF16 as float32."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = (8 + n + o for o in info["data_offsets"])
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw[start:end], "<u2").astype(np.uint32) << 16
            values = bits.view(np.float32)
        else:
            values = np.frombuffer(raw[start:end], {"F32": "<f4", "F16": "<f2"}[info["dtype"]]).astype(np.float32)
        out[name] = values.reshape(info["shape"])
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "stories-hf"
    export_hf(DATA / "stories260K.gguf", folder)
    return folder


def test_the_folder_has_transformers_files_and_keys(exported):
    assert sorted(p.name for p in exported.iterdir()) == FILES
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")} == {
        "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 512, "tie_word_embeddings": False}
    assert (config["bos_token_id"], config["eos_token_id"], config["rope_theta"]) == (1, 2, 10000.0)
    tok_config = json.loads((exported / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert tok_config["add_bos_token"] is True and tok_config["add_eos_token"] is False
    assert json.loads((exported / "special_tokens_map.json").read_text())["bos_token"] == "<s>"
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tensors_read_back_to_the_gguf_values(exported):
    gf = load_gguf(DATA / "stories260K.gguf")
    hp, _ = check_model(gf)
    hf = hf_names("llama")
    tensors = read_safetensors(exported / "model.safetensors")
    assert len(tensors) == len(gf.tensors)
    for name, w in tensors.items():
        gguf = hf.gguf_name(name)
        rows = hf.hf_rows(gguf, w.shape[0], hp.n_head, hp.n_head_kv)
        back = w[np.argsort(rows)] if rows is not None else w
        np.testing.assert_array_equal(back, gf.tensor(gguf), err_msg=name)
    # llama's q rows really move (HF rotates halves of each head): not the identity
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(tensors[q], gf.tensor("blk.0.attn_q.weight"))


def _llmtune_logits(path, ids: list[int]) -> np.ndarray:
    """llmtune's float64 logits [n_tok, n_vocab] for `ids` over the GGUF's weights as float32."""
    gf = load_gguf(path)
    hp, present = check_model(gf)
    model = Model(gf.path, gf, hp, {s.name: gf.tensor(s.name) for s in present})
    _, nodes, logits = model.build(1, len(ids))
    prog = Program([logits], CPUBackend(), params={nodes[n]: w for n, w in model.weights.items()})
    return np.asarray(prog.run(tokens=np.asarray([ids], np.int32), pos=np.arange(len(ids), dtype=np.int32))[0],
                      np.float64).reshape(len(ids), -1)


def test_llmtune_logits_equal_transformers_on_the_exported_folder():
    """tests/data/hf_export: transformers' logits of the folder this export writes (float32, eager)."""
    fixture = json.loads(FIXTURE.read_text())
    ids = fixture["ids"]
    ours = _llmtune_logits(DATA / "stories260K.gguf", ids)
    theirs = np.asarray(fixture["logits"])
    assert ids == Tokenizer.from_gguf(load_gguf(DATA / "stories260K.gguf")).encode(fixture["text"])[:len(ids)]
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4


@pytest.mark.parametrize("dtype,tolerance", [("bf16", 2.0 ** -8), ("f16", 2.0 ** -11)])
def test_half_types_round_to_nearest(dtype, tolerance, tmp_path):
    w = np.array([1.0, -2.5, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.14159, 1e-3], np.float32)
    bits = encode(w, dtype)
    assert bits.dtype.itemsize == 2
    if dtype == "bf16":  # ties to even: 1 + 2^-8 -> 1.0, 1 + 3 * 2^-8 -> 1 + 2^-6
        assert bits[:4].tolist() == [0x3F80, 0xC020, 0x3F80, 0x3F82]
    back = (bits.astype(np.uint32) << 16).view(np.float32) if dtype == "bf16" else bits.astype(np.float32)
    np.testing.assert_allclose(back, w, rtol=tolerance)
    folder = tmp_path / dtype
    export_hf(DATA / "stories260K.gguf", folder, dtype)
    tensors = read_safetensors(folder / "model.safetensors")
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == {"bf16": "bfloat16",
                                                                              "f16": "float16"}[dtype]
    gf = load_gguf(DATA / "stories260K.gguf")
    np.testing.assert_allclose(tensors["model.norm.weight"], gf.tensor("output_norm.weight"), rtol=tolerance)


# llama.cpp's own tokenizer test vectors, on its complete (not slimmed) vocabularies of both kinds
FULL_VOCABS = ["gpt-2", "falcon", "deepseek-coder", "starcoder", "llama-spm", "phi-3"]


@pytest.mark.parametrize("name", FULL_VOCABS)
def test_tokenizer_json_tokenizes_as_llama_cpp(name):
    tokenizers = pytest.importorskip("tokenizers")  # installed with transformers; not a dependency
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    files = tokenizer_files(tokenizer(path), metadata(path), 2048, str(path))
    ht = tokenizers.Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
    failures = [(text, want) for text, want in read_vocab_tests(path)
                if ht.encode(text, add_special_tokens=False).ids != want]
    assert not failures, failures[:3]


def test_stories_tokenizer_json_adds_bos_and_decodes(exported):
    tokenizers = pytest.importorskip("tokenizers")
    ht = tokenizers.Tokenizer.from_file(str(exported / "tokenizer.json"))
    tok = Tokenizer.from_gguf(load_gguf(DATA / "stories260K.gguf"))
    text = "Once upon a time, Lily saw a big dog. \"Hi!\" she said. 123 naïve 🙂"
    ids = ht.encode(text).ids
    assert ids == tok.encode(text) and ids[0] == 1
    assert ht.decode(ids, skip_special_tokens=True) == text


def _one_line(code, err, *words):
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_family_without_a_mapping_is_refused_and_nothing_written(tmp_path, monkeypatch, capsys):
    model = tmp_path / "gpt2.gguf"
    init_model(REPO / "configs" / "gpt2-tiny.toml", VOCAB_DIR / "ggml-vocab-gpt-2.gguf", model, 0,
               test_weights=True)
    monkeypatch.setitem(arch._FAMILIES, "gpt2", toy_family.GPT2WithoutNames())
    code, _, err = run_cli(monkeypatch, capsys, "export", model, "--hf", tmp_path / "out")
    _one_line(code, err, str(model), "the gpt2 family has no Hugging Face tensor names")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


@pytest.fixture(scope="module")
def gpt2_tiny(tmp_path_factory):
    """bench/check_hf_export.py --record's gpt2 model: configs/gpt2-tiny.toml, seed 0, random weights."""
    return init_model(REPO / "configs" / "gpt2-tiny.toml", VOCAB_DIR / "ggml-vocab-gpt-2.gguf",
                      tmp_path_factory.mktemp("gpt2") / "gpt2-tiny.gguf", 0, test_weights=True)


def test_gpt2_folder_conv1d_matrices_and_config(gpt2_tiny, tmp_path):
    """GPT2LMHeadModel's names; c_attn / c_proj / c_fc as Conv1D weights ([n_in, n_out]: the GGUF's
    transposed), everything else as it is; GPT2Config's own keys."""
    folder = tmp_path / "gpt2-hf"
    export_hf(gpt2_tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert {k: config[k] for k in ("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "vocab_size",
                                   "activation_function", "tie_word_embeddings")} == {
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 256, "vocab_size": 50257,
        "activation_function": "gelu_new", "tie_word_embeddings": True}
    assert not {"hidden_size", "rms_norm_eps", "hidden_act", "num_key_value_heads"} & set(config)
    gf = load_gguf(gpt2_tiny)
    hf = hf_names("gpt2")
    tensors = read_safetensors(folder / "model.safetensors")
    assert len(tensors) == len(gf.tensors)
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)
    for name, w in tensors.items():
        gguf = hf.gguf_name(name)
        np.testing.assert_array_equal(w.T if hf.transposed(gguf) else w, gf.tensor(gguf), err_msg=name)
    assert sorted(n for n in tensors if hf.transposed(hf.gguf_name(n))) == sorted(
        f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                   "mlp.c_proj"))


def test_gpt2_llmtune_logits_equal_transformers(gpt2_tiny):
    """tests/data/hf_export/gpt2-tiny.json: transformers' logits (every 97th column) of the folder this
    export writes for gpt2-tiny (float32, eager)."""
    fixture = json.loads((DATA / "hf_export" / "gpt2-tiny.json").read_text())
    ids, every = fixture["ids"], int(fixture["columns"].split()[-1])
    ours = _llmtune_logits(gpt2_tiny, ids)[:, ::every]
    theirs = np.asarray(fixture["logits"])
    assert ids == Tokenizer.from_gguf(load_gguf(gpt2_tiny)).encode(fixture["text"])[:len(ids)]
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4


@pytest.mark.parametrize("args,words", [
    (["--hf-dtype", "q8_0"], ["--hf-dtype", "f32, bf16, f16"]),
    (["-o", "x.gguf"], ["-o", "not with --hf"]),
    (["--peft", "p"], ["--peft", "not with --hf"]),
])
def test_flag_mistakes(args, words, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "export", DATA / "stories260K.gguf", "--hf", tmp_path / "out", *args)
    _one_line(code, err, *words)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_destinations(tmp_path, monkeypatch, capsys):
    stories = DATA / "stories260K.gguf"
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(monkeypatch, capsys, "export", stories, "--hf", tmp_path / "file")
    _one_line(code, err, "--hf", "is a file")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    code, _, err = run_cli(monkeypatch, capsys, "export", stories, "--hf", mine)
    _one_line(code, err, "--hf", str(mine), "new or empty folder")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    code, out, err = run_cli(monkeypatch, capsys, "export", stories, "--hf", tmp_path / "hf")
    assert code == 0 and "LlamaForCausalLM" in out, err
    before = (tmp_path / "hf" / "model.safetensors").read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, "export", stories, "--hf", tmp_path / "hf", "--hf-dtype", "bf16")
    assert code == 0, err  # a folder this export wrote is replaced whole
    assert len((tmp_path / "hf" / "model.safetensors").read_bytes()) < len(before)
    assert not _leftovers(tmp_path)
    code, _, err = run_cli(monkeypatch, capsys, "export", stories, "--hf-dtype", "bf16", "-o", tmp_path / "x.gguf",
                           "--type", "f16")
    _one_line(code, err, "--hf-dtype", "needs --hf")


@pytest.mark.parametrize("n_rot,numbers", [(16, (8.0, 1.0, 4.0, 8192)), (64, (32.0, 1.0, 4.0, 8192)),
                                           (16, (8.0, 1.0, 32.0, 4096)), (64, (4.0, 2.0, 8.0, 1024))])
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(n_rot, numbers):
    hp = HParams(arch="llama", n_vocab=8, n_ctx_train=8, n_embd=n_rot, n_layer=1, n_head=1, n_head_kv=1, n_ff=8,
                 n_rot=n_rot, rope_freq_base=500000.0)
    factors = llama3_factors(hp, *numbers).astype(np.float32)
    rope = llama3_rope(factors, hp)
    assert rope["rope_type"] == "llama3"
    again = llama3_factors(hp, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                           rope["original_max_position_embeddings"])
    np.testing.assert_allclose(again, factors, rtol=1e-6)
    rng = np.random.default_rng(0)
    assert llama3_rope(rng.uniform(1, 8, n_rot // 2).astype(np.float32), hp) is None  # no llama3 scaling gives these


def test_gemma2_norms_lose_the_stored_one_and_the_config_has_gemmas_keys(tmp_path):
    model = tmp_path / "gemma2.gguf"
    init_model(REPO / "configs" / "gemma2-tiny.toml", DATA / "stories260K.gguf", model, 0, test_weights=True)
    export_hf(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["query_pre_attn_scalar"], config["head_dim"]) == (
        ["Gemma2ForCausalLM"], 24, 24)
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"], config["sliding_window"]) == (
        3.0, 4.0, 32)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    tensors = read_safetensors(tmp_path / "hf" / "model.safetensors")
    gf = load_gguf(model)
    np.testing.assert_array_equal(tensors["model.layers.1.post_feedforward_layernorm.weight"] + 1,
                                  gf.tensor("blk.1.post_ffw_norm.weight"))
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.gate_proj.weight"], gf.tensor("blk.1.ffn_gate.weight"))


def test_an_adapter_is_merged_first(tmp_path):
    stories = DATA / "stories260K.gguf"
    model = load_model(stories)
    adapter = random_adapter(model, targets="attn_q|ffn_down")
    path = write_adapter(tmp_path / "a.gguf", adapter, base=load_gguf(stories))
    export_hf(stories, tmp_path / "hf", lora=[path])
    tensors = read_safetensors(tmp_path / "hf" / "model.safetensors")
    merged = load_model(stories)
    attached = lora.attach(merged, [path])
    hp = merged.hp
    for gguf in ("blk.2.attn_q.weight", "blk.2.ffn_down.weight"):
        want = lora.merged_weight(attached, gguf, load_gguf(stories).tensor(gguf))
        rows = hf_names("llama").hf_rows(gguf, want.shape[0], hp.n_head, hp.n_head_kv)
        got = tensors[hf_names("llama").hf_name(gguf)]
        np.testing.assert_allclose(got, want[rows] if rows is not None else want, rtol=1e-6, atol=1e-7)
        base = load_gguf(stories).tensor(gguf)
        assert not np.allclose(got, base[rows] if rows is not None else base)  # the adapter changed it


def test_shards_and_their_index(tmp_path):
    gf = load_gguf(DATA / "stories260K.gguf")
    write_hf(gf, tmp_path / "hf", shard_bytes=200_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    tensors = {}
    for name in shards:
        assert (tmp_path / "hf" / name).stat().st_size <= 200_000 + 4096
        tensors.update(read_safetensors(tmp_path / "hf" / name))
    single = read_safetensors(export_hf(DATA / "stories260K.gguf", tmp_path / "one").folder / "model.safetensors")
    assert tensors.keys() == single.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in single.values())
    for name, w in single.items():
        np.testing.assert_array_equal(tensors[name], w)


def test_qwen3_with_qkv_biases_is_refused_naming_why(tmp_path, monkeypatch, capsys):
    model = tmp_path / "qwen3.gguf"
    biases = [f"blk.{i}.attn_{p}.bias" for i in range(2) for p in "qkv"]
    init_model(REPO / "configs" / "qwen3-tiny.toml", DATA / "stories260K.gguf", model, 0, test_weights=True,
               optional=tuple(biases))
    code, _, err = run_cli(monkeypatch, capsys, "export", model, "--hf", tmp_path / "out")
    _one_line(code, err, str(model), "q/k/v biases", "o_proj")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_special_tokens_in_text_strip_as_llama_cpp_strips(tmp_path):
    """phi-3's <|end|>, <|user|>... eat the whitespace after them in llama.cpp (rstrip): so in tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    path = VOCAB_DIR / "ggml-vocab-phi-3.gguf"
    tok = tokenizer(path)
    ht = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_files(tok, metadata(path), 2048, str(path))[
        "tokenizer.json"]))
    text = ("<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\n Tell me  a story.<|end|>\n"
            "<|assistant|>\n")
    ours = tok.encode(text, add_special=False, parse_special=True)
    assert ht.encode(text, add_special_tokens=False).ids == ours
    assert 13 not in ours[:3]  # the newline after <|user|> is stripped (13: "<0x0A>")
