"""LoRA adapters: applied in BuildContext.mm as llama.cpp's build_lora_mm, trained on a frozen base,
written in llama.cpp's adapter GGUF, merged by export, refused with one line when they do not fit."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import re
import sys
import warnings

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

import cuda_emu
import llmtune
import lora_fixture
from cli_helpers import run_cli
from conftest import DATA, REPO
from llmtune.arch import get_family
from llmtune.arch.context import Batch, BuildContext
from llmtune.backends.cpu import CPUBackend
from llmtune.backends.cpu.threads import blas_threads
from llmtune.backends.cuda import CUDABackend
from llmtune.convert.init import init_model
from llmtune.errors import LlmtuneError, LlmtuneWarning
from llmtune.gguf.file import MetaValue, load_gguf, write_gguf
from llmtune.graph import ops
from llmtune.graph.gradcheck import check_gradients
from llmtune.graph.planner import Program
from llmtune.model import adapter as lora
from llmtune.model.loaded import load_model
from llmtune.train.memory import mapped_bytes
from llmtune.train.trainer import RunningStats, Trainer

CONVERT_F16 = DATA / "lora" / "stories260K-convert-f16.gguf"  # llama.cpp's convert_lora_to_gguf.py --outtype f16
RECORDED = DATA / "lora" / "llamacpp-lora.json"  # bench/check_lora.py --record


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """The models here are tiny: two OpenBLAS threads on a busy 2-core machine make each small
    matmul ~25x slower (thread hand-offs), one thread keeps the module fast."""

    with blas_threads(1):
        yield


@pytest.fixture(scope="module")
def stories(stories_path):
    return load_model(stories_path)


@pytest.fixture(scope="module")
def small_text(tmp_path_factory, wiki100k_path):
    """~800 tokens: at ctx 32 and batch 128, 5 optimizer steps per epoch."""
    path = tmp_path_factory.mktemp("lora") / "small.txt"
    path.write_text(wiki100k_path.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def wiki_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-wiki") / "wiki.test.raw"
    path.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    return path


@pytest.fixture(scope="module")
def fixture_adapter(stories, tmp_path_factory):
    """The deterministic adapter of tests/lora_fixture.py (every matrix, token_embd and output too)."""
    return lora.write_adapter(tmp_path_factory.mktemp("fx") / "fixture.gguf", lora_fixture.fixture_adapter(stories))


def random_adapter(model, rank=4, targets=None, seed=0, b_std=0.05):
    adapter = lora.init_adapter(model, rank, 2.0 * rank, targets, seed)
    rng = np.random.default_rng(seed + 1)
    for pair in adapter.pairs.values():
        pair.a[...] = rng.standard_normal(pair.a.shape).astype(np.float32) * 0.2
        pair.b[...] = rng.standard_normal(pair.b.shape).astype(np.float32) * b_std
    return adapter


def logits_of(model, tokens, dtype=np.float64):
    _, nodes, logits = model.build(*tokens.shape)
    be = CPUBackend(dtype)
    prog = Program([logits], be, params={nodes[n]: np.asarray(w, dtype) for n, w in model.tensors().items()})
    return prog.run(tokens=tokens, pos=np.arange(tokens.shape[1], dtype=np.int32))[0].copy()


def with_adapters(model, *adapters):
    return dataclasses.replace(model, adapters=list(adapters))


# ------------------------------------------------------------------------------ the graph
def test_new_adapter_starts_exactly_at_the_base(stories):
    """B = 0 (PEFT's init): the adapted model's logits are the base's, bit for bit."""
    tokens = np.random.default_rng(0).integers(0, 512, (2, 16)).astype(np.int32)
    fresh = lora.init_adapter(stories, 8, 16.0, seed=3)
    assert all(np.all(p.b == 0) and np.any(p.a != 0) for p in fresh.pairs.values())
    np.testing.assert_array_equal(logits_of(with_adapters(stories, fresh), tokens, np.float32),
                                  logits_of(stories, tokens, np.float32))


def test_first_lora_step_reports_the_base_loss(stories, wikitext_ids):
    """Step 0's loss is the base model's (the first WikiText window: 5.326544, as test_finetune)."""
    tr = _lora_trainer(stories, n_ctx=256, n_batch=256, n_ubatch=256)
    x = wikitext_ids[:257][None]
    assert abs(tr.train_step(x[:, :-1], x[:, 1:], 1e-3, RunningStats()) - 5.326544) < 1e-4


def test_pep_init_is_kaiming_uniform(stories):
    a = lora.init_adapter(stories, 4, None, seed=0)
    assert a.alpha == 4.0 and a.weight_scale("blk.0.attn_q.weight") == 1.0
    pair = a.pairs["blk.0.ffn_down.weight"]  # n_in = n_ff = 172
    bound = 1 / np.sqrt(172)
    assert pair.a.shape == (4, 172) and np.abs(pair.a).max() <= bound and np.abs(pair.a).max() > 0.9 * bound


def test_default_targets_are_attention_and_ffn(stories):
    names = lora.select_targets(stories, None, 4)
    assert len(names) == 5 * 7 and "output.weight" not in names and "token_embd.weight" not in names
    assert {n.split(".")[2] for n in names} == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                "ffn_down"}


