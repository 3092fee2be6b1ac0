"""llmtune export: K-quant encoders, llama.cpp's per-tensor type policy, the exported file, the CLI."""

from __future__ import annotations

import gzip
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, LlamaFileType as FT

import kquant_ref
import llmtune
from cli_helpers import run_cli as _run_cli
from llmtune.convert.export import export
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf
from llmtune.quant import blocks as quants
from llmtune.quant.plan import EXPORT_TYPES, ModelFacts, allows_quantization, plan_types, use_more_bits

DATA = Path(__file__).parent / "data"
STORIES = DATA / "stories260K.gguf"
K_TYPES = {QT.Q4_K: kquant_ref.q4_k_block, QT.Q5_K: kquant_ref.q5_k_block, QT.Q6_K: kquant_ref.q6_k_block}
ALL_TYPES = (QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)


# --- block encoders ------------------------------------------------------------------------------


def _awkward_blocks() -> np.ndarray:
    """Super-blocks that exercise the corner cases of the scale searches."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((12, 256)).astype(np.float32)
    x[1] *= 1e-4  # tiny weights
    x[2, :100] = 0  # sub-blocks of zeros next to data
    x[3] = 0  # an all-zero block
    x[4] = np.abs(x[4]) + 0.5  # all positive: min clamps to 0
    x[5] = -np.abs(x[5]) - 1  # all negative
    x[6] = rng.standard_t(2, 256)  # heavy tails
    x[7] = 0.25  # constant
    x[8, ::17] = 40.0  # outliers
    return x


@pytest.mark.parametrize("qtype", list(K_TYPES), ids=lambda t: t.name)
def test_k_quant_blocks_match_scalar_reference(qtype):
    """The vectorized encoder writes the same bytes as an element-by-element port of ggml's *_ref."""
    x = _awkward_blocks()
    got = quants.quantize(x, qtype).reshape(len(x), -1)
    want = np.stack([K_TYPES[qtype](row) for row in x])
    assert got.shape[1] == quants.type_size(qtype)
    mismatched = [i for i in range(len(x)) if not np.array_equal(got[i], want[i])]
    assert mismatched == []


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_round_trip_error_within_llamacpp_bound(qtype):
    """ggml's test-quantize-fns: data 0.1 + 2 cos(i), error sqrt(sum d^2)/n must stay below 0.002."""
    n = 32 * 128
    x = (0.1 + 2.0 * np.cos(np.arange(n, dtype=np.float32)).astype(np.float64)).astype(np.float32)
    y = quants.dequantize(quants.quantize(x, qtype), qtype)
    assert y.shape == x.shape
    assert np.sqrt(np.sum((x.astype(np.float64) - y) ** 2)) / n < 0.002


# RMS error on N(0, 1) data (measured; BENCHMARKS.md), with headroom for noise between seeds.
GAUSSIAN_RMS = {QT.F16: 2.2e-4, QT.BF16: 1.7e-3, QT.Q8_0: 5.5e-3, QT.Q4_0: 0.088, QT.Q4_1: 0.080,
                QT.Q5_0: 0.044, QT.Q5_1: 0.039, QT.Q4_K: 0.073, QT.Q5_K: 0.037, QT.Q6_K: 0.0182}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_round_trip_gaussian_through_gguf_dequantize(qtype):
    x = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    q = quants.quantize(x, qtype)
    if qtype != QT.F16:
        assert q.dtype == np.uint8 and q.shape == (64, quants.nbytes((1024,), qtype))
    y = gguf.quants.dequantize(q, qtype)  # the decoder llama.cpp's python tools use
    assert y.shape == x.shape
    rms = float(np.sqrt(np.mean((y - x) ** 2)))
    assert GAUSSIAN_RMS[qtype] * 0.9 < rms < GAUSSIAN_RMS[qtype]


def test_k_quant_rejects_rows_that_do_not_split_into_super_blocks():
    with pytest.raises(ValueError, match="256"):
        quants.quantize(np.zeros((4, 96), np.float32), QT.Q4_K)


# --- which tensor gets which type (llama-quant.cpp) -------------------------------------------------


