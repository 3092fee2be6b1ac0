"""Every model family against HF transformers, a second oracle independent of llama.cpp.

    python bench/check_transformers.py [FAMILY ...] [--record | --grads]

For each family of bench/check_families.py (its FAMILIES table) the same random-weight model is
loaded by transformers from the GGUF file, its config and modules patched for the known gaps of
transformers' GGUF loader (PATCHES below: one row per family), and llama.cpp's perplexity
algorithm is run in torch (f32, eager attention) over llmtune's token ids of the text the tests
use (tests/family_check.py): chunks of ctx tokens, BOS first when the vocabulary adds it, positions
ctx/2 .. ctx-2 scored. Prints transformers' and llmtune's running perplexity, chunk by chunk.

--grads   instead: the first window's loss and every tensor's gradient norm, both in float64.
--record  add transformers' numbers to tests/data/families/<family>.json (write it first with
          `bench/check_families.py --bin DIR --record FAMILY`; the model's sha256 must match).

A family helper adds its row to PATCHES: `Patch(config=..., model=...)`, where `config(cfg, gf)`
fixes the config before the model is built (shapes, e.g. head_dim) and `model(m, gf)` fixes the
loaded modules (e.g. rope frequencies); `gf` is llmtune's GGUFFile of the model (metadata, tensors).
Needs torch, transformers and accelerate (none of them is a dependency of llmtune).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import family_check  # noqa: E402
from check_families import FAMILIES  # noqa: E402


def _nothing(*_):
    pass


@dataclass(frozen=True)
class Patch:
    """What transformers' GGUF loader gets wrong for a family, put right on the oracle side."""

    config: Callable = _nothing  # config(cfg, gf): before the model is built
    model: Callable = _nothing  # model(m, gf): after the weights are loaded


# ------------------------------------------------------------------------------ the loader gaps
def rope_frequencies(model, gf) -> None:
    """Llama: the loader ignores rope_freqs.weight (Llama 3.1+: each rotary frequency divided by
    its factor) and rope.scaling linear (every frequency divided by the factor)."""
    import torch

    arch = gf.arch
    divide = np.ones(1, dtype=np.float64)
    if "rope_freqs.weight" in gf.tensors:
        divide = gf.tensor("rope_freqs.weight").astype(np.float64)
    factor = gf.get(f"{arch}.rope.scaling.factor", 0.0) or 1.0
    if gf.get(f"{arch}.rope.scaling.type", "linear") == "linear":
        divide = divide * factor
    rotary = model.model.rotary_emb
    for name in ("inv_freq", "original_inv_freq"):
        buf = getattr(rotary, name, None)
        if buf is not None:
            setattr(rotary, name, (buf.double() / torch.from_numpy(divide)).to(buf.dtype))
            if name in rotary._buffers:
                rotary._buffers[name] = getattr(rotary, name)


def head_dim_from_key_length(cfg, gf) -> None:
    """qwen3: the loader ignores attention.key_length (head size falls back to 128)."""
    key_length = gf.get(f"{gf.arch}.attention.key_length")
    if key_length is not None:
        cfg.head_dim = int(key_length)


def gemma_config(cfg, gf) -> None:
    """gemma2/gemma3: the loader keeps query_pre_attn_scalar 256 (llama.cpp scales queries by
    1/sqrt(key_length), 1/sqrt(n_embd / n_head) for the 27B shapes), ignores both softcap keys
    (gemma2 falls back to 50/30, gemma3 to none) and gemma3's rope.freq_base_swa and missing window."""
    arch, n_layer = gf.arch, cfg.num_hidden_layers
    cfg.query_pre_attn_scalar = (cfg.hidden_size // cfg.num_attention_heads
                                 if n_layer == {"gemma2": 46, "gemma3": 62}[arch] else cfg.head_dim)
    if arch == "gemma2":
        cfg.attn_logit_softcapping = float(gf.get("gemma2.attn_logit_softcapping", 50.0))
        cfg.final_logit_softcapping = float(gf.get("gemma2.final_logit_softcapping", 30.0))
        return
    cfg.final_logit_softcapping = gf.get("gemma3.final_logit_softcapping") or None
    cfg.rope_parameters["sliding_attention"]["rope_theta"] = float(gf.get("gemma3.rope.freq_base_swa", 10000.0))
    if not gf.get("gemma3.attention.sliding_window"):
        cfg.layer_types = ["full_attention"] * n_layer


