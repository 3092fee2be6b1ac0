"""A GGUF model written as a Hugging Face transformers folder (`llmtune export MODEL.gguf --hf DIR`).

The folder is what transformers' save_pretrained writes for a causal LM and its tokenizer:
- config.json (arch/hf_config.py's table), generation_config.json;
- model.safetensors (or model-0000i-of-0000n.safetensors shards and model.safetensors.index.json
  above `shard_bytes`): every tensor under its HF name (arch/hf_names.py), dequantised to float32
  and stored as f32, bf16 or f16; llama's q/k rows back in HF's order (the inverse of
  convert_hf_to_gguf.py's LlamaModel.permute), gemma's norms less the +1 the converter added, gpt2's
  Conv1D matrices transposed back ([n_in, n_out]);
- tokenizer.json, tokenizer_config.json, special_tokens_map.json (tokenizer/hf_files.py).
Tensors are written one at a time into the safetensors file (its header, computed from the shapes,
goes first), so memory holds one tensor. Everything goes into a new folder beside DIR, renamed into
place at the end: a failure leaves nothing half-written. Families or files without an exact mapping
are refused in one line before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.arch import hf_names
from llmtune.arch.hf_config import config_json, hf_config_of
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import GGUFFile
from llmtune.model.loaded import check_model
from llmtune.resources import check_disk_space
from llmtune.tokenizer import Tokenizer
from llmtune.tokenizer.hf_files import tokenizer_files

DTYPES = {"f32": ("F32", 4, "float32"), "bf16": ("BF16", 2, "bfloat16"), "f16": ("F16", 2, "float16")}
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
# the files a folder written here may hold: an existing folder of only these is replaced
_OURS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", INDEX)


@dataclass
class HFWritten:
    folder: Path
    architecture: str
    dtype: str
    n_tensors: int
    n_params: int
    files: list[str] = field(default_factory=list)


def hf_tensors(gf: GGUFFile, hp, changed: Optional[Callable[[str], Optional[np.ndarray]]] = None,
               names: Optional[list[str]] = None):
    """(HF name, float32 values) for each weight of `gf` in file order (`names`: only these; never the
    tensors config.json carries); `changed(name)`: new float32 values (merged adapters) or None."""
    hf, table = hf_names(hp.arch, str(gf.path)), hf_config_of(hp.arch)
    for name in [n for n in gf.tensors if n not in table.in_config] if names is None else names:
        w = changed(name) if changed is not None else None
        w = gf.tensor(name) if w is None else np.asarray(w, np.float32)
        rows = hf.hf_rows(name, w.shape[0], hp.n_head, hp.n_head_kv)
        if rows is not None:  # llama's q/k: per head, adjacent pairs -> halves
            w = w[rows]
        if table.norm_offset and name.endswith("norm.weight"):
            w = w - np.float32(table.norm_offset)
        if hf.transposed(name):  # a Conv1D weight (gpt2): [n_in, n_out]
            w = w.T
        yield hf.hf_name(name), np.ascontiguousarray(w, dtype=np.float32)


def encode(w: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the bytes of `dtype` (bf16: rounded to nearest even, as torch's .to(bfloat16))."""
    if dtype == "f32":
        return w
    if dtype == "f16":
        return w.astype(np.float16)
    bits = w.view(np.uint32)
    r = bits >> 16  # in place from here: one tensor-sized temporary (finite values cannot overflow 32 bits)
    r &= 1
    r += 0x7FFF
    r += bits
    r >>= 16
    rounded = r.astype(np.uint16)
    nan = np.isnan(w)
    if nan.any():  # keep NaNs NaN (rounding could carry them into the infinity pattern)
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def _shards(specs: list[tuple[str, tuple, int]], shard_bytes: int) -> list[list[tuple[str, tuple, int]]]:
    """Tensors in order, cut into files of at most `shard_bytes` (a larger tensor alone)."""
    out, size = [[]], 0
    for spec in specs:
        if out[-1] and size + spec[2] > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(spec)
        size += spec[2]
    return out


