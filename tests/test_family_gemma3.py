"""gemma3: llama.cpp's recorded perplexity of a random-weight tiny model (7 layers: local and global
kinds, two rope bases), hyper-parameter defaults, finite-difference gradients through q/k norms,
the sliding window and the optional output matrix, and the commands (helpers: test_family_gemma2)."""

import numpy as np
import pytest

from family_check import check_family
from llmtune.arch import get_family, read_hparams
from llmtune.convert.init import init_model
from llmtune.gguf.file import load_gguf
from test_family_gemma2 import REPO_CONFIGS, STORIES, extra_tensor_is_refused, gemma_gradient_errors, run_commands


def test_gemma3_matches_llama_cpp(tmp_path):
    """Running perplexity of configs/gemma3-tiny.toml (random weights, every tensor) per chunk."""
    check_family("gemma3", tmp_path)


def _gemma3_meta(**keys):
    md = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["a"] * 11}
    base = {"context_length": 64, "embedding_length": 8, "block_count": 7, "feed_forward_length": 12,
            "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 6,
            "attention.value_length": 6, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6}
    md.update({f"gemma3.{k}": v for k, v in {**base, **keys}.items()})
    return md


def test_gemma3_hparams_defaults_and_keys():
    """No sliding window without the key; with it, il % 6 < 5 are local with rope.freq_base_swa (10000
    when absent); no softcaps unless the file has final_logit_softcapping."""
    hp = read_hparams(_gemma3_meta(), set())
    assert not any(hp.is_swa(i) for i in range(7)) and {hp.rope_base(i) for i in range(7)} == {1e6}
    assert (hp.attn_softcap, hp.final_softcap) == (0.0, 0.0) and hp.tied_output
    hp = read_hparams(_gemma3_meta(**{"attention.sliding_window": 5}), {"output.weight"})
    assert [hp.is_swa(i) for i in range(7)] == [True] * 5 + [False, True] and not hp.tied_output
    assert [hp.rope_base(i) for i in (0, 5, 6)] == [10000.0, 1e6, 10000.0]
    hp = read_hparams(_gemma3_meta(final_logit_softcapping=30.0, **{"attention.sliding_window": 5,
                                                                    "rope.freq_base_swa": 500.0}))
    assert hp.final_softcap == 30.0 and hp.rope_base(0) == 500.0
    assert hp.kq_scale == pytest.approx(1 / np.sqrt(6))


def test_gemma3_init_writes_the_converter_keys(tmp_path):

    gf = load_gguf(init_model(REPO_CONFIGS / "gemma3-tiny.toml", STORIES, tmp_path / "g.gguf"))
    keys = {k[len("gemma3."):] for k in gf.metadata if k.startswith("gemma3.")}
    assert keys == {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
                    "attention.value_length", "rope.freq_base", "rope.freq_base_swa", "attention.sliding_window"}
    assert "blk.6.attn_q_norm.weight" in gf.tensors and "output.weight" not in gf.tensors


def test_gemma3_gradients():
    """Finite differences through a local layer (2-token window, its own rope base) and a global one,
    q/k norms and an untied output matrix (the 6-layer pattern is set explicitly to keep it small)."""
    family = get_family("gemma3")
    hp = family.make_hparams(n_vocab=11, n_ctx_train=16, n_embd=6, n_layer=2, n_head=2, n_head_kv=1, n_ff=6,
                             n_rot=4, head_dim_kq=4, sliding_window=2, swa_layers=(True, False),
                             rope_freq_base=10000.0, rope_freq_base_swa=10.0, final_softcap=2.0)
    names = {s.name for s in family.tensors(hp)}
    assert {"output.weight", "blk.1.attn_k_norm.weight"} <= names
    errors = gemma_gradient_errors(family, hp, seed=11)
    assert max(errors.values()) < 1e-5, errors


def test_gemma3_commands(tmp_path, monkeypatch, capsys, wiki100k_path):
    run_commands("gemma3", tmp_path, monkeypatch, capsys, wiki100k_path)


def test_gemma3_unknown_tensor_is_refused(tmp_path, monkeypatch, capsys):

    model = init_model(REPO_CONFIGS / "gemma3-tiny.toml", STORIES, tmp_path / "g.gguf")
    extra_tensor_is_refused(model, "blk.0.attn_qkv.weight", tmp_path, monkeypatch, capsys)