def test_adapter_terms_equal_the_merged_weights(stories):
    """Applying (x A^T) B^T in the graph = running the merged W + s B A (token_embd: W + s A B^T)."""
    adapter = random_adapter(stories, targets=r"weight$")
    assert "token_embd.weight" in adapter.pairs and "output.weight" in adapter.pairs
    second = random_adapter(stories, rank=2, seed=7)
    second.scale = 0.5
    model = with_adapters(stories, adapter, second)
    merged = dataclasses.replace(stories, weights={n: lora.merged_weight(model, n) for n in stories.weights})
    tokens = np.random.default_rng(1).integers(0, 512, (2, 12)).astype(np.int32)
    applied = logits_of(model, tokens)
    np.testing.assert_allclose(applied, logits_of(merged, tokens), rtol=0, atol=2e-5)
    assert np.abs(applied - logits_of(stories, tokens)).max() > 0.1  # the adapters do something
    w, p = lora.merged_weight(model, "blk.1.attn_v.weight"), adapter.pairs["blk.1.attn_v.weight"]
    s1, s2 = adapter.weight_scale("blk.1.attn_v.weight"), second.weight_scale("blk.1.attn_v.weight")
    assert s1 == 2.0 and s2 == 0.5 * 4.0 / 2
    q = second.pairs["blk.1.attn_v.weight"]
    np.testing.assert_allclose(w, stories.weights["blk.1.attn_v.weight"] + s1 * p.b @ p.a + s2 * q.b @ q.a, atol=1e-6)


def test_lora_gradients_match_finite_differences():
    """float64 finite differences through a tiny llama with an adapter on every matrix (token_embd too)."""
    family = get_family("llama")
    hp = family.make_hparams(n_vocab=11, n_ctx_train=16, n_embd=8, n_layer=1, n_head=2, n_head_kv=1, n_ff=12, n_rot=4)
    rng = np.random.default_rng(2)
    shapes = {s.name: s.shape for s in family.tensors(hp) if not s.optional}
    r = 2
    pairs = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            n_out, n_in = shape
            pairs[name] = ((n_out, r), (n_in, r)) if name == "token_embd.weight" else ((r, n_in), (n_out, r))
    arrays = {n.replace(".", "_"): rng.standard_normal(s) * (1.0 if "norm" in n else 0.4) for n, s in shapes.items()}
    for name, (sa, sb) in pairs.items():
        arrays[(name + ".lora_a").replace(".", "_")] = rng.standard_normal(sa) * 0.5
        arrays[(name + ".lora_b").replace(".", "_")] = rng.standard_normal(sb) * 0.5

    def build(tokens, pos, targets, **w):
        nodes = {n: w[n.replace(".", "_")] for n in shapes}
        terms = {n: [lora.LoraTerm(w[(n + ".lora_a").replace(".", "_")], w[(n + ".lora_b").replace(".", "_")], 0.7, n)]
                 for n in pairs}
        logits = family.build(BuildContext(hp, nodes, Batch(tokens, pos), lora=lora.LoraGraph(terms)))
        return ops.cross_entropy(logits, targets)

    ints = {"tokens": rng.integers(0, 11, (2, 4)), "pos": np.arange(4), "targets": rng.integers(0, 11, 8)}
    errors = check_gradients(build, arrays, CPUBackend(np.float64), int_inputs=ints)
    lora_errors = {k: v for k, v in errors.items() if "lora" in k}
    assert len(lora_errors) == 2 * len(pairs) and max(errors.values()) < 1e-5, errors


# ------------------------------------------------------------------------------ training
def _lora_trainer(stories, n_ctx=24, n_batch=48, n_ubatch=24, dropout=0.0, rank=4, optimizer="adamw"):
    adapter = lora.init_adapter(stories, rank, 8.0, seed=0)
    model = lora.attach(stories, [adapter])
    return Trainer(model, CPUBackend(), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                   trainable=list(adapter.tensors()),
                   optimizer=optimizer, lora_dropout=dropout, seed=5, workers=1)


def test_frozen_base_has_no_gradient_or_optimizer_state(stories):
    """Only A/B sit in the flat buffer; the backward graph computes no frozen weight's gradient
    (no matmul or scatter produces a weight-shaped value: ctx 24 is no weight dimension)."""
    tr = _lora_trainer(stories, n_batch=24)
    adapter = tr.model.adapters[0]
    assert tr.n_trainable == adapter.n_params() and tr.optimizer.state_bytes == 2 * 4 * adapter.n_params()
    mem = tr.memory_bytes()
    packs = ["packed copies"] if tr.float_copies.packing() else []  # the frozen base's, for the compiled product
    assert list(mem) == ["base", "adapters", "gradients", "optimizer", "activations"] + packs
    packed = sum(w.size for n, w in stories.weights.items() if n in tr._packed_names)  # (their file pages go back)
    assert mem["base"] + 4 * packed == 4 * stories.n_params()
    assert mem["adapters"] == mem["gradients"] == 4 * adapter.n_params()
    frozen_shapes = {w.shape for w in stories.weights.values() if w.ndim == 2}
    prog = tr.programs.train[0]
    computed = [n for n in prog.order if not n.is_leaf]
    assert not [n for n in computed if n.op in ("matmul", "sum_to", "add_rows") and n.shape in frozen_shapes]
    assert not [n for n in computed if n.op == "add_rows"]  # no gradient into token_embd


