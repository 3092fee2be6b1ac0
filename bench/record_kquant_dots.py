"""Record ggml's own K-quant dot products (Q4_K, Q5_K, Q6_K against q8_K) as the test fixture
tests/data/kquant_dots.npz, through a small C harness compiled against a llama.cpp build.

    python bench/record_kquant_dots.py --llama PATH/TO/llama.cpp [--build build] [--out tests/data/kquant_dots.npz]

The harness (written to a temporary folder, compiled with the system compiler against
PATH/ggml/include and linked with BUILD/bin/libggml-cpu.so and libggml-base.so) calls ggml's public
CPU type traits, as its mul_mat does: the activation rows through `from_float` of the type's
vec_dot_type (quantize_row_q8_K), then `vec_dot` per weight row (ggml_vec_dot_q{4,5,6}_K_q8_K in
the ISA that build compiled: its __AVX2__ branch on any x86 build with AVX2, AVX-512 ones
included). It also reports ggml_cpu_has_* of that build, recorded in the fixture as `isa`.

The weights, per type 5 rows of 3 super-blocks: 2 rows quantized from a float matrix by
llmtune's quantizers (quant/blocks.py), 2 rows of random bytes with sane fp16 scales, and 1 row of
the extremes (every quant, scale and fifth or sixth bit at its largest, then at its smallest, then
random) where an int16 pair sum comes closest to saturating. The activations: 2 rows, the first
block of the first all zero (a q8_K block with d = 0).

The fixture holds x, ggml's q8_K bytes of x (`y`), per type `<T>.raw` and ggml's products
`<T>.out` [rows of x, weight rows], and the build's description; tests/test_native.py compares the
compiled kernels with it bit for bit where they take ggml's path (an AVX2 build). No llama.cpp is
needed to run the tests, only this recorded file.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from llmtune.quant import blocks

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("Q4_K", "Q5_K", "Q6_K")
N_IN, ROWS, M = 768, 5, 2

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"

/* isa: the features this libggml-cpu was compiled for. Otherwise: TYPE N ROWS M IN OUT, IN holding
 * ROWS weight rows then M float rows of N, OUT receiving the M vec_dot_type rows then M x ROWS floats. */
int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "isa")) {
        printf("avx=%d avx2=%d fma=%d f16c=%d avx_vnni=%d avx512=%d avx512_vnni=%d avx512_vbmi=%d avx512_bf16=%d\n",
               ggml_cpu_has_avx(), ggml_cpu_has_avx2(), ggml_cpu_has_fma(), ggml_cpu_has_f16c(),
               ggml_cpu_has_avx_vnni(), ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni(),
               ggml_cpu_has_avx512_vbmi(), ggml_cpu_has_avx512_bf16());
        return 0;
    }
    if (argc != 7) return 2;
    const int type = atoi(argv[1]);
    const long n = atol(argv[2]), rows = atol(argv[3]), m = atol(argv[4]);
    ggml_cpu_init();
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu(type);
    const struct ggml_type_traits_cpu *a = ggml_get_type_traits_cpu(t->vec_dot_type);
    const size_t wrow = ggml_row_size(type, n), yrow = ggml_row_size(t->vec_dot_type, n);
    char *w = malloc(rows * wrow), *y = malloc(m * yrow);
    float *x = malloc(m * n * sizeof(float)), *out = malloc(m * rows * sizeof(float));
    FILE *in = fopen(argv[5], "rb");
    if (!in || fread(w, wrow, rows, in) != (size_t)rows || fread(x, n * sizeof(float), m, in) != (size_t)m) return 3;
    fclose(in);
    for (long i = 0; i < m; i++) a->from_float(x + i * n, y + i * yrow, n);
    for (long i = 0; i < m; i++)
        for (long r = 0; r < rows; r++) t->vec_dot((int)n, out + i * rows + r, 0, w + r * wrow, 0, y + i * yrow, 0, 1);
    FILE *o = fopen(argv[6], "wb");
    if (!o || fwrite(y, yrow, m, o) != (size_t)m || fwrite(out, sizeof(float) * rows, m, o) != (size_t)m) return 4;
    fclose(o);
    return 0;
}
"""


def _scales(rng, shape) -> np.ndarray:
    """fp16 bytes of sane positive scales (as a quantizer writes them: 1e-4 .. 1e-2)."""
    return np.exp(rng.uniform(np.log(1e-4), np.log(1e-2), shape)).astype(np.float16).view(np.uint8)


