"""A replayed program's kernels as steps of one compiled call (program.c lt_run).

A decode step of a small model is ~600 kernel calls (norms, rope, attention, products, adds); as
Python calls each costs a few microseconds of interpreter and numpy dispatch, as much as the
arithmetic. graph/planner.py Replay asks each kernel for its step (`kernel.encode(out, *args,
**attrs)`: one of the encoders below, attached in backends/cpu.py) and runs every run of
consecutive encoded steps as one `lt_run` over fixed buffers. An encoder returns None where the
compiled op does not take the case (a dtype, a layout, an attribute): that kernel stays a Python
call. Each compiled op computes what the numpy kernel computes (program.c says where the rounding
can differ).
"""

from __future__ import annotations

import ctypes

import numpy as np

from llmtune.backends.cpu.native import kernels
from llmtune.graph.ops import rope_inv_freq
from llmtune.quant.types import QTYPES

OPS = {"add": 0, "mul": 1, "rms_norm": 2, "qlinear": 3, "f32_linear": 4, "rope": 5, "cache_write": 6,
       "matmul": 7, "softmax_causal": 8, "swiglu": 9, "get_rows": 10, "qget_rows": 11, "scale": 12}
QGET_TYPES = {t: QTYPES[t].ggml_id for t in ("Q8_0", "Q4_0", "Q4_1")}  # the embedding row types op_qget_rows decodes
MAX_ROPE = 1024  # rotated dims (program.c's tables)


class Step(ctypes.Structure):
    """program.c lt_step: an op code, integer arguments, pointers, float arguments."""

    _fields_ = [("op", ctypes.c_int64), ("n", ctypes.c_int64 * 16), ("p", ctypes.c_void_p * 6),
                ("f", ctypes.c_double * 2)]


def _step(op: str, ptrs, ints=(), floats=(), keep=()):
    s = Step()
    s.op = OPS[op]
    for i, v in enumerate(ints):
        s.n[i] = int(v)
    for i, a in enumerate(ptrs):
        s.p[i] = None if a is None else _addr(a)
    for i, v in enumerate(floats):
        s.f[i] = float(v)
    s.keep = tuple(a for a in ptrs if a is not None) + tuple(keep)  # the arrays whose addresses it holds
    return s


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _f32(*arrays) -> bool:
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


