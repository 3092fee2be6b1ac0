"""`llmtune generate` against llama.cpp's llama-completion, in the same run: greedy (and seeded)
continuations byte for byte, and decode speed.

    python bench/check_generate.py --bin PATH/TO/llama.cpp/build/bin [--parts text,speed] [--record]

text    the continuation of a prompt, greedy, for stories260K (exactly the acceptance command
        `llama-completion -m stories260K.gguf -p "Once upon a time" -n 64 --temp 0`), for each
        family's random-weight model (tests/data/families/<name>.json regenerates it), for a model
        finetuned by llmtune, for stories260K with a LoRA adapter trained by llmtune (`--lora`),
        and with seeded sampling (temp 0.8 with llama.cpp's default top-k/top-p/min-p, and a
        repeat penalty). llama-completion's stdout (--no-display-prompt) is compared with the
        bytes of llmtune's tokens (control tokens render empty in both). Apart from the acceptance
        command, llama.cpp runs in f32 (-ctk f32 -ctv f32 -fa off): its default f16 KV cache moves
        logits by ~1e-4, enough to flip a near tie of a random model.
speed   decode tokens/s (llama-completion's "eval time" line: n - 1 single-token passes) for
        stories260K and the 15M shape (configs/llama-15m.toml, f32), llama.cpp with 1 thread and
        with its default (every core), llmtune on the cpu backend; medians of interleaved runs.
--record  write tests/data/generate.json: the cases and llama.cpp's bytes, which
          tests/test_generate.py checks without llama.cpp.

llama.cpp's asynchronous logger sometimes drops the end of stdout at exit (issue 22142): each
llama-completion run is repeated until two runs agree, and the longest output is kept.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import family_check  # noqa: E402
import generate_fixture  # noqa: E402  (the fixture's cases, shared with the tests)

F32_ARGS = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]


def llama_completion(bin_dir: Path, model: Path, prompt: str, n: int, ctx: int, extra=(), threads: int = 1) -> bytes:
    """llama-completion's continuation (stdout, prompt not displayed), the trailer removed."""
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", prompt, "-n", str(n), "-c", str(ctx),
           "-no-cnv", "--no-display-prompt", "--no-warmup", "-t", str(threads), *extra]
    outs = []
    for _ in range(8):
        done = subprocess.run(cmd, capture_output=True)
        if done.returncode:
            raise RuntimeError("llama-completion failed: "
                               f"{' '.join(cmd)}\n{done.stderr.decode(errors='replace')[-2000:]}")
        out = done.stdout
        if out.endswith(b"\n\n"):
            out = out[:-2]
        if out.endswith(b" [end of text]\n"):
            out = out[: -len(b" [end of text]\n")]
        if out in outs:
            break
        outs.append(out)
    return max(outs, key=len)


def command_line(prompt: str, n: int, ctx: int, extra) -> str:
    return (f"llama-completion -m MODEL -p {json.dumps(prompt)} -n {n} -c {ctx} -no-cnv --no-display-prompt "
            f"{' '.join(extra)}")


def text_cases(bin_dir: Path, tmp: Path) -> dict:
    """Every text case with llama.cpp's bytes and llmtune's."""
    cases = {}
    for name, case in generate_fixture.cases(tmp).items():
        extra = list(case["llama_args"])
        if case.get("lora"):
            extra += ["--lora", str(case["lora_path"])]
        theirs = llama_completion(bin_dir, case["model_path"], case["prompt"], case["n_predict"], case["ctx"], extra)
        ours = generate_fixture.ours(case)
        shas = {"model_sha256": family_check.sha256(case["model_path"])}
        if case.get("lora"):
            shas["lora_sha256"] = family_check.sha256(case["lora_path"])
        cases[name] = {**{k: v for k, v in case.items() if not k.endswith("_path")}, **shas,
                       "llama.cpp": {"hex": theirs.hex(), "command": command_line(case["prompt"], case["n_predict"],
                                                                                  case["ctx"], extra)},
                       "_ours": ours}
        same = "yes" if ours == theirs else ("prefix" if ours.startswith(theirs) else "NO")
        shown = theirs.decode("utf-8", "replace").replace("\n", "\\n")
        print(f"| {name} | {len(theirs)} bytes | {same} | {shown[:70]} |", flush=True)
    return cases


def decode_speed_llama(bin_dir: Path, model: Path, n: int, threads: int | None) -> float:
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", "Once upon a time", "-n", str(n), "-c", "512",
           "--temp", "0", "-no-cnv", "--no-display-prompt", "--ignore-eos", *F32_ARGS]
    if threads:
        cmd += ["-t", str(threads)]
    for _ in range(8):  # the logger may drop the perf lines at exit (issue 22142): run again
        done = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r" eval time =\s+[0-9.]+ ms /\s+(\d+) runs.*?([0-9.]+) tokens per second",
                      done.stdout + done.stderr)
        if m:
            return float(m.group(2))
    raise RuntimeError(f"no eval time from llama-completion:\n{(done.stdout + done.stderr)[-2000:]}")


def decode_speed_ours(model: Path, n: int) -> float:
    from llmtune.eval.generate import Generator
    from llmtune.eval.sampling import Sampler, SamplerConfig
    from llmtune.model.loaded import load_model

    gen = Generator(load_model(model), "cpu", n_ctx=512)
    ids = gen.tokenize_prompt("Once upon a time")
    return gen.generate(ids, n, Sampler(SamplerConfig(temp=0)), stop_at_eog=False).tokens_per_s


def speed(bin_dir: Path, tmp: Path, repeats: int = 3, n: int = 128) -> None:
    from llmtune.convert.init import init_model

    m15 = init_model(ROOT / "configs" / "llama-15m.toml",
                     family_check.local_copy(DATA / "vocab" / "ggml-vocab-llama-spm.gguf", tmp),
                     tmp / "llama-15m.gguf", seed=0)
    print("| model | llama.cpp -t 1 | llama.cpp default threads | llmtune (cpu) | llmtune / llama.cpp -t 1 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, model in (("stories260K", DATA / "stories260K.gguf"), ("15M shape (llama-15m.toml, f32)", m15)):
        one, default, ours = [], [], []
        for _ in range(repeats):  # interleaved, so load changes hit every column alike
            one.append(decode_speed_llama(bin_dir, model, n, 1))
            default.append(decode_speed_llama(bin_dir, model, n, None))
            ours.append(decode_speed_ours(model, n))
        a, b, c = (statistics.median(v) for v in (one, default, ours))
        print(f"| {label} | {a:,.0f} tok/s | {b:,.0f} tok/s | {c:,.0f} tok/s | {c / a:.2f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, type=Path, help="folder holding llama-completion")
    ap.add_argument("--parts", default="text,speed")
    ap.add_argument("--record", action="store_true", help="write tests/data/generate.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "text" in parts or args.record:
            print("| case | llama.cpp output | llmtune identical | text |")
            print("| --- | ---: | --- | --- |")
            cases = text_cases(args.bin, tmp)
            if args.record:
                for case in cases.values():
                    case.pop("_ours")
                generate_fixture.FIXTURE.write_text(json.dumps(cases, indent=1) + "\n")
                print(f"wrote {generate_fixture.FIXTURE.relative_to(ROOT)}")
        if "speed" in parts:
            speed(args.bin, tmp, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