def weights(qtype: str, rng) -> np.ndarray:
    """ROWS rows of N_IN values as `qtype` block bytes (see the module's docstring)."""
    w = 0.05 * rng.standard_normal((2, N_IN)) + 0.01 * (np.arange(N_IN) % 5)
    real = np.ascontiguousarray(blocks.quantize(w.astype(np.float32), QT[qtype])).view(np.uint8).reshape(2, -1)
    size = real.shape[1] // (N_IN // 256)
    rand = rng.integers(0, 256, (3, N_IN // 256, size), dtype=np.uint8)
    rand[2, 0] = 0xFF  # every quant, scale and high bit at its largest
    rand[2, 1] = 0x00
    if qtype == "Q6_K":  # d last; the int8 scales at their extremes: +127 in the first block, -128 in the second
        rand[2, 0, 192:208], rand[2, 1, 192:208] = 0x7F, 0x80
        rand[..., 208:210] = _scales(rng, (3, N_IN // 256, 1))
    else:  # d and dmin first
        rand[..., 0:4] = _scales(rng, (3, N_IN // 256, 2)).reshape(3, N_IN // 256, 4)
    return np.concatenate([real, rand.reshape(3, -1)])


def activations(rng) -> np.ndarray:
    x = rng.standard_normal((M, N_IN)) * np.exp(rng.standard_normal((M, 1)))
    x[:, 5] *= 30.0
    x[0, :256] = 0.0
    return x.astype(np.float32)


class Harness:
    def __init__(self, llama: Path, build: str, folder: Path):
        bin_dir = llama / build / "bin"
        cc = shutil.which("cc") or "cc"
        self.exe = folder / "kquant_dots"
        src = folder / "kquant_dots.c"
        src.write_text(HARNESS)
        subprocess.run([cc, "-O2", "-I", str(llama / "ggml" / "include"), str(src), "-o", str(self.exe),
                        "-L", str(bin_dir), "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{bin_dir}"], check=True)
        self.folder = folder

    def isa(self) -> str:
        return subprocess.run([str(self.exe), "isa"], check=True, capture_output=True, text=True).stdout.strip()

    def dots(self, qtype: str, raw: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ggml's q8_K bytes of x [M, row bytes], its products [M, ROWS])."""
        src, dst = self.folder / "in.bin", self.folder / "out.bin"
        src.write_bytes(raw.tobytes() + x.tobytes())
        subprocess.run([str(self.exe), str(int(QT[qtype])), str(N_IN), str(len(raw)), str(len(x)), str(src),
                        str(dst)], check=True)
        got = np.fromfile(dst, np.uint8)
        ybytes = got.size - 4 * len(x) * len(raw)
        return got[:ybytes].reshape(len(x), -1), got[ybytes:].view(np.float32).reshape(len(x), len(raw))


def describe(llama: Path, build: str) -> str:
    """The ggml build: its commit (git describe of the llama.cpp folder) and ggml-cpu's compile flags."""
    try:
        commit = subprocess.run(["git", "-C", str(llama), "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    flags = llama / build / "ggml" / "src" / "CMakeFiles" / "ggml-cpu.dir" / "flags.make"
    cflags = [ln for ln in flags.read_text().splitlines() if ln.startswith("C_FLAGS")] if flags.is_file() else []
    return f"llama.cpp {commit or '?'}; ggml-cpu {cflags[0] if cflags else 'C_FLAGS unknown'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama", required=True, type=Path, help="llama.cpp source folder (its ggml/include)")
    ap.add_argument("--build", default="build", help="build folder under --llama whose bin/ holds libggml-cpu.so")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "kquant_dots.npz")
    args = ap.parse_args()
    rng = np.random.default_rng(40)
    x = activations(rng)
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(args.llama, args.build, Path(tmp))
        rec = {"x": x, "isa": np.array(h.isa()), "machine": np.array(platform.machine()),
               "ggml": np.array(describe(args.llama, args.build))}
        for qtype in TYPES:
            raw = weights(qtype, rng)
            y, out = h.dots(qtype, raw, x)
            if "y" in rec:
                assert np.array_equal(rec["y"], y), "from_float differs between types"
            rec.update({"y": y, f"{qtype}.raw": raw, f"{qtype}.out": out})
            print(qtype, "ggml:", out.tolist())
    print("isa:", rec["isa"])
    np.savez_compressed(args.out, **rec)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
