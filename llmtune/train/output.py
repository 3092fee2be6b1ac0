"""Writing what a finetune trained, and checking the file as written.

LoRA: llama.cpp's adapter GGUF (F32 A/B, nothing lost; PiSSA as its rank-2r plain form); DoRA,
which llama.cpp cannot load: the merged model, its adapted matrices F32, the rest as they were. A full finetune: the
input GGUF with its
trained tensors replaced. Their type (the output policy):
  - default: F32. Training updates are small against the weights (lr 1e-5 moves a weight of 0.05
    by about its F16 resolution per step), so F16/BF16 round many of them away, and re-encoding
    in the input's Q4_1/Q8_0/K-quant type throws nearly all of them away. Untrained tensors keep
    their bytes. Shrink the file afterwards with `llmtune export` / llama-quantize, or:
  - `--out-type TYPE` (any `llmtune export` type, mixes included: f16, q8_0, q4_k_m, ...): the
    whole model written as `llmtune export --type TYPE` would write the trained model.
Then the validation windows are scored again with the weights as written (decoded from the file
on rank 0; the same bytes re-encoded on other ranks) beside the in-memory loss; a file worse by
more than WRITTEN_LOSS_MARGIN warns in one line with the numbers and the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
from gguf import GGMLQuantizationType as QT

from llmtune.convert.export import export_plans, write_converted
from llmtune.errors import LlmtuneError, TrainingStopped
from llmtune.gguf.file import load_gguf, write_gguf
from llmtune.model.adapter import write_adapter
from llmtune.model.loaded import Model
from llmtune.quant import blocks as quants
from llmtune.quant.plan import export_type
from llmtune.train import checkpoint as ckpts, guard
from llmtune.train.events import OutputChecked, Saved
from llmtune.train.trainer import RunningStats, Trainer

WRITTEN_LOSS_MARGIN = 0.01  # the written file's validation loss may be 1 % above the in-memory one before a warning


def output_types(model: Model, trained: list[str], out_type: Optional[str]) -> dict[str, QT]:
    """The type each trained tensor is written in (the policy above)."""
    if out_type is None:
        return {name: QT.F32 for name in trained}
    plans = _plans(model, out_type)
    return {name: plans[name].dst_type for name in trained}


def _plans(model: Model, out_type: str) -> dict:
    """--out-type's plan: every tensor's type as `llmtune export --type out_type` would write it."""

    return export_plans(model.gguf, export_type(out_type))


def output_bytes(model: Model, trained: list[str], out_type: Optional[str]) -> int:
    """About the bytes a full finetune's output takes (for the disk check before training)."""

    gf = model.gguf
    if out_type is None:  # the input file, its trained tensors grown to F32
        return gf.file_size + sum(gf.tensors[n].n_elements * 4 - gf.tensors[n].n_bytes for n in trained)
    plans = _plans(model, out_type)
    tensor_bytes = sum(t.n_bytes for t in gf.tensors.values())
    return gf.file_size - tensor_bytes + sum(quants.nbytes(p.shape, p.dst_type) for p in plans.values())


def _kept_or_f32(model: Model, trained: dict[str, np.ndarray]):
    """Every tensor of the input file in its order: trained ones as F32, untouched ones copied
    byte for byte."""
    for name, info in model.gguf.tensors.items():
        if name in trained:
            yield name, np.ascontiguousarray(trained[name], dtype=np.float32), QT.F32
        else:
            yield name, np.asarray(info.raw), info.type


def write_model(trainer: Trainer, out_path: Path, inputs: list, out_type: Optional[str]) -> None:
    """The input GGUF with the trained tensors replaced (LoRA: the trained adapter), written atomically."""
    model = trainer.model
    trained = trainer.trained_weights()
    if model.adapters and model.adapters[0].magnitudes:  # DoRA: llama.cpp has no such adapter, write it merged
        adapter = model.adapters[0].with_tensors(trained)
        merged = {n: adapter.dora_merged(n, model.weights[n]) for n in adapter.pairs}
        write_gguf(out_path, model.gguf.arch, model.gguf.meta, _kept_or_f32(model, merged), inputs=inputs)
    elif model.adapters:

        write_adapter(out_path, model.adapters[0].with_tensors(trained), inputs=inputs, base=model.gguf)
    elif out_type is None:
        write_gguf(out_path, model.gguf.arch, model.gguf.meta, _kept_or_f32(model, trained), inputs=inputs)
    else:

        write_converted(model.gguf, out_path, export_type(out_type), trained.get, inputs=inputs)


