"""PEFT adapter folders (model/adapter/peft.py): llmtune's adapters written in PEFT's layout and read
back exactly, PEFT's own adapters (tests/data/peft/, recorded with PEFT's logits by
`python bench/check_peft.py --record`) applied as PEFT applies them, and bad folders refused in one
line. Needs safetensors (the "hf" extra), never torch, transformers or PEFT."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import sys

import numpy as np
import pytest

import lora_fixture
import toy_family
from cli_helpers import run_cli
from conftest import DATA, REPO
from llmtune import arch
from llmtune.arch import hf_names
from llmtune.arch.hf_names import HFNames
from llmtune.convert.init import init_model
from llmtune.gguf.file import load_gguf
from llmtune.model import adapter as lora
from llmtune.model.loaded import load_model
from llmtune.train.checkpoint import file_sha256
from test_lora import logits_of, random_adapter

safetensors_numpy = pytest.importorskip("safetensors.numpy")  # the "hf" extra: these tests skip without it
safe_open = pytest.importorskip("safetensors").safe_open

PEFT = DATA / "peft"  # bench/check_peft.py --record
FIXTURES = ["stories260K-lora", "stories260K-rslora-bf16"]
GPT2_FIXTURE = "gpt2-tiny-lora"  # on bench/check_peft.py's gpt2 base: configs/gpt2-tiny.toml, seed 0, random weights


@pytest.fixture(scope="module")
def stories(stories_path):
    return load_model(stories_path)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = init_model(REPO / "configs" / "gpt2-tiny.toml", DATA / "vocab" / "ggml-vocab-gpt-2.gguf",
                      tmp_path_factory.mktemp("gpt2") / "gpt2-tiny.gguf", 0, test_weights=True)
    return load_model(path)


@pytest.fixture(scope="module")
def wiki_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("peft-wiki") / "wiki.test.raw"
    path.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes())[:20000])
    return path


def _one_line(code, err, *words):
    line = " ".join(err.split())
    assert code == 2 and err.count("error:") == 1 and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in line, (w, line)


def _pairs_equal(got: lora.LoraAdapter, want: lora.LoraAdapter) -> None:
    assert list(got.pairs) == list(want.pairs)
    for name, pair in want.pairs.items():
        np.testing.assert_array_equal(got.pairs[name].a, pair.a, err_msg=name)
        np.testing.assert_array_equal(got.pairs[name].b, pair.b, err_msg=name)
        assert got.weight_scale(name) == want.weight_scale(name), name


# ------------------------------------------------------------------------------ the name table
def test_llama_q_k_rows_are_the_converters_permutation_undone():
    """convert_hf_to_gguf.py's LlamaModel.permute, written out: GGUF = HF.reshape(h, 2, d/2).swapaxes(1, 2)."""
    hf = hf_names("llama")
    w_hf = np.arange(3 * 8 * 2, dtype=np.float32).reshape(24, 2)  # 3 heads of 8 rows
    w_gguf = w_hf.reshape(3, 2, 4, 2).swapaxes(1, 2).reshape(24, 2)
    rows = hf.hf_rows("blk.1.attn_k.weight", 24, 6, 3)
    np.testing.assert_array_equal(w_gguf[rows], w_hf)
    np.testing.assert_array_equal(w_hf[np.argsort(rows)], w_gguf)
    assert hf.hf_rows("blk.1.attn_v.weight", 24, 6, 3) is None and hf_names("qwen2").hf_rows(
        "blk.1.attn_k.weight", 24, 6, 3) is None
    assert hf.hf_name("blk.11.ffn_gate.weight") == "model.layers.11.mlp.gate_proj.weight"
    assert hf.gguf_name("model.layers.11.self_attn.o_proj.bias") == "blk.11.attn_output.bias"
    assert hf.gguf_name("model.layers.1.self_attn.qkv_proj.weight") is None
    gpt2 = hf_names("gpt2")  # Conv1D matrices: the HF tensor is the GGUF matrix transposed
    assert gpt2.hf_name("blk.3.attn_qkv.weight") == "transformer.h.3.attn.c_attn.weight"
    assert gpt2.transposed("blk.3.attn_qkv.weight") and not gpt2.transposed("blk.3.attn_qkv.bias")
    assert gpt2.hf_shape("blk.0.ffn_up.weight", (256, 64)) == (64, 256) and not gpt2.transposed("token_embd.weight")
    assert gpt2.gguf_name("transformer.h.1.mlp.c_proj.bias") == "blk.1.ffn_down.bias"
    assert gpt2.gguf_name("transformer.h.1.attn.c_proj.weight") == "blk.1.attn_output.weight"


