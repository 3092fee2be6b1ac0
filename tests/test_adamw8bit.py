"""--optimizer adamw8bit (issue 25 part 5): bitsandbytes' AdamW8bit, block-wise 8-bit moments.

- the dynamic maps and the block-wise quantization against a float64 transcription;
- one optimizer step of each backend (cpu; the CUDA kernel under tests/cuda_emu.py's emulator, and
  on a GPU when there is one) against a float64 numpy reference of the algorithm, and CUDA against
  the CPU backend;
- training: tracks float32 AdamW's loss on the bundled stories260K; checkpoint/resume byte-identical;
  the checkpoint holds the 8-bit state; the memory estimate counts 2 bytes per value plus the scales.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import llmtune
from llmtune.backends.cpu import CPUBackend
from llmtune.errors import LlmtuneError
from llmtune.quant import dynamic8
from llmtune.train import checkpoint as ckpts
from llmtune.train.optim import Optimizer
from test_backends import backend_for, name  # noqa: F401  (the backend fixture: cpu, cuda-emu, cuda)

rng = np.random.default_rng(25)


# ------------------------------------------------------------------------------ float64 references
def map_ref(signed: bool) -> np.ndarray:
    """create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) in float64: decade i holds the
    midpoints of 2^i (signed: both signs) or 2^(i+1) equal steps of 0.1..1, scaled by 10^(i-6)."""
    vals = [0.0, 1.0]
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        means = 0.1 + 0.9 * (np.arange(k) + 0.5) / k
        vals += list(10.0 ** (i - 6) * means) + (list(-(10.0 ** (i - 6)) * means) if signed else [])
    return np.sort(np.array(vals))


def blocks_of(starts):
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def quantize_ref(x, starts, code, keep_sign=False):
    """Per block: absmax = max |x|, each x / absmax to the nearest code entry (argmin in float64);
    keep_sign: an entry of the other sign moves one step towards the value's sign."""
    q, absmax = np.zeros(x.size, np.int64), np.zeros(len(starts) - 1)
    for b, sl in enumerate(blocks_of(starts)):
        absmax[b] = np.abs(x[sl]).max()
        scaled = x[sl] / absmax[b] if absmax[b] > 0 else np.zeros_like(x[sl])
        qb = np.abs(scaled[:, None] - code[None, :]).argmin(axis=1)
        if keep_sign:
            qb += np.where((code[qb] < 0) & (scaled >= 0), 1, 0) - np.where((code[qb] >= 0) & (scaled < 0), 1, 0)
        q[sl] = qb
    return q, absmax


def dequantize_ref(q, absmax, starts, code):
    out = np.zeros(q.size)
    for b, sl in enumerate(blocks_of(starts)):
        out[sl] = code[q[sl]] * absmax[b]
    return out


def adamw8bit_ref(w, g, q_m, q_v, am, av, starts, *, lr, beta1, beta2, eps, wd, t):
    """bitsandbytes' AdamW8bit step in float64: dequantize, AdamW (decoupled decay first, as
    torch.optim.AdamW), requantize with each block's new absmax."""
    cm, cv = (dynamic8.dynamic_map(s).astype(np.float64) for s in (True, False))
    m = dequantize_ref(q_m, am, starts, cm) * beta1 + g * (1 - beta1)
    v = dequantize_ref(q_v, av, starts, cv) * beta2 + g * g * (1 - beta2)
    w = w * (1 - lr * wd) - lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    return (w, m, v, *quantize_ref(m, starts, cm, keep_sign=True), *quantize_ref(v, starts, cv))


# ------------------------------------------------------------------------------ the map and quantization
@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bitsandbytes(signed):
    code = dynamic8.dynamic_map(signed)
    assert code.dtype == np.float32 and code.shape == (256,) and np.all(np.diff(code) > 0)
    np.testing.assert_allclose(code, map_ref(signed), rtol=1e-6, atol=0)
    assert code[-1] == 1.0 and (code == 0).sum() == 1
    assert (code < 0).sum() == (127 if signed else 0)
    # the finest step is 10^-6 wide (signed: 5.5e-7 is the smallest magnitude; unsigned: 3.25e-7)
    assert code[code > 0].min() == pytest.approx(5.5e-7 if signed else 3.25e-7, rel=1e-5)


