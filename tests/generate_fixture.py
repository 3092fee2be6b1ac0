"""The generation cases llama.cpp's llama-completion was recorded on (tests/data/generate.json,
written by `python bench/check_generate.py --bin DIR --record`), and how llmtune runs them.

Each case names a model recipe (a bundled file, a family's random-weight model regenerated from
tests/data/families/<name>.json, or stories260K finetuned / LoRA-trained by llmtune on a fixed
slice of text: deterministic, so the test rebuilds the very file llama.cpp ran), a prompt, the
number of tokens, the context, the sampler settings, and llama.cpp's output bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import family_check
import llmtune
from llmtune.backends.cpu.threads import blas_threads
from llmtune.eval.generate import Generator, load_for_generation
from llmtune.eval.sampling import Sampler, SamplerConfig

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
FIXTURE = DATA / "generate.json"
TRAIN_TEXT = REPO / "data" / "wikitext-100k.txt"
TRAIN_BYTES = 6000  # the slice of TRAIN_TEXT the finetuned / LoRA cases train on
GREEDY = {"temp": 0.0}


def load() -> dict:
    return json.loads(FIXTURE.read_text())


def train_text(tmp: Path) -> Path:
    data = TRAIN_TEXT.read_bytes()[:TRAIN_BYTES]
    out = tmp / "train.txt"
    out.write_bytes(data[: data.rindex(b"\n") + 1])
    return out


def finetuned(tmp: Path) -> Path:
    """stories260K after one epoch of llmtune finetune on the text slice (deterministic)."""

    out = tmp / "stories260K-tuned.gguf"
    if not out.exists():
        with blas_threads(1):  # (OpenBLAS threads only spin on a busy machine; results are the same)
            llmtune.finetune(DATA / "stories260K.gguf", train_text(tmp), out, ctx=64, batch=256, epochs=1, lr=3e-3,
                             val_split=0.0, seed=1)
    return out


def lora_adapter(tmp: Path) -> Path:
    """A rank-4 LoRA adapter for stories260K trained one epoch on the text slice (deterministic)."""

    out = tmp / "stories260K-lora.gguf"
    if not out.exists():
        with blas_threads(1):
            llmtune.finetune(DATA / "stories260K.gguf", train_text(tmp), out, ctx=64, batch=256, epochs=1, lr=1e-2,
                             val_split=0.0, seed=1, lora_rank=4)
    return out


def family_model(name: str, tmp: Path) -> Path:
    fixture = family_check.load_fixture(name)
    (tmp / name).mkdir(exist_ok=True)
    return family_check.make_model(fixture, tmp / name)


def families() -> list[str]:
    return sorted(p.stem for p in family_check.FIXTURES.glob("*.json"))


def llama_args(sampler: dict) -> list[str]:
    args = ["--temp", str(sampler["temp"])]
    if "seed" in sampler:
        args += ["-s", str(sampler["seed"])]
    if "repeat_penalty" in sampler:
        args += ["--repeat-penalty", str(sampler["repeat_penalty"])]
    return args


def cases(tmp: Path) -> dict[str, dict]:
    """Every case with its model built (`model_path`, `lora_path`)."""
    f32 = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    stories = DATA / "stories260K.gguf"
    out = {
        # the acceptance command itself, llama.cpp's defaults (f16 KV cache) included
        "stories260K": dict(model="stories260K", model_path=stories, prompt="Once upon a time", n_predict=64, ctx=2048,
                            sampler=GREEDY, llama_args=llama_args(GREEDY)),
        "stories260K-sampled": dict(model="stories260K", model_path=stories, prompt="Once upon a time", n_predict=64,
                                    ctx=256, sampler={"temp": 0.8, "seed": 42}),
        "stories260K-repeat-penalty": dict(model="stories260K", model_path=stories, prompt="Lily and Tom", n_predict=64,
                                           ctx=256, sampler={"temp": 0.0, "repeat_penalty": 1.3}),
        "stories260K-finetuned": dict(model="finetuned", model_path=finetuned(tmp), prompt="The game", n_predict=48,
                                      ctx=256, sampler=GREEDY),
        "stories260K-lora": dict(model="stories260K", model_path=stories, lora="lora", lora_path=lora_adapter(tmp),
                                 prompt="Once upon a time", n_predict=48, ctx=256, sampler=GREEDY),
    }
    for name in families():
        out[f"family-{name}"] = dict(model=f"family:{name}", model_path=family_model(name, tmp),
                                     prompt="Once upon a time",
                                     n_predict=32, ctx=128, sampler=GREEDY)
    for case in out.values():
        case.setdefault("llama_args", llama_args(case["sampler"]) + f32)
    return out


def ours(case: dict) -> bytes:
    """llmtune's continuation for a case (bytes of the generated tokens, control tokens empty)."""

    model = load_for_generation(case["model_path"], [case["lora_path"]] if case.get("lora") else None)
    gen = Generator(model, "cpu", n_ctx=case["ctx"])
    sampler = Sampler(SamplerConfig(**case["sampler"]))
    res = gen.generate(gen.tokenize_prompt(case["prompt"]), case["n_predict"], sampler)
    return b"".join(model.tokenizer.token_to_bytes(t, special=False) for t in res.tokens)
