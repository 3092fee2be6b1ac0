"""Frozen weights kept in their file type: loading, evaluation, LoRA on a quantized base (QLoRA),
full finetunes of a quantized file, and the memory estimate. The kernels themselves are tested
per type and backend in test_backends.py (test_stored_weight_*)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import llmtune
from llmtune.backends.cpu import CPUBackend, backend as cpu_backend, products as qm
from llmtune.backends.cpu.native import kernels
from llmtune.eval.perplexity import perplexity_from_ids
from llmtune.model.adapter import attach, init_adapter
from llmtune.model.loaded import load_model
from llmtune.quant import qtensor
from llmtune.quant.blocks import quantize
from llmtune.quant.qtensor import QTensor, evaluation_budget, float_copy_bytes, training_budget
from llmtune.train.trainer import RunningStats, Trainer
from test_backends import backend_for


@pytest.fixture(scope="module")
def exports(tmp_path_factory, stories_path):
    """stories260K exported to q8_0, q4_k_m (Q5_0 / Q8_0 / F16 at its 64-wide shape) and q4_1."""
    out = tmp_path_factory.mktemp("qexports")
    return {t: llmtune.export(stories_path, out / f"stories-{t}.gguf", t).out_path for t in ("q8_0", "q4_k_m", "q4_1")}


def test_quantized_matrices_stay_views_of_the_file(exports):
    model = load_model(exports["q4_k_m"])
    kept = {n: w for n, w in model.weights.items() if isinstance(w, QTensor)}
    assert {w.qtype for w in kept.values()} >= {"Q5_0", "Q8_0"}
    for name, w in kept.items():
        info = model.gguf.tensors[name]
        assert w.shape == info.shape and w.nbytes == info.n_bytes
        assert np.shares_memory(w.raw, model.gguf._mm)  # no copy: the memory map itself
    assert all(w.ndim == 1 and w.dtype == np.float32 for n, w in model.weights.items() if n not in kept)
    name = "blk.0.attn_q.weight"
    np.testing.assert_array_equal(np.asarray(kept[name]), model.gguf.tensor(name))
    decoded = load_model(exports["q4_k_m"], quantized=False)
    assert not any(isinstance(w, QTensor) for w in decoded.weights.values())


def test_perplexity_rounds_activations(exports, wikitext_ids):
    """Quantized files are evaluated as llama.cpp evaluates them (activations rounded per type);
    the decoded file (plain float32 products) is close but not the same."""
    ids = wikitext_ids[: 128 * 6]
    for path in exports.values():
        kept = perplexity_from_ids(load_model(path), ids, ctx=128)
        plain = perplexity_from_ids(load_model(path, quantized=False), ids, ctx=128)
        assert kept.ppl != plain.ppl
        assert abs(kept.ppl - plain.ppl) / plain.ppl < 2e-2


def _windows(ids, n, ctx=64):
    x = np.stack([ids[i * ctx:(i + 1) * ctx] for i in range(n)])
    y = np.stack([ids[i * ctx + 1:(i + 1) * ctx + 1] for i in range(n)])
    return x, y


def test_lora_on_a_quantized_base(exports, wikitext_ids):
    """QLoRA: the base stays as its file's bytes (the trainer binds the memory map itself and
    counts it as stored), only the adapters train, and the loss follows the decoded model's."""

    model = load_model(exports["q8_0"])
    adapter = init_adapter(model, 4, seed=0)
    adapted = attach(model, [adapter])
    tr = Trainer(adapted, CPUBackend(), n_ctx=64, n_batch=128, n_ubatch=64, trainable=list(adapter.tensors()))
    for name, w in model.weights.items():
        if isinstance(w, QTensor):
            raw = tr.values[name].raw  # bound with the float copies it may keep (test_qlora_float_copies_*)
            assert raw.dtype == np.uint8 and np.shares_memory(raw, model.gguf._mm)
    types = tr.base_types()
    # as stored, but for the matrices multiplied through packed copies (their file pages go back)
    stored = sum(w.nbytes for n, w in model.weights.items() if isinstance(w, QTensor) and n not in tr._packed_names)
    assert types.get("Q8_0", 0) + types.get("F16", 0) == stored
    assert tr.memory_bytes()["base"] == sum(types.values()) < 4 * model.n_params() / 2
    x, y = _windows(wikitext_ids, 2)
    stats = RunningStats()
    losses = [tr.train_step(x, y, 1e-2, stats) for _ in range(3)]
    assert losses[-1] < losses[0]

    decoded = attach(load_model(exports["q8_0"], quantized=False), [adapter])
    ref = Trainer(decoded, CPUBackend(), n_ctx=64, n_batch=128, n_ubatch=64, trainable=list(adapter.tensors()))
    first = ref.train_step(x, y, 1e-2, RunningStats())
    assert abs(first - losses[0]) / first < 1e-2


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m", "q4_1"])
def test_qlora_float_copies_change_no_bit(qtype, exports, wikitext_ids):
    """QLoRA keeps float32 copies of the frozen quantized matrices when they fit (each forward and
    backward then skips the per-block decode) and counts them in the memory estimate; losses and
    gradients are those of the run that decodes every product, bit for bit (the same products
    over the same row blocks; these matrices fit one block). Where this build has the compiled
    product, packed copies replace the float copies (FloatCopies.stored_pack); those change the
    summation order (tests/test_packed_products.py), so here they are turned off after the
    estimate and the float copies given their budget, as a build without them keeps them."""

    model = load_model(exports[qtype])
    adapter = init_adapter(model, 4, seed=0)
    x, y = _windows(wikitext_ids, 2)
    runs = []
    for keep in (True, False):
        tr = Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=64, n_batch=128, n_ubatch=64,
                     trainable=list(adapter.tensors()), workers=1)
        multiplied = {n: w for n, w in model.weights.items() if n != "token_embd.weight"}  # only looked up
        dense = float_copy_bytes(multiplied)
        quantized = [w for w in multiplied.values() if isinstance(w, QTensor)]
        packs = sum(tr.float_copies.packed_bytes(w.shape) for w in quantized) if tr.float_copies.packing() else 0
        if keep:
            memory = tr.memory_bytes()
            if packs:  # the packed forms instead of the float copies
                assert "float copies" not in memory and memory["packed copies"] == packs > dense > 0
                assert tr.float_copies.budget == packs
                tr.float_copies.pack, tr.float_copies.budget = False, dense
            else:
                assert memory["float copies"] == dense > 0 and "packed copies" not in memory
                assert tr.float_copies.budget == dense
        else:
            tr.float_copies.pack = False
            tr.float_copies.budget = 0
            assert "float copies" not in tr.memory_bytes()
        losses, grads = [], []
        for _ in range(3):
            losses.append(tr.train_step(x, y, 1e-2, RunningStats()))
            grads.append(np.array(tr.flat_g))
        assert tr.float_copies.used == (dense if keep else 0)
        runs.append((losses, grads, np.array(tr.flat_w)))
    (l1, g1, w1), (l0, g0, w0) = runs
    assert l1 == l0 and len(set(l1)) == 3
    for a, b in zip(g1, g0):
        np.testing.assert_array_equal(a, b)
    assert np.abs(g1[0]).max() > 0
    np.testing.assert_array_equal(w1, w0)