def test_a_table_reads_both_ways():
    table = HFNames("X", "x", {"tok": "model.embed", "blk.{bid}.q": "model.layers.{bid}.attn.q"})
    for gguf, hf in (("tok.weight", "model.embed.weight"), ("blk.7.q.bias", "model.layers.7.attn.q.bias")):
        assert table.hf_name(gguf) == hf and table.gguf_name(hf) == gguf


# ------------------------------------------------------------------------------ llmtune -> PEFT -> llmtune
def _rslora(model):
    adapter = random_adapter(model, rank=4)
    return dataclasses.replace(adapter, alpha=lora.core.rslora_alpha(8.0, 4), rslora=True, init="kaiming")


def _alpha0(model):
    return dataclasses.replace(random_adapter(model, rank=4), alpha=0.0)


def _two_ranks(model):
    adapter = random_adapter(model, rank=4)
    rng = np.random.default_rng(5)
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight"):
        n_out, n_in = model.weights[name].shape
        adapter.pairs[name] = lora.LoraPair(rng.standard_normal((2, n_in)).astype(np.float32),
                                            rng.standard_normal((n_out, 2)).astype(np.float32))
    return adapter


def _odd_alpha(model):
    return dataclasses.replace(random_adapter(model, rank=4), alpha=float(np.float32(0.1)))


@pytest.mark.parametrize("make,config", [
    ("fixture", {"r": 4, "lora_alpha": 8, "use_rslora": False}),  # every matrix, token_embd and output too
    ("rslora", {"r": 4, "lora_alpha": 8, "use_rslora": True}),
    ("alpha0", {"r": 4, "lora_alpha": 4, "use_rslora": False}),  # llama.cpp's alpha 0: scale 1
    ("two-ranks", {"r": 4, "lora_alpha": 8, "rank_pattern": {"model.layers.0.self_attn.q_proj": 2,
                                                             "model.layers.3.mlp.down_proj": 2}}),
    ("odd-alpha", {"lora_alpha": 0.1}),  # the shortest decimal that reads back as the float32 alpha
])
def test_export_peft_then_load_gives_identical_tensors_and_scale(make, config, stories, stories_path, tmp_path,
                                                                 monkeypatch, capsys):
    adapter = {"fixture": lora_fixture.fixture_adapter, "rslora": _rslora, "alpha0": _alpha0,
               "two-ranks": _two_ranks, "odd-alpha": _odd_alpha}[make](stories)
    path = lora.write_adapter(tmp_path / "a.gguf", adapter, base=stories.gguf)  # with the base's fingerprint
    code, out, err = run_cli(monkeypatch, capsys, "export", path, "--peft", tmp_path / "peft")
    assert code == 0, err
    assert out.startswith(f"wrote {tmp_path / 'peft'}: PEFT LoRA adapter, rank 4") and "base 'llama'" in out
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json",
                                                                       "adapter_model.safetensors"]
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {k: written[k] for k in config} == config
    assert written["peft_type"] == "LORA" and written["task_type"] == "CAUSAL_LM" and written["bias"] == "none"
    assert written["base_model_name_or_path"] == "llama" and written["use_dora"] is False
    back = lora.load_peft(tmp_path / "peft", stories)
    _pairs_equal(back, lora.load_adapter(path, stories))
    assert back.rslora == (make == "rslora") and back.init == "kaiming"  # init_lora_weights true