def _header(shard: list[tuple[str, tuple, int]], st_dtype: str) -> bytes:
    """safetensors' header: 8-byte little-endian length, then JSON padded with spaces to 8 bytes."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, n in shard:
        entries[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_hf(gf: GGUFFile, folder, dtype: str = "f32", changed=None, shard_bytes: int = SHARD_BYTES,
             flag: str = "--hf", progress=None) -> HFWritten:
    """`gf` (a model) as transformers' folder `folder`; see the module docstring. `progress(done,
    total, name)`: called after each tensor (convert/export.py's Progress)."""
    folder = Path(folder)
    if dtype not in DTYPES:
        raise LlmtuneError(f"--hf-dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    st_dtype, width, torch_dtype = DTYPES[dtype]
    hp, _ = check_model(gf)
    source = str(gf.path)
    hf = hf_names(hp.arch, source)
    weights = [n for n in gf.tensors if n not in hf_config_of(hp.arch).in_config] if hf_config_of(hp.arch) else []
    missing = [n for n in weights if hf.hf_name(n) is None]
    tok = Tokenizer.from_gguf(gf)
    special = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    config = config_json(hp, hf, set(gf.tensors), special, source, gf.tensor)  # refuses what has no exact form
    if missing:
        raise LlmtuneError(f"{source}: tensor {missing[0]} has no name in a {hf.architecture} checkpoint; "
                           "no exact Hugging Face export")
    config["torch_dtype"] = torch_dtype
    files = {"config.json": config, "generation_config.json": _generation_config(tok),
             **tokenizer_files(tok, gf.metadata, hp.n_ctx_train, source)}
    _check_destination(folder, flag)
    specs = [(hf.hf_name(n), hf.hf_shape(n, tuple(gf.tensors[n].shape)), int(np.prod(gf.tensors[n].shape)) * width)
             for n in weights]
    shards = _shards(specs, shard_bytes)
    folder.parent.mkdir(parents=True, exist_ok=True)
    check_disk_space(folder.parent, sum(s[2] for s in specs), f"{flag} {folder}: the weights as {dtype}",
                     "--hf-dtype bf16 halves them")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        names = _write_weights(gf, hp, tmp, shards, dtype, st_dtype, changed, progress)
        if len(shards) > 1:
            files[INDEX] = {"metadata": {"total_size": sum(s[2] for s in specs)},
                            "weight_map": {s[0]: f for f, shard in zip(names, shards) for s in shard}}
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        os.chmod(tmp, 0o755)
        _move_into_place(tmp, folder)
    except OSError as exc:
        raise LlmtuneError(f"{flag} {folder}: cannot write ({exc.strerror or exc})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    written = sorted(p.name for p in folder.iterdir())
    return HFWritten(folder, hf.architecture, dtype, len(specs), gf.n_params(), written)


def _write_weights(gf, hp, tmp: Path, shards, dtype: str, st_dtype: str, changed, progress) -> list[str]:
    """Each shard's header, then its tensors one by one; returns the files' names."""
    n = len(shards)
    names = [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    by_hf = {hf_names(hp.arch).hf_name(g): g for g in gf.tensors}  # (rope_freqs: None, in no shard)
    done, total = 0, sum(len(shard) for shard in shards)
    for name, shard in zip(names, shards):
        with open(tmp / name, "wb") as fh:
            fh.write(_header(shard, st_dtype))
            for hf_name, w in hf_tensors(gf, hp, changed, [by_hf[s[0]] for s in shard]):
                fh.write(memoryview(encode(w, dtype)).cast("B"))  # no copy of the bytes
                done += 1
                if progress is not None:
                    progress(done, total, hf_name)
    return names


def _generation_config(tok: Tokenizer) -> dict:
    """generation_config.json: the ids generation starts and stops with (EOS and, when distinct, EOT)."""
    eos = [i for i in dict.fromkeys((tok.eos_id, tok.eot_id)) if i is not None]
    out = {"_from_model_config": True, "bos_token_id": tok.bos_id,
           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    if tok.pad_id is not None:
        out["pad_token_id"] = tok.pad_id
    return out


def _is_ours(p: Path) -> bool:
    return p.is_file() and (p.name in _OURS or (p.name.startswith("model") and p.name.endswith(".safetensors")))


def _check_destination(folder: Path, flag: str) -> None:
    """A new folder, an empty one, or one this export wrote before (replaced whole)."""
    if folder.exists() and not folder.is_dir():
        raise LlmtuneError(f"{flag} {folder}: is a file; give a folder for the Hugging Face model")
    if folder.is_dir() and not all(_is_ours(p) for p in folder.iterdir()):
        raise LlmtuneError(f"{flag} {folder}: holds files a Hugging Face export does not write; give a new or "
                           "empty folder (one an export wrote before is replaced)")


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename the finished folder into place; an old one is moved aside first and removed after."""
    if not folder.exists():
        os.rename(tmp, folder)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
    os.rename(folder, old / "x")
    try:
        os.rename(tmp, folder)
    except OSError:
        os.rename(old / "x", folder)  # put the previous folder back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
