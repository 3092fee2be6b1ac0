"""LoRA variants (--rslora, --dora, --lora-plus, --lora-init-method gaussian|pissa) against float64
numpy transcriptions of PEFT's formulas; bench/check_lora.py --peft checks them against PEFT itself."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

import cuda_emu
import llmtune
from cli_helpers import run_cli
from llmtune.arch.context import Batch, BuildContext
from llmtune.backends.cpu import CPUBackend
from llmtune.backends.cuda import CUDABackend
from llmtune.gguf.file import load_gguf
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import Program
from llmtune.model import adapter as lora
from llmtune.model.loaded import load_model
from llmtune.train import checkpoint as ckpts
from llmtune.train.config import make_config
from llmtune.train.finetune import lr_factors
from llmtune.train.trainer import RunningStats, Trainer
from test_lora import CONVERT_F16, _one_blas_thread, small_text, stories  # noqa: F401 - the same fixtures

# ------------------------------------------------------------------------------ one adapted matrix
N_OUT, N_IN, R, T = 5, 7, 3, 4
rng = np.random.default_rng(11)
W, X, RW = rng.standard_normal((N_OUT, N_IN)), rng.standard_normal((T, N_IN)), rng.standard_normal((T, N_OUT))
A0, B0, M0 = rng.standard_normal((R, N_IN)) * 0.5, rng.standard_normal((N_OUT, R)) * 0.5, rng.uniform(1, 3, N_OUT)
MASK = (rng.random((T, N_IN)) > 0.3) / 0.7


def _graph_values(s: float, dora: bool, dropout: bool, a=A0, b=B0, m=M0):
    """sum(R * y) and its gradients wrt A, B (and m) for y = BuildContext.mm(x, "w") with one
    adapter term, in float64 on the cpu backend."""
    nodes = {"w.weight": ops.param(W.shape, "w.weight", requires_grad=False)}
    a_n, b_n = ops.param(a.shape, "a"), ops.param(b.shape, "b")
    m_n = ops.param(m.shape, "m") if dora else None
    x, r = ops.input(X.shape, name="x"), ops.input(RW.shape, name="r")
    term = lora.LoraTerm(a_n, b_n, s, "t", m_n, nodes["w.weight"] if dora else None)
    graph = lora.LoraGraph({"w.weight": [term]}, 0.5 if dropout else 0.0)
    ctx = BuildContext(None, nodes, Batch.make(1, T), lora=graph)
    loss = ops.sum_to(ops.mul(ctx.mm(x, "w"), r), ())
    wrt = [a_n, b_n] + ([m_n] if dora else [])
    grads = grad(loss, wrt)
    values = {nodes["w.weight"]: W, a_n: a, b_n: b, **({m_n: m} if dora else {})}
    prog = Program([loss] + [grads[n] for n in wrt], CPUBackend(np.float64), params=values)
    feed = {"x": X, "r": RW, **({"t.dropout": MASK} if dropout else {})}
    return [np.array(v, dtype=np.float64) for v in prog.run(**feed)]


def _reference(s: float, a, b, m=None, dropout=False, norm_from=None):
    """PEFT's lora.Linear forward in float64 -> sum(R * y); DoRA (m given): DoraLinearLayer's
    (g - 1) base(xd) + g s B A xd on top of base(x), g = m / ||W + s B A||_row, the norm taken
    from `norm_from` (A, B) when given: the detached norm as a constant."""
    xd = X * MASK if dropout else X
    base, term = X @ W.T, s * (xd @ a.T) @ b.T
    if m is None:
        return float((RW * (base + term)).sum())
    na, nb = norm_from or (a, b)
    g = m / np.linalg.norm(W + s * nb @ na, axis=1)
    return float((RW * (base + (g - 1) * (xd @ W.T) + g * term)).sum())


def _reference_grads(s, a, b, m=None, dropout=False):
    """The analytic gradients of _reference (the norm detached)."""
    xd = X * MASK if dropout else X
    if m is None:
        gy = RW
    else:
        norm = np.linalg.norm(W + s * b @ a, axis=1)
        gy = RW * (m / norm)
    grads = [s * (gy @ b).T @ xd, s * gy.T @ (xd @ a.T)]
    if m is not None:
        grads.append(((RW * (xd @ W.T + s * (xd @ a.T) @ b.T)).sum(axis=0)) / norm)
    return grads


def _numeric_grads(f, arrays, eps=1e-6):
    out = []
    for arr in arrays:
        g = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            orig = arr[idx]
            arr[idx] = orig + eps
            up = f()
            arr[idx] = orig - eps
            g[idx] = (up - f()) / (2 * eps)
            arr[idx] = orig
        out.append(g)
    return out


@pytest.mark.parametrize("variant", ["lora", "rslora", "dora", "dora+dropout"])
def test_forward_and_gradients_equal_the_float64_reference(variant):
    alpha = 6.0
    s = alpha / np.sqrt(R) if variant == "rslora" else alpha / R
    dora, dropout = variant.startswith("dora"), variant.endswith("dropout")
    got = _graph_values(s, dora, dropout)
    m = M0 if dora else None
    assert abs(got[0] - _reference(s, A0, B0, m, dropout)) < 1e-10 * abs(got[0])
    for g, want in zip(got[1:], _reference_grads(s, A0, B0, m, dropout)):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dropout", [False, True])
def test_dora_gradient_check_with_the_norm_detached(dropout):
    """float64 finite differences of DoRA's output with the norm held at its value (PEFT's
    .detach()) equal the graph's gradients; the norm's own dependence on A, B is left out (with
    it the gradients differ: the check can fail)."""
    s = 2.0
    a, b, m = A0.copy(), B0.copy(), M0.copy()
    got = _graph_values(s, True, dropout, a, b, m)
    frozen = (A0.copy(), B0.copy())
    numeric = _numeric_grads(lambda: _reference(s, a, b, m, dropout, norm_from=frozen), [a, b, m])
    for g, want in zip(got[1:], numeric):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-8)
    live = _numeric_grads(lambda: _reference(s, a, b, m, dropout), [a, b])
    assert max(np.abs(g - w).max() for g, w in zip(got[1:3], live)) > 1e-3


def test_dora_row_rnorm_carries_no_gradient():
    x = ops.param((3, 4), "x")
    assert not ops.row_rnorm(x, detach=True).requires_grad and ops.row_rnorm(x).requires_grad


# ------------------------------------------------------------------------------ rsLoRA
def test_rslora_scale_is_alpha_over_sqrt_rank(stories, tmp_path):
    """PEFT's use_rslora; the file keeps alpha * sqrt(r), so llama.cpp's alpha / r is the same scale."""
    plain = lora.init_adapter(stories, 16, 8.0, seed=0)
    rs = lora.init_adapter(stories, 16, 8.0, seed=0, rslora=True)
    name = "blk.0.attn_q.weight"
    assert plain.weight_scale(name) == 0.5 and abs(rs.weight_scale(name) - 8.0 / 4.0) < 1e-6
    back = lora.load_adapter(lora.write_adapter(tmp_path / "rs.gguf", rs), stories)
    assert back.alpha == pytest.approx(32.0) and back.weight_scale(name) == rs.weight_scale(name)


def test_gaussian_init_is_normal_over_rank(stories):
    a = lora.init_adapter(stories, 8, None, r"ffn_up", seed=0, method="gaussian")
    values = np.concatenate([p.a.ravel() for p in a.pairs.values()])
    assert abs(values.std() - 1 / 8) < 0.01 and all(np.all(p.b == 0) for p in a.pairs.values())


# ------------------------------------------------------------------------------ PiSSA
def _pissa(stories, rank=4, targets=None):
    adapter = lora.init_adapter(stories, rank, 8.0, targets, seed=0, method="pissa")
    residual = lora.pissa_init(stories, adapter)
    base = dataclasses.replace(stories, weights={**stories.weights, **residual})
    return adapter, base


def test_pissa_takes_the_top_singular_vectors_and_keeps_the_model(stories):
    adapter, base = _pissa(stories)
    name = "blk.2.ffn_down.weight"
    w = stories.weights[name].astype(np.float64)
    u, sv, vh = np.linalg.svd(w, full_matrices=False)
    s = adapter.weight_scale(name)
    pair = adapter.pairs[name]
    np.testing.assert_allclose(s * pair.b.astype(np.float64) @ pair.a, (u[:, :4] * sv[:4]) @ vh[:4], atol=1e-5)
    np.testing.assert_allclose(np.linalg.svd(base.weights[name].astype(np.float64), compute_uv=False)[:3], sv[4:7],
                               rtol=1e-5)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 16)).astype(np.int32)
    np.testing.assert_allclose(_logits(lora.attach(base, [adapter]), tokens), _logits(stories, tokens), atol=2e-5)


def test_pissa_first_step_reports_the_base_loss(stories, wikitext_ids):
    """The residual base plus the initial adapter is the base model: step 0's loss is the base's
    (5.326544, as test_lora's plain adapter)."""
    adapter, base = _pissa(stories)
    model = lora.attach(base, [adapter])
    tr = Trainer(model, CPUBackend(), n_ctx=256, n_batch=256, n_ubatch=256, trainable=list(adapter.tensors()),
                 workers=1)
    x = wikitext_ids[:257][None]
    assert abs(tr.train_step(x[:, :-1], x[:, 1:], 1e-3, RunningStats()) - 5.326544) < 1e-4


def test_pissa_written_form_is_the_change_on_the_original_base(stories, tmp_path):
    """After training, W_res + s B A = W + s (B A - B0 A0): the rank-2r adapter [A; A0], [B, -B0]
    applied by llama.cpp to the original (maybe quantized) base."""
    adapter, base = _pissa(stories, targets=r"attn_q|ffn_up")
    moved = np.random.default_rng(3)
    trained = {k: v + moved.standard_normal(v.shape).astype(np.float32) * 0.01 for k, v in adapter.tensors().items()}
    adapter = adapter.with_tensors(trained)
    back = lora.load_adapter(lora.write_adapter(tmp_path / "p.gguf", adapter), stories)
    assert back.ranks == {8} and back.alpha == 16.0
    for name in adapter.pairs:
        want = base.weights[name] + adapter.delta(name)
        np.testing.assert_allclose(lora.merged_weight(lora.attach(stories, [back]), name), want, atol=2e-6)


# ------------------------------------------------------------------------------ DoRA
def _random_dora(stories, targets=r"attn_v|ffn_down|output"):
    adapter = lora.init_adapter(stories, 4, 8.0, targets, seed=0)
    lora.dora_init(stories, adapter)
    g = np.random.default_rng(5)
    for name, pair in adapter.pairs.items():
        pair.b[...] = g.standard_normal(pair.b.shape).astype(np.float32) * 0.05
        adapter.magnitudes[name] *= g.uniform(0.8, 1.2, adapter.magnitudes[name].shape).astype(np.float32)
    return adapter


def _logits(model, tokens):
    _, nodes, logits = model.build(*tokens.shape)
    prog = Program([logits], CPUBackend(np.float64),
                   params={nodes[n]: np.asarray(w, np.float64) for n, w in model.tensors().items()})
    return prog.run(tokens=tokens, pos=np.arange(tokens.shape[1], dtype=np.int32))[0].copy()


def test_dora_starts_at_the_base_and_merges_to_what_it_applies(stories):
    fresh = lora.init_adapter(stories, 4, 8.0, seed=0)
    lora.dora_init(stories, fresh)
    tokens = np.random.default_rng(1).integers(0, 512, (2, 12)).astype(np.int32)
    base = _logits(stories, tokens)
    np.testing.assert_allclose(_logits(lora.attach(stories, [fresh]), tokens), base, atol=1e-5)
    adapter = _random_dora(stories)
    applied = _logits(lora.attach(stories, [adapter]), tokens)
    merged = dataclasses.replace(stories, weights={**stories.weights, **{n: adapter.dora_merged(n, stories.weights[n])
                                                                         for n in adapter.pairs}})
    np.testing.assert_allclose(applied, _logits(merged, tokens), atol=2e-5)
    assert np.abs(applied - base).max() > 0.05


def test_finetune_dora_writes_the_merged_model(stories_path, small_text, tmp_path):
    out = tmp_path / "dora.gguf"
    res = llmtune.finetune(stories_path, small_text, out, ctx=32, batch=128, ubatch=64, epochs=1, lr=1e-2,
                           val_split=0.1, lora_rank=4, dora=True, lora_targets=r"attn_v|ffn_down")
    assert res.memory["merged output"] == 4 * 5 * (32 * 64 + 64 * 172)  # the memory estimate counts the merge
    gf = load_gguf(out)
    assert gf.get("general.type") != "adapter" and gf.tensors["blk.0.attn_v.weight"].type.name == "F32"
    merged, base = load_model(out), load_model(stories_path)
    assert np.abs(merged.weights["blk.0.attn_v.weight"] - base.weights["blk.0.attn_v.weight"]).max() > 1e-4
    np.testing.assert_array_equal(merged.weights["blk.0.attn_q.weight"], base.weights["blk.0.attn_q.weight"])


# ------------------------------------------------------------------------------ LoRA+
def test_lora_plus_steps_b_and_magnitudes_at_ratio_times_lr(stories, wikitext_ids):
    adapter = _random_dora(stories, r"attn_q|ffn_up")
    model = lora.attach(stories, [adapter])
    keys = list(adapter.tensors())
    cfg = make_config(lora_rank=4, lora_plus=16.0, dora=True)
    factors = lr_factors(cfg, keys)
    assert {k.rsplit(".", 1)[1]: f for k, f in factors.items()} == {"lora_a": 1.0, "lora_b": 16.0,
                                                                    "lora_magnitude": 16.0}
    tr = Trainer(model, CPUBackend(), n_ctx=24, n_batch=24, n_ubatch=24, trainable=keys, optimizer="sgd", workers=1,
                 lr_factors=factors)
    assert [g[2] for g in tr.optimizer.groups] == [1.0, 16.0]
    before = {k: v.copy() for k, v in tr.trained_weights().items()}
    x = wikitext_ids[:25][None]
    tr.train_step(x[:, :-1], x[:, 1:], 1e-3, RunningStats())
    after = tr.trained_weights()
    for k in keys:
        g = np.asarray(tr.grads[k])
        assert np.abs(g).max() > 0
        ulp = 2 * np.finfo(np.float32).eps * np.abs(before[k]).max()  # the float32 weights' rounding
        np.testing.assert_allclose(after[k] - before[k], -1e-3 * factors[k] * g, rtol=1e-4, atol=ulp)


def test_lora_plus_off_keeps_one_group(stories):
    assert lr_factors(make_config(lora_rank=4), ["x.lora_a", "x.lora_b"]) == {}


# ------------------------------------------------------------------------------ bad combinations
@pytest.mark.parametrize("args, words", [
    (["--rslora"], "--rslora: needs --lora-rank (a new adapter)"),  # --lora-init is refused with it
    (["--dora"], "--dora: needs --lora-rank (or --lora-init)"),
    (["--lora-plus", 4], "--lora-plus: needs --lora-rank (or --lora-init)"),
    (["--lora-init-method", "pissa"], "--lora-init-method: needs --lora-rank (a new adapter)"),
    (["--lora-rank", 4, "--lora-init-method", "olora"], "--lora-init-method: unknown method 'olora'"),
    (["--lora-rank", 4, "--lora-plus", -2], "--lora-plus: must be a positive ratio"),
    (["--lora-init", CONVERT_F16, "--lora-init-method", "pissa"], "--lora-init-method: starts a new adapter"),
    (["--lora-init", CONVERT_F16, "--rslora"], "--rslora: --lora-init"),
    (["--lora-rank", 4, "--dora", "--out-type", "q8_0"], "--out-type: with --dora, -o receives the merged model"),
    (["--lora-rank", 4, "--dora", "--lora-targets", "token_embd"],
     "--dora: applies to matrices multiplied by the input"),
    (["--lora-rank", 4, "--lora-init-method", "pissa", "--lora-targets", "token_embd|attn_q"],
     "--lora-init-method pissa: applies to matrices"),
])
def test_bad_variant_flags(args, words, stories_path, small_text, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, small_text, "-o", tmp_path / "o.gguf",
                           "--ctx", 32, *args)
    assert code == 2 and err.count("error:") == 1 and words in " ".join(err.split()), err


# ------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("variant", [dict(lora_init_method="pissa", rslora=True, lora_plus=4.0),
                                     dict(dora=True, lora_plus=2.0, lora_dropout=0.1)])
