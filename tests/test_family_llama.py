"""llama (Llama 2, Mistral, Llama 3.x) against llama.cpp and HF transformers (tests/data/families/,
see family_check), and how its rope keys and tensors are read."""

from pathlib import Path

import pytest

from family_check import check_family
from llmtune.arch import check_tensors, get_family, read_hparams
from llmtune.convert.init import init_model
from llmtune.errors import LlmtuneError
from llmtune.model.loaded import load_model

LLAMA_KEYS = {
    "general.architecture": "llama", "llama.context_length": 512, "llama.embedding_length": 64,
    "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 512,
}


def test_llama_matches_llama_cpp_and_transformers(tmp_path):
    """Llama 2 / Mistral shape: no rope_freqs (optional), stories260K's SPM vocabulary."""
    check_family("llama", tmp_path)


def test_llama3_rope_freqs_match_llama_cpp_and_transformers(tmp_path):
    """Llama 3.x: rope_freqs.weight divides each rotary frequency (ignoring it moves a chunk by ~7 %),
    rope base 500000, tied output, the Llama 3 BPE vocabulary."""
    check_family("llama3", tmp_path)


def scale_of(**keys) -> float:
    return read_hparams({**LLAMA_KEYS, **{f"llama.{k}": v for k, v in keys.items()}}).rope_freq_scale


def test_rope_scaling_keys_as_llama_cpp_reads_them():
    assert scale_of() == 1.0
    assert scale_of(**{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}) == 0.25
    # the type defaults to linear: a factor alone scales; the older key too; 0 means none
    assert scale_of(**{"rope.scaling.factor": 2.0}) == 0.5
    assert scale_of(**{"rope.scale_linear": 8.0}) == 0.125
    assert scale_of(**{"rope.scaling.factor": 0.0}) == 1.0
    assert scale_of(**{"rope.scaling.type": "none", "rope.scaling.factor": 4.0}) == 1.0
    assert scale_of(**{"rope.scaling.type": "yarn", "rope.scaling.factor": 1.0}) == 1.0  # YaRN at 1 changes nothing


@pytest.mark.parametrize("keys, message", [
    ({"rope.scaling.type": "llama3"}, "rope.scaling.type 'llama3' is not one llama.cpp knows"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "YaRN rope scaling"),
    ({"rope.scaling.factor": -2.0}, "rope.scaling.factor must be positive"),
    ({"rope.dimension_count": 8}, "rope.dimension_count 8 must equal the head size 16"),
])
def test_rope_keys_llama_cpp_refuses_are_user_errors(keys, message):
    with pytest.raises(LlmtuneError, match=message):
        scale_of(**keys)


def test_rope_freqs_is_optional_with_half_the_rotary_dims():
    hp = read_hparams(LLAMA_KEYS, {"token_embd.weight"})
    specs = {s.name: s for s in get_family("llama").tensors(hp)}
    assert specs["rope_freqs.weight"].shape == (8,) and specs["rope_freqs.weight"].optional
    required = {n: s.shape for n, s in specs.items() if not s.optional}
    assert [s.name for s in check_tensors(hp, required, "x")] == list(required)  # Llama 2 / Mistral: without it
    with pytest.raises(LlmtuneError, match=r"rope_freqs.weight has shape \(16,\), expected \(8,\)"):
        check_tensors(hp, {**required, "rope_freqs.weight": (16,)}, "x")


def test_rope_factors_never_train(tmp_path):
    """rope_freqs.weight gets no gradient; training it would only let weight decay shrink it."""

    path = init_model(Path(__file__).parents[1] / "configs" / "llama-tiny.toml",
                      Path(__file__).parent / "data" / "stories260K.gguf",
                      tmp_path / "m.gguf", test_weights=True, optional=("rope_freqs.weight",))
    model = load_model(path)
    assert "rope_freqs.weight" in model.weights
    assert "rope_freqs.weight" not in model.select(None)
    assert "blk.0.attn_q.weight" in model.select("attn_q")
    with pytest.raises(LlmtuneError, match="matches no tensor"):
        model.select("rope_freqs")