@pytest.mark.parametrize("optimizer, tol", [("sgd", 1e-5), ("adamw", 1e-4)])
def test_lora_training_is_ubatch_invariant(optimizer, tol, stories, wikitext_ids):
    """Adapters after 3 steps: ubatch = ctx vs ubatch = batch, with dropout (masks per sequence).
    Float rounding only (AdamW's normalisation lifts it for gradients that are nearly zero)."""
    results = []
    x_all = wikitext_ids[: 4 * 3 * 25].reshape(12, 25)
    for ubatch in (24, 96):
        tr = _lora_trainer(stories, n_batch=96, n_ubatch=ubatch, dropout=0.1, optimizer=optimizer)
        for s in range(3):
            x = x_all[4 * s : 4 * s + 4]
            tr.train_step(x[:, :-1], x[:, 1:], 1e-2 if optimizer == "adamw" else 1.0, RunningStats())
        results.append(np.concatenate([w.ravel() for w in tr.trained_weights().values()]))
    start = np.concatenate([w.ravel() for w in _lora_trainer(stories).trained_weights().values()])
    moved = results[0] - start
    assert np.abs(moved).max() > 1e-2
    np.testing.assert_allclose(results[1] - start, moved, rtol=0, atol=tol * np.abs(moved).max())


def test_dropout_only_in_training_programs(stories):
    tr = _lora_trainer(stories, dropout=0.2)
    masks = [n for n in tr.programs.train[0].inputs if n.endswith(".dropout")]
    assert len(masks) == 35 and "dropout masks" in tr.memory_bytes()
    assert not [n for n in tr.programs.eval_program(2).inputs if n.endswith(".dropout")]
    m = lora.dropout_masks({"m": (48, 1000)}, 0.2, 0, 0, range(2))["m"]
    assert set(np.unique(m)) == {0.0, np.float32(1.25)} and abs((m == 0).mean() - 0.2) < 0.01
    one = lora.dropout_masks({"m": (24, 1000)}, 0.2, 0, 0, range(1, 2))["m"]
    np.testing.assert_array_equal(one, m[24:])  # sequence 1's mask whatever micro-batch holds it


def test_validation_loss_falls(stories, wikitext_ids):
    tr = _lora_trainer(stories, n_ctx=32, n_batch=64, n_ubatch=64)
    windows = np.lib.stride_tricks.sliding_window_view(wikitext_ids[:4000], 33)[::16]
    train, val = windows[:-16], windows[-16:]

    def val_loss():
        stats = RunningStats()
        tr.evaluate(val[:, :-1], val[:, 1:], stats)
        return stats.loss

    before = val_loss()
    for s in range(15):
        x = train[2 * s : 2 * s + 2]
        tr.train_step(x[:, :-1], x[:, 1:], 2e-2, RunningStats())
    after = val_loss()
    assert after < before - 0.3, (before, after)
    assert all(np.array_equal(tr.values[n], stories.weights[n]) for n in stories.weights)  # the base never moved


def test_the_memory_line_says_what_of_a_mapped_base_is_resident(stories, stories_path, small_text, tmp_path,
                                                                 monkeypatch, capsys):
    """LoRA keeps the base memory-mapped: the start report gives its size as mapped and the part the
    run holds as resident (a 98 MiB Q4_1 base under LoRA was reported as "base 0.1 MiB")."""
    tr = _lora_trainer(stories)
    assert mapped_bytes(tr) == 4 * stories.n_params()  # every frozen tensor is a view of the file (F32)
    assert tr.memory_bytes()["base"] < mapped_bytes(tr)  # those multiplied through packed copies go back
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, small_text, "-o", tmp_path / "o.gguf",
                           "--lora-rank", 2, "--ctx", 32, "--batch", 128, "--epochs", 1)
    assert code == 0, err
    line = next(line for line in err.splitlines() if line.startswith("memory: "))
    assert re.match(rf"memory: base {4 * stories.n_params() / 2**20:.1f} MiB mapped, \d+\.\d MiB resident, adapters ",
                    line), line


@pytest.mark.determinism
def test_finetune_writes_a_lora_adapter_same_seed_same_bytes(stories_path, small_text, tmp_path):
    kw = dict(ctx=32, batch=128, ubatch=32, epochs=1, lr=1e-2, val_split=0.1, lora_rank=4, lora_dropout=0.05)
    a = llmtune.finetune(stories_path, small_text, tmp_path / "a.gguf", seed=1, **kw)
    llmtune.finetune(stories_path, small_text, tmp_path / "b.gguf", seed=1, **kw)
    llmtune.finetune(stories_path, small_text, tmp_path / "c.gguf", seed=2, **kw)
    assert a.memory["adapters"] > 0 and "base" in a.memory
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert (tmp_path / "a.gguf").read_bytes() != (tmp_path / "c.gguf").read_bytes()
    adapter = lora.load_adapter(tmp_path / "a.gguf", load_model(stories_path))
    assert len(adapter.pairs) == 35 and all(np.abs(p.b).max() > 0 for p in adapter.pairs.values())


