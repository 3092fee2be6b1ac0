"""qwen3 against llama.cpp and HF transformers (tests/data/families/qwen3.json, see family_check):
per-head q/k RMSNorm before rope (leaving it out moves a chunk by ~3 %), NEOX rope, and a head
size from attention.key_length (32) that differs from n_embd / n_head (16)."""

from family_check import REPO, check_family, load_fixture
from llmtune.arch import get_family
from llmtune.convert.init import load_init_config


def test_qwen3_matches_llama_cpp_and_transformers(tmp_path):
    check_family("qwen3", tmp_path)


def test_qwen3_head_size_is_key_length():
    hp = load_init_config(REPO / load_fixture("qwen3")["config"]).model.hparams(n_vocab=1000)
    assert hp.head_dim == 32 != hp.n_embd // hp.n_head and hp.n_rot == 32
    specs = {s.name: s for s in get_family("qwen3").tensors(hp)}
    assert specs["blk.0.attn_q.weight"].shape == (4 * 32, 64) and specs["blk.0.attn_output.weight"].shape == (64, 128)
    assert specs["blk.0.attn_k.weight"].shape == (2 * 32, 64)
    assert specs["blk.1.attn_q_norm.weight"].shape == specs["blk.1.attn_k_norm.weight"].shape == (32,)
    assert specs["blk.0.attn_q.bias"].optional and "output.bias" not in specs