def test_peft_tensors_have_peft_names_shapes_and_row_order(stories, tmp_path):
    """A [r, in], B [out, r] under base_model.model.<HF module>; the embedding's lora_embedding_A
    [r, n_vocab]; llama's q/k B rows in HF's order (the converter's permutation undone)."""
    adapter = lora_fixture.fixture_adapter(stories)
    lora.write_peft(adapter, tmp_path / "p", (8, 4), 5, "stories")
    with safe_open(str(tmp_path / "p" / "adapter_model.safetensors"), framework="np") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    pre = "base_model.model."
    assert got[pre + "model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert got[pre + "model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    assert got[pre + "model.layers.4.mlp.down_proj.lora_A.weight"].shape == (4, 172)
    np.testing.assert_array_equal(got[pre + "model.embed_tokens.lora_embedding_A"],
                                  adapter.pairs["token_embd.weight"].a.T)
    assert got[pre + "lm_head.lora_B.weight"].shape == (512, 4)
    b = adapter.pairs["blk.2.attn_k.weight"].b  # 4 KV heads of 8 rows: HF row 1 is GGUF row 2, row 4 is row 1
    hf_b = got[pre + "model.layers.2.self_attn.k_proj.lora_B.weight"]
    np.testing.assert_array_equal(hf_b[[0, 1, 4, 8]], b[[0, 2, 1, 8]])
    np.testing.assert_array_equal(got[pre + "model.layers.2.self_attn.v_proj.lora_B.weight"],
                                  adapter.pairs["blk.2.attn_v.weight"].b)
    assert len(got) == 2 * len(adapter.pairs)


def test_target_modules_name_every_layer_or_the_modules(stories, tmp_path):
    adapter = random_adapter(stories, rank=2, targets=r"blk\.[01]\.attn_q|ffn_down")
    done = lora.write_peft(adapter, tmp_path / "p", (8, 4), stories.hp.n_layer)
    assert done.target_modules == ["down_proj", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    _pairs_equal(lora.load_peft(tmp_path / "p", stories), adapter)


def test_export_with_the_base_checks_it_and_needs_no_fingerprint(stories, stories_path, tmp_path, monkeypatch,
                                                                 capsys):
    """An adapter without its base's head counts (llama.cpp's, an older llmtune's): llama's q/k rows
    need them; given with the base, it is checked against it and written."""
    path = lora.write_adapter(tmp_path / "a.gguf", lora_fixture.fixture_adapter(stories))  # no fingerprint
    code, _, err = run_cli(monkeypatch, capsys, "export", path, "--peft", tmp_path / "peft")
    _one_line(code, err, str(path), "does not record its base's head counts",
              "llmtune export BASE.gguf --lora ADAPTER.gguf --peft DIR")
    assert not (tmp_path / "peft").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf"]
    code, out, err = run_cli(monkeypatch, capsys, "export", stories_path, "--lora", path, "--peft", tmp_path / "peft")
    assert code == 0, err
    _pairs_equal(lora.load_peft(tmp_path / "peft", stories), lora.load_adapter(path, stories))
    # a PEFT folder is replaced by the next export; a file or a folder of other files is not
    code, _, err = run_cli(monkeypatch, capsys, "export", stories_path, "--lora", path, "--peft", tmp_path / "peft")
    assert code == 0, err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    for dest, words in ((tmp_path / "other", "holds files and no adapter_config.json"), (path, "is a file")):
        code, _, err = run_cli(monkeypatch, capsys, "export", stories_path, "--lora", path, "--peft", dest)
        _one_line(code, err, f"--peft {dest}", words)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.parametrize("args,words", [
    (["--lora", PEFT / FIXTURES[0], "-o", "x.gguf"], "-o: not with --peft"),
    (["--lora", PEFT / FIXTURES[0], "--type", "f16"], "--type: not with --peft"),
    ([], "is a model, not an adapter"),
    (["--lora", PEFT / FIXTURES[0], "--lora", PEFT / FIXTURES[1]], "--peft: writes one adapter, given 2"),
])
def test_export_peft_flag_mistakes(args, words, stories_path, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "export", stories_path, "--peft", tmp_path / "p", *args)
    _one_line(code, err, words)
    assert not (tmp_path / "p").exists()
    code, _, err = run_cli(monkeypatch, capsys, "export", stories_path, "-o", tmp_path / "x.gguf")
    _one_line(code, err, "--type: missing")


# ------------------------------------------------------------------------------ PEFT -> llmtune
@pytest.mark.parametrize("name", FIXTURES)
def test_a_peft_folder_gives_peft_logits(name, stories):
    """PEFT's own adapters (random A and B; plain with embed_tokens and lm_head, rsLoRA saved in
    bfloat16), read as finetune --lora-init reads them: PEFT's logits, recorded (float32)."""
    expected = np.load(PEFT / "expected.npz")
    tokens, want = expected[f"{name}.tokens"], expected[f"{name}.logits"].astype(np.float64)
    adapter = lora.load_adapter(PEFT / name, stories, flag="--lora-init")
    got = logits_of(dataclasses.replace(stories, adapters=[adapter]), tokens[None].astype(np.int32), np.float32)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert np.abs(logits_of(stories, tokens[None].astype(np.int32), np.float32) - want).max() > 1  # it does something


def test_peft_scale_is_alpha_over_r_or_sqrt_r(stories):
    plain, rs = (lora.load_adapter(PEFT / n, stories) for n in FIXTURES)
    assert plain.ranks == {2} and plain.weight_scale("blk.0.attn_q.weight") == np.float32(5) / np.float32(2)
    assert rs.ranks == {4} and rs.rslora and rs.weight_scale("blk.0.attn_k.weight") == pytest.approx(4.0, rel=1e-7)
    assert len(plain.pairs) == 2 + 7 * 5 and list(plain.pairs)[:2] == ["token_embd.weight", "output.weight"]


def test_lora_and_lora_init_take_a_folder(stories_path, wiki_text, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, wiki_text, "--ctx", 64, "--chunks", 2,
                             "--lora", PEFT / FIXTURES[1])
    assert code == 0, err
    out_path = tmp_path / "continued.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, wiki_text, "-o", out_path, "--ctx", 32,
                           "--batch", 128, "--epochs", 1, "--lr", 1e-3, "--lora-init", PEFT / FIXTURES[1],
                           "--val-split", 0.5)
    assert code == 0, err
    trained = load_gguf(out_path)
    assert trained.get("llmtune.lora.rslora") is None  # PEFT's init_lora_weights=False: the variant is unknown
    assert trained.tensors["blk.0.attn_k.weight.lora_b"].shape == (32, 4)  # numpy [n_out, r]
    assert trained.get("adapter.lora.alpha") == pytest.approx(16.0)  # alpha * sqrt(r)


def test_the_checkpoint_fingerprint_of_a_folder_reads_its_files(tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(PEFT / FIXTURES[1], folder)
    before = file_sha256(folder)
    (folder / "README.md").write_text("notes")
    assert file_sha256(folder) == before
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-2] + b"\0\0")
    assert file_sha256(folder) != before


