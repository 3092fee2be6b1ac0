"""PEFT's LoRA adapter folder, read into a LoraAdapter and written from one.

The folder (PEFT's save_pretrained): adapter_config.json and adapter_model.safetensors (the older
adapter_model.bin, a PyTorch pickle, is refused: llmtune never unpickles). Tensor names are the
HF model's module paths (arch/hf_names.py, the family's table) under "base_model.model.":
- a Linear module M: "M.lora_A.weight" [r, n_in] and "M.lora_B.weight" [n_out, r], llmtune's A and
  B as they are, except llama's q/k, whose B rows are in HF's order (HFNames.hf_rows);
- the embedding: "M.lora_embedding_A" [r, n_vocab] (llmtune's A transposed: llama.cpp's token_embd
  lora_a) and "M.lora_embedding_B" [n_embd, r];
- "M.base_layer.weight" (PEFT's save_embedding_layers copy of a targeted embedding) is skipped, as
  llama.cpp's convert_lora_to_gguf.py skips it;
- a Conv1D module (gpt2's c_attn, c_proj, c_fc: HFNames.transposed) keeps the same A and B (PEFT's
  Linear wrapper takes its in/out features from the stored [n_in, n_out]); fan_in_fan_out, which
  PEFT sets per module from the module's kind whatever the file says, is written True when one is
  adapted and ignored when read.
An adapter GGUF's norm vectors (mergekit-extract-lora's, which llama.cpp skips when applying) have
no PEFT form and are not written.

The scale: PEFT's scaling is lora_alpha / r (use_rslora: lora_alpha / sqrt(r)), per module with
rank_pattern / alpha_pattern; llama.cpp's is adapter.lora.alpha / r with one alpha per adapter.
Read: alpha = lora_alpha (rsLoRA: core.rslora_alpha, alpha * sqrt(r), as finetune --rslora writes
it); per-module alphas all equal to their ranks (scale 1) read as alpha 0 (llama.cpp: scale 1);
other mixes have no llama.cpp form and are refused. Written: the shortest decimal lora_alpha that
reads back as the file's alpha exactly (rsLoRA when the adapter is one, its ranks equal and its
alpha not 0; else plain, which is llama.cpp's own rule), r the commonest rank, the others in
rank_pattern (and alpha_pattern for alpha 0).

What llmtune cannot carry is refused in one line: DoRA (use_dora), bias other than "none",
modules_to_save, lora_bias, trainable tokens, aLoRA, adapters whose base PEFT changed (PiSSA,
OLoRA, CorDA, LoftQ saved without conversion). lora_dropout and the like do nothing at inference
and are ignored. safetensors is an optional dependency (the "hf" extra).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from llmtune.arch import hf_names
from llmtune.errors import LlmtuneError
from llmtune.model.adapter.core import EMBD, LoraAdapter, LoraPair, rslora_alpha
from llmtune.model.adapter.initialise import new_metadata
from llmtune.model.adapter.targets import adaptable, pair_fits, refusal

# annotations name model/loaded.py's Model, which imports this package (no import here: no circle)

CONFIG, WEIGHTS, PICKLE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
PREFIX = "base_model.model."
PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "eA", ".lora_embedding_B": "eB"}
SKIPPED = ".base_layer.weight"
# settings whose truthy value changes what the adapter computes in ways llmtune cannot carry
REFUSED = {
    "use_dora": "a DoRA adapter (llama.cpp has no DoRA; merge it with PEFT's merge_and_unload)",
    "modules_to_save": "full copies of modules beside the adapter",
    "lora_bias": "a bias on lora_B",
    "trainable_token_indices": "trained token embeddings beside the adapter",
    "alora_invocation_tokens": "an activated LoRA (aLoRA)",
    "layer_replication": "replicated layers",
    "target_parameters": "adapted parameters (target_parameters)",
    "use_qalora": "a QALoRA adapter",
}
BASE_CHANGING = ("pissa", "olora", "corda", "loftq")  # init_lora_weights that rewrite the base model


def _safetensors():
    """The safetensors package (optional: the "hf" extra), imported where PEFT folders are used."""
    try:
        import safetensors  # noqa: PLC0415 - optional (the hf extra): only PEFT adapter folders need it
        import safetensors.numpy  # noqa: F401, PLC0415 - save_file
    except ImportError:
        raise LlmtuneError("PEFT adapter folders need the safetensors package: pip install safetensors") from None
    return safetensors


def _fail(flag: str, path, msg: str) -> LlmtuneError:
    return LlmtuneError(f"{flag} {path}: {msg}")


def is_peft_folder(path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def peft_files(folder) -> list[Path]:
    """The files a PEFT adapter folder's adapter is read from (for fingerprints), those present."""
    return [Path(folder) / n for n in (CONFIG, WEIGHTS) if (Path(folder) / n).is_file()]


