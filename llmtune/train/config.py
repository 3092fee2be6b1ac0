"""Finetune settings: built-in defaults < TOML config file < explicit command-line flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from llmtune.errors import LlmtuneError
from llmtune.tomlfile import read_toml


@dataclass
class FinetuneConfig:
    ctx: int = 512  # tokens per training sequence (n_ctx)
    batch: Optional[int] = None  # tokens per optimizer step (n_batch); default: ctx
    ubatch: Optional[int] = None  # tokens per forward/backward pass (n_ubatch); default: batch
    epochs: int = 2
    lr: float = 1e-5
    lr_min: float = 0.0  # > 0: half-life decay from lr to lr_min over decay_epochs
    decay_epochs: float = 0.0  # 0: decay over all epochs
    warmup: int = 0  # linear warmup steps
    wd: float = 0.0  # decoupled weight decay
    optimizer: str = "adamw"  # adamw | sgd
    val_split: float = 0.05  # fraction of windows (the last ones) held out for validation
    params: Optional[str] = None  # regex over GGUF tensor names; None = all
    seed: int = 42
    shuffle: bool = True
    backend: str = "cpu"  # cpu | cuda | auto
    precision: str = "f32"  # matmul precision: f32, or on cuda tf32 / bf16 (f32 master weights)
    grad_checkpoint: bool = False  # recompute each layer's activations in the backward instead of keeping them
    metrics: Optional[str] = None  # JSONL path: one record per step and per validation pass
    # LoRA (set lora_rank or lora_init): train only adapters on a frozen base, write an adapter GGUF
    lora_rank: Optional[int] = None  # r of each adapter pair
    lora_alpha: Optional[float] = None  # scale = alpha / r; default: the rank (scale 1)
    lora_targets: Optional[str] = None  # regex over GGUF tensor names; None = attention + FFN matrices
    lora_dropout: float = 0.0  # dropout on the adapters' inputs while training (PEFT's lora_dropout)
    lora_init: Optional[str] = None  # adapter GGUF to continue training (fixes rank and targets)
    # instruction / chat data (train/chat.py) and samples during training
    format: str = "auto"  # auto | plain | text | completion | chat | sharegpt | alpaca (train/records.py)
    pack: bool = False  # several examples per window, each attending to itself (train/chat.py PackedDataset)
    chat_template: Optional[str] = None  # .jinja file overriding the model's tokenizer.chat_template
    train_on_prompt: bool = False  # completion/chat data: every token carries loss, not only the answers
    sample_prompt: Optional[str] = None  # print a short greedy continuation of this after each epoch
    sample_every: int = 0  # ... or every N optimizer steps (0: after each epoch)
    # checkpoints (train/checkpoint.py): every epoch end, and every checkpoint_every steps when > 0
    checkpoint_every: int = 0
    keep_checkpoints: Optional[int] = None  # None: the last one while training, none once the model is written
    eval_benchmark: Optional[str] = None  # benchmark file (llmtune eval's formats) scored before training and after each epoch

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None or self.lora_init is not None

    def resolved(self) -> "FinetuneConfig":
        """Fill derived defaults and validate ranges (one-line errors naming the flag)."""
        c = dataclasses.replace(self)
        if c.ctx < 2:
            raise LlmtuneError(f"--ctx: must be at least 2, got {c.ctx}")
        c.batch = c.batch or c.ctx
        c.ubatch = c.ubatch or c.batch
        if c.epochs < 1:
            raise LlmtuneError(f"--epochs: must be at least 1, got {c.epochs}")
        if not 0 <= c.val_split < 1:
            raise LlmtuneError(f"--val-split: must be in [0, 1), got {c.val_split}")
        if c.wd < 0:
            raise LlmtuneError(f"--wd: must be >= 0, got {c.wd}")
        if c.precision not in ("f32", "tf32", "bf16"):
            raise LlmtuneError(f"--precision: unknown precision {c.precision!r} (choose f32, tf32 or bf16)")
        if c.warmup < 0:
            raise LlmtuneError(f"--warmup: must be >= 0, got {c.warmup}")
        if c.checkpoint_every < 0:
            raise LlmtuneError(f"--checkpoint-every: must be >= 0 (0: at epoch ends only), got {c.checkpoint_every}")
        if c.keep_checkpoints is not None and c.keep_checkpoints < 1:
            raise LlmtuneError(f"--keep-checkpoints: must be at least 1, got {c.keep_checkpoints}")
        if c.sample_every < 0:
            raise LlmtuneError(f"--sample-every: must be >= 0, got {c.sample_every}")
        if c.sample_every and c.sample_prompt is None:
            raise LlmtuneError("--sample-every: needs --sample-prompt")
        from llmtune.train.chat import FORMATS

        if c.format not in FORMATS:
            raise LlmtuneError(f"--format: unknown format {c.format!r} (choose {', '.join(FORMATS)})")
        if c.lora_rank is not None and c.lora_rank < 1:
            raise LlmtuneError(f"--lora-rank: must be at least 1, got {c.lora_rank}")
        if not 0 <= c.lora_dropout < 1:
            raise LlmtuneError(f"--lora-dropout: must be in [0, 1), got {c.lora_dropout}")
        if c.lora_alpha is not None and not c.lora_alpha >= 0:
            raise LlmtuneError(f"--lora-alpha: must be >= 0, got {c.lora_alpha}")
        if not c.lora:
            for name in ("lora_alpha", "lora_targets"):
                if getattr(c, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise LlmtuneError(f"{flag}: needs --lora-rank (or --lora-init)")
            if c.lora_dropout:
                raise LlmtuneError("--lora-dropout: needs --lora-rank (or --lora-init)")
        elif c.params is not None:
            raise LlmtuneError("--params: LoRA trains only adapters; choose the adapted matrices with --lora-targets")
        elif c.lora_init is not None and c.lora_targets is not None:
            raise LlmtuneError("--lora-targets: --lora-init's adapter fixes the adapted matrices")
        return c


FIELDS = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
# settings that do not change the trained weights: a resumed run may change them
RUN_ONLY = ("backend", "metrics", "checkpoint_every", "keep_checkpoints", "eval_benchmark", "sample_prompt",
            "sample_every")


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _type_words(field: str) -> str:
    """'an integer', 'a number', 'true or false' or 'a string': what FinetuneConfig's annotation asks for."""
    kind = FIELDS[field].type.removeprefix("Optional[").removesuffix("]")
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[kind]


