"""The compiled CPU kernels (one library that build.py makes of qdot.c and its sibling sources),
loaded with ctypes: products of a few activation rows with a matrix in its ggml block type (Q4_0
... Q6_K, activations rounded to the vec_dot type as ggml rounds them) or in float32, the output
rows split over the machine's cores.

Optional: the library is built at first use (native/build.py). When it cannot be (no compiler, a
failed build) or `LLMTUNE_NATIVE=0` is set, `available()` is False and every entry returns False,
so the caller runs its numpy path. `LLMTUNE_NATIVE_THREADS` sets the thread count (default: the
cores this process may use).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import numpy as np

from llmtune.backends.cpu.native import build
from llmtune.backends.cpu.threads import blas_threads, n_cores
from llmtune.quant.types import ACT_TYPES, QTYPES

# The codes the C kernels switch on are the registry's (quant/types.py; build.py generates their
# QT_* / ACT_* #defines from it): a block type's ggml id, a vec_dot type's kind. qdot.c and
# dequant.c take every block type whose activations are rounded to a q8 type (not F16 / BF16).
TYPE_CODES = {t.name: t.ggml_id for t in QTYPES.values() if t.act.startswith("q8")}
ACT_CODES = {a.name: a.kind for a in ACT_TYPES.values() if a.name.startswith("q8")}
# (values, bytes) per block of the types pack() takes
PACK_BLOCKS = {t: (QTYPES[t].block, QTYPES[t].size) for t in ("Q8_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")}
MAX_ROWS = 16  # activation rows a native product takes: a decode step, a short prompt; more go to BLAS

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_lock = threading.Lock()
_state: dict = {}  # "lib" (the CDLL or None), "reason" (why not), "threads"
_OFF = ("0", "off", "false", "no")  # an environment switch's values that turn it off


def _load():
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, reason = None, None
        if os.environ.get("LLMTUNE_NATIVE", "1").strip().lower() in _OFF:
            reason = "disabled by LLMTUNE_NATIVE=0"
        else:
            try:
                lib = build.load("qdot")
                lib.lt_qlinear.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
                lib.lt_f32_linear.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
                lib.lt_quantize_act.argtypes = [_INT, _PTR, _I64, _PTR]
                lib.lt_quantize_act.restype = None
                lib.lt_act_row_bytes.argtypes = [_INT, _I64]
                lib.lt_act_row_bytes.restype = _I64
                lib.lt_rms_norm.argtypes = [_PTR, _I64, _I64, ctypes.c_float, _PTR]
                lib.lt_rms_norm.restype = None
                lib.lt_rms_norm_rows.argtypes = [_PTR, _I64, _I64, ctypes.c_float, _PTR, _INT]
                lib.lt_rms_norm_rows.restype = None
                lib.lt_to_f16.argtypes = [_PTR, _I64, _INT, _PTR]
                lib.lt_to_f16.restype = None
                lib.lt_run.argtypes = [_PTR, _I64, _INT]
                lib.lt_profile.argtypes = [_INT, _PTR]
                lib.lt_profile.restype = None
                lib.lt_pack_bytes.argtypes = [_INT, _I64, _I64]
                lib.lt_pack_bytes.restype = _I64
                lib.lt_pack.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR]
                lib.lt_pack.restype = None
                lib.lt_qlinear_packed.argtypes = [_INT, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
                lib.lt_run.restype = _I64
                lib.lt_swiglu.argtypes = [_PTR, _PTR, _PTR, _I64, _INT]
                lib.lt_swiglu.restype = None
                lib.lt_swiglu_back.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _INT, _INT]
                lib.lt_swiglu_back.restype = None
                lib.lt_rms_norm_back.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _INT]
                lib.lt_rms_norm_back.restype = None
                lib.lt_logsumexp.argtypes = [_PTR, _I64, _I64, _PTR, _INT]
                lib.lt_logsumexp.restype = None
                lib.lt_loss_back.argtypes = [_PTR, _PTR, _PTR, _PTR, ctypes.c_float, _PTR, _I64, _I64, _INT]
                lib.lt_loss_back.restype = None
                lib.lt_pack_wt_floats.argtypes = [_I64, _I64]
                lib.lt_pack_wt_floats.restype = _I64
                lib.lt_pack_wt.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _INT]
                lib.lt_pack_wt.restype = None
                lib.lt_sgemm_packed.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _INT]
                lib.lt_sgemm_packed.restype = _INT
                lib.lt_set_gemm_threads.argtypes = [_INT]
                lib.lt_set_gemm_threads.restype = None
                lib.lt_flash_attn.argtypes = [_PTR] * 5 + [_I64] * 5 + [ctypes.c_float, _I64, _INT]
                lib.lt_flash_attn.restype = _INT
                lib.lt_flash_attn_back.argtypes = [_PTR] * 9 + [_I64] * 5 + [ctypes.c_float, _I64, _INT]
                lib.lt_flash_attn_back.restype = _INT
                lib.lt_rope_pairs.argtypes = [_PTR] * 4 + [_I64] * 4 + [_INT]
                lib.lt_rope_pairs.restype = None
                lib.lt_lora.argtypes = [_PTR] * 5 + [_I64] * 4 + [ctypes.c_float, _INT]
                lib.lt_lora.restype = _INT
                lib.lt_lora_back.argtypes = [_PTR] * 7 + [_I64] * 4 + [ctypes.c_float, _INT]
                lib.lt_lora_back.restype = _INT
                lib.lt_kdot.argtypes = [_INT, _INT, _PTR, _I64, _I64, _PTR, _I64, _PTR]
                lib.lt_kdot.restype = _INT
                lib.lt_attention_built.argtypes = []
                lib.lt_attention_built.restype = _INT
            except build.BuildError as e:
                lib, reason = None, str(e)
        threads = os.environ.get("LLMTUNE_NATIVE_THREADS", "")
        count = int(threads) if threads.isdigit() and int(threads) > 0 else n_cores()
        _state.update(lib=lib, reason=reason, threads=count)
        if lib is not None:
            lib.lt_set_gemm_threads(_state["threads"])
            blas_threads.follow(_follow_blas)
        return lib


def _follow_blas(n: int) -> None:
    """The packed products' thread count, set with OpenBLAS's where the caller asks for both
    (threads.blas_threads(n, compiled=True): a trainer running one worker per core)."""
    lib = _state.get("lib")
    if lib is not None:
        lib.lt_set_gemm_threads(min(int(n), _state["threads"]) if n > 0 else _state["threads"])


def available() -> bool:
    return _load() is not None


def library():
    """The loaded library (ctypes), or None where it is not available."""
    return _load()


def threads() -> int:
    """The threads a product is split over (LLMTUNE_NATIVE_THREADS, else the usable cores)."""
    _load()
    return _state["threads"]


def reason() -> str | None:
    """Why the compiled kernels are not in use (None when they are)."""
    _load()
    return _state["reason"]


def reset() -> None:
    """Forget the loaded state: the next call looks at LLMTUNE_NATIVE / the compiler again."""
    with _lock:
        _state.clear()


def simd() -> bool:
    """Whether the library was built with its AVX2 paths."""
    return simd_width() > 0


def simd_width() -> int:
    """The widest vectors the library's products use: 512 (AVX-512F builds), 256 (AVX2), 0 (portable)."""
    lib = _load()
    return int(lib.lt_simd()) if lib is not None else 0


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _rows_ok(out2: np.ndarray, x2: np.ndarray) -> bool:
    return (x2.shape[0] <= MAX_ROWS and x2.dtype == np.float32 and out2.dtype == np.float32
            and x2.flags.c_contiguous and out2.strides[-1] == 4)