# ------------------------------------------------------------------------------ reading
def load_peft(folder, model: "Model", scale: float = 1.0, flag: str = "--lora") -> LoraAdapter:
    """PEFT's adapter folder as llmtune's adapter for `model`, every tensor checked against it
    (files.load_adapter's checks, in PEFT's names). Errors are one line naming the file."""
    folder = Path(folder)
    config = _read_config(folder, flag)
    weights = folder / WEIGHTS
    if not weights.is_file():
        if (folder / PICKLE).is_file():
            raise _fail(flag, folder / PICKLE, "a PyTorch pickle, which llmtune does not read; convert it to "
                                                "safetensors (adapter_model.safetensors: PEFT's save_pretrained "
                                                "writes it by default)")
        raise _fail(flag, folder, f"no {WEIGHTS} beside {CONFIG}")
    hf = hf_names(model.hp.arch, f"{flag} {folder}")
    tensors = _read_tensors(weights, flag)
    ok = adaptable(model)
    halves: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        module, part = _split_key(key)
        if part is None:
            if key.endswith(SKIPPED):
                continue
            what = "a DoRA magnitude (use_dora)" if "lora_magnitude_vector" in key else "no LoRA A or B"
            raise _fail(flag, weights, f"tensor {key!r} is {what}; llmtune cannot carry it")
        base = hf.gguf_name(module + ".weight")
        if base is None:
            raise _fail(flag, weights, f"tensor {key!r}: {module} is no {model.hp.arch} module llmtune maps "
                                       f"(its Hugging Face names: arch/{model.hp.arch}.py)")
        if (part in ("eA", "eB")) != (base == EMBD):
            raise _fail(flag, weights, f"tensor {key!r}: PEFT names an embedding's pair lora_embedding_A/B "
                                       "and a Linear's lora_A/B.weight")
        if (why := refusal(model, base, ok)):
            raise _fail(flag, weights, f"adapts {module} ({base}), {why}")
        halves.setdefault(base, {})[part[-1]] = (key, value)
    if not halves:
        raise _fail(flag, weights, "holds no LoRA tensors")
    order = [n for n in model.weights if n in halves]
    pairs, ranks = {}, {}
    for base in order:
        found = halves[base]
        module = hf.hf_module(base)
        if len(found) < 2:
            raise _fail(flag, weights, f"{module} lacks its lora_{'B' if 'A' in found else 'A'} tensor")
        (key_a, a), (key_b, b) = found["A"], found["B"]
        n_out, n_in = model.weights[base].shape
        pair = LoraPair(np.ascontiguousarray(a.T if base == EMBD else a), b)
        if not pair_fits(base, (n_out, n_in), pair.a, pair.b) or pair.rank < 1:
            want = f"[r, {n_out}] and [{n_in}, r]" if base == EMBD else f"[r, {n_in}] and [{n_out}, r]"
            raise _fail(flag, weights, f"{key_a} {list(a.shape)} and {key_b} {list(b.shape)} do not fit "
                                       f"{model.path.name}'s {module} (A and B must be {want})")
        rows = hf.hf_rows(base, n_out, model.hp.n_head, model.hp.n_head_kv)
        if rows is not None:  # HF's row order -> llama.cpp's
            pair.b = np.ascontiguousarray(pair.b[np.argsort(rows)])
        pairs[base], ranks[module] = pair, pair.rank
    alpha, rslora = _file_alpha(config, ranks, folder / CONFIG, flag)
    init = {"true": "kaiming", "gaussian": "gaussian"}.get(str(config.get("init_lora_weights", True)).lower(), "")
    return LoraAdapter(model.hp.arch, alpha, pairs, float(scale), folder, new_metadata(model, alpha), init=init,
                       rslora=rslora)


