"""Op tests for every backend present.

- forward: each op (run through Program, as training does) against an independent float64
  numpy reference, and for device backends also against the CPU backend (f32, rel 1e-5);
- gradients: finite differences in float64 (graph/gradcheck.py) for every differentiable op;
- optimizers: AdamW / SGD against a float64 numpy transcription of ggml_opt_step_adamw / _sgd.

Backends: "cpu" always; "cuda" when cupy sees a GPU (marked `cuda`); "cuda-emu": the CUDA
backend's own kernels and matmul planning under tests/cuda_emu.py's CPU emulator, when a C++
compiler is available. Nothing here imports cupy unless the cuda tests actually run.
"""

from __future__ import annotations

import math
import mmap
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import cuda_emu
from llmtune.arch.context import causal_attention
from llmtune.backends import cuda, get_backend
from llmtune.backends.cpu import CPUBackend, attention as cpu_attention, pages, products as qmatmul
from llmtune.backends.cuda import CUDABackend
from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.gradcheck import check_gradients
from llmtune.graph.planner import Program
from llmtune.model.loaded import load_model
from llmtune.quant import blocks
from llmtune.train.trainer import RunningStats, Trainer

BACKEND_NAMES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda), "cuda-emu"]
_backends: dict = {}


def _make_backend(name: str, dtype):
    if name == "cpu":
        return CPUBackend(dtype)

    if name == "cuda":
        pytest.importorskip("cupy")

        if not cuda.available():
            pytest.skip("cupy sees no CUDA device")
        return CUDABackend(dtype)
    if not cuda_emu.available():
        pytest.skip("no C++ compiler for the CUDA kernel emulator")
    return CUDABackend(dtype, runtime=cuda_emu.EmuRuntime())


def backend_for(name: str, dtype=np.float32):
    key = (name, np.dtype(dtype))
    if key not in _backends:
        try:
            _backends[key] = _make_backend(name, dtype)
        except pytest.skip.Exception as exc:
            _backends[key] = exc
    value = _backends[key]
    if isinstance(value, pytest.skip.Exception):
        pytest.skip(str(value))
    return value


@pytest.fixture(params=BACKEND_NAMES)
def name(request):
    backend_for(request.param)  # skip early when absent
    return request.param


rng = np.random.default_rng(1234)
DATA_DIR = Path(__file__).resolve().parent / "data"


def randn(*shape) -> np.ndarray:
    """float32-representable values in float64, so references see exactly the backends' inputs."""
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


def assert_close(got, want, rel=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    err = float(np.abs(got - want).max(initial=0.0)) / scale
    assert err <= rel, f"relative error {err:.3g} > {rel:g}"


def run_graph(backend, build, arrays: dict) -> list[np.ndarray]:
    """Build a graph on input nodes named like `arrays`, run it once, return outputs in float64."""
    nodes = {k: ops.input(v.shape, "i32" if v.dtype.kind in "iu" else "f32", name=k) for k, v in arrays.items()}
    outs = build(**nodes)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    prog = Program(outs, backend)
    feed = {k: backend.asarray(v.astype(np.int32 if v.dtype.kind in "iu" else backend.dtype))
            for k, v in arrays.items()}
    return [backend.to_numpy(r).astype(np.float64) for r in prog.run(**feed)]


def check_forward(name, build, refs, rel=1e-5, **arrays):
    refs = refs if isinstance(refs, (list, tuple)) else [refs]
    got = run_graph(backend_for(name), build, arrays)
    assert len(got) == len(refs)
    for g, r in zip(got, refs):
        assert_close(g, r, rel)
    if name != "cpu":
        for g, c in zip(got, run_graph(backend_for("cpu"), build, arrays)):
            assert_close(g, c, rel)


# ------------------------------------------------------------------------------ references
def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


GELU_C = math.sqrt(2 / math.pi)


def gelu_ref(x):
    """ggml_gelu's formula (the tanh approximation) in float64."""
    return 0.5 * x * (1 + np.tanh(GELU_C * (x + 0.044715 * x**3)))


def gelu_grad_ref(x):
    th = np.tanh(GELU_C * (x + 0.044715 * x**3))
    return 0.5 * (1 + th) + 0.5 * x * (1 - th**2) * GELU_C * (1 + 3 * 0.044715 * x**2)


def rope_ref(x, pos, n_rot, base, freq_scale, mode, inverse, freq_factors=None):
    """Rotation as a complex multiply: NORM pairs (2i, 2i+1), NEOX pairs (i, i + n_rot/2); pair i
    turns by pos * freq_scale * base^(-2i/n_rot) / freq_factors[i] (ggml_rope_ext)."""
    half = n_rot // 2
    ff = np.ones(half) if freq_factors is None else np.asarray(freq_factors, np.float64)[:half]
    theta = freq_scale * pos[:, None] * base ** (-np.arange(0, n_rot, 2) / n_rot) / ff
    rot = np.exp((-1j if inverse else 1j) * theta)[:, None, :]  # [T, 1, half] over [..., T, H, half]
    idx0 = np.arange(0, n_rot, 2) if mode == "norm" else np.arange(half)
    idx1 = idx0 + 1 if mode == "norm" else idx0 + half
    z = (x[..., idx0] + 1j * x[..., idx1]) * rot
    out = x.copy()
    out[..., idx0], out[..., idx1] = z.real, z.imag
    return out


def causal_softmax_ref(x, scale, n_q, n_past, window=0):
    """Key k is visible to query position p when k <= p and (window > 0) p - k < window."""
    rows, n_kv = x.shape[-2], x.shape[-1]
    p = (n_past + np.arange(rows) % n_q)[:, None]
    k = np.arange(n_kv)[None, :]
    visible = (k <= p) & ((p - k < window) if window else True)
    z = np.where(visible, x * scale, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(x):
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ------------------------------------------------------------------------------ forward
def test_lora_term(name):
    """ops.lora: y + ((s x A^T) B^T) over x's rows, rank 1 to 20 and widths past a vector's 16
    lanes (the compiled kernel's tails), its packed gradients against float64."""
    for lead, n_in, n_out, rank in (((2, 37), 50, 70, 3), ((5,), 16, 16, 20), ((3, 1), 100, 37, 1)):
        y, x, g = randn(*lead, n_out), randn(*lead, n_in), randn(*lead, n_out)
        a, b = randn(rank, n_in), randn(n_out, rank)
        t, u = 0.4 * (x @ a.T), 0.4 * (g @ b)

        def rows(v):
            return v.reshape(-1, v.shape[-1])

        grads = np.concatenate([(u @ a).ravel(), (rows(u).T @ rows(x)).ravel(), (rows(g).T @ rows(t)).ravel()])
        check_forward(name, lambda y, x, a, b, g: [ops.lora(y, x, a, b, 0.4), ops.lora_back(x, a, b, g, 0.4, True),
                                                   ops.lora_back(x, a, b, g, 0.4, False)],
                      [y + t @ b.T, grads, grads[x.size:]], rel=1e-5, y=y, x=x, a=a, b=b, g=g)


def test_elementwise_broadcasting(name):
    a, b, c = randn(3, 5, 7), randn(5, 1), randn(7)
    check_forward(name, lambda a, b, c: [ops.add(a, b), ops.add(b, a), ops.mul(a, c), ops.scale(a, -0.37)],
                  [a + b, b + a, a * c, a * -0.37], a=a, b=b, c=c)


def test_sum_to_and_broadcast_to(name):
    x, y = randn(3, 5, 7), randn(5, 1)
    check_forward(name, lambda x, y: [ops.sum_to(x, (5, 1)), ops.sum_to(x, ()), ops.sum_to(x, (1, 7)),
                                      ops.sum_to(x, (7,)), ops.broadcast_to(y, (3, 5, 7))],
                  [x.sum(axis=(0, 2))[:, None], x.sum(), x.sum(axis=(0, 1))[None], x.sum(axis=(0, 1)),
                   np.broadcast_to(y, (3, 5, 7))], x=x, y=y)


def test_activations(name):
    x, u, g = randn(4, 37), randn(4, 37), randn(4, 37)
    s = sigmoid(x)
    check_forward(
        name,
        lambda x, u, g: [ops.silu(x), ops.silu_back(x, g), ops.swiglu(x, u), ops.swiglu_back(x, u, g, 0),
                         ops.swiglu_back(x, u, g, 1)],
        [x * s, g * s * (1 + x * (1 - s)), x * s * u, g * u * s * (1 + x * (1 - s)), g * x * s],
        x=x, u=u, g=g,
    )


def test_gelu_and_geglu(name):
    x, u, g = randn(4, 37), randn(4, 37), randn(4, 37)
    x[0, :6] = [-30.0, -12.0, -9.5, 9.5, 12.0, 30.0]  # saturated tanh: exact 0 / x, no NaN
    gx = gelu_grad_ref(x)
    check_forward(
        name,
        lambda x, u, g: [ops.gelu(x), ops.gelu_back(x, g), ops.geglu(x, u), ops.geglu_back(x, u, g, 0),
                         ops.geglu_back(x, u, g, 1)],
        [gelu_ref(x), g * gx, gelu_ref(x) * u, g * u * gx, g * gelu_ref(x)],
        x=x, u=u, g=g,
    )


def test_softcap_and_back(name):
    x, g, cap = 40 * randn(3, 5, 41), randn(3, 5, 41), 30.0
    y = cap * np.tanh(x / cap)

    def build(x, g):
        y = ops.softcap(x, cap)
        return [y, ops.softcap_back(y, g, cap), ops.softcap(ops.scale(x, 0.5), 50.0)]

    check_forward(name, build, [y, g * (1 - (y / cap) ** 2), 50.0 * np.tanh(0.5 * x / 50.0)], x=x, g=g)


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_matmul_flags_and_batch_broadcasting(name, ta, tb):
    def stored(arr, t):
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2)) if t else arr

    a, b = randn(2, 1, 5, 7), randn(3, 7, 4)  # batch (2,1) x (3,) -> (2,3)
    w, x = randn(7, 9), randn(6, 9)  # a linear layer: x @ w^T
    check_forward(name, lambda a, b, w, x: [ops.matmul(a, b, ta, tb), ops.matmul(x, w, False, True)],
                  [np.matmul(a, b), x @ w.T], a=stored(a, ta), b=stored(b, tb), w=w, x=x)