# ------------------------------------------------------------------------------ bad folders
def _copy(tmp_path, name="bad", config=None, tensors=None, drop=(), add=None):
    folder = tmp_path / name
    shutil.copytree(PEFT / FIXTURES[0], folder)
    if config is not None:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None or drop or add:
        with safe_open(str(folder / "adapter_model.safetensors"), framework="np") as f:
            values = {k: f.get_tensor(k) for k in f.keys()}
        values = {(tensors or {}).get(k, k): v for k, v in values.items() if k not in drop}
        values.update(add or {})
        safetensors_numpy.save_file(values, str(folder / "adapter_model.safetensors"))
    return folder


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _bad_folders(tmp_path):
    cases = {}
    folder = _copy(tmp_path, "noconfig")
    (folder / "adapter_config.json").unlink()
    cases["no config"] = (folder, str(folder), "no adapter_config.json")
    folder = _copy(tmp_path, "bin")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    cases["pickle"] = (folder, str(folder / "adapter_model.bin"), "convert it to safetensors")
    folder = _copy(tmp_path, "truncated")
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases["truncated"] = (folder, str(weights), "not a readable safetensors file")
    folder = _copy(tmp_path, "json")
    (folder / "adapter_config.json").write_text("{r: 2")
    cases["json"] = (folder, str(folder / "adapter_config.json"), "not readable JSON")
    renamed = {Q_A: Q_A.replace("q_proj", "qkv_proj"), Q_A.replace("_A", "_B"): Q_A.replace("q_proj", "qkv_proj")
               .replace("_A", "_B")}
    folder = _copy(tmp_path, "module", tensors=renamed)
    cases["unmapped module"] = (folder, str(folder / "adapter_model.safetensors"),
                                "model.layers.0.self_attn.qkv_proj is no llama module llmtune maps")
    folder = _copy(tmp_path, "shape", drop=[Q_A], add={Q_A: np.zeros((2, 32), np.float32)})
    cases["shape"] = (folder, str(folder / "adapter_model.safetensors"),
                      f"{Q_A} [2, 32] and", "do not fit stories260K.gguf's model.layers.0.self_attn.q_proj")
    folder = _copy(tmp_path, "half", drop=[Q_A])
    cases["half"] = (folder, str(folder / "adapter_model.safetensors"), "q_proj lacks its lora_A tensor")
    folder = _copy(tmp_path, "dora", add={Q_A.replace("lora_A.weight", "lora_magnitude_vector"):
                                          np.ones(64, np.float32)})
    cases["magnitude"] = (folder, str(folder / "adapter_model.safetensors"), "a DoRA magnitude (use_dora)")
    for key, value, words in (("modules_to_save", ["lm_head"], "modules_to_save is set: full copies"),
                              ("bias", "lora_only", "bias is 'lora_only'"),
                              ("use_dora", True, "use_dora is set: a DoRA adapter"),
                              ("peft_type", "IA3", "peft_type is 'IA3'"),
                              ("init_lora_weights", "pissa_niter_4", "the base PEFT rewrote"),
                              ("r", 3, "has rank 2 in adapter_model.safetensors, but the config says r 3"),
                              ("alpha_pattern", {"q_proj": 7}, "one llama.cpp alpha cannot give"),
                              ("lora_alpha", 0, "lora_alpha 0 makes PEFT's scale 0"),
                              ("rank_pattern", {"q_proj": "four"}, "rank_pattern must map module names to numbers")):
        folder = _copy(tmp_path, key, config={key: value})
        cases[key] = (folder, str(folder / "adapter_config.json"), words)
    return cases