def _i32(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.int32 and a.flags.c_contiguous


# ------------------------------------------------------------------------------ encoders: kernel(out, *args, **attrs)
def _binary(op):
    def encode(out, a, b):
        if not _f32(out, a, b) or a.shape != out.shape or out.ndim == 0:
            return None
        if b.shape == out.shape:
            bcast = 0
        elif b.size == out.shape[-1] and b.shape == out.shape[-b.ndim:]:
            bcast = 1  # a weight vector over the rows (a norm's gain)
        else:
            return None
        return _step(op, (a, b, out), (out.size, out.shape[-1], bcast))
    return encode


add, mul = _binary("add"), _binary("mul")


def scale(out, a, s):
    if not (_f32(out, a) and a.shape == out.shape):
        return None
    return _step("scale", (a, None, out), (a.size,), (np.float32(s),))


def rms_norm(out, x, eps):
    if not _f32(out, x) or x.shape != out.shape or x.ndim == 0:
        return None
    return _step("rms_norm", (x, None, out), (x.size // x.shape[-1], x.shape[-1]), (np.float32(eps),))


def swiglu(out, gate, up):
    if not _f32(out, gate, up) or not gate.shape == up.shape == out.shape:
        return None
    return _step("swiglu", (gate, up, out), (out.size,))


def qlinear(out, x, w, qtype, round_x, packed=None):
    """packed: the matrix's kernels.pack copy (read for its whole row groups), or None."""
    if not round_x or qtype not in kernels.TYPE_CODES or not _f32(out, x) or not isinstance(w, np.ndarray):
        return None
    x2, o2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    if x2.shape[0] > kernels.MAX_ROWS or w.dtype != np.uint8 or w.ndim != 2 or w.strides[-1] != 1 \
            or w.shape[0] != o2.shape[1]:
        return None
    return _step("qlinear", (x, w, out, packed), (kernels.TYPE_CODES[qtype], w.strides[0], o2.shape[1], x2.shape[1],
                                                  x2.shape[0], o2.shape[1]))


def _strides4(a: np.ndarray, shape4) -> tuple | None:
    """a's element strides as a [B0, B1, rows, cols] array broadcast to shape4 (0 where broadcast)."""
    if a.ndim > 4 or any(st % a.itemsize for st in a.strides):
        return None
    pad = 4 - a.ndim
    dims, strides = (1,) * pad + a.shape, (0,) * pad + tuple(st // a.itemsize for st in a.strides)
    out = []
    for d, st, want in zip(dims, strides, shape4):
        if d == want:
            out.append(st if d > 1 else 0)
        elif d == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def matmul(out, a, b, ta, tb):
    """A weight product (x [.., n_in] times w [n_out, n_in]^T, few rows) as f32_linear; any other
    (attention's q k^T and p v) as the batched op."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype == np.float32
            and _f32(out)):
        return None
    if tb and not ta and b.ndim == 2 and b.flags.c_contiguous and a.flags.c_contiguous:
        x2, o2 = a.reshape(-1, a.shape[-1]), out.reshape(-1, out.shape[-1])
        if x2.shape[0] > kernels.MAX_ROWS:
            return None
        return _step("f32_linear", (a, b, out), (0, b.strides[0], b.shape[0], b.shape[1], x2.shape[0], o2.shape[1]))
    if a.ndim < 2 or b.ndim < 2 or out.ndim > 4:
        return None
    av = np.swapaxes(a, -1, -2) if ta else a
    bv = np.swapaxes(b, -1, -2) if tb else b
    M, K = av.shape[-2:]
    K2, N = bv.shape[-2:]
    if K != K2 or out.shape[-2:] != (M, N):
        return None
    shape4 = (1,) * (4 - out.ndim) + out.shape
    sa, sb = _strides4(av, shape4[:2] + (M, K)), _strides4(bv, shape4[:2] + (K, N))
    if sa is None or sb is None:
        return None
    # rows and columns keep their strides even where a dimension is 1 (the op indexes them)
    sa = sa[:2] + tuple(st // a.itemsize for st in av.strides[-2:])
    sb = sb[:2] + tuple(st // b.itemsize for st in bv.strides[-2:])
    return _step("matmul", (a, b, out), (shape4[0], shape4[1], M, N, K) + sa + sb)


def rope(out, x, pos, freq_factors=None, *, n_rot, base, freq_scale, mode, inverse):
    if not _f32(out, x) or x.ndim != 4 or out.shape != x.shape or not _i32(pos) or pos.size != x.shape[1] \
            or n_rot % 2 or n_rot > min(MAX_ROPE, x.shape[-1]) or mode not in ("norm", "neox"):
        return None
    inv_freq = np.ascontiguousarray(rope_inv_freq(n_rot, base, freq_factors), dtype=np.float64)
    B, T, H, d = x.shape
    return _step("rope", (x, pos, out, inv_freq), (B, T, H, d, n_rot, mode == "neox", bool(inverse)), (freq_scale,))


def cache_write(out, cache, x, pos):
    if not _f32(cache, x) or not _i32(pos) or cache.ndim != 4 or x.ndim != 4:
        return None
    B, T, H, d = x.shape
    if cache.shape[:2] != (B, H) or cache.shape[3] != d or pos.shape not in ((T,), (B, T)):
        return None  # n[5]: the positions' stride per sequence (0: shared by all)
    return _step("cache_write", (cache, x, pos), (B, H, cache.shape[2], d, T, T if pos.ndim == 2 else 0))


def softmax_causal(out, x, pos=None, *, scale, n_q, n_past, window=0):
    if not _f32(out, x) or x.shape != out.shape or x.ndim < 2 or (pos is not None and not _i32(pos)):
        return None
    rows, n_kv = x.shape[-2:]
    lead = x.size // (rows * n_kv)
    # n[7]: leading rows (of rows x n_kv scores) per sequence when positions are per sequence, else 0
    per_seq = lead // x.shape[0] if pos is not None and pos.ndim == 2 else 0
    return _step("softmax_causal", (x, pos, out), (lead, rows, n_kv, n_q, n_past, window, 0, per_seq),
                 (np.float32(scale),))


def get_rows(out, w, ids):
    if not (_f32(out) and _i32(ids) and isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2
            and w.strides[-1] == 4 and out.size == ids.size * w.shape[1]):
        return None
    return _step("get_rows", (w, ids, out), (ids.size, w.shape[1], w.strides[0] // 4, w.shape[0]))


def qget_rows(out, w, ids, qtype):
    if not (qtype in QGET_TYPES and _f32(out) and _i32(ids) and isinstance(w, np.ndarray) and w.dtype == np.uint8
            and w.ndim == 2 and w.strides[-1] == 1 and out.shape[-1] % 32 == 0
            and out.size == ids.size * out.shape[-1]):
        return None
    return _step("qget_rows", (w, ids, out), (ids.size, out.shape[-1], w.strides[0], w.shape[0], QGET_TYPES[qtype]))


# ------------------------------------------------------------------------------ running them
def _causal(step, softmax):
    """`step` (a matmul) told the positions of `softmax` (softmax_causal): its visible keys only."""
    fused = Step.from_buffer_copy(step)
    fused.p[3] = softmax.p[1]
    fused.n[13], fused.n[14], fused.n[15] = softmax.n[7], softmax.n[3], softmax.n[5]  # per sequence, n_q, window
    fused.keep = step.keep + softmax.keep
    return fused


def _fuse(steps: list, sole: list) -> list:
    """Attention over the visible keys only. Scores that only their causal softmax reads are
    computed for the visible keys (the softmax never reads a masked one); probabilities that only
    a p v product reads are summed over the visible keys (the masked ones are exactly 0) and not
    written as zeros first. The results are the same."""
    steps = list(steps)
    mm, sm = OPS["matmul"], OPS["softmax_causal"]
    for k, s in enumerate(steps):
        j = sole[k]
        if s.op != sm or s.p[1] is None:
            continue
        if k > 0 and sole[k - 1] == k and steps[k - 1].op == mm and s.p[0] == steps[k - 1].p[2] \
                and steps[k - 1].n[8] == 1 and steps[k - 1].n[11] == 1 and steps[k - 1].n[2] == s.n[1]:
            steps[k - 1] = _causal(steps[k - 1], s)  # q k^T: rows against rows
        if j > k and steps[j].op == mm and steps[j].p[0] == s.p[2] and steps[j].n[12] == 1 \
                and steps[j].n[2] == s.n[1] and steps[j].n[4] == s.n[2]:
            steps[j] = _causal(steps[j], s)  # p v: rows of v scaled and summed
            quiet = Step.from_buffer_copy(s)
            quiet.n[6] = 1  # the masked probabilities are not written
            quiet.keep = s.keep
            steps[k] = quiet
    return steps


def compile_steps(steps: list, names: list | None = None, sole: list | None = None):
    """One call with no arguments running `steps` (encoded above) in order on the pool's threads;
    None without the compiled library. sole[k]: the index of the one step reading step k's value,
    or -1 (_fuse). A step that fails (a position past the cache, a row id outside the matrix) raises
    IndexError naming it."""
    lib = kernels.library()
    if lib is None or not steps:
        return None
    if sole is not None:
        steps = _fuse(steps, sole)
    arr = (Step * len(steps))(*steps)
    keep = [s.keep for s in steps]
    run, n, threads = lib.lt_run, len(steps), kernels.threads()

    def call():
        bad = run(arr, n, threads)
        if bad >= 0:
            what = names[bad] if names else f"step {bad}"
            raise IndexError(f"compiled program: {what} has a position or row id out of range")

    call.keep = (arr, keep)
    call.n_steps = n
    return call