def test_matmul_on_strided_views(name):
    # permuted operands whose batch axes do not merge into one stride (as K/V in attention)
    a_raw, b_raw, c_raw = randn(2, 5, 3, 7), randn(2, 4, 3, 7), randn(2, 4, 3, 6)
    a, b, c = (np.transpose(t, (0, 2, 1, 3)) for t in (a_raw, b_raw, c_raw))

    def build(a_raw, b_raw, c_raw):
        a, b, c = (ops.permute(t, (0, 2, 1, 3)) for t in (a_raw, b_raw, c_raw))
        return [ops.matmul(a, b, tb=True), ops.matmul(b, c, ta=True),
                ops.matmul(ops.slice_axis(a, 2, 1, 4), b, tb=True)]

    check_forward(name, build, [a @ np.swapaxes(b, -1, -2), np.swapaxes(b, -1, -2) @ c,
                                a[:, :, 1:4] @ np.swapaxes(b, -1, -2)], a_raw=a_raw, b_raw=b_raw, c_raw=c_raw)


def test_shape_ops(name):
    x = randn(3, 4, 5)
    check_forward(
        name,
        lambda x: [ops.reshape(x, (12, 5)), ops.cont(ops.permute(x, (2, 0, 1))),
                   ops.reshape(ops.permute(x, (1, 0, 2)), (4, 15)),
                   ops.slice_axis(x, 1, 1, 3), ops.pad_axis(x, 1, 2, 7)],
        [x.reshape(12, 5), x.transpose(2, 0, 1), x.transpose(1, 0, 2).reshape(4, 15), x[:, 1:3],
         np.concatenate([np.zeros((3, 2, 5)), x, np.zeros((3, 1, 5))], axis=1)],
        x=x,
    )


def test_get_rows_and_add_rows(name):
    w, g = randn(11, 6), randn(12, 6)
    ids = np.array([[0, 10, 3, 3], [7, 0, 10, 3], [5, 5, 5, 1]], dtype=np.int32)
    expected_scatter = np.zeros((11, 6))
    np.add.at(expected_scatter, ids.reshape(-1), g)
    check_forward(name, lambda w, g, ids: [ops.get_rows(w, ids), ops.add_rows(g, ids, 11)],
                  [w[ids], expected_scatter], w=w, g=g, ids=ids)


def test_slice_last_axis_then_cont(name):
    """phi3 splits fused matrices along the last axis of a 2-D product: strided views, made dense
    by cont (also with a negative axis), or read directly by elementwise ops and matmul."""
    x, w, u = randn(5, 12), randn(16, 7), randn(6, 7)

    def build(x, w, u):
        fused = ops.linear(u, w)  # [6, 16]: gate rows 0..7, up rows 8..15 of w
        gate, up = ops.cont(ops.slice_axis(fused, 1, 0, 8)), ops.cont(ops.slice_axis(fused, -1, 8, 16))
        return [ops.cont(ops.slice_axis(x, 1, 0, 6)), ops.cont(ops.slice_axis(x, 1, 6, 12)),
                ops.cont(ops.slice_axis(x, -1, 2, 5)), ops.swiglu(gate, up), ops.geglu(gate, up),
                ops.add(ops.slice_axis(x, 1, 3, 10), ops.slice_axis(x, 1, 0, 7)),
                ops.matmul(ops.slice_axis(x, 1, 5, 12), ops.slice_axis(w, 0, 0, 7))]

    f = u @ w.T
    check_forward(name, build, [x[:, :6], x[:, 6:], x[:, 2:5], f[:, :8] * sigmoid(f[:, :8]) * f[:, 8:],
                                gelu_ref(f[:, :8]) * f[:, 8:], x[:, 3:10] + x[:, :7], x[:, 5:] @ w[:7]],
                  x=x, w=w, u=u)


def test_learned_position_embeddings(name):
    """gpt2: rows of a position table at the [T] int32 positions, added to every sequence."""
    tok, pos_w = randn(11, 6), randn(9, 6)
    ids = np.array([[0, 10, 3, 3], [7, 0, 10, 3]], dtype=np.int32)
    pos = np.array([0, 1, 2, 8], dtype=np.int32)
    g = randn(4, 6)
    scatter = np.zeros((9, 6))
    scatter[pos] = g
    check_forward(name, lambda tok, pos_w, ids, pos, g: [ops.get_rows(pos_w, pos),
                                                         ops.add(ops.get_rows(tok, ids), ops.get_rows(pos_w, pos)),
                                                         ops.add_rows(g, pos, 9)],
                  [pos_w[pos], tok[ids] + pos_w[pos], scatter], tok=tok, pos_w=pos_w, ids=ids, pos=pos, g=g)


@pytest.mark.parametrize("shape", [(3, 37), (5, 300)])
def test_rms_norm(name, shape):
    x, g, eps = randn(*shape), randn(*shape), 1e-5
    n = shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    dx = r * g - x * r**3 * (g * x).sum(axis=-1, keepdims=True) / n
    check_forward(name, lambda x, g: [ops.rms_norm(x, eps), ops.rms_norm_back(x, g, eps)], [x * r, dx], x=x, g=g)


@pytest.mark.parametrize("shape", [(3, 37), (5, 300), (2, 3, 40)])
def test_row_rnorm(name, shape):
    x = randn(*shape)
    check_forward(name, lambda x: ops.row_rnorm(x), 1.0 / np.sqrt((x * x).sum(axis=-1)), x=x)