@pytest.mark.determinism
def test_resume_of_a_variant_run_is_byte_identical(variant, stories_path, wiki100k_path, tmp_path):
    """The epoch-1 checkpoint resumed writes the uninterrupted run's bytes: the SVD and the magnitudes
    are made again from the same base, the LoRA+ groups laid out alike."""


    text = tmp_path / "t.txt"
    text.write_text(wiki100k_path.read_text(encoding="utf-8")[:1500], encoding="utf-8")
    kw = dict(ctx=16, batch=32, epochs=2, lr=1e-2, val_split=0.1, lora_rank=2, lora_targets=r"attn_q|ffn_down",
              **variant)
    out = tmp_path / "run.gguf"
    llmtune.finetune(stories_path, text, out, keep_checkpoints=2, **kw)
    whole = hashlib.sha256(out.read_bytes()).hexdigest()
    first = ckpts.checkpoints_of(out)[0][1]
    out.unlink()
    llmtune.finetune(stories_path, text, out, resume=first)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == whole


# ------------------------------------------------------------------------------ cuda
def test_variant_training_on_the_cuda_backend_matches_cpu(stories, wikitext_ids):
    """The CUDA backend's kernels (tests/cuda_emu.py's CPU emulator; row_rnorm's included): two
    steps of PiSSA + DoRA with dropout and LoRA+ groups give the CPU's values."""

    if not cuda_emu.available():
        pytest.skip("no C++ compiler for the CUDA kernel emulator")
    results = []
    for be in (CPUBackend(), CUDABackend(np.float32, runtime=cuda_emu.EmuRuntime())):
        adapter, base = _pissa(stories, rank=2, targets=r"blk\.0\.attn_q|blk\.4\.ffn_down|output")
        lora.dora_init(base, adapter)
        keys = list(adapter.tensors())
        start = np.concatenate([np.ravel(adapter.tensors()[k]) for k in sorted(keys)])
        tr = Trainer(lora.attach(base, [adapter]), be, n_ctx=16, n_batch=32, n_ubatch=16, trainable=keys,
                     lora_dropout=0.1, seed=1, workers=1,
                     lr_factors=lr_factors(make_config(lora_rank=2, lora_plus=4.0), keys))
        x = wikitext_ids[:34].reshape(2, 17)
        for _ in range(2):
            tr.train_step(x[:, :-1], x[:, 1:], 1e-2, RunningStats())
        trained = tr.trained_weights()
        results.append(np.concatenate([trained[k].ravel() for k in sorted(keys)]))
    assert any(k.endswith(lora.MAGNITUDE) for k in keys) and np.abs(results[0] - start).max() > 1e-3
    np.testing.assert_allclose(results[1], results[0], rtol=0, atol=1e-5 * np.abs(results[0]).max())