def test_bad_peft_folders_are_one_line_naming_the_file(stories_path, wiki_text, tmp_path, monkeypatch, capsys):
    for kind, (folder, named, *words) in _bad_folders(tmp_path).items():
        for args in (["perplexity", stories_path, wiki_text, "--ctx", 64, "--chunks", 1, "--lora", folder],
                     ["finetune", stories_path, wiki_text, "--lora-init", folder, "-o", tmp_path / "x.gguf"],
                     ["export", stories_path, "--lora", folder, "--peft", tmp_path / "again"]):
            code, _, err = run_cli(monkeypatch, capsys, *args)
            flag = "--lora-init" if args[0] == "finetune" else "--lora"
            _one_line(code, err, f"{flag} {named}", *words)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "again").exists()


def test_dropout_and_base_layer_copies_are_ignored(stories, tmp_path):
    """lora_dropout does nothing at inference; PEFT's save_embedding_layers copy of an embedding
    (base_layer.weight) is skipped, as convert_lora_to_gguf.py skips it."""
    base_copy = {"base_model.model.model.embed_tokens.base_layer.weight": np.zeros((512, 64), np.float32)}
    folder = _copy(tmp_path, config={"lora_dropout": 0.5}, add=base_copy)
    _pairs_equal(lora.load_peft(folder, stories), lora.load_peft(PEFT / FIXTURES[0], stories))


def test_a_family_without_names_is_refused(gpt2, tmp_path, wiki_text, monkeypatch, capsys):
    adapter = lora.write_adapter(tmp_path / "g.gguf", random_adapter(gpt2, rank=2))
    monkeypatch.setitem(arch._FAMILIES, "gpt2", toy_family.GPT2WithoutNames())
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", gpt2.path, wiki_text, "--lora", PEFT / GPT2_FIXTURE)
    _one_line(code, err, f"--lora {PEFT / GPT2_FIXTURE}", "the gpt2 family has no Hugging Face tensor names")
    code, _, err = run_cli(monkeypatch, capsys, "export", adapter, "--peft", tmp_path / "p")
    _one_line(code, err, f"--peft {tmp_path / 'p'}", "the gpt2 family")
    assert not (tmp_path / "p").exists()