def phi3_config(cfg, gf) -> None:
    """phi3: the loader ignores rope.dimension_count (partial rotary), the LongRoPE factor tensors,
    rope.scaling.original_context_length and rope.scaling.attn_factor."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = dict(cfg.rope_parameters or {}, rope_theta=float(gf.get("phi3.rope.freq_base", 10000.0)),
                partial_rotary_factor=int(gf.get("phi3.rope.dimension_count", head_dim)) / head_dim)
    orig = int(gf.get("phi3.rope.scaling.original_context_length", cfg.max_position_embeddings))
    cfg.original_max_position_embeddings = orig
    if "rope_factors_long.weight" in gf.tensors:
        rope.update(rope_type="longrope", original_max_position_embeddings=orig,
                    long_factor=[float(v) for v in gf.tensor("rope_factors_long.weight")],
                    short_factor=[float(v) for v in gf.tensor("rope_factors_short.weight")],
                    attention_factor=float(gf.get("phi3.rope.scaling.attn_factor", 1.0)))
    cfg.rope_parameters = rope


def gpt2_config(cfg, gf) -> None:
    """gpt2: the loader builds a 1024-row position table whatever context_length says, and maps
    feed_forward_length to no field (n_inner)."""
    cfg.n_positions = int(gf.get("gpt2.context_length"))
    cfg.n_inner = int(gf.get("gpt2.feed_forward_length"))


PATCHES: dict[str, Patch] = {
    "phi3": Patch(config=phi3_config),
    "gpt2": Patch(config=gpt2_config),
    "gemma2": Patch(config=gemma_config),
    "gemma3": Patch(config=gemma_config),
    "llama": Patch(model=rope_frequencies),
    "llama3": Patch(model=rope_frequencies),
    "qwen2": Patch(),
    "qwen3": Patch(config=head_dim_from_key_length),
}


# ------------------------------------------------------------------------------ the oracle
def load_hf(model_path: Path, patch: Patch):
    """transformers' model of a GGUF file, patched; float32, eager attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    from llmtune.gguf.file import load_gguf

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    gf = load_gguf(model_path)
    cfg = AutoConfig.from_pretrained(model_path.parent, gguf_file=model_path.name)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the vocabulary (e.g. -1 as u32)
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not 0 <= value < cfg.vocab_size:
            setattr(cfg, key, None)
    patch.config(cfg, gf)
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, config=cfg,
                                                 dtype=torch.float32, attn_implementation="eager")
    patch.model(model, gf)
    return model.eval()


