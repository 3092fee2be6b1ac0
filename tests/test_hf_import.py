"""`llmtune import` (convert/hf_import.py): the converter's bytes and keys on recorded tiny folders, bad input.

The records (tests/data/hf/*.json, bench/check_hf_import.py --record) hold what llama.cpp's
convert_hf_to_gguf.py wrote for each tiny folder: every key and every tensor's type, shape and sha256.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from safetensors.numpy import load_file  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from conftest import DATA, REPO  # noqa: E402
from hf_compare import metadata_digest, plain_fields, tensor_digests  # noqa: E402
from hf_fixture import hf_tensor_shapes as hf_fixture_shapes, load_record, make_folder, write_safetensors  # noqa: E402
from llmtune.convert import hf_import  # noqa: E402
from llmtune.convert.init import init_model  # noqa: E402
from llmtune.gguf.file import load_gguf  # noqa: E402

# *-spm-*: a SentencePiece tokenizer.model; gemma2: its own keys, norms + 1, no lm_head read; gemma3: q/k norms
# + 1, the local rope base; phi3: fused qkv / gate_up, its keys, its added-token rules (longrope: the rope factors);
# gpt2: Conv1D matrices transposed, its six keys, learned positions, GPT-2's tokenizer; gemma3mm:
# Gemma3ForConditionalGeneration's text model (vision tensors left out; v4: a sparse text_config, 4.x names);
# llama31 / llama32: "llama3" rope scaling (rope_freqs.weight first, torch's float32 bits: convert/hf_rope.py)
NAMES = ("llama-tiny", "qwen2-tiny", "qwen3-tiny", "llama-spm-tiny", "gemma2-spm-tiny", "gemma3-spm-tiny",
         "phi3-spm-tiny", "phi3-longrope-spm-tiny", "gpt2-tiny", "gemma3mm-spm-tiny", "gemma3mm-v4-spm-tiny",
         "llama31-tiny", "llama32-tiny")
CASES = [(name, t) for name in NAMES for t in load_record(name)["outputs"]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_folder(load_record(name), root / name) for name in NAMES}


def _imports_as_recorded(monkeypatch, capsys, folder, out, name: str, outtype: str) -> None:
    """`llmtune import folder -o out --type outtype` gives the tensors and metadata recorded for `name`."""
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", outtype)
    assert code == 0, err
    expected = load_record(name)["outputs"][outtype]
    assert {k: list(v) for k, v in tensor_digests(out).items()} == expected["tensors"]
    assert json.loads(json.dumps(metadata_digest(plain_fields(out)))) == expected["metadata"]


def _rewrite_weights(folder, tensors: dict) -> None:
    """folder's model.safetensors written anew (F32) with `tensors`, in name order."""
    arrays = iter([tensors[k] for k in sorted(tensors)])
    write_safetensors(folder / "model.safetensors", {k: tensors[k].shape for k in sorted(tensors)},
                      lambda _: next(arrays), "F32")


@pytest.mark.parametrize("name,outtype", CASES)
def test_same_as_convert_hf_to_gguf(folders, tmp_path, monkeypatch, capsys, name, outtype):
    expected = load_record(name)["outputs"][outtype]
    out = tmp_path / "m.gguf"
    code, stdout, err = run_cli(monkeypatch, capsys, "import", folders[name], "-o", out, "--type", outtype)
    assert code == 0, err
    got_tensors = {k: list(v) for k, v in tensor_digests(out).items()}
    assert list(got_tensors) == list(expected["tensors"])  # same names, same order
    assert got_tensors == expected["tensors"]  # same types, shapes, bytes
    got_meta = json.loads(json.dumps(metadata_digest(plain_fields(out))))
    assert list(got_meta) == list(expected["metadata"])  # same keys, same order
    assert got_meta == expected["metadata"]


def _bad(monkeypatch, capsys, folder, out, *extra):
    code, stdout, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, *extra)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert not out.exists() and not list(out.parent.glob("*.tmp*"))
    return lines[0]


def _copy(folders, tmp_path, name="llama-tiny"):
    return shutil.copytree(folders[name], tmp_path / name)