def _check_type(field: str, value: Any, source: str) -> None:
    """A one-line error naming the setting when `value` is not of the field's type (a TOML
    string where a number belongs would otherwise fail deep inside as a comparison of str and int)."""
    words = _type_words(field)
    ok = {"an integer": isinstance(value, int) and not isinstance(value, bool),
          "a number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "true or false": isinstance(value, bool),
          "a string": isinstance(value, str)}[words]
    if not ok:
        raise LlmtuneError(f"{source}{value!r} should be {words}")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file: top-level keys or a [finetune] table, named like the flags
    (`lr-min` or `lr_min`). Unknown keys are errors, so typos don't pass silently."""
    path = Path(path)
    data = read_toml(path)
    table = data.get("finetune", data)
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name == "no_shuffle":
            _check_type("shuffle", value, f"{path}: {key} = ")
            name, value = "shuffle", not value
        if name not in FIELDS:
            raise LlmtuneError(f"{path}: unknown setting {key!r} (known: {', '.join(sorted(FIELDS))})")
        _check_type(name, value, f"{path}: {key} = ")
        out[name] = value
    return out


def _explicit(config_file, flags: dict) -> dict[str, Any]:
    """The settings a run names: the config file's, then every flag that is not None."""
    values = load_config_file(config_file) if config_file else {}
    for key, value in flags.items():
        if key not in FIELDS:
            raise TypeError(f"unknown finetune setting {key!r}")
        if value is not None:
            _check_type(key, value, f"{flag_name(key)}: ")
            values[key] = value
    return values


def make_config(config_file: str | Path | None = None, **flags) -> FinetuneConfig:
    """Defaults, then the config file, then every flag that is not None."""
    values = _explicit(config_file, flags)
    try:
        return FinetuneConfig(**values).resolved()
    except TypeError as exc:
        raise LlmtuneError(f"{config_file or 'settings'}: {exc}") from None


def resume_config(saved: dict, checkpoint, config_file: str | Path | None = None, **flags) -> FinetuneConfig:
    """The settings of a resumed run: the checkpoint's (`saved`, FinetuneConfig fields), so the
    resume command needs no flags. A flag or config key that would change the trained weights must
    agree with them (one line naming it); RUN_ONLY ones (backend, metrics, checkpointing) may change."""
    values = {k: v for k, v in saved.items() if k in FIELDS}
    for key, value in _explicit(config_file, flags).items():
        if key not in RUN_ONLY and value != values.get(key):
            raise LlmtuneError(
                f"{flag_name(key)}: {value!r} differs from the {values.get(key)!r} checkpoint {checkpoint} was trained "
                f"with (--resume continues a run with its own settings: drop the flag, or start a new run)"
            )
        values[key] = value
    return FinetuneConfig(**values).resolved()
