"""Llama 3.1's rope factors as the converter computes them in torch (convert/hf_rope.py).

tests/data/llama3_rope.json (bench/check_llama3_rope.py --record, once per torch vector width: AVX-512's 16
lanes, AVX2's 8, DEFAULT's none) holds torch's `base ** (arange(0, dim, 2) / dim)` and the converter's
rope_freqs.weight for 48 (base, dim, scaling) cases each, as float32 bytes; the bench compares 912 cases.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest

from conftest import DATA
from llmtune.convert.hf_rope import fma32, llama3_rope_factors, torch_lanes, torch_pow

RECORD = json.loads((DATA / "llama3_rope.json").read_text())


def _rounded_f32(exact: Fraction) -> np.float32:
    """`exact` rounded to the nearest float32, ties to an even last bit (the slow, certain way)."""
    guess = np.float32(float(exact))
    near = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.int32)) & 1))


def test_fma32_rounds_once():
    rng = np.random.default_rng(41)
    a = rng.standard_normal(3000).astype(np.float32) * np.float32(2) ** rng.integers(-20, 20, 3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = rng.standard_normal(3000).astype(np.float32) * np.float32(2) ** rng.integers(-40, 20, 3000).astype(np.float32)
    c[:1000] = -(a[:1000] * b[:1000])  # the error of a product: the case SLEEF's double-float helpers rely on
    c[1000:1500] = -(a[1000:1500] * b[1000:1500]) * np.float32(1 + 2 ** -23)  # near cancellation
    got = fma32(a, b, c)
    want = [_rounded_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert got.tobytes() == np.array(want, np.float32).tobytes()
    separate = (a * b + c).astype(np.float32)
    assert not np.array_equal(got, separate)  # one rounding, not two


def test_fma32_ties_go_to_even():
    one, tiny = np.float32(1), np.float32(2.0 ** -24)  # 1 + 2^-24: halfway between 1 and 1 + 2^-23
    assert fma32(one, one, tiny) == one
    assert fma32(np.float32(1 + 2 ** -23), one, tiny) == np.float32(1 + 2 ** -22)
    assert fma32(one, one, np.float32(2.0 ** -24 + 2.0 ** -47)) == np.float32(1 + 2 ** -23)  # past halfway
    # (1 + 2^-12)^2 + 2^-60 = 1 + 2^-11 + 2^-24 + 2^-60: float64 drops the 2^-60 and lands on the halfway point,
    # which a second rounding sends down; the exact value lies above it
    a = np.float32(1 + 2 ** -12)
    assert fma32(a, a, np.float32(2.0 ** -60)) == np.float32(1 + 2 ** -11 + 2 ** -23)
    assert fma32(a, a, np.float32(-(2.0 ** -60))) == np.float32(1 + 2 ** -11)


@pytest.mark.parametrize("lanes", sorted(RECORD, key=int), ids=lambda lanes: f"{lanes}-lanes")
def test_torch_pow_and_the_converters_factors(lanes):
    for row in RECORD[lanes]:
        base, dim, case = row["base"], row["dim"], (row["base"], row["dim"], row["scaling"])
        exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        assert torch_pow(base, exps, int(lanes)).tobytes().hex() == row["pow"], case
        assert llama3_rope_factors(base, dim, *row["scaling"], lanes=int(lanes)).tobytes().hex() == row["factors"], case


def test_the_vector_width_matters():
    """SLEEF and the C library's powf round some of these differently: the split must be torch's."""
    differ = 0
    for row in RECORD["16"]:
        exps = np.arange(0, row["dim"], 2, dtype=np.float32) / np.float32(row["dim"])
        differ += torch_pow(row["base"], exps, 0).tobytes().hex() != row["pow"]
    assert differ > 0


@pytest.mark.parametrize("capability,lanes", [("avx512", 16), ("AVX2", 8), ("default", 0)])
def test_torch_lanes_follows_aten_cpu_capability(monkeypatch, capability, lanes):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    assert torch_lanes() == lanes
