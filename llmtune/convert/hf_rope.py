"""Llama 3.1's rope factors (config rope_type "llama3") as llama.cpp's converter computes them, bit for bit.

LlamaModel.generate_extra_tensors (convert_hf_to_gguf.py, conversion/llama.py) writes `rope_freqs.weight`:

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    per freq: wavelen = 2 * math.pi / freq; 1, factor, or 1 / ((1 - smooth) / factor + smooth)

all in torch float32. Everything but the power is IEEE float32 arithmetic that numpy's float32 does the same
way, once it is spelled as torch evaluates it (`x / tensor` is `tensor.reciprocal() * x`, a Python float
operand is rounded to float32 first). The power is not: torch's CPU pow(Scalar, Tensor) runs
`Vectorized<float>::pow`, SLEEF's `Sleef_powf16_u10` (AVX-512; `Sleef_powf8_u10` on AVX2) over chunks of two
vectors and the C library's powf over the rest, and SLEEF's u10 power is not correctly rounded (numpy's
power differs from it by an ulp on a few elements of most cases). So `sleef_powf` evaluates SLEEF's xpowf
(src/libm/sleefsimdsp.c: logkf, expkf and df.h's double-float helpers, the FMA variant every AVX2 / AVX-512
build compiles) with an exact float32 fused multiply-add (`fma32`), and `torch_pow` splits the elements as
torch's vectorized loop does. Which elements go to SLEEF depends on torch's vector width, so the converter's
bytes depend on the CPU it ran on: `torch_lanes` reads it as torch's dispatch does (16 floats for AVX-512,
8 for AVX2, none for its DEFAULT capability; ATEN_CPU_CAPABILITY). bench/check_llama3_rope.py compares
with torch on x86-64 under all three; aarch64's 4 NEON lanes follow the same rule but are unchecked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import platform
from pathlib import Path

import numpy as np

F32 = np.float32
_CAPABILITY_LANES = {"avx512": 16, "avx2": 8, "default": 0}


def torch_lanes() -> int:
    """Vectorized<float>::size() of torch's CPU dispatch here (0: DEFAULT, no SLEEF): ATEN_CPU_CAPABILITY
    when set, else what the CPU has (compute_cpu_capability: AVX-512 with F, BW, VL, DQ and FMA; AVX2 with
    FMA), read from /proc/cpuinfo; aarch64: NEON's 4."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap in _CAPABILITY_LANES:
        return _CAPABILITY_LANES[cap]
    if platform.machine().lower() in ("aarch64", "arm64"):
        return 4
    try:
        flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), set())
    except OSError:
        flags = set()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return 16
    return 8 if {"avx2", "fma"} <= flags else 0


# -- exact float32 arithmetic ---------------------------------------------------------------------------


