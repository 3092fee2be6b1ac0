"""LoRA adapters against llama.cpp: adapters trained by llmtune, applied by both tools, merged by both.

    python bench/check_lora.py --bin PATH/TO/llama.cpp/build/bin [CASE ...]
    python bench/check_lora.py --bin PATH/TO/llama.cpp/build/bin --record
    python bench/check_lora.py --peft

For stories260K (tests/data) and a random-weight model of every family in bench/check_families.py
(configs/<family>-tiny.toml, every tensor random) that llmtune loads:

1. `llmtune finetune BASE TEXT --lora-rank 4 ...` trains an adapter (1 epoch, ctx 64, on the first
   20 KB of data/wikitext-100k.txt; stories260K also with every matrix, token_embd and output
   included, with --lora-dropout, --rslora and --lora-init-method pissa (written as rank 8);
   stories260K exported to q8_0 is a base too (adapter trained on the quantized file, applied to
   it; PiSSA too: its residual base is float, the written adapter applies to the q8_0 file);
2. perplexity  `llama-perplexity -m BASE --lora ADAPTER` (f32 KV cache, no flash attention) vs
   `llmtune perplexity BASE --lora ADAPTER`, ctx 128, 16 chunks of WikiText-2 test: the running
   PPL after every chunk, max relative difference (goal < 1e-3);
3. merge       `llama-export-lora -m BASE --lora ADAPTER` vs `llmtune export BASE --lora ADAPTER
   --type f32`: max absolute difference over every tensor (goal <= 1e-6);
4. stories260K also with two adapters at once (the trained one at scale 0.5 and one written by
   llama.cpp's convert_lora_to_gguf.py, F16, tests/data/lora/) through --lora-scaled.

--peft: instead, each LoRA variant against PEFT on configs/llama-tiny.toml's random model loaded
by transformers: llmtune's initial matrices copied into PEFT (PiSSA's and DoRA's initial values
compared first), then the loss and every adapter gradient of one window in float64 (rsLoRA, DoRA,
PiSSA, token_embd and output targets), and one LoRA+ step against create_loraplus_optimizer.

--make-convert-fixture LLAMA_CPP_SRC rewrites tests/data/lora/stories260K-convert-f16.gguf with llama.cpp's
convert_lora_to_gguf.py (from a PEFT-layout adapter made here; needs torch and transformers).

--record writes the test fixture tests/data/lora/llamacpp-lora.json: llama-perplexity's running
PPL of stories260K with the deterministic adapter tests/test_lora.py writes at test time (its
sha256 recorded), alone and together with the convert_lora_to_gguf.py fixture at scale 0.5.
"""

from __future__ import annotations

import argparse
import contextlib
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
           ("stories260K dropout 0.1", DATA / "stories260K.gguf", {"lora_dropout": 0.1}),
           ("stories260K rsLoRA", DATA / "stories260K.gguf", {"rslora": True}),
           ("stories260K PiSSA", DATA / "stories260K.gguf", {"lora_init_method": "pissa"})]
    if not wanted or any(w.startswith("stories260K") for w in wanted):  # trained on, and applied to, a quantized base
        import llmtune

        q8 = llmtune.export(DATA / "stories260K.gguf", tmp / "stories260K-q8_0.gguf", "q8_0").out_path
        out.append(("stories260K-q8_0", q8, {}))
        out.append(("stories260K-q8_0 PiSSA", q8, {"lora_init_method": "pissa"}))
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

    import torch
    from safetensors.torch import save_file

    (tmp / "base").mkdir()
    (tmp / "lora").mkdir()
    (tmp / "base" / "config.json").write_text(json.dumps(STORIES_HF_CONFIG))
    g, tensors = torch.Generator().manual_seed(0), {}
    for layer in range(5):
        for module, (n_in, n_out) in (("self_attn.q_proj", (64, 64)), ("self_attn.v_proj", (64, 32)),
                                      ("mlp.down_proj", (172, 64))):
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


