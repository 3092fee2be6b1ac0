"""Checkpoints of a finetune run: everything needed to continue it exactly, so that a resumed
run writes the same bytes as one that was never interrupted.

Format: one uncompressed `.npz` (a zip of `.npy` arrays that `numpy.load` reads; nothing is
pickled), next to the output as `<output>.ckpt-<step>.npz` (out/demo.gguf.ckpt-000120.npz):

  weights         float32 [n]   the trainer's flat trainable buffer: the trained tensors (full
                                finetune) or the LoRA A/B tensors, concatenated in meta.trainable order
  adam_m, adam_v  float32 [n]   AdamW's moments, same layout (--optimizer adamw)
  adam8_m, adam8_v  uint8 [n8]  adamw8bit's moments of its 8-bit tensors: dynamic-map indices
                                (quant/dynamic8.py), in buffer order
  adam8_absmax_m, adam8_absmax_v  float32 [blocks]  their per-block scales (blocks of 256, per tensor)
  adam8_f32_m, adam8_f32_v  float32 [n - n8]  the moments of its float32 exceptions (train/optim.py
                                keeps_f32_state: the token embedding, tensors under 4096 values)
                                (no optimizer arrays with sgd)
  best_weights    float32 [n]   --save-best: the trained buffer at the best validation pass
  grpo_*          --method grpo (train/grpo.py): the generation batch in flight (its windows, old and
                                reference log-probabilities, advantages, rewards, lengths) and, with
                                --beta, the reference's trained values (grpo_ref_weights); its samples'
                                seeds derive from (seed, step), so no sampler state is kept
  order           int64 [n_train]  the current epoch's window order (its RNG: numpy
                                default_rng([seed, epoch]); dropout masks come from (seed, step))
  meta            uint8         UTF-8 JSON: format, version, the position (step = optimizer steps
                                done, epoch, epoch_step = steps done in it), the resolved config,
                                sha256 fingerprints of the model, data, --lora-init and of the
                                settings that shape the weights, optimizer step count, trainer
                                layout (trainable names, workers), the epoch's running loss and
                                accuracy, finished epochs' results, --metrics lines written, run id,
                                --early-stop / --save-best's state (best value, step, passes since)

Written atomically: a temp file in the same folder (`<name>.XXXX.tmp`), fsync, rename.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.gguf.file import GGUF_MAGIC
from llmtune.model.adapter import is_peft_folder, peft_files
from llmtune.resources import write_atomically
from llmtune.train import guard
from llmtune.train.config import RUN_ONLY
from llmtune.train.events import Checkpoint as CheckpointEvent, EpochResult, Resumed
from llmtune.train.preference import REFERENCE_METHODS
from llmtune.train.records import data_files
from llmtune.train.trainer import RunningStats

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
    """sha256 of a file's bytes; of a data folder (train/records.py data_files) or a PEFT adapter
    folder (--lora-init; model/adapter/peft.py peft_files): of each of its files' name and sha256,
    in order."""
    if Path(path).is_dir():

        files = peft_files(path) if is_peft_folder(path) else data_files(Path(path))
        listing = "".join(f"{f.name}\0{file_sha256(f)}\n" for f in files)
        return hashlib.sha256(listing.encode()).hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def settings_sha256(config, names=None) -> str:
    """Hash of the settings that shape the trained weights (not backend, metrics or checkpointing);
    `names`: only these (a checkpoint's own settings: one written before a setting existed hashes
    without it, and that setting's default keeps what runs did before it)."""

    shaping = {k: v for k, v in dataclasses.asdict(config).items()
               if k not in RUN_ONLY and (names is None or k in names)}
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
    _check_zip(path, flag)
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


def _check_zip(path: Path, flag: str) -> None:
    """A checkpoint is a .npz (a zip): a GGUF (the model, or -o itself) or any other file is one line
    naming what `flag` takes, not numpy's advice to unpickle it."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise LlmtuneError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None
    if head.startswith(b"PK"):
        return
    found = checkpoints_of(path)
    takes = (f"the newest beside this file is {found[-1][1]}" if found
             else "a run writes them beside its -o as OUT.gguf.ckpt-STEP.npz")
    what = "is a GGUF model file" if head == GGUF_MAGIC else "is not a .npz file"
    raise LlmtuneError(f"{flag} {path}: {what}, not a finetune checkpoint ({flag} takes a checkpoint: {takes})")


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


# ---------------------------------------------------------------------- a run's checkpoints
# `run` below is a train/loop.py Run: its position, trainer and result are what a checkpoint holds.

def run_fingerprint(run) -> dict:
    """sha256 of the run's inputs and of its weight-shaping settings (computed once, when first needed)."""
    if run.fingerprint_cache is None:
        fp = {key: file_sha256(path) for key, path in run.inputs.items()}
        run.fingerprint_cache = {**fp, "settings": settings_sha256(run.cfg)}
    return run.fingerprint_cache


def save_checkpoint(run) -> Path | None:
    """Write the run's position atomically and drop its older checkpoints beyond
    --keep-checkpoints. A failed write warns and training goes on (the last one stays)."""

    tr, res = run.trainer, run.result
    guard.check_finite(tr, run.step)  # never a NaN checkpoint: the step that did this stops the run
    if not tr.comm.is_root:  # rank 0 alone writes checkpoints (every rank holds the same state)
        return None
    meta = {
        "step": run.step, "epoch": run.epoch, "epoch_step": run.epoch_step, "steps_per_epoch": run.steps_per_epoch,
        "config": dataclasses.asdict(run.cfg), "fingerprint": run_fingerprint(run), "run_id": run.run_id,
        "inputs": {k: str(v) for k, v in run.inputs.items()}, "output": str(res.output),
        "trainable": tr.trainable, "n_trainable": tr.n_trainable, "workers": tr.n_workers, "ranks": tr.comm.size,
        "base_products": tr.base_products(),
        "backend": tr.backend.name, "optimizer": {"kind": tr.optimizer.kind, "t": tr.optimizer.t},
        "rng": {"order": "numpy default_rng([seed, epoch])", "dropout": "(seed, step)", "seed": run.cfg.seed,
                **({"rollouts": "SeedSequence([seed, 0 train | 1 validation, step, completion])"}
                   if run.cfg.method == "grpo" else {})},
        "stats": {"losses": run.stats.losses, "correct": run.stats.correct, "tokens": run.stats.tokens},
        "first_loss": res.first_loss, "epochs": [dataclasses.asdict(e) for e in res.epochs],
        "metrics_lines": run.log.lines, "elapsed_s": run.elapsed(), "selection": run.selection.state(),
    }
    order = np.zeros(0, np.int64) if run.order is None else np.asarray(run.order, dtype=np.int64)
    path = checkpoint_path(res.output, run.step)
    try:
        write_checkpoint(path, {**tr.state_arrays(), **run.selection.arrays(tr), "order": order, **_reference(run)},
                         meta)
    except LlmtuneError as exc:
        run.warn(f"{exc}; training goes on" + (f" (the last checkpoint is {run.last_checkpoint})" if run.last_checkpoint
                                               else ""))
        return None
    run.last_checkpoint = path
    remove_checkpoints(run, keep=run.cfg.keep_checkpoints or 1)
    run.emit(CheckpointEvent(str(path), run.step, run.where()))
    return path


def _reference(run) -> dict:
    """DPO's reference log-probabilities (train/preference.py; KTO's: completion and KL completion,
    train/kto.py), computed once before the first step: kept, since the weights they came from
    are gone once training has started."""
    ref = getattr(run.dataset, "ref", None)
    return {} if ref is None else {"ref_logps": np.asarray(ref, dtype=np.float64)}


def _lineage(run) -> list[Path]:
    """The run's checkpoints beside its output (same run id), oldest first."""
    mine = []
    for _, path in checkpoints_of(run.result.output):
        try:
            if read_meta(path).get("run_id") == run.run_id:
                mine.append(path)
        except Exception:  # noqa: BLE001 - someone else's or a damaged file: not ours to touch
            continue
    return mine


def remove_checkpoints(run, keep: int = 0) -> None:
    """All but the run's last `keep` checkpoints go."""
    mine = _lineage(run)
    for path in mine[: max(len(mine) - keep, 0)]:
        try:
            path.unlink()
        except OSError:
            pass


def resume_workers(meta: dict, ranks: int) -> int:
    """The workers per rank of a run resumed from a checkpoint written with meta's layout: as many
    gradient buffers in all (workers x ranks) as the checkpoint's run summed, where `ranks` divides
    them (2 ranks x 1 worker -> 1 process x 2 workers), else the checkpoint's workers per rank."""
    lanes = int(meta.get("workers") or 1) * int(meta.get("ranks", 1))
    return lanes // ranks if lanes % ranks == 0 else int(meta.get("workers") or 1)


def same_gradient_sum(meta: dict, backend: str, workers: int, ranks: int, base_products: str = "blas") -> bool:
    """Whether a resumed run computes each step's gradient as the checkpoint's run did, bit for
    bit: the same backend and products of the frozen matrices (Trainer.base_products: whether
    their packed copies fit the memory), and the same layout or two buffers either way (two
    workers' buffers or two ranks' all-reduce: a + b whatever holds them; with more, the order of
    an all-reduce is MPI's)."""
    was = (int(meta.get("workers") or 1), int(meta.get("ranks", 1)))
    if meta.get("backend") != backend or meta.get("base_products", base_products) != base_products:
        return False
    return was == (workers, ranks) or was[0] * was[1] == workers * ranks == 2


def restore(run, ckpt: Checkpoint) -> None:
    """Continue `run` from `ckpt` after checking it belongs to the run's inputs and settings."""

    meta, where = ckpt.meta, f"--resume {ckpt.path}"
    names = {"model": f"the model {run.inputs['model']}", "data": f"the data {run.inputs['data']}",
             "lora_init": f"--lora-init {run.inputs.get('lora_init')}", "settings": "the run's settings"}
    check_fingerprint(ckpt, {**run_fingerprint(run), "settings": settings_sha256(run.cfg, meta["config"])}, names)
    if meta["trainable"] != run.trainer.trainable or meta["steps_per_epoch"] != run.steps_per_epoch:
        raise LlmtuneError(f"{where}: the checkpoint trains other tensors or steps than this run")
    order = ckpt.arrays["order"]
    if meta["epoch"] < run.cfg.epochs and sorted(order.tolist()) != list(range(run.dataset.n_train)):
        raise LlmtuneError(f"{where}: damaged checkpoint (its window order does not fit the data)")
    try:
        run.trainer.load_state(ckpt.arrays, meta["step"])
        run.selection.restore(meta.get("selection"), ckpt.arrays, run.trainer)  # best pass, patience count
    except (LlmtuneError, ValueError) as exc:
        raise LlmtuneError(f"{where}: {exc}") from None
    if hasattr(run.dataset, "ref") and run.cfg.method in REFERENCE_METHODS:
        ref = ckpt.arrays.get("ref_logps")
        if ref is None or ref.shape != (len(run.dataset.pairs), 2):
            raise LlmtuneError(f"{where}: damaged checkpoint (no reference log-probabilities for the data's pairs)")
        run.dataset.ref = np.asarray(ref, dtype=np.float64)
    run.step, run.epoch, run.epoch_step = meta["step"], meta["epoch"], meta["epoch_step"]
    run.order = order.astype(np.int64) if meta["epoch"] < run.cfg.epochs else None
    st = meta.get("stats") or {}
    run.stats = RunningStats(list(st.get("losses", [])), int(st.get("correct", 0)), int(st.get("tokens", 0)))
    run.result.first_loss = meta.get("first_loss", math.nan)
    run.result.epochs = [EpochResult(**e) for e in meta.get("epochs", [])]
    run.seconds_before = float(meta.get("elapsed_s", 0.0))
    run.run_id, run.last_checkpoint = meta.get("run_id") or uuid.uuid4().hex, ckpt.path
    tr = run.trainer
    ranks, now = meta.get("ranks", 1), tr.comm.size  # a checkpoint resumes on any number of ranks
    if not same_gradient_sum(meta, tr.backend.name, tr.n_workers, now, tr.base_products()):
        was = f", {meta['base_products']} base products" if meta.get("base_products") else ""
        run.warn(f"{where}: written on {meta.get('backend')} with {meta.get('workers')} worker(s) x {ranks} rank(s)"
                 f"{was}, continued on {tr.backend.name} with {tr.n_workers} x {now}, {tr.base_products()} base "
                 f"products: the result may differ from an uninterrupted run in float rounding")
    run.emit(Resumed(str(ckpt.path), run.step, run.where(), tuple(run.result.epochs)))