@pytest.mark.parametrize("shape", [(3, 37), (5, 300), (2, 3, 4, 8)])
def test_layer_norm(name, shape):
    x, g, eps = 2 + 3 * randn(*shape), randn(*shape), 1e-5  # an offset: the mean matters
    n = shape[-1]
    xc = x - x.mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    y = xc * r
    dx = r * (g - g.mean(axis=-1, keepdims=True) - y * (g * y).sum(axis=-1, keepdims=True) / n)
    check_forward(name, lambda x, g: [ops.layer_norm(x, eps), ops.layer_norm_back(x, g, eps)], [y, dx], x=x, g=g)


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("n_rot", [10, 6])
def test_rope(name, mode, n_rot):
    x = randn(2, 7, 3, 10)  # head_dim 10: n_rot 6 leaves 4 dims unrotated
    strided = randn(2, 3, 7, 10)  # [B, H, T, d] permuted to a non-contiguous [B, T, H, d]
    pos = np.array([3, 4, 5, 6, 7, 8, 40], dtype=np.int32)
    base, fs = 500.0, 0.5

    def build(x, strided, pos):
        rot = ops.rope(x, pos, n_rot, base, fs, mode)
        return [rot, ops.rope(x, pos, n_rot, base, fs, mode, inverse=True),
                ops.rope(ops.permute(strided, (0, 2, 1, 3)), pos, n_rot, base, fs, mode),
                ops.rope(rot, pos, n_rot, base, fs, mode, inverse=True)]

    p = pos.astype(np.float64)
    check_forward(name, build,
                  [rope_ref(x, p, n_rot, base, fs, mode, False), rope_ref(x, p, n_rot, base, fs, mode, True),
                                rope_ref(strided.transpose(0, 2, 1, 3), p, n_rot, base, fs, mode, False), x],
                  x=x, strided=strided, pos=pos)


def masked_softmax_ref(x, scale, mask):
    B, n_q, n_kv = mask.shape
    z = (x * scale).reshape(B, -1, n_q, n_kv) + mask[:, None]
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).reshape(x.shape)


def test_softmax_masked_and_back(name):
    """A run-time mask per sequence: row r of sequence b reads mask[b, r % n_q]."""
    n_q, n_kv, scale = 3, 40, 0.3
    rng_mask = np.random.default_rng(5)
    mask = np.where(rng_mask.random((2, n_q, n_kv)) < 0.6, -np.inf, 0.0)
    mask[:, :, 0] = 0.0  # every row sees a key
    x, g = randn(2, 2, 2 * n_q, n_kv), randn(2, 2, 2 * n_q, n_kv)
    y = masked_softmax_ref(x, scale, mask)
    dx = scale * y * (g - (g * y).sum(axis=-1, keepdims=True))

    def build(x, g, mask):
        y = ops.softmax_masked(x, scale, mask)
        return [y, ops.softmax_back(y, g, scale)]

    check_forward(name, build, [y, dx], x=x, g=g, mask=mask)
    with pytest.raises(ValueError):
        ops.softmax_masked(ops.param((2, 2, 6, 40)), 1.0, ops.input((2, 4, 40)))


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("n_rot,n_factors", [(10, 5), (6, 3), (6, 4)])
def test_rope_freq_factors(name, mode, n_rot, n_factors):
    """Llama 3.1's rope_freqs / phi3's factors: a third input dividing each pair's angle; a longer
    factor vector than n_rot/2 is read from its start, as ggml does."""
    x = randn(2, 7, 3, 10)
    strided = randn(2, 3, 7, 10)
    pos = np.array([0, 1, 2, 3, 17, 300, 4095], dtype=np.int32)
    ff = np.array([1.0, 1.0, 2.5, 8.0, 31.25, 0.5][:n_factors])
    base, fs = 500000.0, 0.25

    def build(x, strided, pos, ff):
        rot = ops.rope(x, pos, n_rot, base, fs, mode, freq_factors=ff)
        return [rot, ops.rope(x, pos, n_rot, base, fs, mode, inverse=True, freq_factors=ff),
                ops.rope(ops.permute(strided, (0, 2, 1, 3)), pos, n_rot, base, fs, mode, freq_factors=ff),
                ops.rope(rot, pos, n_rot, base, fs, mode, inverse=True, freq_factors=ff),
                ops.rope(x, pos, n_rot, base, fs, mode)]  # the same graph without factors

    p = pos.astype(np.float64)
    check_forward(name, build, [rope_ref(x, p, n_rot, base, fs, mode, False, ff),
                                rope_ref(x, p, n_rot, base, fs, mode, True, ff),
                                rope_ref(strided.transpose(0, 2, 1, 3), p, n_rot, base, fs, mode, False, ff), x,
                                rope_ref(x, p, n_rot, base, fs, mode, False)],
                  x=x, strided=strided, pos=pos, ff=ff)


def test_rope_freq_factors_are_frozen():
    """No gradient flows into the factors, even when they are a trainable parameter, and they do
    not make the rotation of a constant need one; the old positional call still works."""

    x, ff, c = ops.param((1, 3, 2, 4), name="x"), ops.param((2,), name="ff"), ops.input((1, 3, 2, 4), name="c")
    pos = ops.input((3,), "i32", name="pos")
    y = ops.rope(x, pos, 4, 100.0, 1.0, "neox", freq_factors=ff)
    grads = grad(ops.sum_to(y, ()), [x, ff])
    assert set(grads) == {x}
    assert grads[x].op == "rope" and grads[x].inputs[2] is ff and grads[x].attrs["inverse"]
    assert not ops.rope(c, pos, 4, 100.0, 1.0, "neox", False, ff).requires_grad
    assert ops.rope(x, pos, 4, 100.0, 1.0, "norm").inputs == (x, pos)
    with pytest.raises(ValueError):
        ops.rope(x, pos, 4, freq_factors=ops.param((1,), name="short"))


@pytest.mark.parametrize("rows,n_kv,n_q,n_past,window", [(10, 7, 5, 2, 0), (8, 300, 4, 296, 0), (10, 7, 5, 2, 3),
                                                           (10, 7, 5, 2, 1), (8, 300, 4, 296, 100), (6, 6, 6, 0, 40)])
def test_softmax_causal_and_back(name, rows, n_kv, n_q, n_past, window):
    x, g, scale = randn(2, 3, rows, n_kv), randn(2, 3, rows, n_kv), 0.3
    y = causal_softmax_ref(x, scale, n_q, n_past, window)
    dx = scale * y * (g - (g * y).sum(axis=-1, keepdims=True))

    def build(x, g):
        y = ops.softmax_causal(x, scale, n_kv, n_q, n_past, window=window)
        return [y, ops.softmax_back(y, g, scale)]

    check_forward(name, build, [y, dx], x=x, g=g)


@pytest.mark.parametrize("window", [0, 3])
def test_softmax_causal_at_run_time_positions(name, window):
    """pos given as an input: row r is query position pos[r % n_q] (a KV-cached decode step)."""
    n_q, n_kv, scale = 3, 9, 0.3
    pos = np.array([4, 5, 8], dtype=np.int32)
    x, g = randn(2, 2 * n_q, n_kv), randn(2, 2 * n_q, n_kv)
    y, dx = _masked_softmax_reference(x, g, pos[np.arange(2 * n_q) % n_q][:, None], np.arange(n_kv)[None, :],
                                      scale, window)

    def build(x, g, pos):
        y = ops.softmax_causal(x, scale, n_kv, n_q, window=window, pos=pos)
        return [y, ops.softmax_back(y, g, scale)]

    check_forward(name, build, [y, dx], x=x, g=g, pos=pos)