# ------------------------------------------------------------------------------ the file
def test_adapter_file_has_llama_cpp_layout(stories, tmp_path):
    """convert_lora_to_gguf.py's keys, types and order; lora_a ne [n_in, r], lora_b ne [r, n_out]; F32."""
    path = lora.write_adapter(tmp_path / "a.gguf",
                              random_adapter(stories, rank=3, targets=r"attn_q|ffn_down|token_embd"))
    reader = gguf.GGUFReader(path)  # the gguf package's own reader, not ours
    fields = {f.name: f for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    convert = load_gguf(CONVERT_F16)
    assert list(fields) == list(convert.meta)  # the same keys in the same order
    assert [fields[k].types[0] for k in fields] == [convert.meta[k].type for k in convert.meta]
    ours = load_gguf(path)
    assert ours.get("general.type") == "adapter" and ours.get("adapter.type") == "lora"
    assert ours.get("general.architecture") == "llama" and ours.meta["adapter.lora.alpha"] == MetaValue(6.0, VT.FLOAT32)
    ne = {t.name: [int(v) for v in t.shape] for t in reader.tensors}
    assert ne["blk.0.attn_q.weight.lora_a"] == [64, 3] and ne["blk.0.attn_q.weight.lora_b"] == [3, 64]
    assert ne["blk.2.ffn_down.weight.lora_a"] == [172, 3] and ne["blk.2.ffn_down.weight.lora_b"] == [3, 64]
    # token_embd as llama.cpp's loader expects it: A and B flipped (lora_a ne [r, n_vocab], lora_b ne [r, n_embd])
    assert ne["token_embd.weight.lora_a"] == [3, 512] and ne["token_embd.weight.lora_b"] == [3, 64]
    assert {t.tensor_type for t in reader.tensors} == {QT.F32}
    names = [t.name for t in reader.tensors]
    assert names[:2] == ["token_embd.weight.lora_a", "token_embd.weight.lora_b"] and len(names) == 2 * 11


def test_convert_lora_to_gguf_file_round_trips(stories, tmp_path):
    """A file of llama.cpp's converter (F16): loaded, then written back byte for byte."""
    adapter = lora.load_adapter(CONVERT_F16, stories)
    assert adapter.alpha == 4.0 and adapter.ranks == {2} and len(adapter.pairs) == 15
    assert adapter.pairs["blk.0.ffn_down.weight"].a.shape == (2, 172)
    out = lora.write_adapter(tmp_path / "again.gguf", adapter)
    assert out.read_bytes() == CONVERT_F16.read_bytes()


def test_lora_init_continues_a_converted_adapter(stories_path, small_text, tmp_path, monkeypatch, capsys):
    out = tmp_path / "continued.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, small_text, "-o", out, "--ctx", 32,
                           "--batch", 128, "--epochs", 1, "--lr", 1e-2, "--lora-init", CONVERT_F16, "--val-split", 0.2)
    assert code == 0, err
    assert "LoRA adapter (rank 2, alpha 4, 15 matrices" in " ".join(err.split())
    src, got = load_gguf(CONVERT_F16), load_gguf(out)
    # the converter's keys in order, then the base it was trained on now (variant unknown: no llmtune.lora.*)
    assert list(got.meta)[: len(src.meta)] == list(src.meta) and got.get("general.name") == "Lora"
    assert list(got.meta)[len(src.meta):] == ["llmtune.base.name", "llmtune.base.file", "llmtune.base.tensors",
                                              "llmtune.base.sha256", "llmtune.base.head_count",
                                              "llmtune.base.head_count_kv"]
    assert lora.BaseFingerprint.read(got.meta) == lora.BaseFingerprint.of(load_gguf(stories_path))
    assert list(got.tensors) == list(src.tensors) and {t.type for t in got.tensors.values()} == {QT.F16}
    moved = [n for n in src.tensors if not np.array_equal(src.tensor(n), got.tensor(n))]
    assert len(moved) == len(src.tensors)


