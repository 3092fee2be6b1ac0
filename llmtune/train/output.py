"""Writing what a finetune trained: the input GGUF with the trained tensors replaced, or (LoRA)
llama.cpp's adapter GGUF; then the run's checkpoints go unless they are to be kept."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from llmtune.errors import LlmtuneError, TrainingStopped
from llmtune.gguf.file import write_gguf
from llmtune.model.loaded import Model
from llmtune.train import checkpoint as ckpts
from llmtune.train.events import Saved
from llmtune.train.trainer import Trainer


def encode_for_output(model: Model, trained: dict[str, np.ndarray]):
    """Every tensor of the input file in its order: trained ones re-encoded in their original
    type, untouched ones copied byte for byte."""
    from llmtune.quant import blocks as quants

    for name, info in model.gguf.tensors.items():
        if name in trained:
            try:
                data = quants.quantize(trained[name], info.type)
            except (NotImplementedError, ValueError) as exc:
                raise LlmtuneError(f"{model.path}: cannot re-encode {name} as {info.type.name} ({exc})") from None
            yield name, data, info.type
        else:
            yield name, np.asarray(info.raw), info.type


def write_model(trainer: Trainer, out_path: Path, inputs: list) -> None:
    """The input GGUF with the trained tensors replaced (LoRA: the trained adapter), written atomically."""
    model = trainer.model
    if model.adapters:
        from llmtune.model.adapter import write_adapter

        write_adapter(out_path, model.adapters[0].with_tensors(trainer.trained_weights()), inputs=inputs)
        return
    write_gguf(out_path, model.gguf.arch, model.gguf.meta, encode_for_output(model, trainer.trained_weights()),
               inputs=inputs)


def write_output(run) -> None:
    """The trained model of a train/loop.py Run (LoRA: the adapter); then, unless
    --keep-checkpoints, the run's checkpoints go (the model holds the weights). A failed write
    keeps them and says so."""
    out = run.result.output
    run.trainer.check_finite(run.step)
    if not run.trainer.comm.is_root:  # rank 0 alone writes the model
        return
    try:
        write_model(run.trainer, out, inputs=list(run.inputs.values()))
    except LlmtuneError as exc:
        if run.last_checkpoint is None:
            raise
        raise TrainingStopped(f"{exc}; training up to step {run.step} is kept in {run.last_checkpoint}: "
                              f"free some space and resume it to write the model", run.last_checkpoint,
                              resumable=True) from None
    run.emit(Saved(str(out), os.path.getsize(out)))
    if run.cfg.keep_checkpoints is None:
        ckpts.remove_checkpoints(run)