@pytest.mark.parametrize("signed", [True, False])
def test_float32_table_lookup_is_the_binary_search(signed):
    """dynamic8.nearest's bucket table gives np.searchsorted(midpoints, x)'s index for float32:
    values over 1e-9..1, every midpoint, the floats either side of it, +-0 and +-1."""
    code = dynamic8.dynamic_map(signed)
    mid = dynamic8.midpoints(code)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-9, 0, 200_000)).clip(-1, 1).astype(np.float32)
    x = np.concatenate([x, mid, np.nextafter(mid, np.float32(2)), np.nextafter(mid, np.float32(-2)),
                        np.float32([0.0, -0.0, 1.0, -1.0])])
    x = x if signed else np.abs(x)
    np.testing.assert_array_equal(dynamic8.nearest(x, code, signed), np.searchsorted(mid, x, side="left"))


def test_block_starts_never_span_two_tensors():
    starts = dynamic8.block_starts([5000, 10, 2048, 0, 4096], block=2048)
    assert starts.tolist() == [0, 2048, 4096, 5000, 5010, 7058, 9106, 11154]
    assert dynamic8.block_starts([600, 3]).tolist() == [0, 256, 512, 600, 603]  # BLOCK = 256
    assert dynamic8.block_starts([]).tolist() == [0]


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_round_trip_matches_float64(signed):
    """Blocks of several sizes and magnitudes 1e-8..1e2 (and an all-zero block): the same codes as
    a float64 nearest-entry search except where x sits on a midpoint within float32 rounding, and
    a round-trip error of at most half the local step."""
    starts = dynamic8.block_starts([5000, 300, 2048, 64, 1])
    n = int(starts[-1])
    x = rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-8, 2, len(starts) - 1), np.diff(starts))
    x[5000:5300] = 0.0
    if not signed:
        x = x * x
    x32 = x.astype(np.float32)
    code = dynamic8.dynamic_map(signed)
    q, absmax = dynamic8.quantize(x32, starts, code, keep_sign=signed)
    assert q.dtype == np.uint8 and absmax.dtype == np.float32 and absmax.shape == (len(starts) - 1,)
    q_ref, absmax_ref = quantize_ref(x32.astype(np.float64), starts, code.astype(np.float64), keep_sign=signed)
    np.testing.assert_array_equal(absmax, absmax_ref.astype(np.float32))
    scaled = x32.astype(np.float64) / np.where(np.repeat(absmax_ref, np.diff(starts)) > 0,
                                               np.repeat(absmax_ref, np.diff(starts)), 1)
    mid = dynamic8.midpoints(code).astype(np.float64)
    on_midpoint = np.abs(scaled[:, None] - mid[None, :]).min(axis=1) < 1e-6
    differ = q.astype(np.int64) != q_ref
    assert np.all(on_midpoint[differ]) and differ.mean() < 1e-3
    back = dynamic8.dequantize(q, absmax, starts, code)
    step = np.diff(code.astype(np.float64)).max()  # an upper bound: each entry's own step is finer
    assert np.all(np.abs(back - x32) <= (0.5 * step + 1e-6) * np.repeat(absmax, np.diff(starts)))
    # the top decade (0.1..1 of the block's absmax) has 64 (signed) or 128 steps: at most 7% / 3.6%
    big = np.abs(scaled) > 0.1
    assert np.max(np.abs(back[big] - x32[big]) / np.abs(x32[big])) < (0.0704 if signed else 0.036)
    if signed:  # no first moment changes sign (a small negative stays negative)
        assert np.all((back < 0) == (x32 < 0))
    assert np.all(back[5000:5300] == 0)


