"""A family's random-weight model against the numbers other implementations recorded for it.

tests/data/families/<name>.json is written by `python bench/check_families.py --bin DIR --record
NAME` (llama.cpp's llama-perplexity) and completed by `python bench/check_transformers.py
--record NAME` (HF transformers, its GGUF loader patched). It holds what regenerates the model
(config, vocabulary, seed, optional tensors; `init` is deterministic, and the file's sha256 proves
it), the text (the first `text_bytes` of `text`), ctx and chunk count, and each oracle's running
perplexity after every chunk. A per-family test is one call:

    def test_qwen2_matches_llama_cpp(tmp_path):
        check_family("qwen2", tmp_path)

Every chunk is compared, not only the final value: leaving out any feature of a family moves at
least one 128-token chunk by percents, while the oracles, run in f32, agree to ~1e-6.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import llmtune
from llmtune.convert.init import init_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "families"
TEXT = REPO / "data" / "wikitext-100k.txt"  # the first bytes of WikiText-2's test split
TEXT_BYTES = 8192  # cut at the last newline before this
CTX, CHUNKS = 128, 16
# max relative difference of any chunk's running perplexity: the fixtures hold llama.cpp run in
# f32 (its f16 KV cache alone would be ~1e-4 away); a missing feature moves some chunk by percents
TOLERANCE = 1e-4


def fixture_path(name: str) -> Path:
    return FIXTURES / f"{name}.json"


def load_fixture(name: str) -> dict:
    return json.loads(fixture_path(name).read_text())


def write_fixture(name: str, fixture: dict) -> Path:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = fixture_path(name)
    path.write_text(json.dumps(fixture, indent=1) + "\n")
    return path


def local_copy(path: str | Path, tmp: Path) -> Path:
    """`path` (relative to the repo or absolute), unpacked into tmp when it is .gz."""
    path = Path(path) if Path(path).is_absolute() else REPO / path
    if path.suffix != ".gz":
        return path
    out = tmp / path.name[: -len(".gz")]
    if not out.exists():
        out.write_bytes(gzip.decompress(path.read_bytes()))
    return out


def check_text(tmp: Path, text: str | Path = TEXT, text_bytes: int = TEXT_BYTES) -> tuple[Path, int]:
    """The evaluation text: the first `text_bytes` of `text`, cut after a newline (path, bytes)."""
    data = local_copy(text, tmp).read_bytes()[:text_bytes]
    data = data[: data.rindex(b"\n") + 1]
    out = tmp / "family-check.txt"
    out.write_bytes(data)
    return out, len(data)


def make_model(fixture: dict, tmp: Path) -> Path:
    """The fixture's random-weight model (init with test_weights: every tensor random)."""

    out = tmp / f"{fixture['family']}.gguf"
    vocab = local_copy(fixture["vocab"], tmp)
    return init_model(REPO / fixture["config"], vocab, out, fixture["seed"], test_weights=True,
                      optional=tuple(fixture["optional"]))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_fixture(name: str, config: str | Path, vocab: str | Path, optional=(), seed: int = 0) -> dict:
    """A fixture's description before any oracle's numbers (bench/check_families.py --record)."""
    rel = lambda p: str(Path(p).resolve().relative_to(REPO))  # noqa: E731
    return {"family": name, "config": rel(config), "vocab": rel(vocab), "seed": seed, "optional": list(optional),
            "text": rel(TEXT), "text_bytes": TEXT_BYTES, "ctx": CTX, "chunks": CHUNKS}


def llmtune_running_ppl(model: Path, text: Path, ctx: int, chunks: int) -> list[float]:

    return llmtune.perplexity(model, text, ctx=ctx, chunks=chunks).chunks


def max_rel_diff(ours, theirs) -> float:
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    return max(abs(a - b) / b for a, b in zip(ours, theirs))


def check_family(name: str, tmp: Path, tolerance: float = TOLERANCE) -> dict[str, float]:
    """Regenerate the fixture's model, run llmtune's perplexity, compare with every oracle in the
    fixture (chunk by chunk). Returns oracle -> max relative difference."""
    fixture = load_fixture(name)
    model = make_model(fixture, tmp)
    assert sha256(model) == fixture["model_sha256"], (
        f"{name}: the regenerated model differs from the recorded one (init, config or vocabulary changed): "
        f"re-record with bench/check_families.py --record {name}")
    text, n = check_text(tmp, fixture["text"], fixture["text_bytes"])
    assert n == fixture["text_bytes"]
    ours = llmtune_running_ppl(model, text, fixture["ctx"], fixture["chunks"])
    oracles = {k: v["running_ppl"] for k, v in fixture.items() if isinstance(v, dict) and "running_ppl" in v}
    assert oracles, f"{name}: the fixture holds no oracle's numbers"
    diffs = {oracle: max_rel_diff(ours, theirs) for oracle, theirs in oracles.items()}
    for oracle, diff in diffs.items():
        assert diff < tolerance, (f"{name}: llmtune's running perplexity is {diff:.2e} from {oracle}'s "
                                  f"(ours {ours}, theirs {oracles[oracle]})")
    return diffs