def test_missing_config_key(folders, tmp_path, monkeypatch, capsys):
    folder = _copy(folders, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["rms_norm_eps"]
    (folder / "config.json").write_text(json.dumps(config))
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "config.json has no rms_norm_eps" in line and str(folder) in line


def test_shape_not_matching_config(folders, tmp_path, monkeypatch, capsys):
    folder = _copy(folders, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 32
    (folder / "config.json").write_text(json.dumps(config))
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "config.json" in line and "ffn_" in line and "shape" in line


def test_truncated_safetensors(folders, tmp_path, monkeypatch, capsys):
    folder = _copy(folders, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert str(weights) in line


def test_damaged_safetensors_header(folders, tmp_path, monkeypatch, capsys):
    folder = _copy(folders, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\xff" * 64)
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert str(weights) in line and "not a readable safetensors file" in line


@pytest.mark.parametrize("arch,words", [("MambaForCausalLM", "is not an architecture llmtune imports"),
                                        ("GPTNeoXForCausalLM", "is not an architecture llmtune imports")])
def test_unsupported_architecture(folders, tmp_path, monkeypatch, capsys, arch, words):
    folder = _copy(folders, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = [arch]
    (folder / "config.json").write_text(json.dumps(config))
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert arch in line and words in line and "LlamaForCausalLM" in line


@pytest.mark.parametrize("data", [b"\x00", b"\x0a\x05\x0a\x03ab", b"\x0a\x02\x10\x01", b"\x0b"])
def test_damaged_sentencepiece_model(folders, tmp_path, monkeypatch, capsys, data):
    """A field running past its message, a piece without text, an unknown wire type: one line naming the file."""
    folder = _copy(folders, tmp_path, "llama-spm-tiny")
    (folder / "tokenizer.model").write_bytes(data)
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert str(folder / "tokenizer.model") in line and "SentencePiece model" in line


def test_sentencepiece_model_read_first(folders, tmp_path, monkeypatch, capsys):
    """tokenizer.model beside a byte-level BPE tokenizer.json: the SentencePiece vocabulary, as the converter's
    llama set_vocab tries it first (the same tokens, scores and types as without tokenizer.json)."""
    folder = _copy(folders, tmp_path, "llama-spm-tiny")
    shutil.copy(folders["llama-tiny"] / "tokenizer.json", folder / "tokenizer.json")
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "f32")
    assert code == 0, err
    got = json.loads(json.dumps(metadata_digest(plain_fields(out))))
    expected = load_record("llama-spm-tiny")["outputs"]["f32"]["metadata"]
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert got[key] == expected[key], key
    assert "tokenizer.ggml.merges" not in got


def test_gemma2_norms_and_lm_head(tmp_path, monkeypatch, capsys):
    """gemma2: every norm written as 1 + w in float32 (BF16 widened first, no BF16 rounding), and an
    lm_head.weight in the folder never read (Gemma2Model.filter_tensors)."""
    record = load_record("gemma2-spm-tiny")
    record["config"] = {**record["config"], "tie_word_embeddings": False}  # hf_tensor_shapes adds lm_head.weight
    folder = make_folder(record, tmp_path / "g2")
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "f32")
    assert code == 0, err
    assert list(tensor_digests(out)) == list(record["outputs"]["f32"]["tensors"])  # no output.weight
    with open(folder / "model.safetensors", "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(n))["model.norm.weight"]
        fh.seek(8 + n + info["data_offsets"][0])
        bf16 = np.frombuffer(fh.read(info["data_offsets"][1] - info["data_offsets"][0]), "<u2")
    expected = (bf16.astype(np.uint32) << 16).view(np.float32) + np.float32(1)
    got = next(t for t in GGUFReader(out).tensors if t.name == "output_norm.weight")
    assert np.array_equal(np.asarray(got.data), expected)


@pytest.mark.parametrize("change,present,absent", [
    ({"sliding_window_pattern": 1}, (), ("gemma3.attention.sliding_window",)),  # every layer global
    ({"final_logit_softcapping": 30.0}, ("gemma3.final_logit_softcapping",), ()),
])
def test_gemma3_conditional_keys(folders, tmp_path, monkeypatch, capsys, change, present, absent):
    """Gemma3Model.set_gguf_parameters' conditions: the window unless the pattern is 1, the softcap when set."""
    folder = _copy(folders, tmp_path, "gemma3-spm-tiny")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "bf16")
    assert code == 0, err
    keys = plain_fields(out)
    assert all(k in keys for k in present) and not any(k in keys for k in absent)
    expected = load_record("gemma3-spm-tiny")["outputs"]["bf16"]["metadata"]
    assert [k for k in keys if k not in present] == [k for k in expected if k not in absent]


def test_gemma3_needs_head_dim(folders, tmp_path, monkeypatch, capsys):
    """The converter would write its default (256) after the other keys: refused, naming the key."""
    folder = _copy(folders, tmp_path, "gemma3-spm-tiny")
    config = json.loads((folder / "config.json").read_text())
    del config["head_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "config.json has no head_dim" in line


def _edit_config(folder, **change):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return config


@pytest.mark.parametrize("change,words", [
    ({"text_config": [1, 2]}, "text_config is not a JSON object"),
    ({"architectures": ["LlavaForConditionalGeneration"]}, "is not an architecture llmtune imports"),
])
def test_gemma3_multimodal_bad_config(folders, tmp_path, monkeypatch, capsys, change, words):
    folder = _copy(folders, tmp_path, "gemma3mm-spm-tiny")
    _edit_config(folder, **change)
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert words in line and str(folder / "config.json") in line


def test_gemma3_multimodal_text_config_shapes(folders, tmp_path, monkeypatch, capsys):
    """The text model's shapes are checked against text_config (the root's hidden_size is not the text's)."""
    folder = _copy(folders, tmp_path, "gemma3mm-spm-tiny")
    config = _edit_config(folder, hidden_size=32)  # the root key loses to text_config's: imports as before
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "f32")
    assert code == 0, err
    assert tensor_digests(out) == {k: tuple(v) for k, v in
                                   load_record("gemma3mm-spm-tiny")["outputs"]["f32"]["tensors"].items()}
    _edit_config(folder, text_config={**config["text_config"], "intermediate_size": 128})
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "config.json" in line and "ffn_" in line and "shape" in line


def test_gemma3_multimodal_special_ids_root_first(folders, tmp_path, monkeypatch, capsys):
    """SpecialVocab reads config.json's root ids first, then text_config's (which holds bos 1 / eos 2 here);
    the converter gives eos 1 on this folder too."""
    folder = _copy(folders, tmp_path, "gemma3mm-spm-tiny")
    _edit_config(folder, eos_token_id=1)
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "f32")
    assert code == 0, err
    keys = plain_fields(out)
    assert keys["tokenizer.ggml.eos_token_id"] == keys["tokenizer.ggml.bos_token_id"] == ("UINT32", 1)


def test_gemma3_multimodal_text_tensor_missing(folders, tmp_path, monkeypatch, capsys):
    """Only the vision tower and projector left: refused naming the missing text tensors, not imported empty."""
    folder = _copy(folders, tmp_path, "gemma3mm-spm-tiny")
    config = json.loads((folder / "config.json").read_text())
    shapes = {n: s for n, s in hf_fixture_shapes(config).items() if "language_model" not in n}
    write_safetensors(folder / "model.safetensors", shapes, lambda shape: np.zeros(shape, np.float32), "F32")
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "token_embd" in line or "missing" in line


def _with_rope(folders, tmp_path, name: str, edit):
    """A copy of tiny folder `name` whose config's rope_parameters are edit(its rope_parameters)."""
    folder = _copy(folders, tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = edit(config.get("rope_parameters") or {})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change,words", [({"long_factor": [1.0] * 7}, "8 values each"),
                                          ({"rope_type": "dynamic"}, "su / longrope / yarn")])
def test_phi3_bad_longrope(folders, tmp_path, monkeypatch, capsys, change, words):
    folder = _with_rope(folders, tmp_path, "phi3-longrope-spm-tiny", lambda rope: {**rope, **change})
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert words in line and str(folder / "config.json") in line


@pytest.mark.parametrize("name,rope", [
    ("llama-tiny", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                    "original_max_position_embeddings": 1024}),
    ("qwen2-tiny", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0})])  # llama's only