def write_output(run) -> None:
    """The trained model of a train/loop.py Run (LoRA: the adapter), checked as written; then,
    unless --keep-checkpoints, the run's checkpoints go (the model holds the weights). A failed
    write keeps them and says so."""
    out = run.result.output
    guard.check_finite(run.trainer, run.step)
    if run.trainer.comm.is_root:  # rank 0 alone writes the model
        try:
            write_model(run.trainer, out, inputs=list(run.inputs.values()), out_type=run.cfg.out_type)
        except LlmtuneError as exc:
            if run.last_checkpoint is None:
                raise
            raise TrainingStopped(f"{exc}; training up to step {run.step} is kept in {run.last_checkpoint}: "
                                  f"free some space and resume it to write the model", run.last_checkpoint,
                                  resumable=True) from None
    if not run.trainer.model.adapters:
        _check_written(run)
    if run.trainer.comm.is_root:
        run.emit(Saved(str(out), os.path.getsize(out)))
        if run.cfg.keep_checkpoints is None:
            ckpts.remove_checkpoints(run)


def _check_written(run) -> None:
    """Score the validation windows with the trained tensors as written and compare (OutputChecked;
    a warning past WRITTEN_LOSS_MARGIN). Lossless writes (F32) and runs without validation windows
    report the in-memory loss alone."""
    tr, cfg = run.trainer, run.cfg
    types = output_types(tr.model, tr.trainable, cfg.out_type)
    lossy = [name for name, t in types.items() if t != QT.F32]
    in_memory = run.result.epochs[-1].val_loss if run.result.epochs else float("nan")
    if run.cfg.save_best and run.selection.weights is not None:  # -o holds the best pass's weights
        in_memory = run.selection.best_val_loss
    written = in_memory
    if lossy and run.dataset.n_val:
        tr.comm.barrier("writing the model")  # the other ranks score what rank 0 wrote
        _load_as_written(run, lossy, types)
        val = RunningStats()
        x, y, *segments = run.dataset.gather(run.dataset.val_indices())  # packed: + segments
        tr.evaluate(x, y, val, *segments)
        written = val.loss
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    run.emit(OutputChecked(str(run.result.output), in_memory, written, counts, bool(lossy and run.dataset.n_val)))
    if lossy and not run.dataset.n_val:
        run.warn(f"{run.result.output}: {len(lossy)} trained tensors were re-encoded (--out-type {cfg.out_type}) and "
                 f"there are no validation windows to check what that cost (--val-split 0)")
    elif written > in_memory * (1 + WRITTEN_LOSS_MARGIN):
        run.warn(f"{run.result.output}: validation loss {written:.4f} as written vs {in_memory:.4f} in memory "
                 f"(+{100 * (written / in_memory - 1):.1f} %): re-encoding the trained tensors as --out-type "
                 f"{cfg.out_type} lost part of the training; write F32 (no --out-type) or a finer type (f16, q8_0)")
    run.result.val_loss_written = written


def _load_as_written(run, names: list[str], types: dict[str, QT]) -> None:
    """The trainer's trained tensors replaced by their values as written: decoded from the file
    on rank 0, the same encoding redone on the other ranks (it is deterministic)."""

    tr, be = run.trainer, run.trainer.backend
    gf = load_gguf(run.result.output) if tr.comm.is_root else None
    trained = None if gf is not None else tr.trained_weights()
    for name in names:
        if gf is not None:
            values = gf.tensor(name)
        else:
            values = quants.dequantize(quants.quantize(trained[name], types[name]), types[name])
        tr.values[name][...] = be.asarray(np.asarray(values, dtype=np.float32).reshape(tr.values[name].shape)
                                          .astype(be.dtype, copy=False))
