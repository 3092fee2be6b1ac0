"""qwen2 against llama.cpp and HF transformers (tests/data/families/qwen2.json, see family_check):
q/k/v biases (leaving them out moves a chunk by ~6 %), NEOX rope (~19 %), no BOS, tied output."""

from family_check import REPO, check_family, load_fixture
from llmtune.arch import get_family
from llmtune.convert.init import load_init_config


def test_qwen2_matches_llama_cpp_and_transformers(tmp_path):
    check_family("qwen2", tmp_path)


def test_qwen2_tensors_have_qkv_biases_and_neox_rope():
    fixture = load_fixture("qwen2")
    hp = load_init_config(REPO / fixture["config"]).model.hparams(n_vocab=1000)
    specs = {s.name: s for s in get_family("qwen2").tensors(hp)}
    assert hp.rope_mode == "neox" and "rope_freqs.weight" not in specs
    assert specs["blk.1.attn_k.bias"].shape == (hp.n_embd_kv,) and not specs["blk.1.attn_k.bias"].optional
    assert specs["blk.0.attn_q.bias"].shape == (hp.n_embd,) and specs["output.bias"].optional
