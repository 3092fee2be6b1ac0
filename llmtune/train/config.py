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
    metrics: Optional[str] = None  # JSONL path: one record per step and per validation pass

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
        return c


FIELDS = {f.name: f for f in dataclasses.fields(FinetuneConfig)}


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
            name, value = "shuffle", not value
        if name not in FIELDS:
            raise LlmtuneError(f"{path}: unknown setting {key!r} (known: {', '.join(sorted(FIELDS))})")
        out[name] = value
    return out


def make_config(config_file: str | Path | None = None, **flags) -> FinetuneConfig:
    """Defaults, then the config file, then every flag that is not None."""
    values = load_config_file(config_file) if config_file else {}
    for key, value in flags.items():
        if key not in FIELDS:
            raise TypeError(f"unknown finetune setting {key!r}")
        if value is not None:
            values[key] = value
    try:
        return FinetuneConfig(**values).resolved()
    except TypeError as exc:
        raise LlmtuneError(f"{config_file or 'settings'}: {exc}") from None
