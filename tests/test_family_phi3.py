"""phi3: llama.cpp's recorded perplexity of a random-weight tiny model (LongRoPE factors, attention
factor, partial NEOX rotary, GQA), the long/short factor choice, finite-difference gradients
through every feature (fused qkv with bias, fused gate+up, partial rotary with frequency factors
and attention factor), the metadata llama.cpp's converter writes, and the commands."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import llmtune
from cli_helpers import run_cli
from family_check import check_family
from llmtune.arch import check_tensors, get_family
from llmtune.arch.context import Batch, BuildContext
from llmtune.backends.cpu import CPUBackend
from llmtune.convert.init import init_model
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf, write_gguf
from llmtune.graph import ops
from llmtune.graph.gradcheck import check_gradients
from llmtune.graph.planner import Program
from llmtune.model.loaded import load_model

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "tests" / "data" / "stories260K.gguf"  # a 512-token SPM vocabulary: small, fast models
PHI3 = get_family("phi3")


def tiny_hp(**over):
    """head_dim 4 with 2 rotary dims (partial), 2 query heads sharing 1 KV head."""
    fields = dict(n_vocab=11, n_ctx_train=32, n_embd=8, n_layer=2, n_head=2, n_head_kv=1, n_ff=6, n_rot=2,
                  n_ctx_orig=16, rope_attn_factor=1.3)
    return PHI3.make_hparams(**{**fields, **over})


def test_phi3_matches_llama_cpp_and_transformers(tmp_path):
    """Running perplexity of configs/phi3-tiny.toml (every tensor random, long rope factors chosen
    at ctx 128 since llama.cpp's padded context 256 > original context 64) per chunk."""
    check_family("phi3", tmp_path)


def test_phi3_gradients_through_every_feature():
    hp = tiny_hp()
    rng = np.random.default_rng(7)
    specs = {s.name: s.shape for s in PHI3.tensors(hp) if not s.optional or s.name.endswith("attn_qkv.bias")}
    assert "blk.1.attn_qkv.bias" in specs and specs["blk.0.ffn_up.weight"] == (12, 8)
    arrays = {n.replace(".", "_"): (1.0 + 0.3 * rng.standard_normal(s)) if "norm" in n else 0.5 * rng.standard_normal(s)
              for n, s in specs.items()}

    def build(tokens, pos, targets, **w):
        weights = {n: w[n.replace(".", "_")] for n in specs}
        weights["rope_factors_long.weight"] = ops.const(3.0, (hp.n_rot // 2,))  # frozen: no gradient
        logits = PHI3.build(BuildContext(hp, weights, Batch(tokens, pos)))
        return ops.cross_entropy(logits, targets)

    ints = {"tokens": rng.integers(0, 11, (2, 5)), "pos": np.array([0, 1, 2, 5, 9]), "targets": rng.integers(0, 11, 10)}
    errors = check_gradients(build, arrays, CPUBackend(np.float64), int_inputs=ints)
    assert max(errors.values()) < 1e-5, errors


def logits_of(hp, weights: dict, n_tok: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    nodes = {n: ops.param(w.shape, name=n, requires_grad=False) for n, w in weights.items()}
    batch = Batch.make(1, n_tok)
    logits = PHI3.build(BuildContext(hp, nodes, batch))
    prog = Program([logits], CPUBackend(np.float64), params={nodes[n]: w for n, w in weights.items()})
    feed = {"tokens": rng.integers(0, hp.n_vocab, (1, n_tok)).astype(np.int32), "pos": np.arange(n_tok, dtype=np.int32)}
    return prog.run(**feed)[0].copy()


def test_phi3_long_or_short_factors_as_llama_cpp_chooses():
    """llama.cpp's get_rope_factors: long when the context (padded to 256 as llama.cpp pads
    n_ctx_seq) exceeds rope.scaling.original_context_length, short otherwise. Each choice gives
    exactly the logits of the same model with those factors as rope_freqs."""
    rng = np.random.default_rng(1)
    hp = tiny_hp(n_ctx_train=512)
    weights = {s.name: rng.standard_normal(s.shape) * 0.5 for s in PHI3.tensors(hp) if not s.optional}
    long, short = rng.uniform(1, 8, 1), rng.uniform(1, 8, 1)
    both = dict(weights, **{"rope_factors_long.weight": long, "rope_factors_short.weight": short})
    as_freqs = {f: logits_of(hp, dict(weights, **{"rope_freqs.weight": v}), 6)
                for f, v in (("long", long), ("short", short))}
    for n_ctx_orig, chosen in ((256, "short"), (255, "long")):  # 6 tokens: llama.cpp's context is 256
        got = logits_of(tiny_hp(n_ctx_train=512, n_ctx_orig=n_ctx_orig), both, 6)
        np.testing.assert_allclose(got, as_freqs[chosen], rtol=1e-12)
    assert not np.allclose(as_freqs["long"], as_freqs["short"])
    # the attention factor scales the rotated dims only: with it, the logits change
    assert not np.allclose(logits_of(tiny_hp(rope_attn_factor=1.0), weights, 6), logits_of(hp, weights, 6))


def test_phi3_metadata_is_the_converters(tmp_path):
    """init writes the keys convert_hf_to_gguf.py's Phi3MiniModel writes, and reads them back."""

    path = init_model(REPO / "configs" / "phi3-tiny.toml", STORIES, tmp_path / "m.gguf", seed=1)
    keys = {k[len("phi3."):] for k in load_gguf(path).meta if k.startswith("phi3.")}
    assert keys == {"context_length", "rope.scaling.original_context_length", "embedding_length",
                    "feed_forward_length", "block_count", "attention.head_count", "attention.head_count_kv",
                    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base",
                    "attention.sliding_window", "rope.scaling.attn_factor"}
    hp = load_model(path).hp
    assert (hp.n_ctx_orig, hp.n_rot, hp.n_head_kv, hp.rope_mode) == (64, 12, 2, "neox")
    assert hp.rope_attn_factor == pytest.approx(1.1547005) and hp.sliding_window == 0  # phi3 SWA: disabled


def test_phi3_commands_and_unknown_tensor(tmp_path, monkeypatch, capsys, wiki100k_path):
    """info says supported; a short finetune lowers the perplexity; export q8_0 runs; a tensor
    phi3 does not have (separate attn_q) is one line naming it, exit code 2."""


    model = init_model(REPO / "configs" / "phi3-tiny.toml", STORIES, tmp_path / "m.gguf", seed=1)
    code, out, err = run_cli(monkeypatch, capsys, "info", model)
    assert code == 0 and "phi3" in out and "supported" in out and "cannot run" not in out, err
    text = tmp_path / "text.txt"
    text.write_text(wiki100k_path.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    before = llmtune.perplexity(model, text, ctx=64).ppl
    tuned = tmp_path / "tuned.gguf"
    llmtune.finetune(model, text, tuned, ctx=64, batch=256, ubatch=128, epochs=2, lr=3e-3, val_split=0.0)
    after = llmtune.perplexity(tuned, text, ctx=64).ppl
    assert after < 0.9 * before, (before, after)
    q8 = tmp_path / "q8.gguf"
    code, out, err = run_cli(monkeypatch, capsys, "export", tuned, "--type", "q8_0", "-o", q8)
    assert code == 0, err
    assert abs(llmtune.perplexity(q8, text, ctx=64).ppl / after - 1) < 0.02

    gf = load_gguf(model)
    extra = "blk.0.attn_q.weight"
    tensors = [(n, gf.tensor(n), QT.F32) for n in gf.tensors] + [(extra, gf.tensor("blk.0.attn_output.weight"), QT.F32)]
    bad = write_gguf(tmp_path / "extra.gguf", gf.arch, dict(gf.meta), tensors)
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", bad, text, "--ctx", 32)
    assert code == 2 and extra in err and len(err.strip().splitlines()) == 1, err


def test_phi3_optional_tensors_are_known():
    """Every tensor llama.cpp's phi3 accepts: LongRoPE factors, qkv bias, legacy separate biases, no output."""
    hp = tiny_hp(tied_output=True)
    shapes = {s.name: s.shape for s in PHI3.tensors(hp)}
    assert "output.weight" not in shapes and shapes["rope_factors_long.weight"] == (1,)
    present = {s.name for s in check_tensors(hp, shapes, "x.gguf")}
    assert {"blk.0.attn_qkv.bias", "blk.0.attn_q.bias", "rope_factors_short.weight"} <= present
    with pytest.raises(LlmtuneError, match="head_dim cannot be set"):
        PHI3.write_hparams(tiny_hp(head_dim_kq=8))
