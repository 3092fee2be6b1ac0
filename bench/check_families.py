"""Every model family against llama.cpp, in the same run: perplexity chunk by chunk, after a
finetune, and after export to q8_0 / q4_k_m.

    python bench/check_families.py --bin PATH/TO/llama.cpp/build/bin [FAMILY ...] [--parts ppl,finetune,export]
    python bench/check_families.py --bin PATH/TO/llama.cpp/build/bin --record [FAMILY ...]

For each family a random-weight GGUF is written from `configs/<family>-tiny.toml` with llmtune's
`init` metadata (the keys llama.cpp's converter writes) and *every* tensor random (biases, norm
weights and rope factors too, so leaving out any feature moves the numbers), then:

ppl       llama-perplexity vs llmtune perplexity at ctx 128: the running PPL after every chunk,
          max relative difference (goal < 1e-3).
finetune  llmtune finetune (1 epoch, ctx 128): validation loss before/after, and llama.cpp's
          perplexity of the finetuned file vs llmtune's.
export    llmtune export --type q8_0 / q4_k_m, each evaluated by both tools (llmtune also without
          its rounding of the activations to the weights' vec_dot types: load_model(quantized=False)),
          and llmtune's noise floor on that file: how far 1-ulp nudges of the activations before
          their rounding move it from itself (see ulp_noise_floor).
--f32-kv  llama-perplexity with its KV cache and attention in f32 (its default f16 cache and flash
          attention round K, V and the attention sums to f16, which the quantized activations amplify).

--record  write the test fixture tests/data/families/<family>.json instead: what regenerates the
          model, its sha256, and llama-perplexity's running PPL over the short text the tests use
          (tests/family_check.py: layout, text, tolerance); keeps other oracles' entries
          (bench/check_transformers.py --record adds HF transformers'). A test then only calls
          family_check.check_family(name, tmp_path).

Families and their vocabularies are listed in FAMILIES below; a family module adds its row
(a vocabulary may be a .gguf.gz of tests/data/vocab/).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
VOCAB = DATA / "vocab"
sys.path.insert(0, str(ROOT / "tests"))
import family_check  # noqa: E402  (the fixture layout the tests read)


@dataclass(frozen=True)
class FamilyCase:
    config: Path  # init config (configs/<family>-tiny.toml)
    vocab: Path  # GGUF whose tokenizer the model uses
    optional: tuple = ()  # optional tensors to write too (e.g. "rope_freqs.weight")


FAMILIES: dict[str, FamilyCase] = {
    "llama": FamilyCase(ROOT / "configs" / "llama-tiny.toml", DATA / "stories260K.gguf"),
    "llama3": FamilyCase(ROOT / "configs" / "llama3-tiny.toml", VOCAB / "ggml-vocab-llama-bpe.gguf.gz",
                         ("rope_freqs.weight",)),
    "qwen2": FamilyCase(ROOT / "configs" / "qwen2-tiny.toml", VOCAB / "ggml-vocab-qwen2.gguf.gz"),
    "qwen3": FamilyCase(ROOT / "configs" / "qwen3-tiny.toml", VOCAB / "ggml-vocab-qwen2.gguf.gz"),
    "phi3": FamilyCase(ROOT / "configs" / "phi3-tiny.toml", VOCAB / "ggml-vocab-phi-3.gguf",
                       ("rope_factors_long.weight", "rope_factors_short.weight")),
    "gpt2": FamilyCase(ROOT / "configs" / "gpt2-tiny.toml", VOCAB / "ggml-vocab-gpt-2.gguf"),
    "gemma2": FamilyCase(ROOT / "configs" / "gemma2-tiny.toml", DATA / "stories260K.gguf"),
    "gemma3": FamilyCase(ROOT / "configs" / "gemma3-tiny.toml", DATA / "stories260K.gguf"),
}


def random_model(case: FamilyCase, out: Path, seed: int = 0) -> Path:
    """init's metadata and tensor list with every tensor random (see init_tensors' test_weights)."""
    from llmtune.convert.init import init_model

    vocab = family_check.local_copy(case.vocab, out.parent)
    return init_model(case.config, vocab, out, seed, test_weights=True, optional=case.optional)


# llama.cpp computing in f32 throughout (no f16 KV cache, no flash attention): ~1e-6 from llmtune
# instead of ~1e-4, so the fixtures can hold llmtune to a tight tolerance
F32_ARGS = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")


def llama_running_ppl(bin_dir: Path, model: Path, text: Path, ctx: int, chunks: int, extra=()) -> list[float]:
    """The running PPL llama-perplexity prints after each chunk ([1]x,[2]y,...)."""
    # one chunk more than needed (when the text has it): the logger may drop the last value only
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
           "--chunks", str(chunks + 1), "-t", "2", *extra]
    for _ in range(10):  # llama.cpp's async logger may drop the last "[n]x," at exit (its issue 22142): run again
        done = subprocess.run(cmd, capture_output=True, text=True)
        values = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+(?:e[+-]?\d+)?)", done.stdout + done.stderr)]
        if len(values) >= chunks or done.returncode:
            break
    if len(values) < chunks:
        raise RuntimeError(f"llama-perplexity failed on {model}:\n{(done.stdout + done.stderr)[-3000:]}")
    return values[:chunks]


def compare_ppl(bin_dir: Path, model: Path, text: Path, ctx: int = 128, chunks: int = 20,
                extra=()) -> tuple[float, float, float, float | None, float | None]:
    """(llama.cpp final PPL, llmtune final PPL, max relative difference over the running values,
    the same difference for llmtune computing plain float32 products, llmtune's own noise floor);
    the last two are None when the file has no quantized or 16-bit matrix. `extra`: more
    llama-perplexity arguments (F32_ARGS: its KV cache and attention in f32)."""
    import llmtune
    from llmtune.model.loaded import load_model
    from llmtune.quant.qtensor import QTensor

    theirs = llama_running_ppl(bin_dir, model, text, ctx, chunks, extra)
    loaded = load_model(model)
    ours = llmtune.perplexity(loaded, text, ctx=ctx, chunks=chunks).chunks
    diff = family_check.max_rel_diff(ours, theirs)
    if not any(isinstance(w, QTensor) for w in loaded.weights.values()):
        return theirs[-1], ours[-1], diff, None, None
    decoded = llmtune.perplexity(load_model(model, quantized=False), text, ctx=ctx, chunks=chunks).chunks
    return (theirs[-1], ours[-1], diff, family_check.max_rel_diff(decoded, theirs),
            ulp_noise_floor(model, text, ctx, chunks, ours))


def ulp_noise_floor(model: Path, text: Path, ctx: int, chunks: int, ours: list[float], seeds: int = 3) -> float:
    """How far llmtune moves from itself when every activation entering a quantized product is
    nudged by at most one float32 ulp (a third of them up, a third down) before it is rounded to the
    weight's vec_dot type: the largest max-chunk difference over `seeds` runs. Quantizing the
    activations turns a 1-ulp difference at a rounding boundary into a whole quantization step, so
    two correct implementations that sum in different orders (llama.cpp's SIMD blocks, llmtune's
    BLAS) agree on a quantized file only to about this level."""

    import llmtune
    import llmtune.backends.cpu.products as qm
    from llmtune.model.loaded import load_model

    exact = qm.round_activations
    worst = 0.0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)

        def nudged(x, act):
            ulp = np.float32(2**-23) * rng.integers(-1, 2, size=x.shape).astype(np.float32)
            return exact((x * (1 + ulp)).astype(np.float32), act)

        qm.round_activations = nudged
        try:
            again = llmtune.perplexity(load_model(model), text, ctx=ctx, chunks=chunks).chunks
        finally:
            qm.round_activations = exact
        worst = max(worst, family_check.max_rel_diff(again, ours))
    return worst


def llama_version(bin_dir: Path) -> str:
    done = subprocess.run([str(bin_dir / "llama-perplexity"), "--version"], capture_output=True, text=True)
    found = re.search(r"version: .*", done.stdout + done.stderr)
    return found.group(0) if found else "unknown"


def record_family(name: str, case: FamilyCase, bin_dir: Path, tmp: Path) -> None:
    """(Re)write tests/data/families/<name>.json with llama.cpp's numbers (other oracles' kept)."""
    fixture = family_check.new_fixture(name, case.config, case.vocab, case.optional)
    model = family_check.make_model(fixture, tmp)
    text, fixture["text_bytes"] = family_check.check_text(tmp, fixture["text"], fixture["text_bytes"])
    fixture["model_sha256"] = family_check.sha256(model)
    # a verbose tokenizer (gpt2's) fills fewer chunks of the short text: record those it fills
    available = len(family_check.llmtune_running_ppl(model, text, fixture["ctx"], None))
    fixture["chunks"] = min(fixture["chunks"], available)
    path = family_check.fixture_path(name)
    if path.exists():
        old = json.loads(path.read_text())
        if all(old.get(k) == v for k, v in fixture.items()):  # same model and text: other oracles still apply
            fixture = {**old, **fixture}
    theirs = llama_running_ppl(bin_dir, model, text, fixture["ctx"], fixture["chunks"], F32_ARGS)
    fixture["llama.cpp"] = {"running_ppl": theirs, "version": llama_version(bin_dir),
                            "command": f"llama-perplexity -m MODEL -f TEXT -c {fixture['ctx']} -b {fixture['ctx']} "
                                       f"--chunks {fixture['chunks']} {' '.join(F32_ARGS)}"}
    family_check.write_fixture(name, fixture)
    ours = family_check.llmtune_running_ppl(model, text, fixture["ctx"], fixture["chunks"])
    diff = family_check.max_rel_diff(ours, theirs)
    ok = "yes" if diff < family_check.TOLERANCE else "NO"
    print(f"| {name} | {path.relative_to(ROOT)} | {theirs[-1]:.4f} | {ours[-1]:.4f} | {diff:.2e} | {ok} |", flush=True)


def run_family(name: str, case: FamilyCase, bin_dir: Path, text: Path, parts: list[str], tmp: Path,
               extra=()) -> None:
    import llmtune

    compare = lambda path: compare_ppl(bin_dir, path, text, extra=extra)  # noqa: E731
    model = random_model(case, tmp / f"{name}.gguf")
    rows = []
    if "ppl" in parts:
        rows.append(("random weights", *compare(model)))
    if "finetune" in parts:
        tuned = tmp / f"{name}-ft.gguf"
        res = llmtune.finetune(model, ROOT / "data" / "wikitext-100k.txt", tuned, ctx=128, batch=512, ubatch=128,
                               epochs=1, lr=1e-3, val_split=0.1)
        before = llmtune.finetune(model, ROOT / "data" / "wikitext-100k.txt", tmp / "x.gguf", ctx=128, epochs=1,
                                  lr=1e-30, val_split=0.1).epochs[-1].val_loss  # lr > 0 required; no change
        print(f"{name}: validation loss {before:.4f} -> {res.epochs[-1].val_loss:.4f}", flush=True)
        rows.append(("finetuned by llmtune", *compare(tuned)))
        model = tuned
    if "export" in parts:
        for t in ("q8_0", "q4_k_m"):
            out = tmp / f"{name}-{t}.gguf"
            llmtune.export(model, out, t)
            rows.append((f"exported {t}", *compare(out)))
    for what, theirs, ours, diff, plain, noise in rows:
        ok = "yes" if diff < max(1e-3, noise or 0.0) else "NO"
        plain, noise = ("-" if v is None else f"{v:.2e}" for v in (plain, noise))
        print(f"| {name} | {what} | {theirs:.4f} | {ours:.4f} | {diff:.2e} | {ok} | {plain} | {noise} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("families", nargs="*", help=f"default: all ({', '.join(FAMILIES)})")
    ap.add_argument("--bin", required=True, type=Path, help="folder holding llama-perplexity")
    ap.add_argument("--parts", default="ppl,finetune,export")
    ap.add_argument("--record", action="store_true", help="write tests/data/families/FAMILY.json fixtures")
    ap.add_argument("--f32-kv", action="store_true",
                    help=f"run llama-perplexity with {' '.join(F32_ARGS)} (its default f16 KV cache and "
                         "flash attention "
                         "round K, V and the attention to f16)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown} (known: {', '.join(FAMILIES)})")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.record:
            print(f"| family | fixture | llama.cpp PPL | llmtune PPL | max chunk diff | < {family_check.TOLERANCE:g} |")
            print("| --- | --- | ---: | ---: | ---: | --- |")
            for name in args.families or list(FAMILIES):
                (tmp / name).mkdir()
                record_family(name, FAMILIES[name], args.bin, tmp / name)
            return 0
        text = tmp / "wiki.test.raw"
        text.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
        print("| family | model | llama.cpp PPL | llmtune PPL | max chunk diff | < max(1e-3, noise floor) "
              "| without activation rounding | llmtune's 1-ulp noise floor |")
        print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |")
        for name in args.families or list(FAMILIES):
            run_family(name, FAMILIES[name], args.bin, text, parts, tmp, F32_ARGS if args.f32_kv else ())
    return 0


if __name__ == "__main__":
    sys.exit(main())
