"""Checkpoints of a finetune run: everything needed to continue it exactly, so that a resumed
run writes the same bytes as one that was never interrupted.

Format: one uncompressed `.npz` (a zip of `.npy` arrays that `numpy.load` reads; nothing is
pickled), next to the output as `<output>.ckpt-<step>.npz` (out/demo.gguf.ckpt-000120.npz):

  weights         float32 [n]   the trainer's flat trainable buffer: the trained tensors (full
                                finetune) or the LoRA A/B tensors, concatenated in meta.trainable order
  adam_m, adam_v  float32 [n]   AdamW's moments, same layout (absent with sgd)
  order           int64 [n_train]  the current epoch's window order (its RNG: numpy
                                default_rng([seed, epoch]); dropout masks come from (seed, step))
  meta            uint8         UTF-8 JSON: format, version, the position (step = optimizer steps
                                done, epoch, epoch_step = steps done in it), the resolved config,
                                sha256 fingerprints of the model, data, --lora-init and of the
                                settings that shape the weights, optimizer step count, trainer
                                layout (trainable names, workers), the epoch's running loss and
                                accuracy, finished epochs' results, --metrics lines written, run id

Written atomically: a temp file in the same folder (`<name>.XXXX.tmp`), fsync, rename.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.resources import write_atomically

FORMAT = "llmtune-finetune-checkpoint"
VERSION = 1
_NAME = re.compile(r"\.ckpt-(\d+)\.npz$")


def checkpoint_path(out: Path, step: int) -> Path:
    return out.with_name(f"{out.name}.ckpt-{step:06d}.npz")


def checkpoints_of(out: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints next to `out`, oldest first."""
    found = []
    for p in out.parent.glob(glob_escape(out.name) + ".ckpt-*.npz"):
        m = _NAME.search(p.name)
        if m and p.name == checkpoint_path(out, int(m.group(1))).name:
            found.append((int(m.group(1)), p))
    return sorted(found)


def stale_temp_files(out: Path) -> list[Path]:
    """Temp files a killed run left beside `out` (its GGUF's and its checkpoints')."""
    return sorted(p for p in out.parent.glob(glob_escape(out.name) + ".*.tmp") if p.is_file())


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def file_sha256(path) -> str:
    """sha256 of a file's bytes; of a data folder (train/records.py data_files): of each data
    file's name and sha256, in order."""
    if Path(path).is_dir():
        from llmtune.train.records import data_files

        listing = "".join(f"{f.name}\0{file_sha256(f)}\n" for f in data_files(Path(path)))
        return hashlib.sha256(listing.encode()).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def settings_sha256(config) -> str:
    """Hash of the settings that shape the trained weights (not backend, metrics or checkpointing)."""
    from llmtune.train.config import RUN_ONLY

    shaping = {k: v for k, v in dataclasses.asdict(config).items() if k not in RUN_ONLY}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()


@dataclass
class Checkpoint:
    path: Path
    meta: dict
    arrays: dict  # name -> numpy array

    @property
    def step(self) -> int:
        return self.meta["step"]


def write_checkpoint(path: Path, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write atomically; the temp file goes on every exit path (signals included)."""
    meta = {"format": FORMAT, "version": VERSION, **meta}
    blob = np.frombuffer(json.dumps(meta, allow_nan=True).encode("utf-8"), dtype=np.uint8)
    return write_atomically(path, lambda fh: np.savez(fh, meta=blob, **arrays), "cannot write the checkpoint")


def read_meta(path: Path) -> dict:
    """Only the JSON part (cheap: the arrays are not read)."""
    with np.load(path, allow_pickle=False) as z:
        return json.loads(z["meta"].tobytes().decode("utf-8"))


def read_checkpoint(path, flag: str = "--resume") -> Checkpoint:
    """A checkpoint with its arrays in memory; one-line errors naming `flag` and the file."""
    path = Path(path)
    where = f"{flag} {path}"
    if not path.exists():
        raise LlmtuneError(f"{where}: no such file")
    if path.is_dir():
        raise LlmtuneError(f"{where}: is a directory, not a checkpoint")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise LlmtuneError(f"{where}: not an llmtune checkpoint (no meta entry)")
            meta = json.loads(z["meta"].tobytes().decode("utf-8"))
            arrays = {name: z[name] for name in z.files if name != "meta"}
    except LlmtuneError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError, KeyError) as exc:
        raise LlmtuneError(f"{where}: not a readable llmtune checkpoint ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LlmtuneError(f"{where}: not an llmtune finetune checkpoint")
    if meta.get("version") != VERSION:
        raise LlmtuneError(f"{where}: checkpoint version {meta.get('version')} (this llmtune reads version {VERSION})")
    missing = [k for k in ("step", "epoch", "epoch_step", "config", "fingerprint", "trainable") if k not in meta]
    if missing or "weights" not in arrays or "order" not in arrays:
        raise LlmtuneError(f"{where}: damaged checkpoint (missing {', '.join(missing) or 'arrays'})")
    return Checkpoint(path, meta, arrays)


def check_fingerprint(ckpt: Checkpoint, now: dict[str, str], names: dict[str, str], flag: str = "--resume") -> None:
    """Refuse (one line) to continue a checkpoint on another model, data file or settings."""
    saved = ckpt.meta["fingerprint"]
    for key in ("model", "data", "lora_init", "settings"):
        if saved.get(key) != now.get(key):
            what = names.get(key, key)
            raise LlmtuneError(
                f"{flag} {ckpt.path}: {what} differs from the one the checkpoint was trained on "
                f"(sha256 {str(saved.get(key))[:12]} then, {str(now.get(key))[:12]} now)"
            )