def _elementwise_ok(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.float32 and a.flags.c_contiguous and a.size == arrays[0].size for a in arrays)


def to_f16(out: np.ndarray, x: np.ndarray, bf16: bool = False) -> bool:
    """out (float16) = x (float32, or bfloat16 as uint16 when `bf16`) rounded to nearest even, as
    x.astype(np.float16), in this thread (F16C); False (nothing written) where the kernel does not
    take the arrays."""
    lib = _load()
    ok = x.dtype == (np.uint16 if bf16 else np.float32) and out.dtype == np.float16
    if lib is None or not ok or not (out.flags.c_contiguous and x.flags.c_contiguous) or out.size != x.size:
        return False
    lib.lt_to_f16(_addr(x), x.size, int(bf16), _addr(out))
    return True


def swiglu(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> bool:
    """out = silu(gate) * up in one pass over _pool_threads(), exp vectorized (within ~1 ulp of
    numpy's); False (nothing written) where the compiled kernel does not take the arrays."""
    lib = _load()
    if lib is None or not _elementwise_ok(out, gate, up):
        return False
    lib.lt_swiglu(_addr(gate), _addr(up), _addr(out), out.size, _pool_threads())
    return True


def swiglu_back(out: np.ndarray, gate: np.ndarray, up: np.ndarray, g: np.ndarray, wrt: int) -> bool:
    """swiglu's gradient with respect to gate (wrt 0) or up (wrt 1), as cpu.k_swiglu_back, in one
    pass over _pool_threads(); False where the compiled kernel does not take the arrays."""
    lib = _load()
    if lib is None or not _elementwise_ok(out, gate, up, g):
        return False
    lib.lt_swiglu_back(_addr(gate), _addr(up), _addr(g), _addr(out), out.size, int(wrt), _pool_threads())
    return True


def rms_norm(out: np.ndarray, x: np.ndarray, eps: float) -> bool:
    """out = x / sqrt(mean(x^2, last axis) + eps) over a pass's float32 rows (cpu.k_rms_norm) as a
    decode step computes them (the squares summed in double, as ggml does), the rows over
    _pool_threads(); False (nothing written) where the compiled kernel does not take the arrays."""
    lib = _load()
    if lib is None or x.shape != out.shape or not _elementwise_ok(out, x) or x.size == 0:
        return False
    n = x.shape[-1]
    lib.lt_rms_norm_rows(_addr(x), x.size // n, n, eps, _addr(out), _pool_threads())
    return True


def rms_norm_back(out: np.ndarray, x: np.ndarray, g: np.ndarray, eps: float) -> bool:
    """rms_norm's input gradient over rows of the last axis (cpu.k_rms_norm_back) in one pass
    over _pool_threads(), its sums in float32 vector lanes (within float32 rounding of numpy's); False
    (nothing written) where the compiled kernel does not take the arrays."""
    lib = _load()
    if lib is None or x.shape != g.shape or x.shape != out.shape or not _elementwise_ok(out, x, g):
        return False
    n = x.shape[-1]
    lib.lt_rms_norm_back(_addr(x), _addr(g), _addr(out), x.size // n, n, eps, _pool_threads())
    return True


def logsumexp(out: np.ndarray, x2: np.ndarray) -> bool:
    """out[r] = logsumexp of row r of float32 x2 [rows, n] (cpu.k_logsumexp) in one pass a row
    over _pool_threads(): the vector exp, double lane sums (within float32 rounding of numpy's);
    False (nothing written) where the compiled kernel does not take the arrays."""
    lib = _load()
    if (lib is None or x2.ndim != 2 or out.size != x2.shape[0] or x2.dtype != np.float32 or out.dtype != np.float32
            or not (x2.flags.c_contiguous and out.flags.c_contiguous)):
        return False
    lib.lt_logsumexp(_addr(x2), x2.shape[0], x2.shape[1], _addr(out), _pool_threads())
    return True


def loss_back(out2: np.ndarray, x2: np.ndarray, lse: np.ndarray, targets: np.ndarray, weights: np.ndarray | None,
              weight: float = 0.0) -> bool:
    """out2 = (exp(x2 - lse) - onehot(targets)) * w per row, 0 on rows whose target is negative:
    w the row's weights[r], or `weight` for all (cpu.k_cross_entropy_back, k_token_nll_back); one
    pass a row over _pool_threads(); out2 may be x2. False (nothing written) where the compiled
    kernel does not take the arrays."""
    lib = _load()
    rows = x2.shape[0] if x2.ndim == 2 else -1
    if (lib is None or rows < 0 or out2.shape != x2.shape or lse.size != rows or targets.size != rows
            or targets.dtype != np.int32
            or (weights is not None and (weights.size != rows or weights.dtype != np.float32))
            or not all(a.dtype == np.float32 for a in (out2, x2, lse))
            or not all(a is None or a.flags.c_contiguous for a in (out2, x2, lse, targets, weights))):
        return False
    lib.lt_loss_back(_addr(x2), _addr(lse), _addr(targets), None if weights is None else _addr(weights), weight,
                     _addr(out2), rows, x2.shape[1], _pool_threads())
    return True


def qlinear(out2: np.ndarray, x2: np.ndarray, raw: np.ndarray, qtype: str) -> bool:
    """out2[m, n_out] = x2[m, n_in] @ W^T for W as `qtype` block bytes raw [n_out, row bytes], x2
    rounded to the type's vec_dot type first (as quant/matmul.py qlinear with round_x). False
    (nothing written) when the compiled kernel does not take this case."""
    lib = _load()
    code = TYPE_CODES.get(qtype)
    if lib is None or code is None or not _rows_ok(out2, x2) or raw.dtype != np.uint8 or raw.strides[-1] != 1:
        return False
    rc = lib.lt_qlinear(code, _addr(raw), raw.strides[0], out2.shape[1], x2.shape[1], _addr(x2), x2.shape[0],
                        _addr(out2), out2.strides[0] // 4, _state["threads"])
    return rc == 0


def profile(on: bool) -> dict:
    """The compiled programs' per-op timers (program.c lt_profile): {op code: (seconds, calls)} so far;
    on=True clears them and keeps them running, False stops them."""
    lib = _load()
    if lib is None:
        return {}
    buf = np.zeros(32, np.int64)
    lib.lt_profile(int(on), _addr(buf))
    return {code: (buf[code] / 1e9, int(buf[16 + code])) for code in range(16) if buf[16 + code]}


def pack(raw: np.ndarray, qtype: str) -> np.ndarray | None:
    """The matrix as the compiled few-row product reads it fastest, 64-byte aligned (qdot.c lt_pack):
    the whole groups of 8 rows of a Q8_0 / Q4_1 / Q5_0 / Q5_1 matrix repacked for the AVX-512 VNNI
    kernel (each block's 8 scales side by side, Q5's fifth bits as a mask per row pair, then the 8
    rows' quants); a K-quant matrix's rows copied as they are into this process's memory (it streams
    faster than the file's page cache). None where this build or type has none (the products then
    read raw as it is)."""
    lib = _load()
    code = TYPE_CODES.get(qtype)
    if lib is None or code is None or raw.dtype != np.uint8 or raw.ndim != 2 or raw.strides[-1] != 1:
        return None
    block, size = PACK_BLOCKS.get(qtype, (0, raw.shape[1] + 1))
    n_in = raw.shape[1] // size * block
    nbytes = lib.lt_pack_bytes(code, raw.shape[0], n_in) if n_in else 0
    if nbytes <= 0:
        return None
    buf = np.empty(nbytes + 64, np.uint8)
    out = buf[-_addr(buf) % 64:][:nbytes]
    lib.lt_pack(code, _addr(raw), raw.strides[0], raw.shape[0], n_in, _addr(out))
    return out


def qlinear_packed(out2: np.ndarray, x2: np.ndarray, packed: np.ndarray, raw: np.ndarray, qtype: str) -> bool:
    """qlinear with the packed copy (pack) for the whole row groups; False where not taken."""
    lib = _load()
    code = TYPE_CODES.get(qtype)
    if lib is None or code is None or not _rows_ok(out2, x2) or raw.dtype != np.uint8 or raw.strides[-1] != 1:
        return False
    return lib.lt_qlinear_packed(code, _addr(packed), _addr(raw), raw.strides[0], out2.shape[1], x2.shape[1],
                                 _addr(x2), x2.shape[0], _addr(out2), out2.strides[0] // 4, _state["threads"]) == 0


def bind_qlinear(out2: np.ndarray, x2: np.ndarray, raw: np.ndarray, qtype: str):
    """qlinear(out2, x2, raw, qtype) as a call with no arguments (the addresses converted once),
    for a replayed program whose buffers stay where they are; None when the kernel does not take
    the case. The call keeps the arrays alive."""
    lib = _load()
    code = TYPE_CODES.get(qtype)
    if lib is None or code is None or not _rows_ok(out2, x2) or raw.dtype != np.uint8 or raw.strides[-1] != 1:
        return None
    args = (code, _addr(raw), raw.strides[0], out2.shape[1], x2.shape[1], _addr(x2), x2.shape[0], _addr(out2),
            out2.strides[0] // 4, _state["threads"])
    return _bound(lib.lt_qlinear, args, (out2, x2, raw))


def bind_f32_linear(out2: np.ndarray, x2: np.ndarray, w: np.ndarray):
    """f32_linear as a call with no arguments (see bind_qlinear)."""
    lib = _load()
    if lib is None or not _rows_ok(out2, x2) or w.dtype != np.float32 or w.strides[-1] != 4:
        return None
    args = (_addr(w), w.strides[0], w.shape[0], w.shape[1], _addr(x2), x2.shape[0], _addr(out2),
            out2.strides[0] // 4, _state["threads"])
    return _bound(lib.lt_f32_linear, args, (out2, x2, w))


def pack_wt_available() -> bool:
    """Whether this build has the packed float32 product (AVX-512) and `LLMTUNE_PACKED=0` does
    not turn it off (training then keeps no packed copies: their memory, numpy's speed)."""
    lib = _load()
    return (lib is not None and lib.lt_pack_wt_floats(1, 1) > 0
            and os.environ.get("LLMTUNE_PACKED", "1").strip().lower() not in _OFF)


def pack_wt_bytes(shape: tuple, transposed: bool = False) -> int:
    """Bytes of pack_wt's form of a float32 matrix of `shape` (columns padded to whole panels);
    0 where this build has none."""
    lib = _load()
    n, k = shape[::-1] if transposed else shape
    return 4 * lib.lt_pack_wt_floats(n, k) if lib is not None else 0


def pack_wt(w: np.ndarray, transposed: bool = False) -> np.ndarray | None:
    """A frozen float32 matrix w [n, k] packed for sgemm_packed (W^T in panels of 48 columns,
    k-major; sgemm.c lt_pack_wt), 64-byte aligned; transposed: w^T's packed form (for g @ w).
    None where this build has no packed product."""
    lib = _load()
    if not pack_wt_available() or w.dtype != np.float32 or w.ndim != 2 or w.strides[-1] != 4 or w.strides[0] % 4:
        return None
    (n, k), (s_n, s_k) = w.shape, (w.strides[0] // 4, 1)
    if transposed:
        (n, k), (s_n, s_k) = (k, n), (s_k, s_n)
    floats = lib.lt_pack_wt_floats(n, k)
    if floats <= 0:
        return None
    buf = np.empty(floats + 16, np.float32)
    out = buf[(-_addr(buf) % 64) // 4:][:floats]
    lib.lt_pack_wt(_addr(w), s_n, s_k, n, k, _addr(out), _state["threads"])  # every core: see sgemm.c
    return out


def _gemm_ok(out2: np.ndarray, x2: np.ndarray, packed: np.ndarray, n: int, k: int) -> bool:
    return (x2.ndim == 2 and out2.ndim == 2 and x2.dtype == np.float32 and out2.dtype == np.float32
            and x2.strides[-1] == 4 and out2.strides[-1] == 4 and x2.shape[1] == k and out2.shape == (x2.shape[0], n)
            and packed.size == _load().lt_pack_wt_floats(n, k))


def sgemm_packed(out2: np.ndarray, x2: np.ndarray, packed: np.ndarray, n: int, k: int) -> bool:
    """out2[m, n] = x2[m, k] @ W^T with W packed by pack_wt(W [n, k]) (or out2 = x2 @ V for
    pack_wt(V [k, n], transposed=True)), over the cores (_follow_blas: one where the caller runs
    a worker per core); each output one sum in k order, so the bits do not depend on the threads.
    False (nothing written) where the compiled product does not take the case."""
    lib = _load()
    if lib is None or not _gemm_ok(out2, x2, packed, n, k):
        return False
    return lib.lt_sgemm_packed(_addr(x2), x2.strides[0] // 4, x2.shape[0], _addr(packed), n, k, _addr(out2),
                               out2.strides[0] // 4, 0) == 0


def bind_sgemm_packed(out2: np.ndarray, x2: np.ndarray, packed: np.ndarray, n: int, k: int):
    """sgemm_packed as a call with no arguments (see bind_qlinear); None where not taken."""
    lib = _load()
    if lib is None or not _gemm_ok(out2, x2, packed, n, k):
        return None
    args = (_addr(x2), x2.strides[0] // 4, x2.shape[0], _addr(packed), n, k, _addr(out2), out2.strides[0] // 4, 0)
    return _bound(lib.lt_sgemm_packed, args, (out2, x2, packed))


def rope_pairs(out: np.ndarray, x: np.ndarray, cos2: np.ndarray, sin2: np.ndarray) -> bool:
    """Norm-mode rope of x [B, T, H, d] (float32, contiguous) with tables [T, d] as cpu.py's
    _rope_pairs computes it, bit for bit, over the compiled pool; False (nothing written) where
    the compiled kernel does not take the arrays."""
    lib = _load()
    if (lib is None or x.ndim != 4 or x.shape != out.shape or x.shape[-1] % 2 or cos2.shape != (x.shape[1], x.shape[3])
            or cos2.shape != sin2.shape or not all(a.dtype == np.float32 and a.flags.c_contiguous
                                                   for a in (out, x, cos2, sin2))):
        return False
    B, T, H, d = x.shape
    lib.lt_rope_pairs(_addr(x), _addr(cos2), _addr(sin2), _addr(out), B, T, H, d, _pool_threads())
    return True


LORA_MAX_RANK = 128  # lora.c LR_MAX_RANK


def _lora_ok(lib, x2, a, b, rows_out, *arrays) -> bool:
    """Whether the compiled adapter kernels take x2 [M, n_in], A [r, n_in], B [n_out, r] with the
    [M, n_out] arrays `rows_out` and the others (None: absent), all float32 and contiguous."""
    M, n_in = x2.shape
    r, n_out = a.shape[0], b.shape[0]
    return (lib is not None and 1 <= r <= LORA_MAX_RANK and a.shape == (r, n_in) and b.shape == (n_out, r)
            and all(o.shape == (M, n_out) for o in rows_out)
            and all(t is None or (t.dtype == np.float32 and t.flags.c_contiguous)
                    for t in (x2, a, b, *rows_out, *arrays)))


def _lora_call(fn, args, keep):
    """fn(*args, threads) as a call with no arguments (a replayed step binds it once; the thread
    count is read at each call, as the step runs OpenBLAS single- or multi-threaded)."""
    bound = functools.partial(fn, *args)

    def call():
        if bound(_pool_threads()) != 0:  # its scratch (a few rows of rank-r values) not allocated
            raise MemoryError("the compiled adapter product could not allocate its scratch")

    call.keep = keep
    return call


def bind_lora(out2: np.ndarray, y2: np.ndarray, x2: np.ndarray, a: np.ndarray, b: np.ndarray, s: float):
    """out2 = y2 + ((s x2 A^T) B^T) over rows (cpu.k_lora; out2 may be y2) as one call over
    _pool_threads(); each output summed by one task in a fixed order, so the bits do not depend on
    the threads. None where the compiled kernel does not take the arrays."""
    lib = _load()
    if not _lora_ok(lib, x2, a, b, (out2, y2)):
        return None
    (M, n_in), (n_out, r) = x2.shape, b.shape
    args = (_addr(y2), _addr(x2), _addr(a), _addr(b), _addr(out2), M, n_in, n_out, r, s)
    return _lora_call(lib.lt_lora, args, (out2, y2, x2, a, b))


def bind_lora_back(dx: np.ndarray | None, da: np.ndarray, db: np.ndarray, x2: np.ndarray, a: np.ndarray,
                   b: np.ndarray, g2: np.ndarray, s: float):
    """lora's gradients (cpu.k_lora_back; dx None: not wanted) as one call, as bind_lora."""
    lib = _load()
    if not (_lora_ok(lib, x2, a, b, (g2,), dx, da, db) and da.shape == a.shape and db.shape == b.shape
            and (dx is None or dx.shape == x2.shape)):
        return None
    (M, n_in), (n_out, r) = x2.shape, b.shape
    args = (_addr(x2), _addr(a), _addr(b), _addr(g2), None if dx is None else _addr(dx), _addr(da), _addr(db), M,
            n_in, n_out, r, s)
    return _lora_call(lib.lt_lora_back, args, (dx, da, db, x2, a, b, g2))


def _run_once(call) -> bool:
    if call is None:
        return False
    call()
    return True


def lora(*arrays, s: float) -> bool:
    """bind_lora's product run once; False (nothing written) where it is not taken."""
    return _run_once(bind_lora(*arrays, s))


def lora_back(*arrays, s: float) -> bool:
    """bind_lora_back's gradients run once; False (nothing written) where they are not taken."""
    return _run_once(bind_lora_back(*arrays, s))


def attention_available() -> bool:
    """Whether this build has the compiled blockwise attention (AVX-512: its vector exp)."""
    lib = _load()
    return lib is not None and bool(lib.lt_attention_built())


def _pool_threads() -> int:
    """The thread count of a compiled kernel between BLAS products (attention, rope, the adapter
    terms, the norms, swiglu, the loss): the compiled products' (0) while OpenBLAS runs
    single-threaded (a packed-product step, a worker per core), else 1. OpenBLAS's threads spin after
    each product; the pool's workers beside them took the cores from a full finetune's products (its
    matmuls 640 -> 928 ms a step)."""
    return 0 if blas_threads.current() <= 1 else 1


def _attention_ok(lib, q, k, v, outputs) -> bool:
    return (lib is not None and q.ndim == 4 and k.shape == v.shape and q.dtype == k.dtype == v.dtype == np.float32
            and all(a.dtype == np.float32 and a.flags.c_contiguous for a in outputs))


def flash_attn(o: np.ndarray, lse: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
               window: int) -> bool:
    """The forward of ops.flash_attn without a softcap (cpu.k_flash_attn's O [B, T, H, d] and row
    logsumexp [B, Hkv, G, T]) in one call, over _pool_threads(); each output computed by one task,
    so the bits do not depend on the threads. False (nothing usable written) where the compiled
    kernel does not take the case."""
    lib = _load()
    if not _attention_ok(lib, q, k, v, (o, lse)):
        return False
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    (B, T, H, d), Hkv = q.shape, k.shape[2]
    return lib.lt_flash_attn(_addr(q), _addr(k), _addr(v), _addr(o), _addr(lse), B, T, H, Hkv, d, float(scale),
                             int(window), _pool_threads()) == 0


def flash_attn_back(dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    o: np.ndarray, lse: np.ndarray, g: np.ndarray, scale: float, window: int) -> bool:
    """dq, dk, dv of flash_attn from its inputs, its outputs o and lse and the output gradient g
    (cpu.k_flash_attn_back without a softcap) in one call, threads as flash_attn; every output
    written by one task. False (nothing usable written) where the compiled kernel does not take it."""
    lib = _load()
    if not _attention_ok(lib, q, k, v, (dq, dk, dv)) or o.dtype != np.float32 or g.dtype != np.float32 \
            or lse.dtype != np.float32:
        return False
    q, k, v, o, lse, g = (np.ascontiguousarray(a) for a in (q, k, v, o, lse, g))
    (B, T, H, d), Hkv = q.shape, k.shape[2]
    return lib.lt_flash_attn_back(_addr(q), _addr(k), _addr(v), _addr(o), _addr(lse), _addr(g), _addr(dq), _addr(dk),
                                  _addr(dv), B, T, H, Hkv, d, float(scale), int(window), _pool_threads()) == 0


def _bound(fn, args, keep):
    call = functools.partial(fn, *args)
    call.keep = keep  # the arrays whose addresses it holds
    return call


def f32_linear(out2: np.ndarray, x2: np.ndarray, w: np.ndarray) -> bool:
    """out2[m, n_out] = x2[m, n_in] @ w^T for float32 w [n_out, n_in] (ggml_vec_dot_f32 per
    output). False when the compiled kernel does not take this case."""
    lib = _load()
    if lib is None or not _rows_ok(out2, x2) or w.dtype != np.float32 or w.strides[-1] != 4:
        return False
    lib.lt_f32_linear(_addr(w), w.strides[0], w.shape[0], w.shape[1], _addr(x2), x2.shape[0], _addr(out2),
                      out2.strides[0] // 4, _state["threads"])
    return True


def bind_rms_norm(out: np.ndarray, x: np.ndarray, eps: float):
    """out = x / sqrt(mean(x^2, last axis) + eps) for a few float32 rows, as a call with no
    arguments (see bind_qlinear; the squares summed in double, as ggml sums them); None when the
    kernel does not take the case."""
    lib = _load()
    if (lib is None or x.dtype != np.float32 or out.dtype != np.float32 or not x.flags.c_contiguous
            or not out.flags.c_contiguous or x.shape != out.shape or x.size > MAX_ROWS * x.shape[-1]):
        return None
    return _bound(lib.lt_rms_norm, (_addr(x), x.size // x.shape[-1], x.shape[-1], float(eps), _addr(out)), (out, x))


def quantize_activations(x: np.ndarray, act: str) -> np.ndarray:
    """One row x [n] as ggml's `act` blocks (q8_0 / q8_1 / q8_K), the bytes qdot.c multiplies."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the compiled kernels are not available: {_state['reason']}")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    code = ACT_CODES[act]
    out = np.zeros(lib.lt_act_row_bytes(code, x.size), np.uint8)
    lib.lt_quantize_act(code, _addr(x), x.size, _addr(out))
    return out


def kquant_dots(raw: np.ndarray, yq: np.ndarray, qtype: str, portable: bool = False) -> np.ndarray:
    """The K-quant rows raw [n, row bytes] (Q4_K, Q5_K, Q6_K) each against the q8_K activation row
    yq (quantize_activations' bytes) with this build's kernel, or with the portable reference loop
    (kdot.c lt_kdot): what the tests compare with each other and with ggml's own outputs."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the compiled kernels are not available: {_state['reason']}")
    raw, yq = np.ascontiguousarray(raw, np.uint8), np.ascontiguousarray(yq, np.uint8)
    out = np.empty(raw.shape[0], np.float32)
    nb = yq.size // lib.lt_act_row_bytes(ACT_CODES["q8_K"], 256)
    if lib.lt_kdot(TYPE_CODES[qtype], int(portable), _addr(raw), raw.strides[0], raw.shape[0], _addr(yq), nb,
                   _addr(out)):
        raise ValueError(f"{qtype} is not a K-quant type")
    return out


def _load_beside(name: str, signatures: dict):
    """The library built from `name`.c beside the kernel library (under the same switch), its functions
    typed from signatures {function: (argtypes, restype)}; None where it is not available."""
    if not available():
        return None
    with _lock:
        if name not in _state:
            try:
                lib = build.load(name)
                for fn, (argtypes, restype) in signatures.items():
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
            except build.BuildError:
                lib = None
            _state[name] = lib
        return _state[name]


def _load_dequant():
    """dequant.c's block decoders, or None."""
    return _load_beside("dequant", {"lt_dequant": ([_INT, _PTR, _I64, _I64, _I64, _PTR, _I64], _INT),
                                    "lt_round_q8": ([_PTR, _I64, _I64, _INT, _PTR, _PTR], _INT)})


def _load_optim():
    """optim.c's optimizer updates, or None."""
    return _load_beside("optim", {"lt_adamw": ([_PTR] * 4 + [_I64] + [ctypes.c_float] * 8 + [_INT], None),
                                  "lt_sum_squares": ([_PTR, _I64, _I64, _PTR], None)})


def adamw(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, lr: float, beta1: float, beta2: float,
          eps: float, wd: float, t: int) -> bool:
    """ggml_opt_step_adamw over float32 w, g, m, v (contiguous, one size) in one pass: cpu.py
    optim.adamw_range's values bit for bit (its constants rounded to float32 as numpy rounds them).
    False (nothing written) where the compiled kernel does not take the arrays."""
    if not _elementwise_ok(w, g, m, v):
        return False
    lib = _load_optim()
    if lib is None:
        return False
    c1, c2 = 1.0 / (1.0 - beta1**t), 1.0 / (1.0 - beta2**t)
    lib.lt_adamw(_addr(w), _addr(g), _addr(m), _addr(v), w.size, beta1, 1.0 - beta1, beta2, 1.0 - beta2, c2, eps,
                 lr * c1, 1.0 - lr * wd, int(bool(wd)))
    return True


def sum_squares(x: np.ndarray, block: int) -> np.ndarray | None:
    """Per block of `block` elements of float32 x (contiguous), sum(x^2) in float64, each block
    in one fixed order; None where the compiled kernel does not take the array."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    lib = _load_optim()
    if lib is None:
        return None
    out = np.empty(-(-x.size // block), np.float64)
    lib.lt_sum_squares(_addr(x), x.size, block, _addr(out))
    return out


def dequantize_available() -> bool:
    """Whether the compiled block decoders are in use (dequantize_rows takes the ggml block types)."""
    return _load_dequant() is not None


def dequantize_rows(raw: np.ndarray, qtype: str, out: np.ndarray) -> bool:
    """out[r] = row r of raw (`qtype` block bytes [rows, row bytes]) decoded to float32, the numpy
    decoders' values bit for bit (quant/matmul.py dequantize_rows). False (nothing written) when
    the compiled kernel does not take this case."""
    code = TYPE_CODES.get(qtype)
    if (code is None or out.dtype != np.float32 or out.ndim != 2 or out.strides[-1] != 4 or raw.dtype != np.uint8
            or raw.ndim != 2 or raw.strides[-1] != 1 or raw.shape[0] != out.shape[0]):
        return False
    lib = _load_dequant()
    if lib is None:
        return False
    rows, cols = out.shape
    return lib.lt_dequant(code, _addr(raw), raw.strides[0], rows, cols, _addr(out), out.strides[0] // 4) == 0


def round_q8(x: np.ndarray, with_sum: bool):
    """x [M, K] float32 rounded to q8_0 / q8_1 blocks and decoded back, with the Q8_1 correction:
    (x~, corr or None), quant/matmul.py _round_q8_0's values bit for bit; None when the compiled
    kernel does not take the case."""
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous or x.shape[1] % 32:
        return None
    lib = _load_dequant()
    if lib is None:
        return None
    xr = np.empty_like(x)
    corr = np.empty((x.shape[0], x.shape[1] // 32), np.float32) if with_sum else None
    rc = lib.lt_round_q8(_addr(x), x.shape[0], x.shape[1], int(with_sum), _addr(xr), _addr(corr) if with_sum else None)
    return (xr, corr) if rc == 0 else None