def _read_config(folder: Path, flag: str) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise _fail(flag, folder, f"no {CONFIG}: a PEFT adapter folder holds {CONFIG} and {WEIGHTS}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _fail(flag, path, f"not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(flag, path, "not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(flag, path, f"peft_type is {config['peft_type']!r}; llmtune reads LoRA adapters (LORA) only")
    if config.get("bias", "none") != "none":
        raise _fail(flag, path, f"bias is {config['bias']!r}: trained biases are no part of a LoRA adapter "
                                "llama.cpp or llmtune can carry (train with bias='none')")
    for key, what in REFUSED.items():
        if config.get(key):
            raise _fail(flag, path, f"{key} is set: {what}, which llmtune cannot carry")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING):
        raise _fail(flag, path, f"init_lora_weights is {init!r}: the adapter applies to the base PEFT rewrote, "
                                "not to the original model (save it with path_initial_model_for_weight_conversion)")
    return config


def _read_tensors(path: Path, flag: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (F32, F16, BF16, F64)."""
    st = _safetensors()
    out = {}
    try:
        with st.safe_open(str(path), framework="np") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype == "BF16":  # numpy has no bfloat16: the raw 16 bits are a float32's upper half
                    out[key] = _bf16(path, key)
                elif dtype in ("F32", "F16", "F64"):
                    out[key] = np.asarray(f.get_tensor(key), dtype=np.float32)
                else:
                    raise _fail(flag, path, f"tensor {key!r} is {dtype}; LoRA tensors are floats")
    except LlmtuneError:
        raise
    except Exception as exc:  # safetensors' SafetensorError (a damaged or truncated file), OSError
        raise _fail(flag, path, f"not a readable safetensors file ({exc})") from None
    return out


def _bf16(path: Path, key: str) -> np.ndarray:
    """A BF16 tensor by the format's header (8-byte length, JSON), which safe_open has already checked."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(n))[key]
        start, end = info["data_offsets"]
        fh.seek(8 + n + start)
        raw = np.frombuffer(fh.read(end - start), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def _split_key(key: str) -> tuple[str, Optional[str]]:
    """("model.layers.0.self_attn.q_proj", "A") for PEFT's key of that module's lora_A; (key, None) otherwise."""
    if key.startswith(PREFIX):
        for suffix, part in PARTS.items():
            if key.endswith(suffix):
                return key[len(PREFIX): -len(suffix)], part
    return key, None


def _matches(pattern: str, module: str) -> bool:
    """PEFT's get_pattern_key / target-module rule: `module` is `pattern` or ends with ".pattern"."""
    return re.match(rf"(.*\.)?({pattern})$", module) is not None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))


def _pattern(config: dict, key: str, path: Path, flag: str) -> dict:
    """rank_pattern / alpha_pattern: PEFT's regular expressions over module paths -> numbers."""
    value = config.get(key) or {}
    if not isinstance(value, dict) or not all(_number(v) for v in value.values()):
        raise _fail(flag, path, f"{key} must map module names to numbers")
    for k in value:
        try:
            re.compile(k)
        except re.error:
            raise _fail(flag, path, f"{key}: {k!r} is not a regular expression") from None
    return value


def _file_alpha(config: dict, ranks: dict[str, int], path: Path, flag: str) -> tuple[float, bool]:
    """llama.cpp's adapter.lora.alpha giving every module PEFT's scale, and whether it is rsLoRA's."""
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora", False))
    if not _number(alpha):
        raise _fail(flag, path, f"lora_alpha is {alpha!r}, not a number")
    rank_pattern, pattern = (_pattern(config, key, path, flag) for key in ("rank_pattern", "alpha_pattern"))
    for module, rank in ranks.items():
        want = next((v for k, v in rank_pattern.items() if _matches(k, module)), config.get("r", 8))
        if want != rank:
            raise _fail(flag, path, f"{module} has rank {rank} in {WEIGHTS}, but the config says r {want}")
    alphas = {m: next((v for k, v in pattern.items() if _matches(k, m)), alpha) for m in ranks}
    if len(set(alphas.values())) == 1:
        alpha = next(iter(alphas.values()))
        if alpha == 0:
            raise _fail(flag, path, "lora_alpha 0 makes PEFT's scale 0 (the adapter does nothing), which llama.cpp "
                                    "reads as scale 1")
        if not rslora:
            return float(np.float32(alpha)), False
        if len(set(ranks.values())) == 1:
            return rslora_alpha(alpha, next(iter(ranks.values()))), True
    elif not rslora and all(alphas[m] == ranks[m] for m in ranks):
        return 0.0, False  # every scale 1: llama.cpp's alpha 0
    raise _fail(flag, path, "per-module scales (alpha_pattern, or use_rslora with several ranks) that one "
                            "llama.cpp alpha cannot give; llmtune's adapter has one alpha")


# ------------------------------------------------------------------------------ writing
@dataclass
class PeftWritten:
    folder: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]
    n_pairs: int
    base: str