def test_lora_init_round_trip_of_our_own_adapter(stories_path, small_text, tmp_path):
    """Training 2 epochs = 1 epoch, then 1 more from the written adapter (--lora-init, no shuffle,
    plain SGD so no optimizer state is lost between the runs)."""
    kw = dict(ctx=32, batch=128, lr=5e-1, val_split=0.1, shuffle=False, optimizer="sgd")
    llmtune.finetune(stories_path, small_text, tmp_path / "two.gguf", epochs=2, lora_rank=4, **kw)
    llmtune.finetune(stories_path, small_text, tmp_path / "one.gguf", epochs=1, lora_rank=4, **kw)
    llmtune.finetune(stories_path, small_text, tmp_path / "one+one.gguf", epochs=1,
                     lora_init=str(tmp_path / "one.gguf"), **kw)
    two, resumed = load_gguf(tmp_path / "two.gguf"), load_gguf(tmp_path / "one+one.gguf")
    assert list(two.meta) == list(resumed.meta) and list(two.tensors) == list(resumed.tensors)
    for name in two.tensors:
        np.testing.assert_allclose(resumed.tensor(name), two.tensor(name), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ the base it was trained on
def test_the_base_fingerprint_is_as_documented(stories_path):
    """model/adapter/provenance.py's definition: sha256 over name, type, ne and the first 16 rows'
    stored bytes of token_embd, then output_norm; every tensor's name, ne and type listed."""
    gf = load_gguf(stories_path)
    digest = hashlib.sha256()
    for name in ("token_embd.weight", "output_norm.weight"):
        info = gf.tensors[name]
        ne = ",".join(map(str, reversed(info.shape)))
        digest.update(f"{name}\0F32\0{ne}\0".encode() + np.ascontiguousarray(info.raw[:16]).tobytes())
    fp = lora.BaseFingerprint.of(gf)
    assert fp.sha256 == digest.hexdigest() and (fp.name, fp.file) == ("llama", "stories260K.gguf")
    assert fp.tensors[:2] == ("token_embd.weight:64,512:F32", "output_norm.weight:64:F32")
    assert (fp.n_head, fp.n_head_kv) == (8, 4)  # the q/k row order in Hugging Face's layout (export --peft)
    assert len(fp.tensors) == len(gf.tensors) and lora.BaseFingerprint.read(fp.meta()) == fp


def test_finetune_writes_the_base_and_variant_and_info_shows_them(stories_path, small_text, tmp_path, monkeypatch,
                                                                  capsys):
    out = tmp_path / "rs.gguf"
    llmtune.finetune(stories_path, small_text, out, ctx=32, batch=128, epochs=1, lr=1e-2, lora_rank=4, lora_alpha=8,
                     rslora=True, lora_targets="attn_(q|v)")
    gf = load_gguf(out)
    assert gf.get("llmtune.lora.init") == "kaiming" and gf.get("llmtune.lora.rslora") is True
    assert lora.BaseFingerprint.read(gf.meta) == lora.BaseFingerprint.of(load_gguf(stories_path))
    keys = list(gf.meta)  # llama.cpp's keys first, as convert_lora_to_gguf.py writes them; ours after
    assert keys[:6] == list(load_gguf(CONVERT_F16).meta) and all(k.startswith("llmtune.") for k in keys[6:])
    code, text, err = run_cli(monkeypatch, capsys, "info", out)
    text = " ".join(text.split())
    assert code == 0, err
    for words in ("rank 4 lora_b's ne[0]", "alpha 16 adapter.lora.alpha; scale alpha / rank = 4",
                  "method rsLoRA, --lora-alpha 8 (scale alpha / sqrt(rank)", "targets attn_q, attn_v in blocks 0-4",
                  "10 matrices", "base llama (stories260K.gguf)", "base tensors 48, mostly F32",
                  f"base fingerprint {gf.get('llmtune.base.sha256')[:12]}"):
        assert words in text, words


@pytest.mark.parametrize("init, rslora, words", [
    ("kaiming", False, "method LoRA, --lora-alpha 8 llmtune.lora.init"),
    ("gaussian", False, "method LoRA (gaussian init), --lora-alpha 8"),
    ("pissa", True, "method PiSSA + rsLoRA, --lora-alpha 8 (scale alpha / sqrt(rank)"),
    (None, False, "method LoRA no llmtune.lora.init (variant unknown"),
])
def test_info_names_the_variant(init, rslora, words, stories, tmp_path, monkeypatch, capsys):
    adapter = lora.init_adapter(stories, 4, 8.0, r"attn_q", method=init or "kaiming", rslora=rslora)
    if init == "pissa":
        lora.pissa_init(stories, adapter)
    out = lora.write_adapter(tmp_path / "a.gguf", adapter, base=stories.gguf if init else None)
    code, text, err = run_cli(monkeypatch, capsys, "info", out)
    text = " ".join(text.split())
    assert code == 0 and words in text, text
    assert ("rank 8 (PiSSA" in text) == (init == "pissa")
    assert ("base unknown no llmtune.base.*" in text) == (init is None)


@pytest.fixture(scope="module")
def other_bases(stories_path, tmp_path_factory):
    """Bases an adapter of stories260K may meet: its Q8_0 export, a copy with other weights, another model."""
    folder = tmp_path_factory.mktemp("bases")
    gf = load_gguf(stories_path)
    tuned = write_gguf(folder / "tuned.gguf", "llama", dict(gf.meta),
                       [(n, gf.tensor(n) * np.float32(1.5 if n == "output_norm.weight" else 1), QT.F32)
                        for n in gf.tensors])
    llmtune.export(stories_path, folder / "q8.gguf", "q8_0")
    return {"q8": folder / "q8.gguf", "tuned": tuned,
            "tiny": init_model(REPO / "configs" / "llama-tiny.toml", stories_path, folder / "tiny.gguf", seed=1)}


def test_an_adapter_on_another_copy_of_its_base_warns_naming_both(stories, stories_path, other_bases, tmp_path,
                                                                  wiki_text, monkeypatch, capsys):
    ours = lora.write_adapter(tmp_path / "ours.gguf", random_adapter(stories, targets="attn_q"), base=stories.gguf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own base, and an adapter without a fingerprint: not a word
        lora.load_adapter(ours, stories)
        lora.load_adapter(CONVERT_F16, load_model(other_bases["q8"]))
    trained = f"ours.gguf was trained on base 'llama' (stories260K.gguf, fingerprint {stories_fp(stories)})"
    with pytest.warns(LlmtuneWarning, match=r"stored as Q8_0 where the adapter's base was F32, a requantized copy") \
            as caught:
        lora.load_adapter(ours, load_model(other_bases["q8"]))
    assert trained in str(caught[0].message) and "q8.gguf is 'llama' (q8.gguf, fingerprint" in str(caught[0].message)
    with pytest.warns(LlmtuneWarning, match=r"the same tensor shapes and types with other weights"):
        lora.load_adapter(ours, load_model(other_bases["tuned"]))
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", other_bases["q8"], wiki_text, "--ctx", 64, "--chunks", 1,
                           "--lora", ours)
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert code == 0 and len(lines) == 1 and f"--lora {ours}: {trained}" in " ".join(err.split()), err


def test_an_adapter_for_another_model_names_its_base(stories, stories_path, other_bases, small_text, tmp_path,
                                                     monkeypatch, capsys):
    tiny = load_model(other_bases["tiny"])
    both = lora.write_adapter(tmp_path / "both.gguf", random_adapter(tiny, targets="attn_q|ffn_down"), base=tiny.gguf)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, small_text, "--lora-init", both, "-o",
                           tmp_path / "x.gguf", "--ctx", 32)
    line = " ".join(err.split())
    assert code == 2 and err.count("error:") == 1 and "blk.0.ffn_down.weight has the wrong shape" in line, err
    assert "both.gguf was trained on base 'llama-tiny' (tiny.gguf, fingerprint" in line
    assert "stories260K.gguf is 'llama'" in line and "another model (blk.0.ffn_gate.weight is ne [64, 96] there" in line
    fits = lora.write_adapter(tmp_path / "fits.gguf", random_adapter(tiny, targets="attn_q"), base=tiny.gguf)
    with pytest.warns(LlmtuneWarning, match=r"fits.gguf was trained on base 'llama-tiny' .* another model .* its "
                                            r"matrices fit this one's, so it is applied"):
        lora.load_adapter(fits, stories)