def test_float_copies_follow_the_memory_left(exports, wikitext_ids, monkeypatch):
    """The copies' budget is half of what the run leaves free, none when memory is unknown."""

    model = load_model(exports["q8_0"])
    dense = float_copy_bytes(model.weights)
    assert training_budget(model.weights, 1000, None) == 0
    assert training_budget(model.weights, 1000, 1000 + 2 * dense) == dense
    assert training_budget(model.weights, 1000, 1000 + dense) == dense // 2
    adapter = init_adapter(model, 4, seed=0)
    tr = Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=64, n_batch=64, n_ubatch=64,
                 trainable=list(adapter.tensors()), workers=1)
    need = sum(v for k, v in tr.memory_bytes().items() if k not in ("float copies", "packed copies"))
    # free memory for half of them (and no packed copies); a memory limit that binds is the whole
    # process's budget instead (tests/test_memory_limit.py)
    monkeypatch.setattr("llmtune.resources._host_available", lambda: need + dense)
    tr = Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=64, n_batch=64, n_ubatch=64,
                 trainable=list(adapter.tensors()), workers=1)
    assert 0 < tr.memory_bytes()["float copies"] <= dense // 2 + 1 and "packed copies" not in tr.memory_bytes()


@pytest.mark.parametrize("packing", [True, False])
def test_a_build_without_the_packed_product_keeps_float_copies(exports, monkeypatch, packing):
    """QLoRA's frozen matrices: packed copies where the compiled product is built, else float32
    copies (numpy's products then skip the per-block decode). A build without it used to plan
    packed copies of 0 bytes and keep neither."""

    if packing and not kernels.pack_wt_available():
        pytest.skip("this build has no packed product")
    monkeypatch.setattr(kernels, "pack_wt_available", lambda: packing)
    if not packing:
        monkeypatch.setattr(kernels, "pack_wt_bytes", lambda shape, transposed=False: 0)  # as such a build says
    model = load_model(exports["q8_0"])
    adapter = init_adapter(model, 4, seed=0)
    tr = Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=64, n_batch=64, n_ubatch=64,
                 trainable=list(adapter.tensors()))
    kept = {k for k in tr.memory_bytes() if k.endswith("copies")}
    assert kept == ({"packed copies"} if packing else {"float copies"})
    assert tr.base_products() == ("packed" if packing else "blas")