def _llama_tensors(n_layer=16, n_embd=256, n_ff=768, n_vocab=1024, tied=False):
    t = {"token_embd.weight": ((n_vocab, n_embd), QT.F32), "output_norm.weight": ((n_embd,), QT.F32)}
    if not tied:
        t["output.weight"] = ((n_vocab, n_embd), QT.F32)
    for i in range(n_layer):
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, n_embd)), ("attn_v", (n_embd, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            t[f"blk.{i}.{name}.weight"] = (shape, QT.F32)
        t[f"blk.{i}.attn_norm.weight"] = ((n_embd,), QT.F32)
        t[f"blk.{i}.ffn_norm.weight"] = ((n_embd,), QT.F32)
    return t


def _plan(type_name, **kw):
    n_layer = kw.get("n_layer", 16)
    return plan_types(EXPORT_TYPES[type_name], _llama_tensors(**kw), ModelFacts("llama", n_layer, 8, 8))


def test_use_more_bits_layers_of_a_32_layer_model():
    # llama.cpp gives these layers of a 32-layer model Q6_K attn_v / ffn_down in Q4_K_M
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4_k_m_mix():
    plans = _plan("q4_k_m")
    more = [i for i in range(16) if use_more_bits(i, 16)]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    for i in range(16):
        want = QT.Q6_K if i in more else QT.Q4_K
        assert plans[f"blk.{i}.attn_v.weight"].dst_type == want
        assert plans[f"blk.{i}.ffn_down.weight"].dst_type == want
        assert plans[f"blk.{i}.attn_q.weight"].dst_type == QT.Q4_K
        assert plans[f"blk.{i}.ffn_up.weight"].dst_type == QT.Q4_K
        assert plans[f"blk.{i}.attn_norm.weight"].dst_type == QT.F32
    assert plans["output.weight"].dst_type == QT.Q6_K
    assert plans["token_embd.weight"].dst_type == QT.Q4_K
    assert plans["output_norm.weight"].dst_type == QT.F32 and not plans["output_norm.weight"].quantizable


def test_tied_embeddings_take_the_output_rule():
    assert _plan("q4_k_m", tied=True)["token_embd.weight"].dst_type == QT.Q6_K
    assert _plan("q8_0", tied=True)["token_embd.weight"].dst_type == QT.Q8_0


def test_legacy_types_put_the_output_in_q6_k_and_float_types_do_not():
    assert _plan("q4_0")["output.weight"].dst_type == QT.Q6_K
    assert _plan("q4_0")["blk.3.attn_v.weight"].dst_type == QT.Q4_0
    assert _plan("q8_0")["output.weight"].dst_type == QT.Q8_0
    assert _plan("f16")["output.weight"].dst_type == QT.F16
    assert _plan("q6_k")["blk.5.ffn_down.weight"].dst_type == QT.Q6_K


def test_pure_k_types_use_one_type_for_every_weight():
    plans = _plan("q5_k")
    types = {p.dst_type for p in plans.values() if p.quantizable}
    assert types == {QT.Q5_K}


def test_fallback_when_rows_do_not_split_into_blocks():
    plans = _plan("q4_k_m", n_embd=64, n_ff=172)  # stories260K's shapes
    assert plans["blk.0.attn_q.weight"].dst_type == QT.Q5_0 and plans["blk.0.attn_q.weight"].fallback
    assert plans["blk.0.attn_v.weight"].dst_type == QT.Q8_0  # wanted Q6_K (layer 0 of 16)
    assert plans["blk.2.attn_v.weight"].dst_type == QT.Q5_0
    assert plans["blk.0.ffn_down.weight"].dst_type == QT.F16  # 172 columns: no 32-block type fits
    assert plans["output.weight"].dst_type == QT.Q8_0 and not plans["output.weight"].fallback
    assert _plan("q5_k", n_embd=64)["blk.1.attn_k.weight"].dst_type == QT.Q5_1
    assert _plan("q6_k", n_embd=64)["blk.1.attn_k.weight"].dst_type == QT.Q8_0
    assert _plan("q8_0", n_ff=172, n_embd=64)["blk.1.ffn_down.weight"].dst_type == QT.F16


def test_only_multi_dimensional_weights_are_quantized():
    assert allows_quantization("blk.0.attn_q.weight", (64, 64))
    assert not allows_quantization("blk.0.attn_norm.weight", (64,))
    assert not allows_quantization("blk.0.attn_q.weight", (1, 64))  # ggml counts this as 1-D
    assert not allows_quantization("blk.0.attn_q.bias", (64, 64))
    assert not allows_quantization("blk.0.ffn_gate_inp.weight", (8, 64))


# --- the exported file ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source():
    return load_gguf(STORIES)


@pytest.mark.parametrize("type_name", list(EXPORT_TYPES))
def test_export_stories260k(tmp_path, source, type_name):
    out = tmp_path / f"s-{type_name}.gguf"
    calls = []
    summary = export(STORIES, out, type_name, progress=lambda done, total, name: calls.append((done, total, name)))
    gf = load_gguf(out)

    xt = EXPORT_TYPES[type_name]
    assert gf.get("general.file_type") == int(xt.ftype)
    assert gf.meta["general.file_type"].type == gguf.GGUFValueType.UINT32
    assert gf.get("general.quantization_version") == 2
    for key, mv in source.meta.items():  # every other key kept, with its type
        assert gf.meta[key] == mv, key

    assert list(gf.tensors) == list(source.tensors)
    assert [c[0] for c in calls] == list(range(1, len(source.tensors) + 1))
    by_name = {t.name: t for t in summary.tensors}
    for name, info in gf.tensors.items():
        assert info.shape == source.tensors[name].shape
        assert info.type == by_name[name].dst_type
        assert info.n_bytes == by_name[name].dst_bytes
        if len(info.shape) == 1:
            assert info.type == QT.F32  # norms stay F32
            np.testing.assert_array_equal(gf.tensor(name), source.tensor(name))
        else:
            a, b = source.tensor(name), gf.tensor(name)
            assert np.sqrt(np.mean((a - b) ** 2)) < 0.1 * np.sqrt(np.mean(a**2)), name
    assert summary.file_bytes == out.stat().st_size
    assert summary.bytes_out < out.stat().st_size < summary.bytes_out + 100_000  # data + header


def test_export_f32_copies_the_data_unchanged(tmp_path, source):
    out = tmp_path / "copy.gguf"
    export(STORIES, out, "f32")
    gf = load_gguf(out)
    for name in source.tensors:
        np.testing.assert_array_equal(np.asarray(gf.tensors[name].raw), np.asarray(source.tensors[name].raw))


def test_requantizing_the_same_type_keeps_the_blocks(tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    export(STORIES, first, "q8_0")
    summary = export(first, second, "q8_0")
    a, b = load_gguf(first), load_gguf(second)
    for name in a.tensors:
        assert np.array_equal(np.asarray(a.tensors[name].raw), np.asarray(b.tensors[name].raw)), name
    assert summary.bytes_in == summary.bytes_out


def test_stories260k_q4_k_m_type_mix(tmp_path):
    summary = export(STORIES, tmp_path / "m.gguf", "q4_k_m")
    types = {t.name: t.dst_type for t in summary.tensors}
    # 5 layers: use_more_bits picks layers 2 and 4; rows of 64 fall back from Q6_K to Q8_0, from Q4_K to Q5_0
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(5)] == [QT.Q5_0, QT.Q5_0, QT.Q8_0, QT.Q5_0, QT.Q8_0]
    assert types["output.weight"] == QT.Q8_0
    assert types["blk.0.ffn_down.weight"] == QT.F16
    assert summary.type_counts() == {"Q5_0": 29, "F32": 11, "F16": 5, "Q8_0": 3}
    assert summary.file_type == FT.MOSTLY_Q4_K_M


def test_library_errors(tmp_path):
    with pytest.raises(LlmtuneError, match="--type q3_k: unknown type"):
        export(STORIES, tmp_path / "x.gguf", "q3_k")
    with pytest.raises(LlmtuneError, match="no such file"):
        export(tmp_path / "missing.gguf", tmp_path / "x.gguf", "f16")
    with pytest.raises(LlmtuneError, match="refusing to overwrite"):
        export(STORIES, STORIES, "f16")
    assert not (tmp_path / "x.gguf").exists()


# --- command line -----------------------------------------------------------------------------------


def test_cli_unknown_type(monkeypatch, capsys, tmp_path):
    code, _, err = _run_cli(monkeypatch, capsys, "export", str(STORIES), "-o", str(tmp_path / "o.gguf"), "--type",
                            "q3_k")
    assert code == 2
    assert err.strip().startswith("error:") and "--type q3_k: unknown type" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.gguf").exists()


def test_cli_missing_model(monkeypatch, capsys, tmp_path):
    code, _, err = _run_cli(monkeypatch, capsys, "export", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "o.gguf"),
                            "--type", "f16")
    assert code == 2 and "nope.gguf: no such file" in err and len(err.strip().splitlines()) == 1


def test_cli_refuses_to_overwrite_its_input(monkeypatch, capsys, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(STORIES.read_bytes())
    before = model.read_bytes()
    code, _, err = _run_cli(monkeypatch, capsys, "save", str(model), "-o", str(model), "--type", "q8_0")
    assert code == 2 and "refusing to overwrite the input file" in err and len(err.strip().splitlines()) == 1
    assert model.read_bytes() == before


def test_cli_save_alias_writes_and_summarises(monkeypatch, capsys, tmp_path):
    out = tmp_path / "q.gguf"
    code, stdout, _ = _run_cli(monkeypatch, capsys, "save", str(STORIES), "-o", str(out), "-t", "q6_k")
    assert code == 0
    assert load_gguf(out).get("general.file_type") == int(FT.MOSTLY_Q6_K)
    assert "size before" in stdout and "F32 -> Q8_0" in stdout and "total" in stdout


# --- perplexity of exported models (llama-perplexity's algorithm, llmtune.perplexity) --------------


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):

    path = tmp_path_factory.mktemp("text") / "wikitext-2-raw-test.txt"
    path.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    return path


@pytest.fixture(scope="module")
def ppl_f32(wikitext):

    return llmtune.perplexity(STORIES, wikitext, ctx=128, chunks=40).ppl


@pytest.mark.parametrize("type_name, tolerance", [("f16", 1e-4), ("q8_0", 5e-3)])
def test_exported_perplexity_close_to_f32(tmp_path, wikitext, ppl_f32, type_name, tolerance):

    out = tmp_path / f"s-{type_name}.gguf"
    export(STORIES, out, type_name)
    ppl = llmtune.perplexity(out, wikitext, ctx=128, chunks=40).ppl
    assert ppl != ppl_f32  # the weights did change
    assert abs(ppl / ppl_f32 - 1) < tolerance