def stories_fp(model) -> str:
    return lora.BaseFingerprint.of(model.gguf).sha256[:12]


# ------------------------------------------------------------------------------ merge and perplexity
def test_export_merges_the_adapter(stories_path, stories, fixture_adapter, wiki_text, tmp_path, monkeypatch, capsys):
    merged = tmp_path / "merged.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "export", stories_path, "--lora", fixture_adapter, "--type", "f32",
                           "-o", merged)
    assert code == 0, err
    gf, adapter = load_gguf(merged), lora.load_adapter(fixture_adapter, stories)
    for name in stories.weights:
        want = stories.weights[name] + adapter.delta(name) if name in adapter.pairs else stories.weights[name]
        np.testing.assert_allclose(gf.tensor(name), want, rtol=0, atol=1e-6)
    applied = llmtune.perplexity(stories_path, wiki_text, ctx=64, chunks=4, lora=fixture_adapter).chunks
    np.testing.assert_allclose(llmtune.perplexity(merged, wiki_text, ctx=64, chunks=4).chunks, applied, rtol=1e-5)
    q8 = tmp_path / "merged-q8.gguf"  # one command from adapter to a quantized file
    llmtune.export(stories_path, q8, "q8_0", lora=fixture_adapter, lora_scale=0.5)
    assert load_gguf(q8).tensors["blk.0.attn_q.weight"].type == QT.Q8_0


def test_perplexity_matches_recorded_llama_cpp(stories_path, stories, fixture_adapter, wiki_text, monkeypatch, capsys):
    """llama-perplexity --lora on stories260K (bench/check_lora.py --record): every running value within 1e-3."""
    rec = json.loads(RECORDED.read_text())
    assert hashlib.sha256(fixture_adapter.read_bytes()).hexdigest() == rec["adapter_sha256"]
    ours = llmtune.perplexity(stories_path, wiki_text, ctx=rec["ctx"], chunks=rec["chunks"],
                              lora=fixture_adapter).chunks
    theirs = rec["running_ppl"]["alone"]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) < 1e-3
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, wiki_text, "--ctx", rec["ctx"],
                             "--chunks",
                             rec["chunks"], "--lora", fixture_adapter, "--lora", CONVERT_F16, "--lora-scale", 1,
                             "--lora-scale", 0.5)
    assert code == 0, err
    both = [float(v) for v in __import__("re").findall(r"\[\d+\]([0-9.]+)", out)]
    theirs = rec["running_ppl"]["with_convert_f16_at_0.5"]
    assert len(both) == len(theirs) and max(abs(a - b) / b for a, b in zip(both, theirs)) < 1e-3