def hf_running_ppl(model, ids: np.ndarray, add_bos: bool, bos: int, ctx: int, chunks: int) -> list[float]:
    """perplexity.cpp's running perplexity, computed with the transformers model."""
    import torch

    first = ctx // 2
    nll, count, running = 0.0, 0, []
    with torch.no_grad():
        for c in range(min(chunks, ids.size // ctx)):
            window = ids[c * ctx:(c + 1) * ctx].astype(np.int64)
            tokens = window.copy()
            if add_bos:
                tokens[0] = bos
            logits = model(torch.from_numpy(tokens)[None]).logits[0].double()
            logp = torch.log_softmax(logits[first:ctx - 1], dim=-1)
            targets = torch.from_numpy(window[first + 1:])
            nll -= float(logp.gather(1, targets[:, None]).sum())
            count += ctx - 1 - first
            running.append(math.exp(nll / count))
    return running


def check_family(name: str, tmp: Path, record: bool) -> None:
    from llmtune.eval.perplexity import tokenize
    from llmtune.eval.scoring import add_bos_of, as_model
    from llmtune.tokenizer import read_text

    case = FAMILIES[name]
    fixture = family_check.new_fixture(name, case.config, case.vocab, case.optional)
    model_path = family_check.make_model(fixture, tmp)
    text, fixture["text_bytes"] = family_check.check_text(tmp, fixture["text"], fixture["text_bytes"])
    ctx, chunks = fixture["ctx"], fixture["chunks"]

    ours = family_check.llmtune_running_ppl(model_path, text, ctx, chunks)
    fixture["chunks"] = chunks = min(chunks, len(ours))  # as check_families.py --record: the chunks the text fills
    lt_model = as_model(model_path)
    ids = tokenize(lt_model, read_text(text))
    theirs = hf_running_ppl(load_hf(model_path, PATCHES.get(name, Patch())), ids, *add_bos_of(lt_model), ctx, chunks)
    diff = family_check.max_rel_diff(ours, theirs)
    ok = "yes" if diff < family_check.TOLERANCE else "NO"
    where = ""
    if record:
        import transformers

        path = family_check.fixture_path(name)
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run bench/check_families.py --bin DIR --record {name} first")
        recorded = family_check.load_fixture(name)
        if recorded.get("model_sha256") != family_check.sha256(model_path) or any(
                recorded.get(k) != v for k, v in fixture.items()):
            raise SystemExit(f"{path} describes another model or text: re-record it with bench/check_families.py")
        recorded["transformers"] = {"running_ppl": theirs, "version": f"transformers {transformers.__version__}",
                                    "patches": f"bench/check_transformers.py PATCHES[{name!r}]"}
        family_check.write_fixture(name, recorded)
        where = str(path.relative_to(ROOT))
    print(f"| {name} | {theirs[-1]:.4f} | {ours[-1]:.4f} | {diff:.2e} | {ok} | {where} |", flush=True)


def check_gradients(name: str, tmp: Path) -> None:
    """--grads: loss and per-tensor gradient L2 norms on the fixture text's first ctx-token window
    (inputs ids[0:ctx], targets ids[1:ctx+1]), llmtune and transformers both in float64. HF
    parameters are matched to GGUF names through gguf-py's tensor name map (a tied output's
    gradient lands in token_embd in both)."""
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    from llmtune.backends.cpu import CPUBackend
    from llmtune.eval.perplexity import tokenize
    from llmtune.graph import ops
    from llmtune.graph.autodiff import grad
    from llmtune.graph.planner import Program
    from llmtune.model.loaded import load_model
    from llmtune.tokenizer import read_text

    case = FAMILIES[name]
    fixture = family_check.new_fixture(name, case.config, case.vocab, case.optional)
    model_path = family_check.make_model(fixture, tmp)
    text, _ = family_check.check_text(tmp, fixture["text"], fixture["text_bytes"])
    ctx, model = fixture["ctx"], load_model(model_path)
    ids = tokenize(model, read_text(text))[: ctx + 1].astype(np.int32)

    names = sorted(model.weights)
    _, nodes, logits = model.build(1, ctx, trainable=names)
    loss = ops.cross_entropy(logits, ops.input((ctx,), "i32", name="targets"))
    grads = grad(loss, [nodes[n] for n in names])
    names = [n for n in names if nodes[n] in grads]  # frozen tensors (rope factors) have no gradient
    prog = Program([loss] + [grads[nodes[n]] for n in names], CPUBackend(np.float64),
                   params={nodes[n]: np.asarray(w, np.float64) for n, w in model.weights.items()})
    out = prog.run(tokens=ids[None, :ctx], pos=np.arange(ctx, dtype=np.int32), targets=ids[1:])
    our_loss, ours = float(out[0]), {n: float(np.linalg.norm(g)) for n, g in zip(names, out[1:])}

    hf = load_hf(model_path, PATCHES.get(name, Patch())).double()
    t = torch.from_numpy(ids.astype(np.int64))
    their_loss = torch.nn.functional.cross_entropy(hf(t[None, :ctx]).logits[0], t[1:])
    their_loss.backward()
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == model.hp.arch)
    tmap = get_tensor_name_map(arch, model.hp.n_layer)
    theirs = {}
    for hf_name, p in hf.named_parameters():
        base, suffix = hf_name.rsplit(".", 1)
        theirs[f"{tmap.get_name(base)}.{suffix}"] = float(p.grad.norm())
    common = [n for n in names if n in theirs]
    rel = {n: abs(ours[n] - theirs[n]) / theirs[n] for n in common}
    worst = max(rel, key=rel.get)
    unmatched = sorted(set(names) - set(common))
    loss_diff = abs(our_loss - float(their_loss)) / float(their_loss)
    print(f"| {name} | {float(their_loss):.6f} | {our_loss:.6f} | {loss_diff:.1e} | {len(common)}/{len(names)} | "
          f"{rel[worst]:.1e} ({worst}) | {', '.join(unmatched) or '-'} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("families", nargs="*", help=f"default: all ({', '.join(FAMILIES)})")
    ap.add_argument("--record", action="store_true", help="add transformers' numbers to the test fixtures")
    ap.add_argument("--grads", action="store_true", help="compare first-window loss and gradient norms instead")
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown} (known: {', '.join(FAMILIES)})")
    if args.grads:
        print("| family | transformers loss | llmtune loss | rel. diff | tensors matched | worst grad-norm rel. diff "
              "| unmatched |")
        print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
        for name in args.families or list(FAMILIES):
            with tempfile.TemporaryDirectory() as tmp:
                check_gradients(name, Path(tmp))
        return 0
    print(f"| family | transformers PPL | llmtune PPL | max chunk diff | < {family_check.TOLERANCE:g} | fixture |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for name in args.families or list(FAMILIES):
        with tempfile.TemporaryDirectory() as tmp:
            check_family(name, Path(tmp), args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