# ------------------------------------------------------------------------------ variants against PEFT
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_RANK, PEFT_ALPHA, PEFT_CTX = 4, 8.0, 32
# (label, llmtune's init/graph settings, PEFT LoraConfig settings, GGUF target regex, extra HF modules)
PEFT_CASES = [
    ("LoRA", {}, {}, None, []),
    ("LoRA, token_embd and output too", {}, {}, r"weight$", ["embed_tokens", "lm_head"]),
    ("rsLoRA", {"rslora": True}, {"use_rslora": True}, None, []),
    ("rsLoRA, token_embd and output too", {"rslora": True}, {"use_rslora": True}, r"weight$",
     ["embed_tokens", "lm_head"]),
    ("DoRA, output too", {"dora": True}, {"use_dora": True}, r"blk|output", ["lm_head"]),
    ("PiSSA, output too", {"method": "pissa"}, {"init_lora_weights": "pissa"}, r"blk|output", ["lm_head"]),
    ("PiSSA + DoRA", {"method": "pissa", "dora": True}, {"init_lora_weights": "pissa", "use_dora": True}, None, []),
    ("rsLoRA + DoRA", {"rslora": True, "dora": True}, {"use_rslora": True, "use_dora": True}, None, []),
]


def _peft_model(model_path: Path, peft_kw: dict, modules: list):
    """transformers' model of the GGUF file (check_transformers.load_hf) wrapped by PEFT; PEFT
    initialises in float32 (pissa_init refuses float64), the comparison runs in float64."""
    from peft import LoraConfig, get_peft_model

    import check_transformers

    hf = check_transformers.load_hf(model_path, check_transformers.PATCHES["llama"])
    cfg = LoraConfig(r=PEFT_RANK, lora_alpha=PEFT_ALPHA, lora_dropout=0.0, target_modules=PEFT_MODULES + modules,
                     **peft_kw)
    return get_peft_model(hf, cfg)


def _gguf_name(model, hf_name: str) -> str:
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == model.hp.arch)
    return get_tensor_name_map(arch, model.hp.n_layer).get_name(hf_name.removeprefix("base_model.model.")) + ".weight"


def _row_perms(model_path: Path, model) -> dict:
    """GGUF matrix name -> row permutation p with W_hf = W_gguf[p] (the loader un-permutes
    llama.cpp's q/k rows), read off transformers' unwrapped model."""
    import check_transformers

    hf = check_transformers.load_hf(model_path, check_transformers.PATCHES["llama"])
    out = {}
    for name, module in hf.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim != 2:
            continue
        w = np.asarray(model.weights[_gguf_name(model, name)], np.float32)
        rows = {r.tobytes(): i for i, r in enumerate(w)}
        out[_gguf_name(model, name)] = np.array([rows[r.tobytes()] for r in weight.detach().float().numpy()])
    return out


def _peft_layers(peft_model, model, perms: dict) -> dict:
    """GGUF base tensor name -> (PEFT LoRA layer, its row permutation)."""
    from peft.tuners.lora import LoraLayer

    return {_gguf_name(model, name): (module, perms[_gguf_name(model, name)])
            for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}


def _peft_parts(module, name: str):
    """PEFT's A, B (as llmtune's numpy layout) and magnitude parameters of one layer."""
    from llmtune.model.adapter import EMBD

    if name == EMBD:  # lora_embedding_A [r, n_vocab] is llmtune's A^T; B [n_embd, r] the same
        return module.lora_embedding_A["default"], module.lora_embedding_B["default"], None
    mag = module.lora_magnitude_vector["default"].weight if module.use_dora.get("default") else None
    return module.lora_A["default"].weight, module.lora_B["default"].weight, mag


def _to_peft(layers, adapter, residual) -> None:
    """Copy llmtune's A, B, magnitudes (and PiSSA's residual bases) into the PEFT model."""
    import torch

    from llmtune.model.adapter import EMBD

    with torch.no_grad():
        for name, (module, perm) in layers.items():
            pa, pb, pm = _peft_parts(module, name)
            pair = adapter.pairs[name]
            pa.copy_(torch.from_numpy(pair.a.T.copy() if name == EMBD else pair.a))
            pb.copy_(torch.from_numpy(pair.b if name == EMBD else pair.b[perm]))
            if pm is not None:
                pm.copy_(torch.from_numpy(adapter.magnitudes[name][perm]))
            if name in residual:
                module.get_base_layer().weight.copy_(torch.from_numpy(residual[name][perm]))