def peft_config(adapter: LoraAdapter, hf, n_layer: Optional[int], base: str) -> dict:
    """adapter_config.json's fields for `adapter` (see the module docstring for the alpha)."""
    modules = {name: hf.hf_module(name) for name in adapter.pairs}
    ranks = {modules[n]: p.rank for n, p in adapter.pairs.items()}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    uniform = len(set(ranks.values())) == 1
    rslora = adapter.rslora and uniform and adapter.alpha != 0
    if adapter.alpha == 0:  # llama.cpp: scale 1 whatever the rank
        lora_alpha, alpha_pattern = rank, {m: r for m, r in ranks.items() if r != rank}
    else:
        exact = adapter.alpha / np.sqrt(rank) if rslora else adapter.alpha
        lora_alpha, alpha_pattern = _shortest(float(exact), float(adapter.alpha), rank if rslora else None), {}
        lora_alpha = int(lora_alpha) if lora_alpha.is_integer() else lora_alpha  # as PEFT writes it
    return {
        "alpha_pattern": alpha_pattern,
        "base_model_name_or_path": base or None,
        "bias": "none",
        "fan_in_fan_out": any(hf.transposed(name) for name in adapter.pairs),  # a Conv1D module (gpt2)
        "inference_mode": True,
        "init_lora_weights": "gaussian" if adapter.init == "gaussian" else True,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
        "target_modules": _target_modules(list(modules.values()), n_layer, hf.module_names()),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": rslora,
    }


def _shortest(exact: float, file_alpha: float, rslora_rank: Optional[int]) -> float:
    """The decimal with the fewest digits near `exact` that reads back (_file_alpha) as `file_alpha`
    exactly: float32(x), or rslora_alpha(x, rank) for rsLoRA."""
    for digits in range(1, 18):
        x = float(f"{exact:.{digits}g}")
        if (rslora_alpha(x, rslora_rank) if rslora_rank else float(np.float32(x))) == file_alpha:
            return x
    return exact