# ------------------------------------------------------------------------------ one optimizer step
@pytest.mark.parametrize("dtype,rel", [(np.float32, 2e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw8bit_step_matches_reference(name, dtype, rel, wd):  # noqa: F811
    """Each of 4 steps from the backend's own state before it: the update within `rel`, the new
    scales equal, the codes equal but where float32 rounding lands on a midpoint (then one apart)."""
    be = backend_for(name, dtype)
    sizes = [3000, 17, 4096, 600]
    opt = Optimizer("adamw8bit", be, sum(sizes), wd=wd, tensors=[(f"t{i}", k) for i, k in enumerate(sizes)],
                    min_8bit_size=0)
    starts = dynamic8.block_starts(sizes)
    n = int(starts[-1])
    w = be.asarray(rng.standard_normal(n).astype(dtype))
    scale = np.repeat(10.0 ** rng.uniform(-4, 0, len(starts) - 1), np.diff(starts))
    hp = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, wd=wd)
    for t in (1, 2, 3, 4):
        g = (rng.standard_normal(n) * scale).astype(dtype).astype(np.float64)
        w0 = be.to_numpy(w).astype(np.float64)
        qm0, qv0 = (be.to_numpy(a).astype(np.int64) for a in (opt.m, opt.v))
        am0, av0 = (be.to_numpy(a).astype(np.float64) for a in (opt.absmax_m, opt.absmax_v))
        opt.step(w, be.asarray(g.astype(dtype)), hp["lr"])
        w_ref, _, _, qm_ref, am_ref, qv_ref, av_ref = adamw8bit_ref(w0, g, qm0, qv0, am0, av0, starts, t=t, **hp)
        got = be.to_numpy(w).astype(np.float64)
        assert np.max(np.abs((got - w0) - (w_ref - w0))) <= rel * np.max(np.abs(w_ref - w0))
        np.testing.assert_allclose(be.to_numpy(opt.absmax_m), am_ref, rtol=rel)
        np.testing.assert_allclose(be.to_numpy(opt.absmax_v), av_ref, rtol=rel)
        for q, q_ref in ((opt.m, qm_ref), (opt.v, qv_ref)):
            d = np.abs(be.to_numpy(q).astype(np.int64) - q_ref)
            assert d.max() <= 1 and (d > 0).mean() <= (2e-3 if dtype == np.float32 else 0), (t, (d > 0).sum())
    assert opt.t == 4


def test_adamw8bit_cuda_equals_cpu(name):  # noqa: F811
    """The CUDA kernel (emulated, or on a GPU) against the CPU backend from the same state: codes
    within one entry on at most 0.1% of values (FMA contraction on a GPU can move a value across a
    midpoint), scales within 1e-5 relative, weights within 2 float32 ulps."""
    if name == "cpu":
        pytest.skip("the CPU backend is the reference here")
    sizes = [5000, 33, 2048]
    be, cpu = backend_for(name), backend_for("cpu")
    n = sum(sizes)
    opts = [Optimizer("adamw8bit", b, n, wd=0.05, tensors=[(f"t{i}", k) for i, k in enumerate(sizes)], min_8bit_size=0)
            for b in (be, cpu)]
    w0 = rng.standard_normal(n).astype(np.float32)
    ws = [b.asarray(w0.copy()) for b in (be, cpu)]
    for _ in range(3):
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        before = cpu.to_numpy(ws[1]).copy()
        ws[0][...] = be.asarray(before)  # each step from the same weights (the states stay each backend's own)
        for b, o, w in zip((be, cpu), opts, ws):
            o.step(w, b.asarray(g), 0.05)
        dev, host = (o.state_arrays() for o in opts)
        for k in ("adam8_absmax_m", "adam8_absmax_v"):
            np.testing.assert_allclose(dev[k], host[k], rtol=1e-5)
        for k in ("adam8_m", "adam8_v"):
            d = np.abs(dev[k].astype(np.int64) - host[k].astype(np.int64))
            assert d.max() <= 1 and (d > 0).mean() <= 1e-3
        # the weights: within 2 float32 ulps of the weights before the step (the decay and the
        # update round in another order)
        got, want = be.to_numpy(ws[0]), cpu.to_numpy(ws[1])
        assert np.all(np.abs(got - want) <= 2 * np.spacing(np.maximum(np.abs(before), np.abs(want))))


TENSORS = [("token_embd.weight", 5000), ("blk.0.attn_norm.weight", 17), ("blk.0.ffn_up.weight", 4096 * 3),
           ("blk.0.ffn_down.weight", 4100), ("output_norm.weight", 600)]


def test_state_bytes_are_two_per_value_plus_scales():
    """The 8-bit tensors: 2 bytes per value, a float32 per block and moment, the block tables; the
    float32 exceptions (the embedding, tensors under 4096 values): 8 bytes per value."""

    n = sum(k for _, k in TENSORS)
    opt8, opt32 = (Optimizer(k, CPUBackend(), n, tensors=TENSORS) for k in ("adamw8bit", "adamw"))
    n8, blocks = 4096 * 3 + 4100, 48 + 17  # ffn_up, ffn_down: one run of 8-bit tensors, blocks per tensor
    assert opt8.m.shape == (n8,) and opt8.absmax_m.shape == (blocks,) and opt8.m32.shape == (n - n8,)
    assert opt8.state_bytes == 2 * n8 + 2 * 4 * blocks + 8 * (blocks + 1) + 2 * 256 * 4 + 8 * (n - n8)
    assert opt32.state_bytes == 8 * n
    with pytest.raises(LlmtuneError, match="--optimizer: unknown optimizer 'adam4bit'"):
        Optimizer("adam4bit", CPUBackend(), n)


def test_float32_exceptions_step_as_adamw(name):  # noqa: F811
    """The embedding and the small tensors of an adamw8bit buffer get exactly adamw's update; the
    8-bit tensors exactly what an all-8-bit optimizer over them alone gives."""
    be = backend_for(name)
    n = sum(k for _, k in TENSORS)
    mixed, plain = Optimizer("adamw8bit", be, n, wd=0.1, tensors=TENSORS), Optimizer("adamw", be, n, wd=0.1)
    eight = Optimizer("adamw8bit", be, 4096 * 3 + 4100, wd=0.1, tensors=TENSORS[2:4])
    w0 = rng.standard_normal(n).astype(np.float32)
    ws = [be.asarray(w0.copy()) for _ in range(3)]
    lo, hi = 5017, 5017 + 4096 * 3 + 4100
    for _ in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        mixed.step(ws[0], be.asarray(g), 0.01)
        plain.step(ws[1], be.asarray(g), 0.01)
        eight.step(ws[2][lo:hi], be.asarray(g[lo:hi]), 0.01)
    got, f32, e8 = (be.to_numpy(w) for w in ws)
    np.testing.assert_array_equal(np.r_[got[:lo], got[hi:]], np.r_[f32[:lo], f32[hi:]])
    np.testing.assert_array_equal(got[lo:hi], e8[lo:hi])
    assert not np.array_equal(got[lo:hi], f32[lo:hi])


@pytest.mark.parametrize("kind", ["adamw8bit", "adamw", "sgd"])
def test_lr_factors_scale_each_tensor_as_its_own_optimizer(kind):
    """LoRA+'s learning-rate factors (Optimizer lr_factors) with every optimizer kind: a buffer of
    tensors with factors 1 and 4 steps exactly as one optimizer per tensor at lr x factor."""

    be = CPUBackend()
    tensors = [("a", 8192), ("b", 4608), ("c", 8192)]
    factors = {"b": 4.0, "c": 4.0}
    n = sum(k for _, k in tensors)
    grouped = Optimizer(kind, be, n, wd=0.1, tensors=tensors, lr_factors=factors)
    alone = [Optimizer(kind, be, k, wd=0.1, tensors=[(t, k)]) for t, k in tensors]
    w0 = rng.standard_normal(n).astype(np.float32)
    w, parts = w0.copy(), [w0[:8192].copy(), w0[8192:12800].copy(), w0[12800:].copy()]
    for _ in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        grouped.step(w, g, 0.01)
        for (t, _), opt, part, gp in zip(tensors, alone, parts, np.split(g, [8192, 12800])):
            opt.step(part, gp, 0.01 * factors.get(t, 1.0))
    np.testing.assert_array_equal(w, np.concatenate(parts))


# ------------------------------------------------------------------------------ training
def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def text(tmp_path_factory, wiki100k_path):
    path = tmp_path_factory.mktemp("adam8") / "text.txt"
    path.write_text(wiki100k_path.read_text(encoding="utf-8")[:1500], encoding="utf-8")
    return path


SETTINGS = dict(ctx=16, batch=32, epochs=1, lr=1e-3, seed=3, val_split=0.0)


def test_training_tracks_f32_adamw(stories_path, text, tmp_path):
    """A full finetune of stories260K (~56 steps at lr 1e-4): adamw8bit's loss, averaged over
    windows of 10 steps, stays within 1% of float32 AdamW's (same data and order), and both learn.
    (At lr 1e-3, where this tiny model memorizes the text, the 8-bit run falls behind.)"""
    losses, memory = {}, {}
    for kind in ("adamw", "adamw8bit"):
        seen = []
        res = llmtune.finetune(stories_path, text, tmp_path / f"{kind}.gguf", optimizer=kind,
                               callback=lambda e: seen.append(e.loss) if e.kind == "step" else None,
                               **{**SETTINGS, "lr": 1e-4})
        losses[kind] = np.array(seen)
        memory[kind] = res.memory
    a, b = losses["adamw"], losses["adamw8bit"]
    assert a.size == b.size > 50
    wa, wb = (np.array([x[i : i + 10].mean() for i in range(0, x.size, 10)]) for x in (a, b))
    assert np.max(np.abs(wb - wa) / wa) < 0.01, (wa, wb)
    assert not np.array_equal(a, b) and wb[-1] < wb[0] - 1.0
    # the printed estimate: 2 bytes per 8-bit value, 8 per value of the float32 exceptions (here
    # the embedding and the tensors under 4096 values are 40% of the model)
    est8, est32 = memory["adamw8bit"]["optimizer"], memory["adamw"]["optimizer"]
    assert 0.3 < est8 / est32 < 0.45 and memory["adamw8bit"]["gradients"] == memory["adamw"]["gradients"]


@pytest.mark.determinism
def test_resume_is_byte_identical_and_the_checkpoint_holds_8bit_state(stories_path, text, tmp_path):
    ref = tmp_path / "ref.gguf"
    llmtune.finetune(stories_path, text, ref, optimizer="adamw8bit", **SETTINGS)
    out = tmp_path / "run.gguf"
    llmtune.finetune(stories_path, text, out, optimizer="adamw8bit", checkpoint_every=10, keep_checkpoints=100,
                     **SETTINGS)
    assert _sha(out) == _sha(ref)
    found = ckpts.checkpoints_of(out)
    step, mid = found[len(found) // 2]
    z = np.load(mid)
    n = z["weights"].size
    n8, n32 = z["adam8_m"].size, z["adam8_f32_m"].size
    assert z["adam8_m"].dtype == z["adam8_v"].dtype == np.uint8 and z["adam8_v"].shape == (n8,) and n8 + n32 == n
    assert z["adam8_f32_m"].dtype == z["adam8_f32_v"].dtype == np.float32 and z["adam8_f32_v"].shape == (n32,)
    assert z["adam8_absmax_m"].dtype == np.float32 and z["adam8_absmax_m"].shape == z["adam8_absmax_v"].shape
    assert "adam_m" not in z.files and z["adam8_absmax_m"].size >= -(-n8 // dynamic8.BLOCK)
    assert ckpts.read_meta(mid)["optimizer"] == {"kind": "adamw8bit", "t": step}
    for _, p in found:
        if p != mid:
            p.unlink()
    out.unlink()
    llmtune.finetune(stories_path, text, out, resume=mid)
    assert _sha(out) == _sha(ref)


def test_an_adamw_checkpoint_still_resumes(stories_path, text, tmp_path):
    """Checkpoints of --optimizer adamw keep their float32 adam_m / adam_v arrays (older files load)."""
    ref, out = tmp_path / "ref.gguf", tmp_path / "run.gguf"
    llmtune.finetune(stories_path, text, ref, **SETTINGS)
    llmtune.finetune(stories_path, text, out, checkpoint_every=20, keep_checkpoints=100, **SETTINGS)
    (_, first), *rest = ckpts.checkpoints_of(out)
    z = np.load(first)
    assert z["adam_m"].dtype == np.float32 and "adam8_m" not in z.files
    for _, p in rest:
        p.unlink()
    out.unlink()
    llmtune.finetune(stories_path, text, out, resume=first)
    assert _sha(out) == _sha(ref)