def _init_difference(layers, adapter, residual) -> float:
    """Largest relative difference of PEFT's initial values from llmtune's: PiSSA's A, B (per
    singular triplet up to its sign) and residual base, DoRA's magnitude."""
    from llmtune.model.adapter import EMBD

    worst = 0.0

    def rel(a, b):
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    for name, (module, perm) in layers.items():
        pa, pb, pm = (None if t is None else t.detach().double().numpy() for t in _peft_parts(module, name))
        pair = adapter.pairs[name]
        if adapter.initial and name != EMBD:
            sign = np.sign((pa * pair.a).sum(axis=1))  # SVD's sign per singular vector
            worst = max(worst, rel(pa * sign[:, None], pair.a), rel(pb * sign[None, :], pair.b[perm]))
            base = module.get_base_layer().weight.detach().double().numpy()
            worst = max(worst, rel(base, residual[name][perm]))
        if pm is not None:
            worst = max(worst, rel(pm, adapter.magnitudes[name][perm]))
    return worst


def _ours(model, adapter, tokens):
    """llmtune's loss and adapter gradients (float64, cpu) on one window."""
    from llmtune.backends.cpu import CPUBackend
    from llmtune.graph import ops
    from llmtune.graph.autodiff import grad
    from llmtune.graph.planner import Program
    from llmtune.model.adapter import attach

    m = attach(model, [adapter])
    keys = list(adapter.tensors())
    _, nodes, logits = m.build(1, PEFT_CTX, trainable=keys)
    loss = ops.cross_entropy(logits, ops.input((PEFT_CTX,), "i32", name="targets"))
    grads = grad(loss, [nodes[k] for k in keys])
    prog = Program([loss] + [grads[nodes[k]] for k in keys], CPUBackend(np.float64),
                   params={nodes[n]: np.asarray(w, np.float64) for n, w in m.tensors().items()})
    out = prog.run(tokens=tokens[None, :PEFT_CTX], pos=np.arange(PEFT_CTX, dtype=np.int32), targets=tokens[1:])
    return float(out[0]), dict(zip(keys, [np.array(g) for g in out[1:]]))


def _theirs_grads(layers, adapter) -> dict:
    """PEFT's gradients in llmtune's keys and layout (B rows and magnitudes un-permuted)."""
    from llmtune.model.adapter import EMBD, MAGNITUDE, A, B, tensor_key

    out = {}
    for name, (module, perm) in layers.items():
        pa, pb, pm = _peft_parts(module, name)
        inv = np.argsort(perm)
        ga, gb = pa.grad.double().numpy(), pb.grad.double().numpy()
        out[tensor_key(name, A)] = ga.T if name == EMBD else ga
        out[tensor_key(name, B)] = gb if name == EMBD else gb[inv]
        if pm is not None:
            out[tensor_key(name, MAGNITUDE)] = pm.grad.double().numpy()[inv]
    return out


@contextlib.contextmanager
def _svd_in_float64():
    """PEFT's pissa_init with torch.linalg.svd taken in float64 (results rounded to the float32
    the layer holds), as llmtune takes it: the same formula without float32's SVD error."""
    from unittest import mock

    import torch

    svd = torch.linalg.svd

    def svd64(w, full_matrices=True):
        return tuple(t.to(w.dtype) for t in svd(w.double(), full_matrices=full_matrices))

    with mock.patch.object(torch.linalg, "svd", svd64):
        yield


