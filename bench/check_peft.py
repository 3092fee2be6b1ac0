"""PEFT adapter folders both ways (llmtune export --peft, --lora DIR / --lora-init DIR) against PEFT
itself and llama.cpp's convert_lora_to_gguf.py.

    python bench/check_peft.py [--llama-cpp SRC --bin BUILD/bin] [--record] [--families]

1. round trip: `llmtune finetune tests/data/stories260K.gguf` trains a rank-4 adapter (plain and
   --rslora) on the first 20 KB of data/wikitext-100k.txt; `llmtune export A.gguf --peft DIR` writes
   it as PEFT's folder; PEFT loads it on transformers' model of the GGUF (check_transformers.load_hf)
   and its logits of a 64-token window are compared with llmtune's with the adapter GGUF (f32; max
   |difference| / max |logit|, goal < 1e-4).
2. llama.cpp (--llama-cpp, --bin): convert_lora_to_gguf.py on that folder, --base the HF folder
   transformers saves (config.json is all the converter reads), then llama-perplexity --lora with
   the converted file and with llmtune's original, ctx 128, 8 chunks of WikiText-2 test (goal 1e-5
   relative). The converter ignores use_rslora (it writes lora_alpha as it is): the rsLoRA adapter
   is shown to differ, by design of the converter.
3. PEFT's own adapters (init_lora_weights=False, so B != 0): plain (every matrix, embed_tokens and
   lm_head too) and rsLoRA saved in bfloat16, read by llmtune the way finetune --lora-init reads
   them: logits vs PEFT's (goal < 1e-4); the adapter `llmtune finetune --lora-init DIR --lr 1e-30`
   writes after an epoch that moves nothing (step 0's adapter): the same; and `llmtune perplexity
   --lora DIR` vs PEFT's running perplexity (check_transformers.hf_running_ppl).
   The same for gpt2-tiny (`llmtune init configs/gpt2-tiny.toml`, seed 0, random weights): PEFT's
   c_attn / c_proj / c_fc, Conv1D modules (fan_in_fan_out).
4. --families: every family of bench/check_families.py with a Hugging Face name table, a random model
   and a random adapter on every matrix that takes one, exported and compared with PEFT on a 128-token
   window (the length check_transformers.py holds the bases to; goal < 1e-4).
5. gpt2: `llmtune finetune` of gpt2-tiny trains a rank-4 adapter on its four matrices (attn_qkv,
   attn_output, ffn_up, ffn_down: transformers' Conv1D c_attn, c_proj, c_fc), and one on attn_output
   alone (target_modules must then name attn.c_proj, not the "c_proj" mlp.c_proj shares); exported
   with --peft, PEFT's logits on transformers' gpt2 vs llmtune's with the GGUF adapter (goal < 1e-4).
   With --llama-cpp / --bin: convert_lora_to_gguf.py on that folder and on PEFT's own gpt2 adapter; its
   GPT2Model transposes the Conv1D modules' LoRA (A and B swapped), so llama.cpp refuses both files:
   shown, not a goal llmtune can meet (its folder is PEFT's own layout).

--record writes the tests' fixtures: tests/data/peft/<case>/ (case 3's plain and bfloat16 rsLoRA
folders and gpt2's) and tests/data/peft/expected.npz (their tokens and PEFT's logits), expected.json (how).
Needs torch, transformers, peft (none of them is a dependency of llmtune) and safetensors.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
FIXTURES = DATA / "peft"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import check_families  # noqa: E402
import check_lora  # noqa: E402
import check_transformers  # noqa: E402
from llmtune.arch import get_family  # noqa: E402
from llmtune.backends.cpu import CPUBackend  # noqa: E402
from llmtune.convert.init import init_model  # noqa: E402
from llmtune.eval.perplexity import tokenize  # noqa: E402
from llmtune.eval.scoring import add_bos_of, as_model  # noqa: E402
from llmtune.gguf.file import load_gguf  # noqa: E402
from llmtune.graph.planner import Program  # noqa: E402
from llmtune.model.adapter import adaptable, attach, init_adapter, load_adapter, write_peft  # noqa: E402
from llmtune.model.loaded import load_model  # noqa: E402
from llmtune.tokenizer import read_text  # noqa: E402

# torch, transformers and peft (the oracles, not llmtune's dependencies) are imported where used

CTX, CHUNKS, N_TOK = 128, 8, 64
GOAL_LOGITS, GOAL_PPL = 1e-4, 1e-5
# the recorded fixtures: (folder name, LoraConfig settings, dtype saved); the base is the name's first part
FIXTURE_CASES = [
    ("stories260K-lora", dict(r=2, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj", "embed_tokens", "lm_head"]),
     "float32"),
    ("stories260K-rslora-bf16", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj"]),
     "bfloat16"),
    ("gpt2-tiny-lora", dict(r=2, lora_alpha=5, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
     "float32"),
]
GPT2_TARGETS = "attn_qkv|attn_output|ffn_up|ffn_down"
GPT2_COLUMNS = 97  # the gpt2 fixture's logits: every 97th of 50,257 columns (a small expected.npz)


def gpt2_tiny(tmp: Path) -> Path:
    """tests' gpt2 base: `llmtune init` of configs/gpt2-tiny.toml with GPT-2's vocabulary, seed 0, random weights."""
    out = tmp / "gpt2-tiny.gguf"
    if not out.is_file():
        init_model(ROOT / "configs" / "gpt2-tiny.toml", DATA / "vocab" / "ggml-vocab-gpt-2.gguf", out, 0,
                   test_weights=True)
    return out


def base_of(name: str, tmp: Path) -> tuple[Path, str]:
    """A fixture case's base model and family."""
    return (gpt2_tiny(tmp), "gpt2") if name.startswith("gpt2") else (STORIES, "llama")