def test_evaluation_copies_follow_the_decoder_and_the_model_size(exports, monkeypatch):
    """An evaluation keeps no float copies where the compiled decoders run (its peak stays near
    the file's size), else at most the stored size (and a quarter of the free memory)."""

    model = load_model(exports["q4_k_m"])
    stored = sum(w.nbytes for w in model.weights.values() if isinstance(w, QTensor))
    monkeypatch.setattr(kernels, "dequantize_available", lambda: True)
    assert evaluation_budget(model.weights, compiled_decoders=True) == 0
    assert CPUBackend().bind(model, float_copies=True).float_copies is None
    monkeypatch.setattr(kernels, "dequantize_available", lambda: False)
    assert evaluation_budget(model.weights, False) == min(stored, float_copy_bytes(model.weights)) == stored > 0
    assert CPUBackend().bind(model, float_copies=True).float_copies.budget == stored
    monkeypatch.setenv("LLMTUNE_MEMORY_LIMIT", str(stored))
    assert evaluation_budget(model.weights, False) == stored // 4


def test_full_finetune_of_a_quantized_file(exports, wiki100k_path, tmp_path):
    """Trained matrices of a quantized file become float32 master weights, written as F32 (the
    output policy: re-quantizing would round the training away), and --out-type q8_0 stores them
    back in the file's type; the frozen ones stay as stored."""

    model = load_model(exports["q8_0"])
    trainable = model.select("attn_q")
    tr = Trainer(model, CPUBackend(), n_ctx=64, n_batch=64, n_ubatch=64, trainable=trainable)
    assert all(tr.values[n].dtype == np.float32 for n in trainable)
    assert tr.values["blk.0.attn_k.weight"].raw.dtype == np.uint8  # with the float copies it may keep
    assert "F32" in tr.base_types() and "Q8_0" in tr.base_types()
    x, y = _windows(np.arange(1, 200, dtype=np.int32) % 500, 1)
    tr.train_step(x, y, 1e-3, RunningStats())
    moved = tr.trained_weights()["blk.0.attn_q.weight"] - np.asarray(model.weights["blk.0.attn_q.weight"])
    assert np.abs(moved).max() > 0
    out, text = tmp_path / "tuned.gguf", tmp_path / "text.txt"
    text.write_text(wiki100k_path.read_text()[:3000])
    llmtune.finetune(exports["q8_0"], text, out, ctx=64, batch=64, epochs=1, lr=1e-4, params="attn_q", val_split=0.5)
    types = {n: getattr(w, "qtype", "F32") for n, w in model.weights.items()}
    written = {n: getattr(w, "qtype", "F32") for n, w in load_model(out).weights.items()}
    assert written == {n: "F32" if n in trainable else t for n, t in types.items()}
    llmtune.finetune(exports["q8_0"], text, tmp_path / "q8.gguf", ctx=64, batch=64, epochs=1, lr=1e-4, params="attn_q",
                     val_split=0.5, out_type="q8_0")
    assert {n: getattr(w, "qtype", "F32") for n, w in load_model(tmp_path / "q8.gguf").weights.items()} == types