def _masked_softmax_reference(x, g, p, k, scale, window):
    """softmax_causal at query positions p over keys k (broadcast), and its backward for g."""
    visible = (k <= p) & ((p - k < window) if window else True)
    z = np.where(visible, x * scale, -np.inf)
    y = np.exp(z - z.max(-1, keepdims=True))
    y /= y.sum(-1, keepdims=True)
    return y, scale * y * (g - (g * y).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("window", [0, 3])
def test_softmax_causal_at_positions_per_sequence(name, window):
    """pos [B, n_q] (a batched decode): row r of sequence b is query position pos[b, r % n_q]."""
    n_q, n_kv, scale = 2, 9, 0.3
    pos = np.array([[4, 5], [0, 1], [7, 8]], dtype=np.int32)
    x, g = randn(3, 2, 2 * n_q, n_kv), randn(3, 2, 2 * n_q, n_kv)
    y, dx = _masked_softmax_reference(x, g, pos[:, np.arange(2 * n_q) % n_q][:, None, :, None], np.arange(n_kv),
                                      scale, window)

    def build(x, g, pos):
        y = ops.softmax_causal(x, scale, n_kv, n_q, window=window, pos=pos)
        return [y, ops.softmax_back(y, g, scale)]

    check_forward(name, build, [y, dx], x=x, g=g, pos=pos)


@pytest.mark.parametrize("T", [1, 2])
def test_cache_write_positions_per_sequence(name, T):
    """pos [B, T]: cache[b, :, pos[b, t]] = x[b, t], each sequence at its own positions."""
    backend = backend_for(name)
    B, H, N, d = 3, 2, 7, 4
    pos = np.array([[5, 6], [0, 1], [3, 2]], dtype=np.int32)[:, :T].copy()
    start, x = randn(B, H, N, d), randn(B, T, H, d)
    want = start.copy()
    for b in range(B):
        want[b][:, pos[b]] = x[b].transpose(1, 0, 2)
    cache = backend.asarray(start.astype(np.float32))
    c = ops.param((B, H, N, d), name="cache", requires_grad=False)
    xn, pn = ops.input((B, T, H, d), name="x"), ops.input((B, T), "i32", name="pos")
    out = ops.cache_write(c, ops.scale(xn, 1.0), pn)
    prog = Program([ops.scale(out, 1.0)], backend, params={c: cache})
    got = prog.run(x=backend.asarray(x.astype(np.float32)), pos=backend.asarray(pos))[0]
    assert_close(backend.to_numpy(got), want)
    assert_close(backend.to_numpy(cache), want)  # written in place


def test_cache_write(name):
    """cache[:, :, pos[t]] = x[:, t] in a persistent buffer; the op's value is the cache."""
    backend = backend_for(name)
    B, H, N, d, T = 2, 3, 7, 4, 2
    start, x, pos = randn(B, H, N, d), randn(B, T, H, d), np.array([5, 2], dtype=np.int32)
    want = start.copy()
    want[:, :, pos] = x.transpose(0, 2, 1, 3)
    cache = backend.asarray(start.astype(np.float32))
    c = ops.param((B, H, N, d), name="cache", requires_grad=False)
    xn, pn = ops.input((B, T, H, d), name="x"), ops.input((T,), "i32", name="pos")
    out = ops.slice_axis(ops.cache_write(c, ops.scale(xn, 1.0), pn), 2, 0, 6)
    prog = Program([out], backend, params={c: cache})
    got = prog.run(x=backend.asarray(x.astype(np.float32)), pos=backend.asarray(pos))[0]
    assert_close(backend.to_numpy(got), want[:, :, :6])
    assert_close(backend.to_numpy(cache), want)  # written in place


def test_cross_entropy_ignores_negative_targets(name):
    """Rows with target -1 (masked prompt / padding) carry no loss and no gradient; the mean is
    over the other rows; all rows masked: loss 0."""
    logits, g = 3 * randn(6, 301), np.array(0.75)
    targets = np.array([4, -1, 300, -1, 0, 17], dtype=np.int32)
    keep = targets >= 0
    lsm = log_softmax(logits)
    grad_ref = (np.exp(lsm) - np.eye(301)[np.where(keep, targets, 0)]) * 0.75 / keep.sum()
    grad_ref[~keep] = 0
    none = np.full(6, -1, dtype=np.int32)
    check_forward(
        name,
        lambda logits, targets, g, none: [
            ops.cross_entropy(logits, targets), ops.cross_entropy_back(logits, targets, ops.logsumexp(logits), g),
            ops.count_correct(logits, targets), ops.cross_entropy(logits, none)],
        [-lsm[np.flatnonzero(keep), targets[keep]].mean(), grad_ref,
         np.count_nonzero(logits.argmax(-1) == targets), 0.0],
        logits=logits, targets=targets, g=g, none=none,
    )


def test_token_nll_per_row(name):
    """token_nll: each row's lse - logit[target] (0 where masked); its backward weighs each row by
    its own seed value (the preference losses' per-token weights)."""
    logits, g = 3 * randn(5, 301), np.array([0.5, -1.25, 2.0, 0.0, 0.75])
    targets = np.array([4, -1, 300, 0, 17], dtype=np.int32)
    keep = targets >= 0
    lsm = log_softmax(logits)
    want = np.where(keep, -lsm[np.arange(5), np.where(keep, targets, 0)], 0.0)
    grad_ref = (np.exp(lsm) - np.eye(301)[np.where(keep, targets, 0)]) * g[:, None]
    grad_ref[~keep] = 0
    check_forward(name, lambda logits, targets, g: [
        ops.token_nll(logits, targets), ops.token_nll_back(logits, targets, ops.logsumexp(logits), g)],
        [want, grad_ref], logits=logits, targets=targets, g=g)


def test_cross_entropy_and_count_correct(name):
    logits, g = 3 * randn(6, 301), np.array(0.75)
    targets = rng.integers(0, 301, size=6).astype(np.int32)
    targets[0] = logits[0].argmax()  # at least one hit
    # numpy's argmax: the first maximum wins ties, NaN beats everything
    ties = np.array([[1, 3, 3, 0], [2, 2, 1, 2], [0, 0, 0, 0], [5, -1, 5, 5], [1, np.nan, 3, np.nan]])
    first_max = np.array([1, 0, 0, 0, 1], dtype=np.int32)
    last_max = np.array([2, 3, 3, 3, 3], dtype=np.int32)
    lsm = log_softmax(logits)
    onehot = np.eye(301)[targets]
    check_forward(
        name,
        lambda logits, targets, g, ties, first_max, last_max: [
            ops.logsumexp(logits), ops.cross_entropy(logits, targets),
            ops.cross_entropy_back(logits, targets, ops.logsumexp(logits), g),
            ops.count_correct(logits, targets), ops.count_correct(ties, first_max), ops.count_correct(ties, last_max)],
        [(logits - lsm)[:, 0], -lsm[np.arange(6), targets].mean(), (np.exp(lsm) - onehot) * 0.75 / 6,
         np.count_nonzero(logits.argmax(-1) == targets), 5.0, 0.0],
        logits=logits, targets=targets, g=g, ties=ties, first_max=first_max, last_max=last_max,
    )


def attention_ref(q, k, v, softcap=0.0, window=0):
    """Causal GQA attention: query head h reads KV head h // (n_head / n_head_kv); softcapped
    scores cap * tanh(scale * s / cap) (gemma2), sliding window as llama.cpp's is_masked_swa."""
    B, T, H, d = q.shape
    group = H // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kk)
    scale = 1 / math.sqrt(d)
    if softcap:
        s, scale = softcap * np.tanh(s * scale / softcap), 1.0
    p = causal_softmax_ref(s, scale, T, 0, window)
    return np.einsum("bhts,bshd->bthd", p, vv).reshape(B * T, H * d)


@pytest.mark.parametrize("softcap,window", [(0.0, 0), (2.0, 0), (0.0, 3), (1.5, 2)])
def test_attention_gqa(name, softcap, window):
    B, T, H, Hkv, d = 2, 7, 6, 2, 5
    q, k, v = 2 * randn(B, T, H, d), randn(B, T, Hkv, d), randn(B, T, Hkv, d)
    check_forward(name, lambda q, k, v: _attn(q, k, v, softcap, window), attention_ref(q, k, v, softcap, window),
                  q=q, k=k, v=v)


@pytest.mark.parametrize("precision,lo,hi", [("tf32", 1e-5, 2e-3), ("bf16", 1e-4, 1e-2)])
def test_reduced_precision_matmul(name, precision, lo, hi):
    """tf32/bf16 products stay accurate to their format; under the emulator (exact rounding, as the
    tensor cores do) the error also shows the inputs really were rounded. cuBLAS may legitimately
    pick a more precise kernel for a FAST compute type, so on a GPU only the upper bound holds."""
    if name == "cpu":
        pytest.skip("a CUDA backend option")

    base = backend_for(name)
    be = CUDABackend(np.float32, runtime=base.rt, precision=precision)
    a, b = randn(3, 64, 96), randn(80, 96)
    got = run_graph(be, lambda a, b: ops.matmul(a, b, tb=True), {"a": a, "b": b})[0]
    err = np.abs(got - a @ b.T).max() / np.abs(a @ b.T).max()
    assert err < hi
    if name == "cuda-emu":
        assert err > lo
    with pytest.raises(LlmtuneError):
        CUDABackend(np.float64, runtime=base.rt, precision=precision)


# ------------------------------------------------------------------------------ gradients
def _attn(q, k, v, softcap=0.0, window=0):
    """Causal grouped-query attention -> [B * T, H * d] (the shape the output projection reads)."""
    B, T, H, d = q.shape
    return ops.reshape(causal_attention(q, k, v, 1.0 / math.sqrt(d), softcap=softcap, window=window), (B * T, H * d))


def _consts(values):
    """A float vector known to the graph (no gradient): one-hot pads of scalar constants, summed."""
    out = None
    for i, v in enumerate(values):
        term = ops.pad_axis(ops.const(v, (1,)), 0, i, len(values))
        out = term if out is None else ops.add(out, term)
    return out


def _fused_gate_up(x, w):
    """phi3's FFN entry: one product, split in halves of its last axis."""
    fused = ops.linear(x, w)
    n = w.shape[0] // 2
    return ops.swiglu(ops.cont(ops.slice_axis(fused, 1, 0, n)), ops.cont(ops.slice_axis(fused, 1, n, 2 * n)))


GRAD_CASES = {
    "add_broadcast": (lambda a, b: ops.add(a, b), {"a": (2, 3, 4), "b": (3, 1)}, {}),
    "mul_broadcast": (lambda a, b: ops.mul(a, b), {"a": (2, 3, 4), "b": (4,)}, {}),
    "scale": (lambda a: ops.scale(a, -1.7), {"a": (3, 4)}, {}),
    "sum_to": (lambda a: ops.sum_to(a, (3, 1)), {"a": (2, 3, 4)}, {}),
    "broadcast_to": (lambda a: ops.broadcast_to(a, (2, 3, 4)), {"a": (3, 1)}, {}),
    "silu": (lambda a: ops.silu(a), {"a": (3, 5)}, {}),
    "swiglu": (lambda a, b: ops.swiglu(a, b), {"a": (3, 5), "b": (3, 5)}, {}),
    "gelu": (lambda a: ops.gelu(a), {"a": (3, 5)}, {}),
    "geglu": (lambda a, b: ops.geglu(a, b), {"a": (3, 5), "b": (3, 5)}, {}),
    "softcap": (lambda a: ops.softcap(a, 1.5), {"a": (3, 5)}, {}),
    # softcap of a computed value runs in place, and so does its backward over the output
    "softcap_inplace": (lambda a, b: ops.softcap(ops.matmul(a, b), 2.0), {"a": (3, 4), "b": (4, 5)}, {}),
    "matmul": (lambda a, b: ops.matmul(a, b), {"a": (2, 3, 4), "b": (4, 5)}, {}),
    "matmul_tt": (lambda a, b: ops.matmul(a, b, True, True), {"a": (4, 3), "b": (5, 4)}, {}),
    "matmul_batch_broadcast": (lambda a, b: ops.matmul(a, b, tb=True), {"a": (2, 1, 3, 4), "b": (3, 2, 4)}, {}),
    "permute_reshape": (lambda a: ops.reshape(ops.permute(a, (1, 0, 2)), (3, 8)), {"a": (2, 3, 4)}, {}),
    "slice": (lambda a: ops.slice_axis(a, 1, 1, 3), {"a": (2, 4, 3)}, {}),
    "pad": (lambda a: ops.pad_axis(a, 1, 2, 6), {"a": (2, 3, 2)}, {}),
    "slice_last_axis_cont": (lambda a: ops.geglu(ops.cont(ops.slice_axis(a, 1, 0, 3)),
                                                 ops.cont(ops.slice_axis(a, -1, 3, 6))),
                             {"a": (4, 6)}, {}),
    # phi3's fused gate+up projection, split in halves of the product's last axis
    "fused_gate_up": (_fused_gate_up, {"x": (4, 5), "w": (6, 5)}, {}),
    "pos_embd": (lambda tok, pos_w, ids, pos: ops.add(ops.get_rows(tok, ids), ops.get_rows(pos_w, pos)),
                 {"tok": (5, 3), "pos_w": (6, 3)},
                 {"ids": np.array([[4, 0, 4], [1, 1, 2]]), "pos": np.array([0, 1, 5])}),
    "get_rows": (lambda w, ids: ops.get_rows(w, ids), {"w": (5, 3)}, {"ids": np.array([[4, 0, 4], [1, 1, 2]])}),
    "add_rows": (lambda g, ids: ops.add_rows(g, ids, 5), {"g": (6, 3)}, {"ids": np.array([0, 4, 4, 2, 0, 0])}),
    "rms_norm": (lambda x: ops.rms_norm(x, 1e-5), {"x": (3, 7)}, {}),
    "row_rnorm": (lambda x: ops.row_rnorm(x), {"x": (3, 7)}, {}),
    "layer_norm": (lambda x: ops.layer_norm(x, 1e-5), {"x": (3, 7)}, {}),
    # with the caller's affine weight and bias, as build_norm applies them
    "layer_norm_affine": (lambda x, w, b: ops.add(ops.mul(ops.layer_norm(x, 1e-5), w), b),
                          {"x": (2, 3, 5), "w": (5,), "b": (5,)}, {}),
    "rope_norm_partial": (lambda x, pos: ops.rope(x, pos, 4, 100.0, 1.0, "norm"), {"x": (1, 3, 2, 6)},
                          {"pos": np.array([2, 3, 4])}),
    "rope_neox": (lambda x, pos: ops.rope(x, pos, 6, 100.0, 0.5, "neox"), {"x": (1, 3, 2, 6)},
                  {"pos": np.array([0, 1, 5])}),
    "rope_norm_factors": (lambda x, pos: ops.rope(x, pos, 4, 100.0, 1.0, "norm", freq_factors=_consts([2.0, 0.3])),
                          {"x": (1, 3, 2, 6)}, {"pos": np.array([2, 3, 4])}),
    "rope_neox_factors": (lambda x, pos: ops.rope(x, pos, 6, 100.0, 0.5, "neox",
                                                  freq_factors=_consts([1.0, 4.0, 0.25])),
                          {"x": (2, 3, 2, 6)}, {"pos": np.array([0, 1, 5])}),
    "softmax_causal": (lambda x: ops.softmax_causal(x, 0.7, n_kv=4, n_q=3, n_past=1), {"x": (2, 6, 4)}, {}),
    "softmax_masked": (lambda x, mask: ops.softmax_masked(x, 0.7, mask), {"x": (2, 6, 4)},
                       {"mask": np.array([[[0, -np.inf, 0, 0], [0, 0, -np.inf, -np.inf], [-np.inf, 0, 0, -np.inf]],
                                          [[0, 0, 0, 0], [-np.inf, -np.inf, -np.inf, 0], [0, 0, -np.inf, 0]]])}),
    "softmax_causal_window": (lambda x: ops.softmax_causal(x, 0.7, n_kv=5, n_q=3, n_past=2, window=2), {"x": (2, 6, 5)},
                              {}),
    "cross_entropy": (lambda logits, t: ops.cross_entropy(logits, t), {"logits": (4, 6)},
                      {"t": np.array([0, 5, 2, 2])}),
    "cross_entropy_masked": (lambda logits, t: ops.cross_entropy(logits, t), {"logits": (4, 6)},
                             {"t": np.array([0, -1, 2, -1])}),
    "token_nll_masked": (lambda logits, t: ops.token_nll(logits, t), {"logits": (4, 6)},
                         {"t": np.array([3, -1, 2, 0])}),
    "token_nll_inplace": (lambda a, b, t: ops.token_nll(ops.matmul(a, b), t), {"a": (4, 3), "b": (3, 6)},
                          {"t": np.array([1, 5, -1, 0])}),
    "softmax_causal_pos": (lambda x, pos: ops.softmax_causal(x, 0.7, n_kv=6, n_q=2, window=3, pos=pos),
                           {"x": (2, 4, 6)},
                           {"pos": np.array([3, 5])}),
    "softmax_causal_pos_per_seq": (lambda x, pos: ops.softmax_causal(x, 0.7, n_kv=6, n_q=2, window=3, pos=pos),
                                   {"x": (2, 2, 4, 6)},
                                   {"pos": np.array([[3, 4], [1, 5]])}),
    # logits computed by an op: the backward overwrites them in place
    "cross_entropy_inplace": (lambda a, b, t: ops.cross_entropy(ops.matmul(a, b), t), {"a": (4, 3), "b": (3, 6)},
                              {"t": np.array([1, 5, 0, 0])}),
    # a scheduling view: the value and gradient of its first input, none for the dependency
    "after": (lambda a, b: ops.add(ops.after(ops.scale(a, 2.0), ops.silu(b)), b), {"a": (2, 3), "b": (2, 3)}, {}),
    "attention_gqa": (_attn, {"q": (1, 3, 4, 2), "k": (1, 3, 2, 2), "v": (1, 3, 2, 2)}, {}),
    # an adapter's term over a computed base product (in place over it) and a computed input
    "lora": (lambda y, x, a, b: ops.lora(ops.scale(y, 2.0), ops.silu(x), a, b, 0.6),
             {"y": (2, 3, 5), "x": (2, 3, 4), "a": (3, 4), "b": (5, 3)}, {}),
    # the first layer's: its input (the embedding of frozen rows) has no gradient, so no dx is computed
    "lora_no_dx": (lambda y, a, b, ids: ops.lora(y, ops.get_rows(ops.const(0.5, (4, 4)), ids), a, b, -1.3),
                   {"y": (3, 2), "a": (1, 4), "b": (2, 1)}, {"ids": np.array([0, 3, 3])}),
    "attention_softcap_window": (lambda q, k, v: _attn(q, k, v, softcap=1.5, window=2),
                                 {"q": (1, 4, 4, 2), "k": (1, 4, 2, 2), "v": (1, 4, 2, 2)}, {}),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_gradients_match_finite_differences(name, case):
    build, shapes, int_inputs = GRAD_CASES[case]
    arrays = {k: rng.standard_normal(s) for k, s in shapes.items()}
    errors = check_gradients(build, arrays, backend_for(name, np.float64), int_inputs=int_inputs)
    assert set(errors) == set(shapes)
    assert max(errors.values()) < 1e-6, errors


def _plain_attention(q, k, v, scale, softcap=0.0, window=0):
    """The composition ops.flash_attn replaces (and the KV-cached path still uses): the [T, T]
    scores of each KV head's stacked query group, softmax_causal, probabilities times V."""
    B, T, H, d = q.shape
    Hkv = k.shape[2]
    qg = ops.reshape(ops.permute(q, (0, 2, 1, 3)), (B, Hkv, (H // Hkv) * T, d))
    kt, vt = ops.cont(ops.permute(k, (0, 2, 1, 3))), ops.cont(ops.permute(v, (0, 2, 1, 3)))
    scores = ops.matmul(qg, kt, tb=True)
    if softcap:
        scores, scale = ops.softcap(ops.scale(scores, scale), softcap), 1.0
    probs = ops.softmax_causal(scores, scale, n_kv=T, n_q=T, window=window)
    return ops.permute(ops.reshape(ops.matmul(probs, vt), (B, H, T, d)), (0, 2, 1, 3))


def _attention_and_grads(backend, attention, arrays, r):
    """attention(q, k, v) and the gradients of sum(out * r) wrt q, k, v, as host float64 arrays."""
    nodes = {n: ops.param(a.shape, name=n) for n, a in arrays.items()}
    out = ops.reshape(attention(**nodes), r.shape)
    weights = ops.input(r.shape, name="r")
    grads = grad(ops.sum_to(ops.mul(out, weights), ()), list(nodes.values()))
    prog = Program([out] + [grads[n] for n in nodes.values()], backend,
                   params={nodes[n]: backend.asarray(a) for n, a in arrays.items()})
    return [backend.to_numpy(x).astype(np.float64) for x in prog.run(r=backend.asarray(r))]


# (B, T, H, Hkv, d, softcap, window): query blocks of 4 positions (cpu), so T crosses several,
# partial last blocks, window edges inside and across blocks, grouped-query heads
FLASH_CASES = [(2, 13, 4, 2, 3, 0.0, 0), (1, 11, 6, 2, 4, 1.5, 0), (1, 14, 2, 1, 5, 0.0, 5), (2, 9, 4, 1, 3, 2.0, 3),
               (1, 6, 3, 3, 2, 0.0, 2)]


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attention_matches_plain_composition(name, case, monkeypatch):
    """Blockwise attention equals the [T, T] composition in float64, forward and gradients."""

    monkeypatch.setattr(cpu_attention, "_FA_BLOCK", 4)
    B, T, H, Hkv, d, cap, window = case
    arrays = {"q": rng.standard_normal((B, T, H, d)), "k": rng.standard_normal((B, T, Hkv, d)),
              "v": rng.standard_normal((B, T, Hkv, d))}
    r = rng.standard_normal((B, T, H, d))
    scale = 1 / math.sqrt(d)
    be = backend_for(name, np.float64)
    got = _attention_and_grads(be, lambda q, k, v: ops.flash_attn(q, k, v, scale, cap, window), arrays, r)
    want = _attention_and_grads(backend_for("cpu", np.float64),
                                lambda q, k, v: _plain_attention(q, k, v, scale, cap, window), arrays, r)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-12)


@pytest.mark.parametrize("cap,window", [(0.0, 0), (1.5, 3)])
def test_flash_attention_gradients_across_blocks(name, cap, window, monkeypatch):
    """Finite differences through several query and key blocks (blocks of 2 positions on the cpu)."""

    monkeypatch.setattr(cpu_attention, "_FA_BLOCK", 2)
    arrays = {"q": rng.standard_normal((1, 5, 4, 2)), "k": rng.standard_normal((1, 5, 2, 2)),
              "v": rng.standard_normal((1, 5, 2, 2))}
    errors = check_gradients(lambda q, k, v: ops.flash_attn(q, k, v, 0.8, cap, window), arrays,
                             backend_for(name, np.float64))
    assert max(errors.values()) < 1e-6, errors


def test_flash_attention_keeps_no_score_matrix():
    """Training memory of attention grows with T, not T^2: the planned arena at T = 1024 is far
    below one [H, T, T] float32 score matrix (what the plain composition keeps per layer)."""
    B, T, H, d = 1, 1024, 4, 16
    q, k, v = (ops.param((B, T, H, d), name=n) for n in "qkv")
    out = ops.flash_attn(q, k, v, 0.25)
    grads = grad(ops.sum_to(out, ()), [q, k, v])
    params = {n: np.zeros(n.shape, np.float32) for n in (q, k, v)}
    prog = Program([grads[n] for n in (q, k, v)], CPUBackend(), params=params)
    assert prog.memory.planned_bytes < H * T * T * 4 / 8


# ------------------------------------------------------------------------------ optimizers
def adamw_ref(w, g, m, v, lr, beta1, beta2, eps, wd, t):
    """ggml_opt_step_adamw in float64."""
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    mh = m / (1 - beta1**t)
    vh = np.sqrt(v / (1 - beta2**t)) + eps
    return w * (1 - lr * wd) - lr * mh / vh, m, v


@pytest.mark.parametrize("dtype,rel", [(np.float32, 2e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_ggml(name, dtype, rel, wd):
    be = backend_for(name, dtype)
    n = 1001
    w, m, v = randn(n), 0.1 * randn(n), np.abs(randn(n)) * 0.01
    hp = dict(lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8, wd=wd)
    dw, dm, dv = (be.asarray(a.astype(dtype)) for a in (w, m, v))
    for t in (1, 2, 3):  # each step checked from the backend's own state before it
        g = randn(n)
        w0, m0, v0 = (be.to_numpy(a).astype(np.float64) for a in (dw, dm, dv))
        be.adamw_step(dw, be.asarray(g.astype(dtype)), dm, dv, t=t, **hp)
        w_ref, m_ref, v_ref = adamw_ref(w0, g, m0, v0, t=t, **hp)
        assert_close(be.to_numpy(dw) - w0, w_ref - w0, rel)  # the update itself, not just w
        assert_close(be.to_numpy(dm), m_ref, rel)
        assert_close(be.to_numpy(dv), v_ref, rel)


@pytest.mark.parametrize("dtype,rel", [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_sgd_matches_ggml(name, dtype, rel):
    be = backend_for(name, dtype)
    w, g, lr, wd = randn(1001), randn(1001), 0.05, 0.1
    dw = be.asarray(w.astype(dtype))
    be.sgd_step(dw, be.asarray(g.astype(dtype)), lr=lr, wd=wd)
    assert_close(be.to_numpy(dw) - w, w * (1 - lr * wd) - lr * g - w, rel)


# ------------------------------------------------------------------------------ weights kept in a GGUF type
QTYPE_NAMES = ("F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_VEC_DOT = {"F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0", "Q4_1": "q8_1",
            "Q5_1": "q8_1", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K"}


def stored_matrix(w: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 block bytes [rows, bytes per row], their float64 values decoded by gguf-py)."""


    qt = gguf.GGMLQuantizationType[qtype]
    raw = np.ascontiguousarray(blocks.quantize(w.astype(np.float32), qt)).view(np.uint8).reshape(w.shape[0], -1)
    if qtype == "F16":
        return raw, raw.view(np.float16).astype(np.float64)
    return raw, gguf.quants.dequantize(raw, qt).astype(np.float64).reshape(w.shape)


def ggml_round_ref(x: np.ndarray, act: str):
    """ggml's CPU conversion of float32 activation rows to a vec_dot_type and back, transcribed
    block by block from quants.c / ggml-quants.c (x86 quantize_row_q8_0 / q8_1, quantize_row_q8_K_ref,
    fp16 and bf16 rounding): (x~ float64, per-block Q8_1 correction s - fp16(d) * sum q or None)."""
    f32 = np.float32
    x = np.asarray(x, f32)
    out = np.empty(x.shape, np.float64)
    if act == "f16":
        return x.astype(np.float16).astype(np.float64), None
    if act == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(f32).astype(np.float64), None
    size = 256 if act == "q8_K" else 32
    corr = np.zeros((x.shape[0], x.shape[1] // size))
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // size):
            v = x[r, b * size:(b + 1) * size]
            if act == "q8_K":
                i = int(np.argmax(np.abs(v)))  # the first largest |x|
                if v[i] == 0:
                    out[r, b * size:(b + 1) * size] = 0
                    continue
                iscale = f32(-127.0) / v[i]
                q = np.minimum(np.rint(iscale * v), f32(127))
                out[r, b * size:(b + 1) * size] = q * (f32(1.0) / iscale)
                continue
            amax = np.abs(v).max()
            d = amax / f32(127)
            inv = f32(127) / amax if amax else f32(0)
            q = np.rint(v * inv)
            dh = f32(np.float16(d))
            out[r, b * size:(b + 1) * size] = q.astype(np.float64) * dh
            if act == "q8_1":
                s = f32(np.float16(d * f32(q.sum())))
                corr[r, b] = float(s) - float(dh) * float(q.sum())
    return out, corr if act == "q8_1" else None


def qlinear_ref(x: np.ndarray, raw: np.ndarray, wd: np.ndarray, qtype: str, round_x: bool) -> np.ndarray:
    """float64: x (rounded as ggml rounds it) @ W^T, plus ggml's Q4_1/Q5_1 min term from s."""
    x2 = x.reshape(-1, x.shape[-1])
    if not round_x:
        return (x2 @ wd.T).reshape(x.shape[:-1] + (wd.shape[0],))
    xr, corr = ggml_round_ref(x2, _VEC_DOT[qtype])
    y = xr @ wd.T
    if corr is not None:
        size = {"Q4_1": 20, "Q5_1": 24}[qtype]
        mins = np.ascontiguousarray(raw.reshape(raw.shape[0], -1, size)[:, :, 2:4]).view(np.float16)[..., 0]
        y += corr @ mins.astype(np.float64).T
    return y.reshape(x.shape[:-1] + (wd.shape[0],))


def activations(*shape) -> np.ndarray:
    """Rows of different scales with outliers and an all-zero block, as real activations."""
    x = randn(*shape) * np.exp(randn(*shape[:-1], 1))
    x[..., 3] *= 30.0
    x.reshape(-1, shape[-1])[0, :256] = 0.0
    return x.astype(np.float32).astype(np.float64)


def run_stored(backend, build, raw: np.ndarray, shape, arrays: dict) -> list[np.ndarray]:
    w = ops.qweight(shape, build.qtype, name="w")
    nodes = {k: ops.input(v.shape, "i32" if v.dtype.kind in "iu" else "f32", name=k) for k, v in arrays.items()}
    prog = Program(build(w, **nodes), backend, params={w: backend.asarray(raw)})
    feed = {k: backend.asarray(v.astype(np.int32 if v.dtype.kind in "iu" else backend.dtype))
            for k, v in arrays.items()}
    return [backend.to_numpy(r).astype(np.float64) for r in prog.run(**feed)]


@pytest.mark.parametrize("qtype", QTYPE_NAMES)
def test_stored_weight_ops(name, qtype, monkeypatch):
    """qlinear (activations rounded as ggml's CPU matmul rounds them, and not), qlinear_back,
    qget_rows and dequantize against gguf-py's decoding and a transcription of ggml's activation
    quantizers; W is dequantized in blocks of 3 rows, so the blocked paths run."""

    be = backend_for(name)
    n_out, n_in = 7, 512
    monkeypatch.setattr(qmatmul, "SCRATCH_ELEMENTS", 3 * n_in)
    if name != "cpu":
        monkeypatch.setattr(be, "q_scratch_elements", 3 * n_in)
    w = 0.05 * randn(n_out, n_in) + 0.01 * (np.arange(n_in) % 5)  # offsets: the Q4_1/Q5_1 mins matter
    raw, wd = stored_matrix(w, qtype)
    x, g = activations(2, 3, n_in), randn(2, 3, n_out)
    ids = np.array([[0, 6, 3], [3, 3, 1]], dtype=np.int32)

    def build(w, x, g, ids):
        return [ops.qlinear(x, w), ops.qlinear(x, w, round_x=False), ops.qlinear_back(g, w), ops.qget_rows(w, ids),
                ops.dequantize(w)]

    build.qtype = qtype
    want = [qlinear_ref(x, raw, wd, qtype, True), qlinear_ref(x, raw, wd, qtype, False), g @ wd, wd[ids], wd]
    got = run_stored(be, build, raw, (n_out, n_in), {"x": x, "g": g, "ids": ids})
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, 1e-6 if k < 3 else 0.0)
    # the rounding is no small matter: without it the product is visibly off
    assert np.abs(got[1] - want[0]).max() > 1e-5 * np.abs(want[0]).max()


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q5_1"])
def test_stored_weight_gradient(name, qtype):
    """Only the input gets a gradient, g @ W, straight through the activations' rounding."""

    be = backend_for(name, np.float64)
    raw, wd = stored_matrix(0.3 * randn(3, 64), qtype)
    w = ops.qweight((3, 64), qtype, name="w")
    errors = check_gradients(lambda x: ops.qlinear(x, w, round_x=False), {"x": rng.standard_normal((2, 2, 64))}, be,
                             leaves={w: be.asarray(raw)})
    assert errors["x"] < 1e-6, errors
    x = ops.param((2, 64), name="x")
    y = ops.qlinear(x, w)
    assert not w.requires_grad and y.requires_grad
    assert grad(ops.sum_to(y, ()), [x, w]).keys() == {x}
    assert grad(ops.sum_to(y, ()), [x])[x].op == "qlinear_back"


def test_stored_weight_shapes_are_checked():
    w = ops.qweight((4, 64), "Q8_0", name="w")
    with pytest.raises(ValueError):
        ops.qlinear(ops.input((2, 32), name="x"), w)
    with pytest.raises(ValueError):
        ops.qweight((4, 64), "Q2_K")
    with pytest.raises(ValueError):
        ops.qlinear(ops.input((2, 64), name="x"), ops.param((4, 64), name="p"))


def test_stored_weight_matches_ggml_kernels():
    """Products recorded from ggml's own CPU kernels (bench/check_qmatmul.py --record: from_float of
    each type's vec_dot_type, then vec_dot) on this fixture's bytes: qlinear gives them to float
    summation order, and the same product with unrounded activations does not."""

    rec = np.load(DATA_DIR / "qmatmul" / "ggml-products.npz")
    x = rec["x"]
    for qtype in QTYPE_NAMES:
        raw, theirs = rec[f"{qtype}.raw"], rec[f"{qtype}.out"]
        ours = qmatmul.qlinear(np.empty_like(theirs), x, raw, qtype)
        plain = qmatmul.qlinear(np.empty_like(theirs), x, raw, qtype, round_x=False)
        scale = np.abs(theirs).max()
        assert np.abs(ours - theirs).max() <= 2e-6 * scale, qtype
        assert np.abs(plain - theirs).max() > 1e-4 * scale, qtype


# ------------------------------------------------------------------------------ whole model
def test_training_steps_match_cpu(name, stories_path, wikitext_ids):
    """stories260K through the Trainer: losses and SGD updates (linear in the gradients) agree with
    the CPU backend, so every kernel also works on the layouts the real llama graph produces."""
    if name == "cpu":
        pytest.skip("the reference itself")

    model = load_model(stories_path)
    x = np.stack([wikitext_ids[0:64], wikitext_ids[300:364]])
    y = np.stack([wikitext_ids[1:65], wikitext_ids[301:365]])
    results = {}
    for be_name in ("cpu", name):
        trainer = Trainer(model, backend_for(be_name), n_ctx=64, n_batch=128, n_ubatch=64,
                          trainable=list(model.weights), optimizer="sgd", wd=0.1)
        stats = RunningStats()
        losses = [trainer.train_step(x, y, 0.5, stats) for _ in range(2)]
        results[be_name] = losses, stats.correct, trainer.trained_weights()
    (cpu_losses, cpu_correct, cpu_w), (losses, correct, w) = results["cpu"], results[name]
    assert_close(losses, cpu_losses, 1e-5)
    assert correct == cpu_correct
    for k, w0 in model.weights.items():
        assert_close(w[k] - w0, cpu_w[k] - w0, 1e-4)


# ------------------------------------------------------------------------------ CUDA specifics (no GPU needed)
def test_cuda_module_import_does_not_import_cupy():
    code = "import sys, llmtune.backends.cuda, llmtune.backends.base; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_without_device_is_a_one_line_user_error():

    assert isinstance(cuda.available(), bool)
    if cuda.available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(LlmtuneError) as exc:
        get_backend("cuda")
    assert str(exc.value).startswith("--backend cuda: ") and "\n" not in str(exc.value)
    assert isinstance(get_backend("auto"), CPUBackend)


def test_reduced_precision_needs_cuda():
    with pytest.raises(LlmtuneError, match="--precision bf16"):
        get_backend("cpu", precision="bf16")


def _views():
    """(label, array) operands: contiguous, transposed, permuted, sliced, batch-broadcast."""
    base = randn(2, 3, 5, 7)
    return [
        ("contiguous", base),
        ("transposed", np.swapaxes(randn(2, 3, 7, 5), -1, -2)),
        ("permuted", np.transpose(randn(2, 5, 3, 7), (0, 2, 1, 3))),
        ("row_slice", randn(2, 3, 9, 7)[:, :, 2:7]),
        ("batch_broadcast", np.broadcast_to(randn(5, 7), (2, 3, 5, 7))),
    ]


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_gemm_plan_reads_views_in_place(ta, tb):
    """plan_gemm + cuBLAS's column-major contract (executed literally on the raw memory) == np.matmul,
    without copying transposed, permuted, sliced or broadcast operands."""

    runtime = cuda_emu.EmuRuntime()
    st = cuda.element_strides
    for (la, a), (lb, b) in [(x, y) for x in _views() for y in _views()]:
        a_in = np.swapaxes(a, -1, -2) if ta else a  # op(a_in) == a, as a view
        b_in = b if tb else np.swapaxes(b, -1, -2)  # op(b_in) == b^T, as a view
        want = np.matmul(a, np.swapaxes(b, -1, -2))
        out = np.empty(want.shape)
        plan = cuda.plan_gemm(a_in.shape, st(a_in), b_in.shape, st(b_in), out.shape, st(out), ta, tb)
        assert plan is not None, (la, lb)
        runtime.gemm(np.float64, plan, b_in.ctypes.data, a_in.ctypes.data, out.ctypes.data)
        assert_close(out, want, 1e-12)


def test_gemm_plan_refuses_unreadable_views():

    a = randn(6, 8)[::2, ::2]  # neither rows nor columns contiguous
    b = randn(4, 2)
    st = cuda.element_strides
    assert cuda.plan_gemm(a.shape, st(a), b.shape, st(b), (3, 2), (2, 1), False, False) is None


def test_cuda_kernels_compile_with_nvrtc():
    """The CUDA sources compile for both dtypes (needs cupy + NVRTC, not a GPU)."""
    pytest.importorskip("cupy")
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415 - optional, probed where used

        nvrtc.getVersion()
    except Exception as exc:  # the NVRTC shared library is not installed
        pytest.skip(f"NVRTC unavailable: {exc}")

    for dtype in (np.float32, np.float64):
        prog = nvrtc.createProgram(cuda.kernel_source(dtype), "llmtune.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_75"])
        except Exception:
            pytest.fail(nvrtc.getProgramLog(prog))
        finally:
            nvrtc.destroyProgram(prog)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux only")
def test_release_zeros_hands_back_whole_pages_inside_only():
    """CPU release_zeros (backends/cpu/pages.py) drops exactly the pages lying wholly inside the
    stretch: those read zeros again (ones written here to see it; callers hand back zeros), the
    partly covered pages at either end and everything outside keep their values."""
    page = mmap.PAGESIZE // 4
    buf = np.ones(16 * page + 3, dtype=np.float32)  # large: its own mapping; a page at each end partly outside
    lo, hi = 5, 16 * page - 7
    released = pages.release_zeros(buf[lo:hi])
    first = -(-(buf.ctypes.data + lo * 4) // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (buf.ctypes.data + hi * 4) // mmap.PAGESIZE * mmap.PAGESIZE
    assert released == last - first > 0
    i0, i1 = (first - buf.ctypes.data) // 4, (last - buf.ctypes.data) // 4
    assert lo <= i0 < i1 <= hi
    assert not buf[i0:i1].any() and (buf[:i0] == 1).all() and (buf[i1:] == 1).all()
    buf[i0:i1] = 2.0  # writable memory again
    assert (buf[i0:i1] == 2).all()
    assert pages.release_zeros(buf[:0]) == 0 and pages.release_zeros(buf[::2]) == 0