def llmtune_cli(*args) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "llmtune.cli", *map(str, args)], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        raise RuntimeError(f"llmtune {args[0]} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def rel(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours.astype(np.float64) - theirs).max() / np.abs(theirs).max())


def ours_logits(model_path: Path, adapter, tokens: np.ndarray, flag: str = "--lora") -> np.ndarray:
    """llmtune's logits (f32) of `tokens` with `adapter` (a GGUF, a PEFT folder or a LoraAdapter)
    read by load_adapter as `flag` reads it."""
    model = load_model(model_path, quantized=False)
    if not hasattr(adapter, "pairs"):
        adapter = load_adapter(adapter, model, flag=flag)
    model = attach(model, [adapter])
    _, nodes, logits = model.build(1, tokens.size)
    prog = Program([logits], CPUBackend(np.float32),
                   params={nodes[n]: np.asarray(w, np.float32) for n, w in model.tensors().items()})
    return prog.run(tokens=tokens[None].astype(np.int32), pos=np.arange(tokens.size, dtype=np.int32))[0].copy()


def hf_model(model_path: Path, family: str = "llama"):
    return check_transformers.load_hf(model_path, check_transformers.PATCHES.get(family, check_transformers.Patch()))


def peft_logits(model_path: Path, folder: Path, tokens: np.ndarray, family: str = "llama") -> np.ndarray:
    import torch
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model(model_path, family), str(folder)).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens[None].astype(np.int64))).logits[0].double().numpy()


def hf_plain_logits(model_path: Path, tokens: np.ndarray, family: str) -> np.ndarray:
    """transformers' logits of the base alone (how far an adapter moves them)."""
    import torch

    with torch.no_grad():
        return hf_model(model_path, family)(torch.from_numpy(tokens[None].astype(np.int64))).logits[0].double().numpy()