@pytest.mark.parametrize("name", ["cuda-emu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_lora_on_a_quantized_base_matches_cpu(name, exports, wikitext_ids):
    """The CUDA backend's stored-weight kernels inside a real QLoRA step (token lookup from a Q8_0
    table, rounded products, input gradients): losses and adapter updates as on the CPU."""

    model = load_model(exports["q4_k_m"])
    adapter = init_adapter(model, 2, targets=r"blk\.1\.(attn_q|ffn_down)", seed=0)
    adapted = attach(model, [adapter])
    x, y = _windows(wikitext_ids, 1, ctx=32)
    results = {}
    for be_name in ("cpu", name):
        tr = Trainer(adapted, backend_for(be_name), n_ctx=32, n_batch=32, n_ubatch=32,
                     trainable=list(adapter.tensors()), optimizer="sgd")
        losses = [tr.train_step(x, y, 0.5, RunningStats()) for _ in range(2)]
        results[be_name] = losses, tr.trained_weights()
    (cpu_losses, cpu_w), (losses, w) = results["cpu"], results[name]
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
    for k, w0 in adapter.tensors().items():
        np.testing.assert_allclose(w[k] - w0, cpu_w[k] - w0, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_decoded_copies_give_the_stored_products(qtype):
    """With a FloatCopies a product reads a float32 copy of the weight (made once, within the
    budget) and gives the stored path's numbers; a matrix over the budget keeps the stored path;
    the copies belong to the FloatCopies (the bound weights), nothing is kept without one."""


    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(w, QT[qtype])).view(np.uint8).reshape(96, -1)
    x = rng.standard_normal((24, 256)).astype(np.float32)  # more rows than the compiled product takes
    stored = qm.qlinear(np.empty((24, 96), np.float32), x, raw, qtype)
    cache = qm.FloatCopies(96 * 256 * 4)
    cached = qm.qlinear(np.empty((24, 96), np.float32), x, raw, qtype, copies=cache)
    again = qm.qlinear(np.empty((24, 96), np.float32), x, raw, qtype, copies=cache)
    assert cache.used == 96 * 256 * 4 and len(cache.arrays) == 1
    small = raw[:48]  # another matrix: the budget is spent, so it takes the stored path
    qm.qlinear(np.empty((24, 48), np.float32), x, small, qtype, copies=cache)
    assert len(cache.arrays) == 1
    np.testing.assert_allclose(cached, stored, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(again, cached)


def test_evaluation_keeps_decoded_copies_and_the_numbers(exports, wikitext_ids, monkeypatch):
    """perplexity on a quantized file, with a budget for every copy, decodes each matrix once (not
    per pass) with the same numbers; with none (the default where the compiled decoders run,
    test_evaluation_copies_follow_*) it decodes per product."""

    monkeypatch.setattr(cpu_backend, "evaluation_budget", lambda tensors, compiled: qtensor.float_copy_bytes(tensors))
    model = load_model(exports["q8_0"])
    decodes = []
    real = qm.dequantize_rows
    monkeypatch.setattr(qm, "dequantize_rows", lambda *a: decodes.append(1) or real(*a))
    cached = perplexity_from_ids(model, wikitext_ids, ctx=64, batch=64, chunks=6, workers=1)
    n_cached = len(decodes)
    monkeypatch.setattr(cpu_backend, "evaluation_budget", lambda tensors, compiled: 0)
    decodes.clear()
    stored = perplexity_from_ids(model, wikitext_ids, ctx=64, batch=64, chunks=6, workers=1)
    n_matrices = sum(isinstance(w, QTensor) for w in model.weights.values())
    assert n_cached <= n_matrices + 6 < len(decodes)  # + at most one embedding row lookup per chunk
    np.testing.assert_allclose(cached.chunks, stored.chunks, rtol=1e-6)