def check_peft_case(model_path: Path, perms: dict, label: str, ours_kw: dict, peft_kw: dict, targets, modules,
                    seed: int = 0) -> dict:
    """One variant: llmtune's and PEFT's initial values, then (llmtune's values copied into PEFT,
    B, magnitudes moved off their start) the loss and every adapter gradient, both float64."""
    import dataclasses

    import torch

    from llmtune.model import adapter as lora
    from llmtune.model.loaded import load_model

    model = load_model(model_path)
    adapter = lora.init_adapter(model, PEFT_RANK, PEFT_ALPHA, targets, seed, ours_kw.get("method", "kaiming"),
                                ours_kw.get("rslora", False))
    residual = lora.pissa_init(model, adapter) if ours_kw.get("method") == "pissa" else {}
    model = dataclasses.replace(model, weights={**model.weights, **residual})
    if ours_kw.get("dora"):
        lora.dora_init(model, adapter)
    init_f32 = None
    if residual:  # PEFT's own float32 SVD: singular vectors of close singular values move by ~1e-5
        layers = _peft_layers(_peft_model(model_path, peft_kw, modules), model, perms)
        init_f32 = _init_difference(layers, adapter, residual)
    with _svd_in_float64() if residual else contextlib.nullcontext():
        peft_model = _peft_model(model_path, peft_kw, modules)
    layers = _peft_layers(peft_model, model, perms)
    assert set(layers) == set(adapter.pairs), sorted(set(layers) ^ set(adapter.pairs))
    init_diff = _init_difference(layers, adapter, residual)
    rng = np.random.default_rng(seed + 1)  # as after some training: every gradient non-zero
    for name, pair in adapter.pairs.items():
        pair.b += rng.standard_normal(pair.b.shape).astype(np.float32) * np.float32(0.05)
        if name == lora.EMBD:
            pair.a += rng.standard_normal(pair.a.shape).astype(np.float32) * np.float32(0.05)
        if name in adapter.magnitudes:
            adapter.magnitudes[name] *= rng.uniform(0.9, 1.1, adapter.magnitudes[name].shape).astype(np.float32)
    _to_peft(layers, adapter, residual)
    tokens = rng.integers(0, model.hp.n_vocab, PEFT_CTX + 1).astype(np.int32)
    our_loss, ours = _ours(model, adapter, tokens)
    peft_model = peft_model.double()
    t = torch.from_numpy(tokens.astype(np.int64))
    their_loss = torch.nn.functional.cross_entropy(peft_model(t[None, :PEFT_CTX]).logits[0], t[1:])
    their_loss.backward()
    theirs = _theirs_grads(layers, adapter)
    assert set(theirs) == set(ours)
    grad_diff = max(float(np.abs(ours[k] - theirs[k]).max() / max(np.abs(theirs[k]).max(), 1e-30)) for k in ours)
    return {"label": label, "pairs": len(adapter.pairs), "init": init_diff, "init_f32": init_f32, "loss_ours": our_loss,
            "loss_theirs": float(their_loss), "loss": abs(our_loss - float(their_loss)) / float(their_loss),
            "grad": grad_diff, "values": sum(v.size for v in ours.values())}