def window(n_vocab: int, seed: int = 0, n: int = N_TOK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


# ------------------------------------------------------------------------------ 1 and 2: llmtune -> PEFT
def round_trip(tmp: Path, llama_cpp: Path | None, bin_dir: Path | None) -> None:
    text = tmp / "train.txt"
    text.write_text((ROOT / "data" / "wikitext-100k.txt").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    wiki = tmp / "wiki.test.raw"
    wiki.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    hf_dir = tmp / "hf-base"
    if llama_cpp:  # the HF base's config.json (transformers will not save_pretrained a model read from GGUF)
        config = hf_model(STORIES).config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [get_family("llama").hf.architecture]  # not set by the GGUF loader
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokens = window(512)
    for label, extra in (("LoRA", []), ("rsLoRA", ["--rslora", "--lora-alpha", "8"])):
        gguf, folder = tmp / f"{label}.gguf", tmp / f"{label}-peft"
        llmtune_cli("finetune", STORIES, text, "-o", gguf, "--lora-rank", 4, "--ctx", 64, "--epochs", 1, "--lr", 1e-2,
                    *extra)
        print(llmtune_cli("export", gguf, "--peft", folder).strip())
        diff = rel(ours_logits(STORIES, gguf, tokens), peft_logits(STORIES, folder, tokens))
        print(f"  {label}: PEFT's logits vs llmtune's (adapter GGUF): max rel diff {diff:.2e} "
              f"{'ok' if diff < GOAL_LOGITS else 'FAIL'}")
        back = rel(ours_logits(STORIES, folder, tokens), ours_logits(STORIES, gguf, tokens))
        print(f"  {label}: llmtune with the PEFT folder vs with the GGUF: max rel diff {back:.2e}")
        if llama_cpp and bin_dir:
            converted = tmp / f"{label}-converted.gguf"
            run([sys.executable, llama_cpp / "convert_lora_to_gguf.py", "--base", hf_dir, "--outtype", "f32",
                 "--outfile", converted, folder], env={"HF_HUB_OFFLINE": "1"})
            theirs = llama_ppl(bin_dir, wiki, converted)
            ours = llama_ppl(bin_dir, wiki, gguf)
            n = min(len(theirs), len(ours))  # llama-perplexity's logger may drop the last chunk's value
            theirs, ours = theirs[:n], ours[:n]
            d = max(abs(a - b) / b for a, b in zip(theirs, ours))
            verdict = "ok" if d < GOAL_PPL else ("differs: convert_lora_to_gguf.py ignores use_rslora"
                                                 if label == "rsLoRA" else "FAIL")
            print(f"  {label}: llama-perplexity --lora converted {theirs[-1]:.6f} vs llmtune's file {ours[-1]:.6f}: "
                  f"max rel diff {d:.2e} over {len(ours)} chunks {verdict}")


def run(cmd: list, env: dict | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        raise RuntimeError(f"{cmd[1] if len(cmd) > 1 else cmd[0]} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def llama_ppl(bin_dir: Path, text: Path, adapter: Path, base: Path = STORIES) -> list[float]:
    return check_lora.llama_running_ppl(bin_dir, base, text, CHUNKS, ["--lora", adapter])


# ------------------------------------------------------------------------------ 3: PEFT -> llmtune
def make_peft(folder: Path, settings: dict, dtype: str, seed: int = 0, base: Path = STORIES,
              family: str = "llama") -> None:
    """A PEFT adapter with random A and B (init_lora_weights=False) on `base` (stories260K), saved."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base, family), LoraConfig(init_lora_weights=False, lora_dropout=0.1, **settings))
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(folder), save_embedding_layers=False)  # no full embedding copies: a small fixture
    with open(folder / "adapter_config.json") as fh:  # the base's name as a person would see it
        config = json.load(fh)
    config["base_model_name_or_path"] = base.stem
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for extra in folder.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()  # PEFT's README.md


def peft_made(tmp: Path, record: bool) -> None:
    import peft
    import transformers

    wiki = tmp / "wiki.test.raw"
    wiki.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    text = tmp / "init.txt"
    text.write_text((ROOT / "data" / "wikitext-100k.txt").read_text(encoding="utf-8")[:5000], encoding="utf-8")
    expected, meta = {}, {}
    for name, settings, dtype in FIXTURE_CASES:
        base, family = base_of(name, tmp)
        folder = (FIXTURES if record else tmp) / name
        if folder.exists():
            shutil.rmtree(folder)
        make_peft(folder, settings, dtype, base=base, family=family)
        n_vocab = load_model(base).hp.n_vocab
        tokens = window(n_vocab, seed=1)[:8] if family == "gpt2" else window(512, seed=1)[:8]
        theirs = peft_logits(base, folder, tokens, family)
        diff = rel(ours_logits(base, folder, tokens, flag="--lora-init"), theirs)
        print(f"  {name}: llmtune (as --lora-init reads it) vs PEFT: logits max rel diff {diff:.2e} "
              f"{'ok' if diff < GOAL_LOGITS else 'FAIL'}")
        trained = tmp / f"{name}-init.gguf"  # an epoch that moves nothing: the adapter finetune starts from
        llmtune_cli("finetune", base, text, "-o", trained, "--lora-init", folder, "--lr", 1e-30, "--ctx", 64,
                    "--epochs", 1)
        d_init = rel(ours_logits(base, trained, tokens), theirs)
        print(f"  {name}: finetune --lora-init DIR --lr 1e-30, the adapter written: logits vs PEFT {d_init:.2e} "
              f"{'ok' if d_init < GOAL_LOGITS else 'FAIL'}")
        long = window(n_vocab, seed=2) if family == "gpt2" else window(512, seed=2)
        d_long = rel(ours_logits(base, folder, long), peft_logits(base, folder, long, family))
        print(f"  {name}: {N_TOK}-token window: max rel diff {d_long:.2e}")
        out = llmtune_cli("perplexity", base, wiki, "--ctx", CTX, "--chunks", 4, "--lora", folder)
        ours_ppl = float(out.split("PPL = ")[1].split()[0]) if "PPL = " in out else float("nan")
        hf = peft_model_of(folder, base, family)
        lt = as_model(base)
        ids = tokenize(lt, read_text(wiki))
        theirs_ppl = check_transformers.hf_running_ppl(hf, ids, *add_bos_of(lt), CTX, 4)[-1]
        print(f"  {name}: llmtune perplexity --lora DIR {ours_ppl:.6f} vs PEFT {theirs_ppl:.6f} "
              f"(rel {abs(ours_ppl - theirs_ppl) / theirs_ppl:.1e})")
        every = GPT2_COLUMNS if family == "gpt2" else 1
        expected[f"{name}.tokens"], expected[f"{name}.logits"] = tokens, theirs.astype(np.float32)[:, ::every]
        meta[name] = {"settings": settings, "dtype": dtype, "tokens": tokens.tolist(), "columns": f"every {every}"}
    if record:
        np.savez_compressed(FIXTURES / "expected.npz", **expected)
        meta["recorded_by"] = (f"python bench/check_peft.py --record (peft {peft.__version__}, transformers "
                               f"{transformers.__version__}): PEFT's logits (float32 model) of the tokens")
        (FIXTURES / "expected.json").write_text(json.dumps(meta, indent=2) + "\n")
        print(f"wrote {FIXTURES.relative_to(ROOT)}/")


def peft_model_of(folder: Path, base: Path = STORIES, family: str = "llama"):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base, family), str(folder)).eval()


# ------------------------------------------------------------------------------ 5: gpt2 trained here
def gpt2_round_trip(tmp: Path, llama_cpp: Path | None, bin_dir: Path | None) -> None:
    """Case 5; with llama.cpp, convert_lora_to_gguf.py on the four-matrix folder (--base: gpt2-tiny as
    `llmtune export --hf` writes it; config.json is what the converter reads) and llama-perplexity
    --lora with the converted file and with llmtune's original."""
    base = gpt2_tiny(tmp)
    text = tmp / "train.txt"
    text.write_text((ROOT / "data" / "wikitext-100k.txt").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    tokens = window(load_model(base).hp.n_vocab, n=CTX)
    for label, targets in (("four matrices", GPT2_TARGETS), ("attn_output alone", "attn_output")):
        gguf, folder = tmp / f"gpt2-{len(targets)}.gguf", tmp / f"gpt2-{len(targets)}-peft"
        llmtune_cli("finetune", base, text, "-o", gguf, "--lora-rank", 4, "--lora-targets", targets, "--ctx", 64,
                    "--epochs", 1, "--lr", 1e-2)
        print(llmtune_cli("export", gguf, "--peft", folder).strip())
        config = json.loads((folder / "adapter_config.json").read_text())
        diff = rel(ours_logits(base, gguf, tokens), peft_logits(base, folder, tokens, "gpt2"))
        moved = rel(ours_logits(base, gguf, tokens), hf_plain_logits(base, tokens, "gpt2"))
        print(f"  gpt2 {label} ({', '.join(config['target_modules'])}; fan_in_fan_out {config['fan_in_fan_out']}): "
              f"PEFT's logits vs llmtune's (adapter GGUF): max rel diff {diff:.2e} "
              f"{'ok' if diff < GOAL_LOGITS else 'FAIL'} (the adapter moves them {moved:.1e})")
        back = rel(ours_logits(base, folder, tokens), ours_logits(base, gguf, tokens))
        print(f"  gpt2 {label}: llmtune with the PEFT folder vs with the GGUF: max rel diff {back:.2e}")
        if llama_cpp and bin_dir and targets == GPT2_TARGETS:
            llama_cpp_gpt2(tmp, base, gguf, folder, llama_cpp, bin_dir)


def llama_cpp_gpt2(tmp: Path, base: Path, gguf: Path, folder: Path, llama_cpp: Path, bin_dir: Path) -> None:
    """convert_lora_to_gguf.py on gpt2 folders, ours and PEFT's own (tests/data/peft/gpt2-tiny-lora): its
    GPT2Model transposes c_attn / c_proj / c_fc's LoRA as it transposes their Conv1D weights, swapping A
    and B, though PEFT's pairs are already a Linear's; llama.cpp then refuses the file (shape)."""
    hf_dir = tmp / "gpt2-hf-base"
    llmtune_cli("export", base, "--hf", hf_dir)
    wiki = tmp / "wiki.test.raw"
    if not wiki.is_file():
        wiki.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    ours = llama_ppl(bin_dir, wiki, gguf, base)
    for label, peft_dir in (("llmtune's --peft", folder), ("PEFT's own", FIXTURES / "gpt2-tiny-lora")):
        converted = tmp / f"gpt2-converted-{peft_dir.name}.gguf"
        run([sys.executable, llama_cpp / "convert_lora_to_gguf.py", "--base", hf_dir, "--outtype", "f32",
             "--outfile", converted, peft_dir], env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(llama_cpp / "gguf-py")})
        shapes = {n: tuple(t.shape) for n, t in load_gguf(converted).tensors.items() if n.startswith("blk.0.attn_qkv")}
        try:
            theirs = llama_ppl(bin_dir, wiki, converted, base)
        except RuntimeError as exc:
            why = next((ln.strip() for ln in str(exc).splitlines() if "incorrect shape" in ln), str(exc)[-200:])
            print(f"  gpt2 {label} folder through convert_lora_to_gguf.py: {shapes} (want lora_a (r, 64), lora_b "
                  f"(192, r)); llama-perplexity: {why}")
            continue
        if label == "llmtune's --peft":
            n = min(len(theirs), len(ours))
            d = max(abs(a - b) / b for a, b in zip(theirs[:n], ours[:n]))
            print(f"  gpt2: llama-perplexity --lora converted {theirs[n - 1]:.6f} vs llmtune's file "
                  f"{ours[n - 1]:.6f}: max rel diff {d:.2e} over {n} chunks {'ok' if d < GOAL_PPL else 'FAIL'}")


# ------------------------------------------------------------------------------ 4: every family
def families(tmp: Path) -> None:
    for name, case in check_families.FAMILIES.items():
        path = check_families.random_model(case, tmp / f"{name}.gguf")
        model = load_model(path, quantized=False)
        if get_family(model.hp.arch).hf is None:
            print(f"  {name}: no Hugging Face name table (refused)")
            continue
        targets = "|".join(f"^{n}$".replace(".", r"\.") for n in adaptable(model))
        adapter = init_adapter(model, 2, 3.0, targets, seed=0)
        rng = np.random.default_rng(1)
        for pair in adapter.pairs.values():
            pair.a[...] = rng.standard_normal(pair.a.shape).astype(np.float32) * 0.2
            pair.b[...] = rng.standard_normal(pair.b.shape).astype(np.float32) * 0.05
        folder = tmp / f"{name}-peft"
        write_peft(adapter, folder, (model.hp.n_head, model.hp.n_head_kv), model.hp.n_layer, name)
        tokens = window(model.hp.n_vocab, n=CTX)  # phi3: the length check_transformers.py checks (long factors)
        try:
            theirs = peft_logits(path, folder, tokens, name)
        except Exception as exc:  # transformers' GGUF loader may lack a family
            print(f"  {name}: PEFT could not load it ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        diff = rel(ours_logits(path, adapter, tokens), theirs)
        modules = json.loads((folder / "adapter_config.json").read_text())["target_modules"]
        print(f"  {name}: {len(adapter.pairs)} matrices ({', '.join(modules)}): logits max rel diff {diff:.2e} "
              f"{'ok' if diff < GOAL_LOGITS else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's source folder (convert_lora_to_gguf.py)")
    ap.add_argument("--bin", type=Path, help="llama.cpp's build/bin (llama-perplexity)")
    ap.add_argument("--record", action="store_true", help="write tests/data/peft/")
    ap.add_argument("--families", action="store_true", help="every family with a name table too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("1/2. llmtune's adapters as PEFT folders")
        round_trip(tmp, args.llama_cpp, args.bin)
        print("3. PEFT's adapters in llmtune")
        peft_made(tmp, args.record)
        print("5. gpt2: llmtune's adapters as PEFT folders")
        gpt2_round_trip(tmp, args.llama_cpp, args.bin)
        if args.families:
            print("4. every family")
            families(tmp)


if __name__ == "__main__":
    main()