# ------------------------------------------------------------------------------ gpt2: Conv1D modules
def test_gpt2_adapter_round_trip_and_fan_in_fan_out(gpt2, tmp_path):
    """gpt2's c_attn / c_proj / c_fc are Conv1D weights ([n_in, n_out]), but PEFT's LoRA of one keeps A
    [r, n_in] and B [n_out, r] as for a Linear: llmtune's pairs as they are, fan_in_fan_out true."""
    adapter = random_adapter(gpt2, rank=2)
    assert sorted({n.split(".")[2] for n in adapter.pairs}) == ["attn_output", "attn_qkv", "ffn_down", "ffn_up"]
    done = lora.write_peft(adapter, tmp_path / "p", (4, 4), gpt2.hp.n_layer)
    assert done.target_modules == ["c_attn", "c_fc", "c_proj"]
    config = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True
    got = safetensors_numpy.load_file(str(tmp_path / "p" / "adapter_model.safetensors"))
    pre = "base_model.model.transformer.h.1."
    np.testing.assert_array_equal(got[pre + "attn.c_attn.lora_A.weight"], adapter.pairs["blk.1.attn_qkv.weight"].a)
    assert got[pre + "mlp.c_fc.lora_B.weight"].shape == (256, 2) and got[pre + "mlp.c_proj.lora_A.weight"].shape == (
        2, 256)
    _pairs_equal(lora.load_peft(tmp_path / "p", gpt2), adapter)


def test_gpt2_c_proj_is_named_in_full_when_one_of_its_two_is_adapted(gpt2, tmp_path):
    """"c_proj" would select mlp.c_proj too (PEFT matches a module's last name): attn_output alone is
    written as the modules' paths."""
    adapter = random_adapter(gpt2, rank=2, targets="attn_output|ffn_up")
    done = lora.write_peft(adapter, tmp_path / "p", (4, 4), gpt2.hp.n_layer)
    assert done.target_modules == ["c_fc", "transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]
    _pairs_equal(lora.load_peft(tmp_path / "p", gpt2), adapter)


def test_gpt2_peft_folder_gives_peft_logits(gpt2, tmp_path, monkeypatch, capsys):
    """PEFT's own gpt2 adapter (random A and B on c_attn, c_proj, c_fc; bench/check_peft.py --record): PEFT's
    logits, read as --lora-init reads it; and finetune --lora-init starts from it."""
    expected = np.load(PEFT / "expected.npz")
    tokens = expected[f"{GPT2_FIXTURE}.tokens"][None].astype(np.int32)
    want = expected[f"{GPT2_FIXTURE}.logits"].astype(np.float64)
    every = int(json.loads((PEFT / "expected.json").read_text())[GPT2_FIXTURE]["columns"].split()[-1])
    adapter = lora.load_adapter(PEFT / GPT2_FIXTURE, gpt2, flag="--lora-init")
    assert len(adapter.pairs) == 4 * gpt2.hp.n_layer
    got = logits_of(dataclasses.replace(gpt2, adapters=[adapter]), tokens, np.float32)[..., ::every]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert np.abs(logits_of(gpt2, tokens, np.float32)[..., ::every] - want).max() > 0.1  # it does something
    out = tmp_path / "continued.gguf"  # --lora-init DIR: finetune starts from PEFT's adapter
    wiki = tmp_path / "w.txt"
    wiki.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", gpt2.path, wiki, "-o", out, "--ctx", 32, "--epochs", 1,
                           "--lr", 1e-30, "--lora-init", PEFT / GPT2_FIXTURE)
    assert code == 0, err
    start = lora.load_adapter(out, gpt2)
    got = logits_of(dataclasses.replace(gpt2, adapters=[start]), tokens, np.float32)[..., ::every]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_without_safetensors_one_line_says_how_to_get_it(stories_path, wiki_text, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, wiki_text, "--lora", PEFT / FIXTURES[0])
    _one_line(code, err, "pip install safetensors")
