"""LoRA adapters against llama.cpp: adapters trained by llmtune, applied by both tools, merged by both.

    python bench/check_lora.py --bin PATH/TO/llama.cpp/build/bin [CASE ...]
    python bench/check_lora.py --bin PATH/TO/llama.cpp/build/bin --record

For stories260K (tests/data) and a random-weight model of every family in bench/check_families.py
(configs/<family>-tiny.toml, every tensor random) that llmtune loads:

1. `llmtune finetune BASE TEXT --lora-rank 4 ...` trains an adapter (1 epoch, ctx 64, on the first
   20 KB of data/wikitext-100k.txt; stories260K also with every matrix, token_embd and output
   included, and with --lora-dropout);
   stories260K exported to q8_0 is a base too (adapter trained on the quantized file, applied to it);
2. perplexity  `llama-perplexity -m BASE --lora ADAPTER` (f32 KV cache, no flash attention) vs
   `llmtune perplexity BASE --lora ADAPTER`, ctx 128, 16 chunks of WikiText-2 test: the running
   PPL after every chunk, max relative difference (goal < 1e-3);
3. merge       `llama-export-lora -m BASE --lora ADAPTER` vs `llmtune export BASE --lora ADAPTER
   --type f32`: max absolute difference over every tensor (goal <= 1e-6);
4. stories260K also with two adapters at once (the trained one at scale 0.5 and one written by
   llama.cpp's convert_lora_to_gguf.py, F16, tests/data/lora/) through --lora-scaled.

--make-convert-fixture LLAMA_CPP_SRC rewrites tests/data/lora/stories260K-convert-f16.gguf with llama.cpp's
convert_lora_to_gguf.py (from a PEFT-layout adapter made here; needs torch and transformers).

--record writes the test fixture tests/data/lora/llamacpp-lora.json: llama-perplexity's running
PPL of stories260K with the deterministic adapter tests/test_lora.py writes at test time (its
sha256 recorded), alone and together with the convert_lora_to_gguf.py fixture at scale 0.5.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import check_families  # noqa: E402  (families, random models, llama-perplexity runner)

CTX, CHUNKS = 128, 16
CONVERT_FIXTURE = DATA / "lora" / "stories260K-convert-f16.gguf"  # convert_lora_to_gguf.py --outtype f16
RECORD = DATA / "lora" / "llamacpp-lora.json"
F32_ARGS = check_families.F32_ARGS


def run(cmd: list) -> str:
    import subprocess

    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{cmd[0]} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def llama_running_ppl(bin_dir: Path, model: Path, text: Path, chunks: int, flags: list) -> list[float]:
    """llama-perplexity's running values; its async logger now and then drops the last "[n]x," at
    exit (several times in a row, on a busy machine): after 4 tries, the chunks it printed."""
    import re
    import subprocess

    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(CTX), "-b", str(CTX),
           "--chunks", str(chunks), "-t", "2", *F32_ARGS, *map(str, flags)]
    best: list[float] = []
    for _ in range(4):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"llama-perplexity failed on {model}:\n{(done.stdout + done.stderr)[-3000:]}")
        values = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+(?:e[+-]?\d+)?)", done.stdout + done.stderr)]
        best = values if len(values) > len(best) else best
        if len(best) >= chunks:
            break
    if len(best) < chunks - 1:
        raise RuntimeError(f"llama-perplexity printed {len(best)} of {chunks} chunks for {model}")
    return best[:chunks]


def train_adapter(base: Path, text: Path, out: Path, **extra) -> Path:
    import llmtune

    llmtune.finetune(base, text, out, ctx=64, batch=128, ubatch=64, epochs=1, lr=1e-2, val_split=0.1,
                     lora_rank=4, lora_alpha=8.0, **extra)
    return out


def compare_ppl(bin_dir: Path, base: Path, text: Path, adapters: list, scales: list) -> tuple[float, float, float]:
    """(llama.cpp final PPL, llmtune's, max relative difference over the running values)."""
    import llmtune

    flags = []
    for a, s in zip(adapters, scales):
        flags += ["--lora", str(a)] if s == 1.0 else ["--lora-scaled", f"{a}:{s}"]
    theirs = llama_running_ppl(bin_dir, base, text, CHUNKS, flags)
    ours = llmtune.perplexity(base, text, ctx=CTX, chunks=CHUNKS, lora=adapters, lora_scale=scales).chunks
    return theirs[-1], ours[len(theirs) - 1], max(abs(a - b) / b for a, b in zip(ours, theirs))


def compare_merge(bin_dir: Path, base: Path, adapter: Path, tmp: Path) -> tuple[float, int]:
    """(max |llama-export-lora - llmtune export --type f32| over every tensor, tensors compared)."""
    import llmtune
    from llmtune.gguf.file import load_gguf

    theirs, ours = tmp / "merged-llamacpp.gguf", tmp / "merged-llmtune.gguf"
    run([bin_dir / "llama-export-lora", "-m", base, "--lora", adapter, "-o", theirs, "-t", "2"])
    llmtune.export(base, ours, "f32", lora=adapter)
    a, b, src = load_gguf(theirs), load_gguf(ours), load_gguf(base)
    assert set(a.tensors) == set(b.tensors), "different tensor lists"
    # llama-export-lora writes F16 for a non-F32 base tensor: compare where it keeps F32
    names = [n for n in a.tensors if src.tensors[n].type.name == "F32"]
    return max(float(np.abs(a.tensor(n) - b.tensor(n)).max()) for n in names), len(names)


def cases(tmp: Path, wanted: list[str]) -> list[tuple[str, Path, dict]]:
    """(case name, base model, finetune extras) for stories260K and every family that loads."""
    from llmtune.model.loaded import load_model

    out = [("stories260K", DATA / "stories260K.gguf", {}),
           ("stories260K all matrices", DATA / "stories260K.gguf", {"lora_targets": r"weight$"}),
           ("stories260K dropout 0.1", DATA / "stories260K.gguf", {"lora_dropout": 0.1})]
    if not wanted or any(w.startswith("stories260K") for w in wanted):  # trained on, and applied to, a quantized base
        import llmtune

        q8 = llmtune.export(DATA / "stories260K.gguf", tmp / "stories260K-q8_0.gguf", "q8_0").out_path
        out.append(("stories260K-q8_0", q8, {}))
    for name, case in check_families.FAMILIES.items():
        try:
            model = check_families.random_model(case, tmp / f"{name}.gguf")
            load_model(model)
        except Exception as exc:  # a family being added right now may not load yet
            print(f"skipping {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        out.append((name, model, {}))
    return [c for c in out if not wanted or {c[0].split()[0], c[0].split()[0].split("-")[0]} & set(wanted)]


def fixture_adapter(model_path: Path, out: Path) -> Path:
    """The deterministic adapter tests/test_lora.py writes (same code: tests/lora_fixture.py)."""
    import lora_fixture

    return lora_fixture.write_fixture_adapter(model_path, out)


def record(bin_dir: Path, tmp: Path, text: Path) -> None:
    base = DATA / "stories260K.gguf"
    adapter = fixture_adapter(base, tmp / "fixture-adapter.gguf")
    sha = hashlib.sha256(adapter.read_bytes()).hexdigest()
    runs = {}
    for key, flags in (("alone", ["--lora", adapter]),
                       ("with_convert_f16_at_0.5", ["--lora", adapter, "--lora-scaled", f"{CONVERT_FIXTURE}:0.5"])):
        runs[key] = llama_running_ppl(bin_dir, base, text, 8, flags)
        assert len(runs[key]) == 8, "llama-perplexity dropped a chunk: record again"
    fixture = {"adapter_sha256": sha, "ctx": CTX, "chunks": 8, "text": "tests/data/wikitext-2-raw-test.txt.gz",
               "version": check_families.llama_version(bin_dir),
               "command": f"llama-perplexity -m stories260K.gguf -f wiki.test.raw -c {CTX} -b {CTX} --chunks 8 "
                          f"{' '.join(F32_ARGS)} --lora ADAPTER [--lora-scaled CONVERT:0.5]",
               "running_ppl": runs}
    RECORD.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {RECORD.relative_to(ROOT)}: {json.dumps(runs)}")


STORIES_HF_CONFIG = {  # stories260K's shape as a transformers config (convert_lora_to_gguf.py --base needs one)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
    "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 5, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32"}


def make_convert_fixture(llama_cpp_src: Path, tmp: Path) -> None:
    """Rewrite CONVERT_FIXTURE with llama.cpp's own converter (needs torch, transformers, safetensors):
    a PEFT-layout adapter (rank 2, alpha 4, q_proj / v_proj / down_proj, torch seed 0) of stories260K."""
    import subprocess

    import torch
    from safetensors.torch import save_file

    (tmp / "base").mkdir()
    (tmp / "lora").mkdir()
    (tmp / "base" / "config.json").write_text(json.dumps(STORIES_HF_CONFIG))
    g, tensors = torch.Generator().manual_seed(0), {}
    for layer in range(5):
        for module, (n_in, n_out) in (("self_attn.q_proj", (64, 64)), ("self_attn.v_proj", (64, 32)), ("mlp.down_proj", (172, 64))):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(2, n_in, generator=g) * 0.1
            tensors[prefix + ".lora_B.weight"] = torch.randn(n_out, 2, generator=g) * 0.1
    save_file(tensors, str(tmp / "lora" / "adapter_model.safetensors"))
    (tmp / "lora" / "adapter_config.json").write_text(json.dumps(
        {"lora_alpha": 4, "r": 2, "peft_type": "LORA", "target_modules": ["q_proj", "v_proj", "down_proj"],
         "base_model_name_or_path": "stories260K"}))
    run([sys.executable, llama_cpp_src / "convert_lora_to_gguf.py", "--base", tmp / "base", "--outtype", "f16",
         "--outfile", CONVERT_FIXTURE, tmp / "lora"])
    print(f"wrote {CONVERT_FIXTURE.relative_to(ROOT)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help="stories260K and/or family names (default: all)")
    ap.add_argument("--bin", required=True, type=Path, help="folder holding llama-perplexity and llama-export-lora")
    ap.add_argument("--record", action="store_true", help=f"write {RECORD.relative_to(ROOT)}")
    ap.add_argument("--make-convert-fixture", type=Path, metavar="LLAMA_CPP_SRC",
                    help=f"rewrite {CONVERT_FIXTURE.relative_to(ROOT)} with LLAMA_CPP_SRC/convert_lora_to_gguf.py")
    args = ap.parse_args()
    if args.make_convert_fixture:
        with tempfile.TemporaryDirectory() as tmp:
            make_convert_fixture(args.make_convert_fixture, Path(tmp))
        return 0
    from llmtune.backends.threads import blas_threads

    with tempfile.TemporaryDirectory() as tmp, blas_threads(1):  # tiny models: one BLAS thread is fastest
        tmp = Path(tmp)
        text = tmp / "wiki.test.raw"
        text.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
        if args.record:
            record(args.bin, tmp, text)
            return 0
        train_text = tmp / "train.txt"
        raw = (ROOT / "data" / "wikitext-100k.txt").read_bytes()[:20000]
        train_text.write_bytes(raw[: raw.rindex(b"\n") + 1])
        print(f"llama.cpp: {check_families.llama_version(args.bin)}")
        print("| model | adapter | llama.cpp PPL | llmtune PPL | max chunk rel. diff | merge max abs diff (tensors) | ok |")
        print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
        worst_ppl, worst_merge = 0.0, 0.0
        for i, (name, base, extra) in enumerate(cases(tmp, args.cases)):
            work = tmp / f"case{i}"
            work.mkdir()
            adapter = train_adapter(base, train_text, work / "adapter.gguf", **extra)
            from llmtune.gguf.file import load_gguf

            n_pairs = len(load_gguf(adapter).tensors) // 2
            theirs, ours, diff = compare_ppl(args.bin, base, text, [adapter], [1.0])
            merge, n = compare_merge(args.bin, base, adapter, work)
            worst_merge = max(worst_merge, merge)
            ok = "yes" if diff < 1e-3 and merge <= 1e-6 else "NO"
            if "q8_0" in name:  # llama.cpp quantizes activations for q8_0 dot products: the base alone differs
                b_theirs, b_ours, b_diff = compare_ppl(args.bin, base, text, [], [])
                print(f"| {name} | none (the quantized base alone) | {b_theirs:.4f} | {b_ours:.4f} | {b_diff:.2e} | | "
                      f"(llama.cpp's q8_0 activations) |", flush=True)
                ok = "yes (the base's residue)" if diff < max(1e-3, 1.5 * b_diff) and merge <= 1e-6 else "NO"
            else:
                worst_ppl = max(worst_ppl, diff)
            label = "rank 4, " + (extra.get("lora_targets") and "every matrix" or "default targets") + \
                (f", dropout {extra['lora_dropout']}" if "lora_dropout" in extra else "") + f" ({n_pairs} pairs)"
            print(f"| {name.split()[0]} | {label} | {theirs:.4f} | {ours:.4f} | {diff:.2e} | {merge:.2e} ({n}) | {ok} |",
                  flush=True)
            if name == "stories260K":
                theirs, ours, diff = compare_ppl(args.bin, base, text, [adapter, CONVERT_FIXTURE], [0.5, 2.0])
                worst_ppl = max(worst_ppl, diff)
                ok = "yes" if diff < 1e-3 else "NO"
                print(f"| stories260K | this one at 0.5 + convert_lora_to_gguf.py F16 at 2.0 | {theirs:.4f} | {ours:.4f} "
                      f"| {diff:.2e} | | {ok} |", flush=True)
        print(f"\nworst (float bases): perplexity {worst_ppl:.2e} (goal < 1e-3), merge {worst_merge:.2e} (goal <= 1e-6)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