def check_peft_loraplus(model_path: Path, perms: dict, optimizer: str, dtype, ratio: float = 16.0, lr: float = 1e-3,
                        seed: int = 0) -> dict:
    """LoRA+: one step of llmtune's trainer (B at ratio x lr) against torch.optim's SGD / AdamW
    from PEFT's create_loraplus_optimizer on the same values and window, in `dtype` both. Per part
    (lora_a, lora_b): (max |our step - theirs| / max |their step|, max |their step|)."""
    import torch
    from peft.optimizers import create_loraplus_optimizer

    from llmtune.backends.cpu import CPUBackend
    from llmtune.model import adapter as lora
    from llmtune.model.loaded import load_model
    from llmtune.train.config import make_config
    from llmtune.train.finetune import lr_factors
    from llmtune.train.trainer import RunningStats, Trainer

    model = load_model(model_path)
    adapter = lora.init_adapter(model, PEFT_RANK, PEFT_ALPHA, None, seed)
    rng = np.random.default_rng(seed + 1)
    for pair in adapter.pairs.values():
        pair.b += rng.standard_normal(pair.b.shape).astype(np.float32) * np.float32(0.05)
    peft_model = _peft_model(model_path, {}, [])
    layers = _peft_layers(peft_model, model, perms)
    _to_peft(layers, adapter, {})
    tokens = rng.integers(0, model.hp.n_vocab, PEFT_CTX + 1).astype(np.int32)
    keys = list(adapter.tensors())
    factors = lr_factors(make_config(lora_rank=PEFT_RANK, lora_plus=ratio), keys)
    tr = Trainer(lora.attach(model, [adapter]), CPUBackend(dtype), n_ctx=PEFT_CTX, n_batch=PEFT_CTX, n_ubatch=PEFT_CTX,
                 trainable=keys, workers=1, lr_factors=factors, optimizer=optimizer)
    def values():  # in the trainer's own dtype (trained_weights() rounds to float32)
        return {k: np.array(tr.backend.to_numpy(tr.values[k]), np.float64) for k in keys}

    before = values()
    tr.train_step(tokens[None, :PEFT_CTX], tokens[None, 1:], lr, RunningStats())
    ours = {k: v - before[k] for k, v in values().items()}
    peft_model = peft_model.to(torch.float64 if dtype == np.float64 else torch.float32)
    opt = create_loraplus_optimizer(peft_model, torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW, lr=lr,
                                    loraplus_lr_ratio=ratio, **({} if optimizer == "sgd" else {"eps": 1e-8}))
    t = torch.from_numpy(tokens.astype(np.int64))
    torch.nn.functional.cross_entropy(peft_model(t[None, :PEFT_CTX]).logits[0], t[1:]).backward()
    start = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    opt.step()
    moved = {n: (p.detach() - start[n]) for n, p in peft_model.named_parameters() if p.requires_grad}
    for name, (module, perm) in layers.items():  # the step lands in .data: read it as gradients to map back
        for part in _peft_parts(module, name)[:2]:
            part.grad = next(moved[n] for n, p in peft_model.named_parameters() if p is part).clone()
    theirs = _theirs_grads(layers, adapter)
    by_part = {}
    for k in keys:
        part = k.rsplit(".", 1)[1]
        scale = np.abs(theirs[k]).max()
        by_part.setdefault(part, []).append((float(np.abs(ours[k] - theirs[k]).max() / scale), float(scale)))
    return {p: (max(d for d, _ in v), max(s for _, s in v)) for p, v in by_part.items()}