def test_rope_scaling_refused(folders, tmp_path, monkeypatch, capsys, name, rope):
    """Not written yet: refused, never a file without the converter's rope keys or rope tensors."""
    folder = _with_rope(folders, tmp_path, name, lambda _: rope)
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert f"rope scaling {rope['rope_type']!r}" in line and "config.json" in line


def test_llama3_rope_in_transformers_4_form(folders, tmp_path, monkeypatch, capsys):
    """Llama 3.1's own config.json (transformers 4): rope_scaling, rope_theta beside it; the same file."""
    folder = _copy(folders, tmp_path, "llama31-tiny")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    _imports_as_recorded(monkeypatch, capsys, folder, tmp_path / "m.gguf", "llama31-tiny", "f16")


@pytest.mark.parametrize("change,words", [({"rope_theta": -5.0}, "rope_theta"), ({"factor": "8"}, "factor"),
                                          ({"low_freq_factor": 0}, "low_freq_factor")])
def test_llama3_rope_bad_numbers(folders, tmp_path, monkeypatch, capsys, change, words):
    folder = _with_rope(folders, tmp_path, "llama31-tiny", lambda rope: {**rope, **change})
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert f"llama3 rope scaling's {words} must be a positive number" in line and str(folder / "config.json") in line


@pytest.mark.parametrize("name", ["llama31-tiny", "llama32-tiny"])
def test_llama3_rope_survives_export_hf_and_import(folders, tmp_path, monkeypatch, capsys, name):
    """export --hf recovers the llama3 numbers from rope_freqs.weight (hf_config.llama3_rope); importing its
    folder computes the same factors again: every tensor as the converter wrote it from the original."""
    first, hf_dir, again = tmp_path / "a.gguf", tmp_path / "hf", tmp_path / "b.gguf"
    assert run_cli(monkeypatch, capsys, "import", folders[name], "-o", first, "--type", "f32")[0] == 0
    assert run_cli(monkeypatch, capsys, "export", first, "--hf", hf_dir)[0] == 0
    assert json.loads((hf_dir / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert run_cli(monkeypatch, capsys, "import", hf_dir, "-o", again, "--type", "f32")[0] == 0
    expected = load_record(name)["outputs"]["f32"]["tensors"]
    assert {k: list(v) for k, v in tensor_digests(again).items()} == expected


def test_linear_rope_scaling_keys(folders, tmp_path, monkeypatch, capsys):
    """TextModel.set_gguf_parameters' linear scaling: type and factor after head_count_kv, before the rope base
    (the converter's bytes on this folder, and on gemma3 with a full_attention factor: bench, ad hoc)."""
    folder = _copy(folders, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "f32")
    assert code == 0, err
    fields = plain_fields(out)
    keys = list(fields)
    at = keys.index("llama.attention.head_count_kv")
    assert keys[at + 1:at + 4] == ["llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.freq_base"]
    assert fields["llama.rope.scaling.type"] == ("STRING", "linear")
    assert fields["llama.rope.scaling.factor"] == ("FLOAT32", 2.0)
    expected = load_record("llama-tiny")["outputs"]["f32"]
    assert {k: list(v) for k, v in tensor_digests(out).items()} == expected["tensors"]


def test_no_tokenizer(folders, tmp_path, monkeypatch, capsys):
    folder = _copy(folders, tmp_path, "llama-spm-tiny")
    (folder / "tokenizer.model").unlink()
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "neither tokenizer.model" in line and str(folder) in line


def test_hub_name_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _bad(monkeypatch, capsys, "HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "o.gguf")
    assert "never downloads" in line and "--local-dir" in line


def test_unknown_type(folders, tmp_path, monkeypatch, capsys):
    line = _bad(monkeypatch, capsys, folders["llama-tiny"], tmp_path / "o.gguf", "--type", "q3_x")
    assert "--type" in line and "q3_x" in line


def test_sharded_folder_with_index(folders, tmp_path, monkeypatch, capsys):
    """model-0000N-of-00002.safetensors with model.safetensors.index.json: the same file as one part."""
    folder = _copy(folders, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for part, part_names in parts.items():
        arrays = iter([tensors[n] for n in part_names])
        write_safetensors(folder / part, {n: tensors[n].shape for n in part_names}, lambda _, a=arrays: next(a), "F32")
    weight_map = {n: part for part, part_names in parts.items() for n in part_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folder, "-o", out, "--type", "f32")
    assert code == 0, err
    expected = load_record("llama-tiny")["outputs"]["f32"]["tensors"]
    assert {k: list(v) for k, v in tensor_digests(out).items()} == expected
    (folder / "model-00002-of-00002.safetensors").unlink()
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "model.safetensors.index.json" in line and "model-00002-of-00002.safetensors" in line


@pytest.mark.parametrize("name,outtype", [("llama-spm-tiny", "f16"), ("llama-tiny", "f16"), ("qwen2-tiny", "bf16"),
                                          ("gpt2-tiny", "q8_0")])
def test_small_pieces_same_bytes(folders, tmp_path, monkeypatch, capsys, name, outtype):
    """Pieces of 200 values (many a tensor, rows permuted across pieces for llama's q/k, gpt2's transposed
    matrices gathered column by column): the one-ahead
    pipeline and the reused F16 buffers give the converter's bytes still."""
    monkeypatch.setattr(hf_import, "PIECE_ELEMENTS", 200)
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "import", folders[name], "-o", out, "--type", outtype)
    assert code == 0, err
    assert {k: list(v) for k, v in tensor_digests(out).items()} == load_record(name)["outputs"][outtype]["tensors"]


def test_gpt2_mask_buffers_and_context_keys(folders, tmp_path, monkeypatch, capsys):
    """Older GPT-2 checkpoints hold attn.bias / attn.masked_bias (causal masks, not weights): not read. A
    config.json without n_ctx (transformers 5 writes n_positions only) takes n_positions; without either,
    one line naming them."""
    folder = _copy(folders, tmp_path, "gpt2-tiny")
    config = json.loads((folder / "config.json").read_text())
    n = config["n_positions"]
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({"transformer.h.0.attn.bias": np.tril(np.ones((1, 1, n, n), np.float32)),
                    "transformer.h.1.attn.masked_bias": np.array(-1e4, np.float32)})
    _rewrite_weights(folder, tensors)
    del config["n_ctx"]
    (folder / "config.json").write_text(json.dumps(config))
    _imports_as_recorded(monkeypatch, capsys, folder, tmp_path / "m.gguf", "gpt2-tiny", "f32")
    del config["n_positions"]
    (folder / "config.json").write_text(json.dumps(config))
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "config.json has no" in line and "n_ctx" in line and str(folder) in line


def test_gpt2_names_without_transformer_prefix(folders, tmp_path, monkeypatch, capsys):
    """GPT-2's own files (saved from GPT2Model: "h.0.attn.c_attn.weight", "wte.weight") lack the
    "transformer." prefix; the converter maps both (its output is the same file, checked by hand with
    convert_hf_to_gguf.py on this folder), and so does import."""
    folder = _copy(folders, tmp_path, "gpt2-tiny")
    _rewrite_weights(folder, {k.removeprefix("transformer."): v
                              for k, v in load_file(str(folder / "model.safetensors")).items()})
    _imports_as_recorded(monkeypatch, capsys, folder, tmp_path / "m.gguf", "gpt2-tiny", "q8_0")


def test_gpt2_feed_forward_is_four_times_n_embd(folders, tmp_path, monkeypatch, capsys):
    """GPT2Model.set_gguf_parameters writes 4 * n_embd whatever n_inner says: a c_fc of another width is
    refused by its shape, in one line, rather than written into a file llama.cpp cannot load."""
    folder = _copy(folders, tmp_path, "gpt2-tiny")
    config = json.loads((folder / "config.json").read_text())
    config["n_inner"] = 3 * config["n_embd"]
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {k: tuple(v) for k, v in hf_fixture_shapes(config).items()}
    write_safetensors(folder / "model.safetensors", shapes, lambda shape: np.zeros(shape, np.float32), "F32")
    line = _bad(monkeypatch, capsys, folder, tmp_path / "o.gguf")
    assert "ffn_up" in line and str(folder) in line


def test_gpt2_export_then_import_gives_the_model_back(tmp_path, monkeypatch, capsys):
    """export --hf (Conv1D matrices transposed to [n_in, n_out]) then import (transposed back): every
    tensor of gpt2-tiny in its order and bits, and every hyper-parameter and tokenizer key."""
    src = init_model(REPO / "configs" / "gpt2-tiny.toml", DATA / "vocab" / "ggml-vocab-gpt-2.gguf",
                     tmp_path / "g.gguf", 0, test_weights=True)
    back = tmp_path / "back.gguf"
    for args in (("export", src, "--hf", tmp_path / "hf"), ("import", tmp_path / "hf", "-o", back, "--type", "f32")):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
    a, b = load_gguf(src), load_gguf(back)
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        np.testing.assert_array_equal(b.tensor(name), a.tensor(name), err_msg=name)
    for key, value in a.metadata.items():
        if not key.startswith("general."):
            assert b.metadata[key] == value, key


def test_bf16_kept_is_the_converters_round_trip():
    """BF16 -> BF16 without the float32 round trip: gguf-py's quantize of the widened values, NaNs made quiet."""
    bits = np.concatenate([np.arange(0, 1 << 16, 7, dtype=np.uint16), np.uint16([0x7F81, 0xFF81, 0x7FC0, 0x7F80])])
    wide = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(hf_import.bf16_kept(bits), gguf.quants.quantize(wide, gguf.GGMLQuantizationType.BF16))


def test_other_types_are_import_then_export(folders, tmp_path, monkeypatch, capsys):
    """--type q4_k_m: byte for byte `import --type f32` followed by `llmtune export --type q4_k_m`."""
    one, f32, two = tmp_path / "one.gguf", tmp_path / "f32.gguf", tmp_path / "two.gguf"
    for args in (("import", folders["qwen2-tiny"], "-o", one, "--type", "q4_k_m"),
                 ("import", folders["qwen2-tiny"], "-o", f32, "--type", "f32"),
                 ("export", f32, "-o", two, "--type", "q4_k_m")):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
    assert one.read_bytes() == two.read_bytes()
