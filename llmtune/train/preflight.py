"""Checks before the first step of a finetune, cheapest (and likeliest to fail) first: output
paths (writable, not inputs), leftovers of earlier runs, the batch, settings that cannot do
their work in this run, memory, disk space."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import numpy as np

from llmtune.errors import LlmtuneError, plural
from llmtune.gguf.file import GGUF_KIND, check_output_path
from llmtune.resources import (
    available_memory,
    binding_limit,
    check_disk_space,
    check_writable_folder,
    limit_reserve,
    memory_limit_source,
)
from llmtune.train import checkpoint as ckpts
from llmtune.train.config import FinetuneConfig
from llmtune.train.data import WindowDataset
from llmtune.train.memory import held_already, runtime_bytes
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
    held, runtime = held_already(trainer), runtime_bytes(trainer)
    need, free, limit = sum(memory.values()), available_memory(trainer.backend), binding_limit(trainer.backend)
    # the free memory no longer counts what setup has written (the trained values), which the need
    # does count; a memory limit that binds is the budget of the whole process, its runtime included
    if free is not None and (need + runtime if limit is not None else need - held) > free:
        more = f" and {runtime / 2**20:.0f} MiB of runtime" if limit is not None else \
            f", {held / 2**20:.0f} MiB of it held already,"
        allowed = f"is allowed ({memory_limit_source()})" if limit is not None else "is available besides"
        raise LlmtuneError(
            f"{model_path}: the run needs {need / 2**20:.0f} MiB "
            f"({', '.join(f'{k} {v / 2**20:.0f}' for k, v in memory.items())})"
            f"{more} but only {free / 2**20:.0f} MiB {allowed} "
            f"({_shrink_hint(trainer)})"
        )
    if trainer.backend.resident_bytes() is not None:  # the trained weights, written already, count in "base"
        memory["runtime"] = runtime
    return memory


COPIES = ("float copies", "packed copies")  # the estimate's parts a limit may shrink (memory.plan_copies)


def planned_trainer(make: Callable[[FinetuneConfig], Trainer],
                    cfg: FinetuneConfig) -> tuple[Trainer, FinetuneConfig, tuple[str, ...]]:
    """The run's trainer, planned to fit a memory limit (--memory-limit, LLMTUNE_MEMORY_LIMIT) that
    binds: the frozen matrices' copies take what the rest leaves (memory.plan_copies); where even
    without them the run does not fit, --grad-checkpoint is turned on (said, in the plan) and the
    trainer made again. -> (trainer, its config, the plan's lines: plan_lines). What cannot fit
    even then is refused later, by checked_memory, in one line."""
    limit = binding_limit()
    if limit is None or cfg.grad_checkpoint:
        trainer = make(cfg)
        return trainer, cfg, plan_lines(trainer, limit, None)
    try:
        trainer = make(cfg)
    except LlmtuneError:  # its activations alone do not fit (StepPrograms): checkpointing is the saving left
        trainer = None
    if trainer is not None and _fits_without_copies(trainer, limit):
        return trainer, cfg, plan_lines(trainer, limit, None)
    before = trainer.memory_bytes()["activations"] if trainer is not None else None
    flops_before = trainer.flops_per_step if trainer is not None else None
    del trainer  # its buffers go before the next one's are made
    cfg = dataclasses.replace(cfg, grad_checkpoint=True)
    trainer = make(cfg)
    after = trainer.memory_bytes()["activations"]
    cost = f", ~{trainer.flops_per_step / flops_before:.2f}x the step's products (the recompute)" \
        if flops_before else ""
    turned_on = ("--grad-checkpoint: turned on, the run does not fit the limit without it (activations "
                 + (f"{before / 2**20:,.0f} -> " if before is not None else "") + f"{after / 2**20:,.0f} MiB{cost})")
    return trainer, cfg, plan_lines(trainer, limit, turned_on)


def _fits_without_copies(trainer: Trainer, limit: int) -> bool:
    """Whether the run's estimate, its copies left out, and its runtime fit the limit (its reserve kept)."""
    need = sum(v for k, v in trainer.memory_bytes().items() if k not in COPIES)
    return need + runtime_bytes(trainer) + limit_reserve(limit) <= limit


def plan_lines(trainer: Trainer, limit: int | None, turned_on: str | None) -> tuple[str, ...]:
    """What a binding memory limit decided, and its cost, in words: the limit; the frozen matrices'
    copies kept of all they would take and, for those left decoded per product, the base products'
    slowdown: 1 + s (c - 1), s the share of their FLOPs left without a copy (a copy's bytes are its
    weights', as are its FLOPs) and c the backend's measured decode cost (Backend.decode_cost; the
    highest of the base's types); --grad-checkpoint when the limit turned it on. Empty where no
    limit binds and every copy is kept."""
    copies = trainer.float_copies
    wanted = getattr(trainer, "copies_wanted", 0)
    kept = 0 if copies is None else copies.budget - (trainer._packed_bytes if copies.pack else 0)
    packed_all = copies is not None and copies.pack and trainer._packed_bytes and copies.budget >= trainer._packed_bytes
    lines = []
    if limit is not None:
        lines.append(f"memory limit {_size(limit)} ({memory_limit_source()}), the process's runtime and a "
                     f"reserve of {_size(limit_reserve(limit))} included")
    if packed_all:
        lines.append(f"packed copies: all {_size(trainer._packed_bytes)} (the compiled product)")
    elif wanted and (limit is not None or kept < wanted):
        short = max(0, wanted - kept) / wanted  # the share of the frozen products' FLOPs decoded per product
        qtypes = {w.qtype for n, w in trainer.frozen.items() if hasattr(w, "qtype")}
        costs = [c for c in (trainer.backend.decode_cost(q) for q in sorted(qtypes)) if c is not None]
        cost = max(costs) if costs else None
        if short <= 0:
            lines.append(f"float copies: all {_size(wanted)}")
        else:
            slower = "" if cost is None else (
                f": ~{1 + short * (cost - 1):.2f}x slower base products (a product decoded per block takes "
                f"{cost:.2f}x its float32 copy's, measured)")
            lines.append(f"float copies: {_size(max(0, kept), wanted)} of {_size(wanted)}, the rest "
                         f"({100 * short:.0f} %) decoded per product{slower}")
    if turned_on:
        lines.append(turned_on)
    return tuple(lines)


def _size(n: int, unit_of: int | None = None) -> str:
    """Bytes in GiB (2 decimals) from 1 GiB up, else in MiB; unit_of: in the unit of that size."""
    return f"{n / 2**30:.2f} GiB" if (unit_of or n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


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