def peft_table(tmp: Path) -> None:
    import torch

    import family_check

    torch.manual_seed(0)
    case = check_families.FAMILIES["llama"]
    fixture = family_check.new_fixture("llama", case.config, case.vocab, case.optional)
    model_path = family_check.make_model(fixture, tmp)
    import peft
    import transformers

    from llmtune.model.loaded import load_model

    perms = _row_perms(model_path, load_model(model_path))

    print(f"PEFT {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; "
          f"{fixture['config']} (random weights), rank {PEFT_RANK}, alpha {PEFT_ALPHA:g}, one window of "
          f"{PEFT_CTX} tokens")
    print("| variant | pairs | initial values, max rel. diff | loss PEFT | loss llmtune | rel. diff | "
          "gradients, max rel. diff | ok |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for label, ours_kw, peft_kw, targets, modules in PEFT_CASES:
        r = check_peft_case(model_path, perms, label, ours_kw, peft_kw, targets, modules)
        ok = "yes" if r["init"] < 1e-5 and r["loss"] < 1e-5 and r["grad"] < 1e-5 else "NO"
        init = f"{r['init']:.1e}" if ours_kw.get("method") == "pissa" or ours_kw.get("dora") else "(copied)"
        if r["init_f32"] is not None:
            init += f" (PEFT's float32 SVD: {r['init_f32']:.1e})"
        print(f"| {label} | {r['pairs']} | {init} | {r['loss_theirs']:.10f} | {r['loss_ours']:.10f} | "
              f"{r['loss']:.1e} | "
              f"{r['grad']:.1e} | {ok} |", flush=True)
    print("\nLoRA+ (ratio 16, lr 1e-3, one step against PEFT's create_loraplus_optimizer):\n")
    print("| optimizer | dtype | A's step (max) | rel. diff | B's step (max) | rel. diff | ok |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for optimizer, dtype, goal in (("sgd", np.float64, 1e-5), ("adamw", np.float64, 1e-5), ("adamw", np.float32, 1e-4)):
        steps = check_peft_loraplus(model_path, perms, optimizer, dtype)
        (da, sa), (db, sb) = steps["lora_a"], steps["lora_b"]
        ok = "yes" if max(da, db) < goal else "NO"
        print(f"| {optimizer} | {np.dtype(dtype).name} | {sa:.3e} | {da:.1e} | {sb:.3e} | {db:.1e} | {ok} |",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help="stories260K and/or family names (default: all)")
    ap.add_argument("--bin", type=Path, help="folder holding llama-perplexity and llama-export-lora")
    ap.add_argument("--peft", action="store_true", help="instead: the LoRA variants against PEFT (needs torch, "
                                                        "transformers, peft)")
    ap.add_argument("--record", action="store_true", help=f"write {RECORD.relative_to(ROOT)}")
    ap.add_argument("--make-convert-fixture", type=Path, metavar="LLAMA_CPP_SRC",
                    help=f"rewrite {CONVERT_FIXTURE.relative_to(ROOT)} with LLAMA_CPP_SRC/convert_lora_to_gguf.py")
    args = ap.parse_args()
    if args.make_convert_fixture:
        with tempfile.TemporaryDirectory() as tmp:
            make_convert_fixture(args.make_convert_fixture, Path(tmp))
        return 0
    if args.peft:
        with tempfile.TemporaryDirectory() as tmp:
            peft_table(Path(tmp))
        return 0
    if args.bin is None:
        ap.error("--bin is needed (or --peft)")
    from llmtune.backends.cpu.threads import blas_threads

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
        print("| model | adapter | llama.cpp PPL | llmtune PPL | max chunk rel. diff | merge max abs diff "
              "(tensors) | ok |")
        print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
        worst_ppl, worst_merge = 0.0, 0.0
        for i, (name, base, extra) in enumerate(cases(tmp, args.cases)):
            work = tmp / f"case{i}"
            work.mkdir()
            adapter = train_adapter(base, train_text, work / "adapter.gguf", **extra)
            from llmtune.gguf.file import load_gguf

            n_pairs = len(load_gguf(adapter).tensors) // 2
            theirs, ours, diff = compare_ppl(args.bin, base, text, [adapter], [1.0])
            if (args.bin / "llama-export-lora").exists():
                merge, n = compare_merge(args.bin, base, adapter, work)
            else:  # a build without it: the perplexity column alone
                merge, n = 0.0, "no llama-export-lora"
            worst_merge = max(worst_merge, merge)
            ok = "yes" if diff < 1e-3 and merge <= 1e-6 else "NO"
            # llama.cpp quantizes activations for q8_0 dot products: the base alone differs
            if name == "stories260K-q8_0":
                b_theirs, b_ours, b_diff = compare_ppl(args.bin, base, text, [], [])
                print(f"| {name} | none (the quantized base alone) | {b_theirs:.4f} | {b_ours:.4f} | {b_diff:.2e} | | "
                      f"(llama.cpp's q8_0 activations) |", flush=True)
            if "q8_0" in name:
                ok = "yes (the base's residue)" if diff < max(1e-3, 1.5 * b_diff) and merge <= 1e-6 else "NO"
            else:
                worst_ppl = max(worst_ppl, diff)
            label = "rank 4, " + (extra.get("lora_targets") and "every matrix" or "default targets") + \
                (f", dropout {extra['lora_dropout']}" if "lora_dropout" in extra else "") + \
                (", rsLoRA" if extra.get("rslora") else "") + \
                (", PiSSA (written as rank 8)" if extra.get("lora_init_method") == "pissa"
                 else "") + f" ({n_pairs} pairs)"
            merge_cell = f"{merge:.2e} ({n})" if isinstance(n, int) else f"({n})"
            print(f"| {name.split()[0]} | {label} | {theirs:.4f} | {ours:.4f} | {diff:.2e} | {merge_cell} | {ok} |",
                  flush=True)
            if name == "stories260K":
                theirs, ours, diff = compare_ppl(args.bin, base, text, [adapter, CONVERT_FIXTURE], [0.5, 2.0])
                worst_ppl = max(worst_ppl, diff)
                ok = "yes" if diff < 1e-3 else "NO"
                print("| stories260K | this one at 0.5 + convert_lora_to_gguf.py F16 at 2.0 | "
                      f"{theirs:.4f} | {ours:.4f} "
                      f"| {diff:.2e} | | {ok} |", flush=True)
        print(f"\nworst (float bases): perplexity {worst_ppl:.2e} (goal < 1e-3), "
              f"merge {worst_merge:.2e} (goal <= 1e-6)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
