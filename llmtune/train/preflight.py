"""Checks before the first step of a finetune, cheapest (and likeliest to fail) first: output
paths (writable, not inputs), leftovers of earlier runs, the batch, settings that cannot do
their work in this run, memory, disk space."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from llmtune.errors import LlmtuneError, plural
from llmtune.gguf.file import GGUF_KIND, check_output_path
from llmtune.resources import available_memory, check_disk_space, check_writable_folder, memory_limit
from llmtune.train import checkpoint as ckpts
from llmtune.train.config import FinetuneConfig
from llmtune.train.data import WindowDataset
from llmtune.train.optim import LRSchedule
from llmtune.train.output import output_bytes
from llmtune.train.trainer import Trainer


def check_outputs(out_path, cfg: FinetuneConfig, inputs: dict, ckpt, warn, force: bool = False) -> Path:
    """-o, --metrics, --plot and --tensorboard: writable, not one of the inputs, not each other, -o
    not an existing file other than a GGUF unless `force`; leftovers reported."""
    paths = [*inputs.values(), *([ckpt.path] if ckpt is not None else [])]
    out_path = check_output_path(out_path, *paths, replaces=GGUF_KIND, force=force)
    report_leftovers(out_path, ckpt, warn)
    check_writable_folder(out_path, "-o")
    taken = {out_path.resolve(): "-o"}
    for flag, name in (("--metrics", cfg.metrics), ("--plot", cfg.plot)):
        if name:
            path = check_output_path(name, *paths, flag=flag)
            if path.resolve() in taken:
                raise LlmtuneError(f"{flag} {name}: is the {taken[path.resolve()]} file too; "
                                   f"choose another {flag} path")
            taken[path.resolve()] = flag
            check_writable_folder(path, flag)
    if cfg.tensorboard:
        check_log_folder(Path(cfg.tensorboard), "--tensorboard")
    return out_path


def check_log_folder(folder: Path, flag: str) -> None:
    """A folder that files will be written into: created if missing, writable."""
    if folder.exists() and not folder.is_dir():
        raise LlmtuneError(f"{flag} {folder}: is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LlmtuneError(f"{flag} {folder}: cannot create the folder ({exc.strerror or exc})") from None
    check_writable_folder(folder / "events", flag)


def report_leftovers(out: Path, ckpt, warn) -> None:
    """Temp files of a killed run to the same output, and (for a new run) checkpoints of an earlier
    one: reported, never deleted (another run may still be writing them, or the user wants them)."""
    for tmp in ckpts.stale_temp_files(out):
        try:
            size = tmp.stat().st_size
        except FileNotFoundError:  # its writer finished meanwhile: not a leftover
            continue
        warn(f"{tmp}: a temp file left by an interrupted run ({size / 2**20:,.1f} MiB); "
             f"llmtune does not delete it: remove it unless another run is writing {out}")
    found = ckpts.checkpoints_of(out)
    if ckpt is None and found:
        warn(f"{found[-1][1]}: a checkpoint of an earlier run to {out} ({len(found)} in all) is "
             f"kept; to continue that run instead, add --resume {found[-1][1]}")


def steps_per_epoch(dataset: WindowDataset, cfg: FinetuneConfig, data_path) -> int:
    """Optimizer steps per epoch (the windows that do not fill a last batch wait for the next epoch)."""
    seqs_per_step = cfg.batch // cfg.ctx
    steps = dataset.n_train // seqs_per_step if seqs_per_step else 0
    if hasattr(dataset, "steps_per_epoch"):  # a dataset whose steps are not its windows' count (train/grpo.py)
        steps = dataset.steps_per_epoch()
    if steps < 1:
        raise LlmtuneError(
            f"{data_path}: {dataset.n_train} training window(s) of {cfg.ctx} tokens cannot fill one batch of "
            f"{cfg.batch} tokens (lower --batch or --ctx)"
        )
    return steps


def check_selection(dataset: WindowDataset, cfg: FinetuneConfig) -> None:
    """--eval-every, --early-stop and --save-best need something to evaluate."""
    if cfg.early_stop or cfg.save_best:
        if cfg.select_metric.startswith("val_") and not dataset.n_val:
            flag = "--early-stop" if cfg.early_stop else "--save-best"
            raise LlmtuneError(f"{flag}: there are no validation windows to follow {cfg.select_metric} on "
                               f"(raise --val-split, or --select-metric benchmark with --eval-benchmark)")
    if cfg.eval_every and not dataset.n_val and cfg.eval_benchmark is None:
        raise LlmtuneError("--eval-every: there are no validation windows (raise --val-split) and no --eval-benchmark")


def warn_futile(cfg: FinetuneConfig, schedule: LRSchedule, steps_per_epoch: int, warn) -> None:
    """Settings a new run accepts but cannot act on, one line each: a --warmup as long as the run
    (the rate never reaches --lr), an --early-stop with too few validation passes to ever stop."""
    total = cfg.epochs * steps_per_epoch
    if 0 < total <= cfg.warmup:
        last = schedule.lr((total - 1) / steps_per_epoch, total - 1)
        warn(f"--warmup {cfg.warmup}: the run has {plural(total, 'optimizer step')} ({cfg.epochs} x "
             f"{steps_per_epoch} per epoch), so it ends still warming up, at a learning rate of {last:.2g} "
             f"(--lr {cfg.lr:g}); try --warmup {total // 10} (about a tenth of the run)")
    p, every = cfg.early_stop, cfg.eval_every
    passes = validation_passes(cfg.epochs, steps_per_epoch, every)
    if p and passes < p + 2:  # the best, p passes without improvement, and a pass after them
        when = f"every {every} steps and at each epoch's end" if every else "at each epoch's end"
        fix = (f"add --eval-every {total // (p + 2)}" if total >= p + 2 and not every
               else f"lower --eval-every to {total // (p + 2)}" if total >= p + 2 else "raise --epochs")
        warn(f"--early-stop {p}: can never stop this run: it validates {plural(passes, 'time')} ({when}), and "
             f"stopping early takes {p + 2} (the best, {p} without improvement, and one left to skip); "
             f"{fix}")


def validation_passes(epochs: int, steps_per_epoch: int, eval_every: int) -> int:
    """Validation passes of a run (train/loop.py): one at each epoch's end, and one every eval_every
    steps (those falling on an epoch's end are that one)."""
    total = epochs * steps_per_epoch
    if not eval_every:
        return epochs
    return epochs + total // eval_every - total // math.lcm(eval_every, steps_per_epoch)


def checked_memory(trainer: Trainer, model_path, best_copy: bool = False) -> dict[str, int]:
    """The bytes the run needs, by kind; refused up front when more than is available. Where the
    backend can measure its process ("runtime"), it is what the process holds already besides the
    trained weights (interpreter, libraries, tokenizer, data), measured, not guessed. best_copy:
    --save-best's copy of the trained values."""
    memory = trainer.memory_bytes()
    if best_copy:
        memory["best weights"] = trainer.n_trainable * np.dtype(trainer.backend.dtype).itemsize
    held = _held_already(trainer)
    need, free, limit = sum(memory.values()), available_memory(trainer.backend), memory_limit()
    # the free memory no longer counts what setup has written (the trained values), which the need
    # does count; a LLMTUNE_MEMORY_LIMIT that binds is the budget of the whole run
    whole_run = limit is not None and free is not None and free >= limit
    if free is not None and (need if whole_run else need - held) > free:
        more = "" if whole_run else f", {held / 2**20:.0f} MiB of it held already,"
        raise LlmtuneError(
            f"{model_path}: the run needs {need / 2**20:.0f} MiB "
            f"({', '.join(f'{k} {v / 2**20:.0f}' for k, v in memory.items())})"
            f"{more} but only {free / 2**20:.0f} MiB is available{'' if whole_run else ' besides'} "
            f"({_shrink_hint(trainer)})"
        )
    rss = trainer.backend.resident_bytes()
    if rss is not None:  # the trained weights, written already, are resident and counted in "base"
        memory["runtime"] = max(0, rss - held)
    return memory


def _held_already(trainer: Trainer) -> int:
    """Bytes of the estimate that setup has written already: the trained values (and PiSSA's
    residual bases, made in memory); the gradients and optimizer state are zeros not yet touched."""
    held = trainer.n_trainable * np.dtype(trainer.backend.dtype).itemsize
    adapters = trainer.model.adapters
    if adapters and adapters[0].initial:
        held += sum(trainer.model.weights[n].nbytes for n in adapters[0].initial)
    return held


def _shrink_hint(trainer: Trainer) -> str:
    """What makes a run smaller, AdamW's 8-bit states first when they are what a full finetune spends."""
    hint = "lower --ubatch or --ctx, train fewer tensors with --params, or use --grad-checkpoint"
    if trainer.optimizer.kind == "adamw" and not trainer.model.adapters:
        hint = "--optimizer adamw8bit keeps about a quarter of AdamW's state; or " + hint
    return hint


def check_disk(out: Path, trainer: Trainer, model_path, cfg: FinetuneConfig, dataset: WindowDataset) -> None:
    """Room for the output and the checkpoints (the kept ones plus the one being written) before
    the first step."""
    n = trainer.n_trainable
    copies = 1 + (1 if cfg.save_best else 0)  # weights, best weights (float32), plus the optimizer's state
    per_checkpoint = n * 4 * copies + trainer.optimizer.state_bytes + dataset.n_train * 8 + (1 << 16)
    adapters = trainer.model.adapters
    if adapters and adapters[0].magnitudes:  # DoRA: the merged model
        out_bytes = output_bytes(trainer.model, list(adapters[0].pairs), None)
    elif adapters:  # PiSSA's written form has twice the rank
        out_bytes = n * 4 * (2 if adapters[0].initial else 1) + (1 << 20)
    else:
        out_bytes = output_bytes(trainer.model, trainer.trainable, cfg.out_type)
    keep = (cfg.keep_checkpoints or 1) + 1
    check_disk_space(out.parent, out_bytes + keep * per_checkpoint,
                     f"the output ({out_bytes / 2**20:,.1f} MiB) and {keep} checkpoints "
                     f"({per_checkpoint / 2**20:,.1f} MiB each)",
                     "free some space, choose another -o folder, or lower --keep-checkpoints")