# ------------------------------------------------------------------------------ bad input
def _rewrite(src, out, meta_update=None, rename=None, reshape=None, drop=None):
    gf = load_gguf(src)
    meta = dict(gf.meta)
    meta.update(meta_update or {})
    tensors = []
    for name, info in gf.tensors.items():
        if name == drop:
            continue
        data = gf.tensor(name)
        if reshape and name == reshape[0]:
            data = np.zeros(reshape[1], np.float32)
        tensors.append(((rename or {}).get(name, name), data, QT.F32))
    return write_gguf(out, meta.get("general.architecture", MetaValue("llama", VT.STRING)).value, meta, tensors)


@pytest.fixture()
def bad_adapters(fixture_adapter, tmp_path):
    a = "blk.0.attn_q.weight.lora_a"
    return {
        "architecture": (_rewrite(fixture_adapter, tmp_path / "arch.gguf",
                                  {"general.architecture": MetaValue("qwen2", VT.STRING)}), "architecture 'qwen2'"),
        "name": (_rewrite(fixture_adapter, tmp_path / "name.gguf", rename={a: "blk.9.attn_q.weight.lora_a",
                          "blk.0.attn_q.weight.lora_b": "blk.9.attn_q.weight.lora_b"}), "does not have"),
        "shape": (_rewrite(fixture_adapter, tmp_path / "shape.gguf", reshape=(a, (4, 32))), "wrong shape"),
        "half": (_rewrite(fixture_adapter, tmp_path / "half.gguf", drop=a), "lacks its lora_a half"),
        "suffix": (_rewrite(fixture_adapter, tmp_path / "suffix.gguf", rename={a: "blk.0.attn_q.weight.lora_x"}),
                   "neither a .lora_a nor a .lora_b"),
        "type": (_rewrite(fixture_adapter, tmp_path / "type.gguf", {"general.type": MetaValue("model", VT.STRING)}),
                 "not a LoRA adapter (general.type is 'model'"),
        "norm": (_rewrite(fixture_adapter, tmp_path / "norm.gguf", rename={
            a: "blk.0.attn_norm.weight.lora_a", "blk.0.attn_q.weight.lora_b": "blk.0.attn_norm.weight.lora_b"}),
            "takes no adapter"),
    }


@pytest.mark.parametrize("kind", ["architecture", "name", "shape", "half", "suffix", "type", "norm"])
def test_bad_adapter_is_one_line_naming_the_file(kind, bad_adapters, stories_path, wiki_text, tmp_path, monkeypatch,
                                                 capsys):
    path, words = bad_adapters[kind]
    for args in (["perplexity", stories_path, wiki_text, "--ctx", 64, "--chunks", 1, "--lora", path],
                 ["export", stories_path, "--lora", path, "--type", "f32", "-o", tmp_path / "m.gguf"],
                 ["finetune", stories_path, wiki_text, "--lora-init", path, "-o", tmp_path / "x.gguf", "--ctx", 32]):
        code, out, err = run_cli(monkeypatch, capsys, *args)
        flag = "--lora-init" if args[0] == "finetune" else "--lora"
        line = " ".join(err.split())
        assert code == 2 and err.count("error:") == 1 and f"{flag} {path}" in line and words in line, (args[0], err)
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "x.gguf").exists()


def test_a_model_file_given_as_adapter(stories_path, wiki_text, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, wiki_text, "--lora", stories_path)
    assert code == 2 and "not a LoRA adapter (it has no general.type" in " ".join(err.split())


@pytest.mark.parametrize("args, words", [
    (["--lora-rank", 0], "--lora-rank: must be at least 1"),
    (["--lora-rank", -3], "--lora-rank: must be at least 1"),
    (["--lora-rank", 33], "--lora-rank: 33 is larger than blk.0.attn_k.weight allows (32 x 64: at most 32)"),
    (["--lora-rank", 4, "--lora-targets", "norm"], "matches no matrix of stories260K.gguf that takes an adapter"),
    (["--lora-rank", 4, "--lora-targets", "("], "--lora-targets: invalid regular expression"),
    (["--lora-rank", 4, "--params", "attn"], "--params: LoRA trains only adapters"),
    (["--lora-rank", 4, "--lora-dropout", 1.0], "--lora-dropout: must be in [0, 1)"),
    (["--lora-alpha", 8], "--lora-alpha: needs --lora-rank"),
    (["--lora-rank", 4, "--lora-alpha", -1], "--lora-alpha: must be >= 0"),
    (["--lora-rank", 3, "--lora-init", CONVERT_F16], "--lora-rank: 3 differs from --lora-init"),
    (["--lora-init", CONVERT_F16, "--lora-targets", "attn"], "--lora-targets: --lora-init's adapter fixes"),
])
def test_bad_lora_flags(args, words, stories_path, small_text, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, small_text, "-o", tmp_path / "o.gguf",
                           "--ctx", 32, *args)
    assert code == 2 and err.count("error:") == 1 and words in " ".join(err.split()), err


