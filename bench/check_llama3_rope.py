"""llmtune's Llama 3.1 rope factors (convert/hf_rope.py) against the converter's own code run in torch.

    python bench/check_llama3_rope.py             # every case: torch's pow and the converter's factors, bits
    python bench/check_llama3_rope.py --record    # also tests/data/llama3_rope.json (this CPU's vector width)
    ATEN_CPU_CAPABILITY=avx2 python bench/check_llama3_rope.py --record   # the AVX2 width's cases too

The oracle is LlamaModel.generate_extra_tensors itself (the vendored convert_hf_to_gguf.py's conversion/
llama.py, called on a stand-in with the case's rope parameters), and `base ** (arange / dim)` as it spells
it. Each case is compared bit for bit; numpy's float32 power and a correctly rounded power (float64 rounded
to float32) are counted beside it, to show what the SLEEF emulation is for.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LLAMA_CPP = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
sys.path[:0] = [str(LLAMA_CPP), str(LLAMA_CPP / "gguf-py")]
from conversion.llama import LlamaModel  # noqa: E402

from llmtune.convert.hf_rope import llama3_rope_factors, torch_lanes, torch_pow  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "llama3_rope.json"
BASES = (10000.0, 500000.0, 1000000.0, 50000.0, 123456.7, 10000.5)
DIMS = tuple(range(2, 258, 2))  # head dims 2..256: rope dims / 2 = 1..128 elements, tails of every length
# (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
SCALINGS = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 2.0, 4096), (4.5, 2.0, 8.0, 2048),
            (8, 1, 4, 8192), (32.0, 1.5, 3.7, 8000), (2.0, 0.5, 4.0, 16384), (64.0, 1.0, 8.0, 1024))
RECORDED_DIMS = (64, 96, 128, 80, 100, 256, 22, 160)


def lanes() -> int:
    """Vectorized<float>::size() for torch's dispatch on this CPU (0: DEFAULT, no SLEEF)."""
    return {"AVX512": 16, "AVX2": 8, "DEFAULT": 0}[torch.backends.cpu.get_cpu_capability()]


def converter_factors(base, dim: int, scaling) -> np.ndarray:
    factor, low, high, ctx = scaling
    rope = {"rope_type": "llama3", "rope_theta": base, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": ctx}
    stand_in = SimpleNamespace(rope_parameters=rope, hparams={"head_dim": dim}, format_tensor_name=lambda t: t)
    ((_, tensor),) = LlamaModel.generate_extra_tensors(stand_in)
    return tensor.numpy()


def torch_powers(base, dim: int) -> np.ndarray:
    return (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).numpy()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max(initial=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help=f"write this width's cases into {FIXTURE}")
    args = ap.parse_args()
    width = lanes()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}: {width} lanes; "
          f"llmtune's torch_lanes() {'agrees' if torch_lanes() == width else f'DIFFERS ({torch_lanes()})'}")

    pow_same = pow_numpy = pow_rounded = pow_cases = 0
    worst = 0
    for base, dim in itertools.product(BASES, DIMS):
        want = torch_powers(base, dim)
        exps = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        got = torch_pow(base, exps, width)
        pow_cases += 1
        pow_same += same(want, got)
        worst = max(worst, ulps(want, got))
        pow_numpy += same(want, np.float32(base) ** exps)
        pow_rounded += same(want, (np.float64(np.float32(base)) ** exps.astype(np.float64)).astype(np.float32))
    print(f"pow: {pow_same}/{pow_cases} (base, dim) cases bit-identical to torch (largest difference {worst} ulp); "
          f"numpy's float32 power {pow_numpy}/{pow_cases}, float64 rounded {pow_rounded}/{pow_cases}")

    cases = [(b, d, s) for (b, d), s in zip(itertools.product(BASES, DIMS), itertools.cycle(SCALINGS))]
    cases += list(itertools.product(BASES, (64, 96, 128), SCALINGS))
    fac_same, worst, failed = 0, 0, []
    for base, dim, scaling in cases:
        want = converter_factors(base, dim, scaling)
        got = llama3_rope_factors(base, dim, *scaling, lanes=width)
        fac_same += same(want, got)
        worst = max(worst, ulps(want, got))
        if not same(want, got):
            failed.append((base, dim, scaling))
    print(f"rope factors: {fac_same}/{len(cases)} cases bit-identical to the converter's "
          f"(largest difference {worst} ulp){'; differ: ' + str(failed[:10]) if failed else ''}")

    if args.record:
        record = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {}
        rows = []
        for i, (base, dim) in enumerate(itertools.product(BASES, RECORDED_DIMS)):
            scaling = SCALINGS[i % len(SCALINGS)]
            rows.append({"base": base, "dim": dim, "scaling": list(scaling),
                         "pow": torch_powers(base, dim).tobytes().hex(),
                         "factors": converter_factors(base, dim, scaling).tobytes().hex()})
        record[str(width)] = rows
        FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded {len(rows)} cases for {width} lanes in {FIXTURE}")


if __name__ == "__main__":
    main()
