"""The quantized frozen-weight product against ggml's own CPU kernels, through ctypes.

    python bench/check_qmatmul.py --bin PATH/TO/llama.cpp/build/bin [--rows 48] [--out 40] [--cols 1024]
    python bench/check_qmatmul.py --bin PATH/TO/llama.cpp/build/bin --record


For each weight type ggml reads (F16, BF16, Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K) a random
matrix is quantized by llmtune's quantizers; ggml then computes every product the way its mul_mat
does (type_traits_cpu: the activation row converted by `from_float` of the type's vec_dot_type,
then `vec_dot` per weight row). llmtune's ops.qlinear (quant/matmul.py) computes the same products
with the activations rounded as ggml rounds them, and without (plain float32 activations), so the
table shows both the agreement and the effect the rounding reproduces.

--record writes the test fixture tests/data/qmatmul/ggml-products.npz instead: a small x and, per
type, the weight bytes and ggml's products (tests/test_backends.py reads it, no llama.cpp needed).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from llmtune.backends.cpu import products as qmatmul
from llmtune.quant import blocks


class _Traits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Ggml:
    def __init__(self, bin_dir: Path):
        ctypes.CDLL(str(bin_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(str(bin_dir / "libggml-cpu.so"))
        self.lib.ggml_cpu_init()
        self.lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
        self.lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]

    def traits(self, qtype: QT) -> _Traits:
        return self.lib.ggml_get_type_traits_cpu(int(qtype)).contents

    def matmul(self, raw: np.ndarray, qtype: QT, x: np.ndarray) -> np.ndarray:
        """x [M, K] float32 times the stored rows raw [N, row bytes]^T, as ggml's mul_mat."""
        t = self.traits(qtype)
        vd = self.traits(QT(t.vec_dot_type))
        from_float = FROM_FLOAT(vd.from_float)
        vec_dot = VEC_DOT(t.vec_dot)
        M, K = x.shape
        N = raw.shape[0]
        block, size = blocks.block_size(QT(t.vec_dot_type)), blocks.type_size(QT(t.vec_dot_type))
        xq = np.zeros((M, K // block * size), np.uint8)
        for i in range(M):
            row = np.ascontiguousarray(x[i], dtype=np.float32)
            from_float(row.ctypes.data, xq[i].ctypes.data, K)
        out = np.empty((M, N), np.float32)
        s = ctypes.c_float()
        for i in range(M):
            for j in range(N):
                vec_dot(K, ctypes.byref(s), 0, raw[j].ctypes.data, 0, xq[i].ctypes.data, 0, 1)
                out[i, j] = s.value
        return out


TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, type=Path, help="folder holding libggml-cpu.so")
    ap.add_argument("--rows", type=int, default=48, help="activation rows")
    ap.add_argument("--out", type=int, default=40, help="weight rows")
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--record", action="store_true", help="write the test fixture (6 x 512 activations, 5 rows)")
    args = ap.parse_args()
    if args.record:
        args.rows, args.out, args.cols = 6, 5, 512
    ggml = Ggml(args.bin)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.out, args.cols)).astype(np.float32) * 0.05
    w[:, ::7] += 0.02  # some offset, so the Q4_1 / Q5_1 mins matter
    x = rng.standard_normal((args.rows, args.cols)).astype(np.float32)
    x *= np.exp(rng.standard_normal((args.rows, 1))).astype(np.float32)  # rows of different scales
    x[:, rng.integers(0, args.cols, 8)] *= 20  # outliers, as real activations have
    x[0, :256] = 0.0  # an all-zero block of every type
    record = {"x": x}
    print("| weight | ggml vec_dot_type | max rel. diff, activations rounded as ggml | without rounding |")
    print("| --- | --- | ---: | ---: |")
    worst = 0.0
    for name in TYPES:
        qt = QT[name]
        raw = np.ascontiguousarray(blocks.quantize(w, qt)).view(np.uint8).reshape(args.out, -1)
        theirs = ggml.matmul(raw, qt, x)
        scale = np.abs(theirs).max()
        ours = qmatmul.qlinear(np.empty_like(theirs), x, raw, name, round_x=True)
        plain = qmatmul.qlinear(np.empty_like(theirs), x, raw, name, round_x=False)
        d1, d2 = np.abs(ours - theirs).max() / scale, np.abs(plain - theirs).max() / scale
        worst = max(worst, d1)
        vdt = QT(ggml.traits(qt).vec_dot_type).name
        print(f"| {name} | {vdt} | {d1:.2e} | {d2:.2e} |", flush=True)
        record[f"{name}.raw"], record[f"{name}.out"] = raw, theirs
    if args.record:
        path = Path(__file__).resolve().parents[1] / "tests" / "data" / "qmatmul" / "ggml-products.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **record)
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