def fma32(a, b, c) -> np.ndarray:
    """fmaf(a, b, c) for float32 arrays: a * b + c rounded once (to nearest even), as _mm512_fmadd_ps.
    The product is exact in float64; the sum is rounded to float64 *to odd* (TwoSum's error says which way
    the exact value lies), and a round-to-odd result with 29 spare bits rounds to float32 as the exact value."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    v = s - p
    err = (p - (s - v)) + (c - v)  # s + err == p + c exactly (TwoSum)
    inexact_even = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(inexact_even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def _two(hi, lo) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(hi, F32), np.asarray(lo, F32)


# -- SLEEF's double-float helpers (src/common/df.h, ENABLE_FMA_SP) ------------------------------------------


def _df_add2_f_f(x, y):
    """dfadd2_vf2_vf_vf: x + y as a pair (TwoSum)."""
    s = x + y
    v = s - x
    return _two(s, (x - (s - v)) + (y - v))


def _df_add2_f2_f(x, y):
    """dfadd2_vf2_vf2_vf."""
    s = x[0] + y
    v = s - x[0]
    t = (x[0] - (s - v)) + (y - v)
    return _two(s, t + x[1])


def _df_add2_f2_f2(x, y):
    """dfadd2_vf2_vf2_vf2."""
    s = x[0] + y[0]
    v = s - x[0]
    t = (x[0] - (s - v)) + (y[0] - v)
    return _two(s, t + (x[1] + y[1]))


def _df_add_f2_f2(x, y):
    """dfadd_vf2_vf2_vf2 (|x| >= |y|): ((x.hi - s) + y.hi + x.lo + y.lo) left to right."""
    s = x[0] + y[0]
    return _two(s, (((x[0] - s) + y[0]) + x[1]) + y[1])


def _df_add_f_f2(x, y):
    """dfadd_vf2_vf_vf2: ((x - s) + y.hi) + y.lo."""
    s = x + y[0]
    return _two(s, ((x - s) + y[0]) + y[1])


def _df_normalize(t):
    s = t[0] + t[1]
    return _two(s, (t[0] - s) + t[1])


def _df_scale(d, s):
    return _two(d[0] * s, d[1] * s)


def _df_mul_f2_f(x, y):
    """dfmul_vf2_vf2_vf: s = x.hi * y; lo = fma(x.lo, y, fma(x.hi, y, -s))."""
    s = x[0] * y
    return _two(s, fma32(x[1], y, fma32(x[0], y, -s)))


def _df_mul_f2_f2(x, y):
    """dfmul_vf2_vf2_vf2."""
    s = x[0] * y[0]
    return _two(s, fma32(x[0], y[1], fma32(x[1], y[0], fma32(x[0], y[0], -s))))


def _df_squ(x):
    """dfsqu_vf2_vf2."""
    s = x[0] * x[0]
    return _two(s, fma32(x[0] + x[0], x[1], fma32(x[0], x[0], -s)))


def _df_div(n, d):
    """dfdiv_vf2_vf2_vf2 (vrec: a true division)."""
    t = F32(1) / d[0]
    s = n[0] * t
    u = fma32(t, n[0], -s)
    v = fma32(-d[1], t, fma32(-d[0], t, F32(1)))
    return _two(s, fma32(s, v, fma32(n[1], t, u)))


# -- SLEEF's xpowf (src/libm/sleefsimdsp.c, the ENABLE_AVX512F branches) -------------------------------------


def _getexp_getmant(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logkf's e = getexp(d * (1 / 0.75f)) and m = getmant(d) in [0.75, 1.5) (_MM_MANT_NORM_p75_1p5), for
    positive normal d (the rope bases)."""
    e = np.frexp(d * F32(1.0 / 0.75))[1] - 1  # floor(log2(product)), exactly
    m = np.frexp(d)[0]  # d = m 2^k, m in [0.5, 1)
    m = np.where(m < F32(0.75), m * F32(2), m)  # [0.75, 1.5): only the exponent changes
    return e.astype(F32), m.astype(F32)


def _logkf(d: np.ndarray):
    """logkf: log(d) as a float pair."""
    e, m = _getexp_getmant(d)
    x = _df_div(_df_add2_f_f(F32(-1), m), _df_add2_f_f(F32(1), m))
    x2 = _df_squ(x)
    t = fma32(F32(0.240320354700088500976562), x2[0], F32(0.285112679004669189453125))
    t = fma32(t, x2[0], F32(0.400007992982864379882812))
    c = _two(F32(0.66666662693023681640625), F32(3.69183861259614332084311e-09))
    s = _df_mul_f2_f(_two(F32(0.69314718246459960938), F32(-1.904654323148236017e-09)), e)
    s = _df_add_f2_f2(s, _df_scale(x, F32(2)))
    return _df_add_f2_f2(s, _df_mul_f2_f2(_df_mul_f2_f2(x2, x), _df_add2_f2_f2(_df_mul_f2_f(x2, t), c)))