def test_lora_scale_count_must_match(stories_path, fixture_adapter, wiki_text, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, wiki_text, "--lora", fixture_adapter,
                           "--lora-scale", 1, "--lora-scale", 2)
    assert code == 2 and "--lora-scale: give one value, or one per --lora" in " ".join(err.split())
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", stories_path, wiki_text, "--lora-scale", 2)
    assert code == 2 and "--lora-scale: needs --lora" in err
    code, _, err = run_cli(monkeypatch, capsys, "export", stories_path, "--lora-scale", 2, "--type", "f32", "-o",
                           fixture_adapter.parent / "never.gguf")
    assert code == 2 and "--lora-scale: needs --lora" in err and not (fixture_adapter.parent / "never.gguf").exists()


def test_an_adapter_given_as_the_model(stories_path, fixture_adapter, wiki_text, tmp_path, monkeypatch, capsys):
    for args, flag in ((["perplexity", fixture_adapter, wiki_text], "--lora"),
                       (["export", fixture_adapter, "--type", "f16", "-o", tmp_path / "o.gguf"], "--lora"),
                       (["finetune", fixture_adapter, wiki_text, "--lora-rank", 4, "-o", tmp_path / "o.gguf"],
                        "--lora-init")):  # each command's own flag for an adapter (finetune has no --lora)
        code, _, err = run_cli(monkeypatch, capsys, *args)
        words = " ".join(err.split()) + " "
        assert code == 2 and "is a LoRA adapter, not a model" in words and f" {flag} " in words, err
        assert args[0] != "finetune" or "--lora " not in words, err
    code, out, _ = run_cli(monkeypatch, capsys, "info", fixture_adapter)
    assert code == 0 and "a LoRA adapter (lora): apply it to a llama model with --lora" in " ".join(out.split())


def test_tied_output_refuses_a_token_embd_adapter(tmp_path, stories_path):
    """llama.cpp would apply a token_embd pair to the tied output matmul too (and fail): refused."""

    config = tmp_path / "tied.toml"
    config.write_text('[model]\narchitecture = "llama"\nn_embd = 32\nn_layer = 1\nn_head = 4\nn_ff = 48\n'
                      'tied_output = true\n')
    model = load_model(init_model(config, stories_path, tmp_path / "tied.gguf"))
    assert "token_embd.weight" not in lora.adaptable(model)
    with pytest.raises(LlmtuneError, match="tied; llama.cpp cannot apply"):
        lora.select_targets(model, "token_embd", 4)
    assert lora.select_targets(model, "weight$", 4)[0] == "blk.0.attn_q.weight"


def test_every_family_takes_adapters(tmp_path):
    """A random model of every family: its fused/plain attention and FFN matrices are targets, and a
    random adapter applied in the graph equals the merged weights."""

    spec = importlib.util.spec_from_file_location("check_families", REPO / "bench" / "check_families.py")
    check_families = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_families", check_families)
    spec.loader.exec_module(check_families)  # the families bench/check_lora.py checks against llama.cpp
    done = []
    for name, case in check_families.FAMILIES.items():
        try:
            model = load_model(check_families.random_model(case, tmp_path / f"{name}.gguf"))
        except Exception:  # a family being added right now may not load yet
            continue
        adapter = random_adapter(model, rank=2, b_std=0.02)
        kinds = {n.split(".")[2] for n in adapter.pairs}
        assert kinds & {"attn_q", "attn_qkv"} and kinds & {"ffn_up"} and "attn_output" in kinds, (name, kinds)
        tokens = np.random.default_rng(0).integers(0, model.hp.n_vocab, (1, 8)).astype(np.int32)
        adapted = with_adapters(model, adapter)
        merged = dataclasses.replace(model, weights={n: lora.merged_weight(adapted, n) for n in model.weights})
        np.testing.assert_allclose(logits_of(adapted, tokens), logits_of(merged, tokens), rtol=0, atol=1e-4,
                                   err_msg=name)
        done.append(name)
    assert "llama" in done and len(done) >= 3


def test_lora_training_on_the_cuda_backend_matches_cpu(stories, wikitext_ids):
    """The CUDA backend's kernels (under tests/cuda_emu.py's CPU emulator): two LoRA steps with
    dropout, token_embd and output adapters give the CPU's adapter."""

    if not cuda_emu.available():
        pytest.skip("no C++ compiler for the CUDA kernel emulator")
    results = []
    for be in (CPUBackend(), CUDABackend(np.float32, runtime=cuda_emu.EmuRuntime())):
        adapter = lora.init_adapter(stories, 2, 4.0, r"attn_q|ffn_down|token_embd|output", seed=0)
        tr = Trainer(lora.attach(stories, [adapter]), be, n_ctx=16, n_batch=32, n_ubatch=16,
                     trainable=list(adapter.tensors()), lora_dropout=0.1, seed=1, workers=1)
        x = wikitext_ids[:34].reshape(2, 17)
        for _ in range(2):
            tr.train_step(x[:, :-1], x[:, 1:], 1e-2, RunningStats())
        results.append(np.concatenate([w.ravel() for w in tr.trained_weights().values()]))
    assert np.abs(results[0]).max() > 1.0
    np.testing.assert_allclose(results[1], results[0], rtol=0, atol=1e-5 * np.abs(results[0]).max())