def _target_modules(modules: list[str], n_layer: Optional[int], table: list[str]) -> list[str]:
    """PEFT's target_modules: a module's last name ("q_proj") when every module that name would select
    (every block's, of each of the family's `table` paths ending so: gpt2's attn.c_proj and mlp.c_proj
    share "c_proj") is adapted, else the adapted modules' full paths."""
    found = [int(m.group(1)) for path in modules if (m := re.search(r"\.(\d+)\.", path))]
    n = n_layer if n_layer else 1 + max(found, default=-1)
    adapted, out = set(modules), []
    for short in dict.fromkeys(m.rsplit(".", 1)[-1] for m in modules):
        selected = {t.replace("{bid}", str(b)) for t in table if t.rsplit(".", 1)[-1] == short
                    for b in (range(n) if "{bid}" in t else (0,))}
        mine = [m for m in modules if m.rsplit(".", 1)[-1] == short]
        out += [short] if selected <= adapted else mine
    return sorted(out)


def peft_tensors(adapter: LoraAdapter, hf, heads: Optional[tuple[int, int]], flag: str) -> dict[str, np.ndarray]:
    """adapter_model.safetensors' tensors for `adapter` (float32, PEFT's names and layout)."""
    out = {}
    for name, pair in adapter.pairs.items():
        module = hf.hf_module(name)
        if module is None:
            raise _fail(flag, adapter.path, f"adapts {name}, which has no Hugging Face name in llmtune's "
                                            f"{adapter.arch} table")
        if name == EMBD:
            out[PREFIX + module + ".lora_embedding_A"] = np.ascontiguousarray(pair.a.T)
            out[PREFIX + module + ".lora_embedding_B"] = np.ascontiguousarray(pair.b)
            continue
        b = pair.b
        if hf.permuted(name):  # llama's q/k: rows in HF's order per head
            if heads is None:
                raise _fail(flag, adapter.path, f"adapts {name}, whose rows Hugging Face orders per attention "
                                                "head, and the adapter does not record its base's head counts; "
                                                "give the base too: llmtune export BASE.gguf --lora ADAPTER.gguf "
                                                "--peft DIR")
            b = b[hf.hf_rows(name, b.shape[0], *heads)]
        out[PREFIX + module + ".lora_A.weight"] = np.ascontiguousarray(pair.a, dtype=np.float32)
        out[PREFIX + module + ".lora_B.weight"] = np.ascontiguousarray(b, dtype=np.float32)
    return out


def write_peft(adapter: LoraAdapter, folder, heads: Optional[tuple[int, int]] = None, n_layer: Optional[int] = None,
               base: str = "", flag: str = "--peft") -> PeftWritten:
    """Write `adapter` as PEFT's adapter folder: everything into a new folder beside `folder`,
    then moved into place (a new folder renamed; into an existing PEFT folder, or an empty one,
    each file replaced whole), so a failure leaves nothing half-written. `heads`: the base's
    (n_head, n_head_kv) (llama's q/k rows); `n_layer`: its blocks (target_modules' short names)."""
    st = _safetensors()
    folder = Path(folder)
    hf = hf_names(adapter.arch, f"{flag} {folder}")
    adapter = adapter.as_plain()
    tensors = peft_tensors(adapter, hf, heads, flag)
    config = peft_config(adapter, hf, n_layer, base)
    _check_destination(folder, flag)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        st.numpy.save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        if folder.is_dir():
            for name in (WEIGHTS, CONFIG):
                os.replace(tmp / name, folder / name)
            tmp.rmdir()
        else:
            os.chmod(tmp, 0o755)
            os.rename(tmp, folder)
    except OSError as exc:
        raise _fail(flag, folder, f"cannot write ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return PeftWritten(folder, config["r"], config["lora_alpha"], config["use_rslora"], config["target_modules"],
                       len(adapter.pairs), base)


def _check_destination(folder: Path, flag: str) -> None:
    """A new folder, an empty one or a PEFT adapter folder (replaced); anything else is refused."""
    if folder.exists() and not folder.is_dir():
        raise _fail(flag, folder, "is a file; give a folder for the PEFT adapter")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / CONFIG).is_file():
        raise _fail(flag, folder, f"holds files and no {CONFIG}; give a new or empty folder (a PEFT adapter "
                                  "folder is replaced)")