def _ldexp(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """vldexp_vf_vf_vi2: x * 2^q in the steps SLEEF multiplies by (exact while the result is normal)."""
    q = q.astype(np.int32)
    m = q >> 31
    m = (((m + q) >> 6) - m) << 4
    q = q - (m << 2)
    m = m + 0x7F
    m = np.where(m > 0, m, 0)
    m = np.where(m > 0xFF, 0xFF, m)
    u = (m.astype(np.int32) << 23).view(F32)
    x = x * u * u * u * u
    return x * ((q + 0x7F) << 23).astype(np.int32).view(F32)


def _expkf(d):
    """expkf: exp of a float pair."""
    u = (d[0] + d[1]) * F32(1.442695040888963407359924681001892137426645954152985934135449406931)
    q = np.rint(u).astype(np.int32)  # cvtps_epi32: to nearest, ties to even
    qf = q.astype(F32)
    s = _df_add2_f2_f(d, qf * F32(-0.693145751953125))
    s = _df_add2_f2_f(s, qf * F32(-1.428606765330187045e-06))
    s = _df_normalize(s)
    u = F32(0.00136324646882712841033936)
    for coef in (0.00836596917361021041870117, 0.0416710823774337768554688, 0.166665524244308471679688,
                 0.499999850988388061523438):
        u = fma32(u, s[0], F32(coef))
    t = _df_add_f2_f2(s, _df_mul_f2_f(_df_squ(s), u))
    t = _df_add_f_f2(F32(1), t)
    u = _ldexp(t[0] + t[1], q)
    return np.where(d[0] < F32(-104), F32(0), u).astype(F32)


def sleef_powf(x: float, y: np.ndarray) -> np.ndarray:
    """SLEEF's xpowf (Sleef_powf16_u10) of a positive normal float32 base `x` and exponents `y` in float32
    (the special cases of the rope factors only: y == 0 and x == 1 give 1)."""
    y = np.asarray(y, F32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        d = np.full(y.shape, F32(x), F32)
        lg = _logkf(d)
        out = _expkf(_df_mul_f2_f(lg, y))
    out = np.where(np.isnan(out), F32(np.inf), out)
    return np.where((y == 0) | (d == 1), F32(1), out).astype(F32)


@functools.cache
def _powf():
    try:
        libm = ctypes.CDLL("libm.so.6")
    except OSError:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or ctypes.util.find_library("c"))
    libm.powf.restype = ctypes.c_float
    libm.powf.argtypes = (ctypes.c_float, ctypes.c_float)
    return libm.powf


def c_powf(x: float, y: np.ndarray) -> np.ndarray:
    """The C library's powf (std::pow(float, float)), which torch's scalar loop calls: the same function,
    not a copy (glibc's is not correctly rounded either)."""
    powf = _powf()
    return np.array([powf(F32(x), F32(v)) for v in np.asarray(y, F32).reshape(-1)], F32).reshape(np.shape(y))


def torch_pow(base: float, exps: np.ndarray, lanes: int | None = None) -> np.ndarray:
    """torch.pow(base, exps) on CPU for float32 (cpu_kernel_vec's vectorized_loop): SLEEF over the largest
    multiple of 2 * `lanes` elements, the C library's powf over the rest; a base of 1 fills ones
    (pow_Scalar_out). `lanes` 0: torch's DEFAULT capability, whose Vectorized pow maps std::pow."""
    exps = np.asarray(exps, F32)
    if F32(base) == 1:
        return np.ones_like(exps)
    lanes = torch_lanes() if lanes is None else lanes
    split = len(exps) - len(exps) % (2 * lanes) if lanes else 0
    return np.concatenate([sleef_powf(base, exps[:split]), c_powf(base, exps[split:])])


# -- the converter's computation ---------------------------------------------------------------------------


def llama3_rope_factors(base: float, dim: int, factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, old_context_len: float = 8192,
                        lanes: int | None = None) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' rope factors (dim / 2 of them, float32), each step as torch
    evaluates it on float32 tensors: Python numbers are rounded to float32 where they meet a tensor,
    `number / tensor` is tensor.reciprocal() * number, the thresholds are compared in float32. `lanes`:
    torch's vector width (torch_lanes() by default)."""
    exps = np.arange(0, dim, 2, dtype=F32) / F32(dim)
    freqs = (F32(1) / torch_pow(base, exps, lanes)) * F32(1.0)
    low_wavelen = old_context_len / low_freq_factor  # Python floats, as the converter computes them
    high_wavelen = old_context_len / high_freq_factor
    out = np.empty(len(freqs), F32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for i, freq in enumerate(freqs):
            wavelen = (F32(1) / freq) * F32(2 * math.pi)
            if wavelen < F32(high_wavelen):
                out[i] = 1
            elif wavelen > F32(low_wavelen):
                out[i] = F32(factor)
            else:
                smooth = ((F32(1) / wavelen) * F32(old_context_len) - F32(low_freq_factor)) \
                    / F32(high_freq_factor - low_freq_factor)
                out[i] = (F32(1) / ((F32(1) - smooth) / F32(factor) + smooth)) * F32(1)
    return out
