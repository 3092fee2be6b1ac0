"""--early-stop and --save-best: the best validation pass of a run by --select-metric, and
how many passes since have not improved on it (transformers' EarlyStoppingCallback:
early_stopping_patience, early_stopping_threshold; and Keras' EarlyStopping / ModelCheckpoint
save_best_only, whose rule this is: a pass improves when it beats the best by more than
min_delta; only an improvement becomes the best and resets the count).

--save-best keeps a copy of the trained buffer on the backend at each improvement (memory and
checkpoints grow by one copy of the trained values); the run's end loads it back, so -o is
written from it. A checkpoint stores the state (state()) and the copy (array best_weights)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from llmtune.train.events import Evaluation

# metric -> (the Evaluation field it reads, +1 when higher is better, -1 when lower is)
METRICS = {"val_loss": ("val_loss", -1), "val_accuracy": ("val_accuracy", +1), "benchmark": ("bench_accuracy", +1)}


@dataclass
class Selection:
    metric: str = "val_loss"
    min_delta: float = 0.0
    patience: int = 0  # 0: never stops
    best_value: float = math.nan
    best_step: int = 0  # 0: no pass yet
    best_epoch: int = 0
    best_val_loss: float = math.nan  # the best pass's validation loss (what -o is checked against)
    since_best: int = 0  # passes since the best that did not improve on it
    stopped_at: int = 0  # the step --early-stop ended training at (0: it has not)
    weights: Any = None  # --save-best: the best pass's trained buffer (on the backend); not in state()

    @classmethod
    def of(cls, cfg) -> "Selection":
        return cls(cfg.select_metric, cfg.min_delta, cfg.early_stop)

    def value(self, e: Evaluation) -> float:
        return getattr(e, METRICS[self.metric][0])

    def update(self, e: Evaluation) -> bool:
        """Count the pass `e`; True when it is the new best."""
        value, sign = self.value(e), METRICS[self.metric][1]
        if math.isnan(value):
            return False
        if math.isnan(self.best_value) or sign * (value - self.best_value) > self.min_delta:
            self.best_value, self.best_step = value, e.global_step
            self.best_epoch, self.best_val_loss = e.epoch, e.val_loss
            self.since_best = 0
            return True
        self.since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.since_best >= self.patience

    def keep(self, trainer) -> None:
        """Copy the trainer's trained values as the best (--save-best)."""
        if self.weights is None:
            self.weights = trainer.backend.zeros((trainer.n_trainable,))
        self.weights[...] = trainer.flat_w

    def load_best(self, trainer) -> bool:
        """Put the best pass's values back into the trainer (the run's end, --save-best)."""
        if self.weights is None:
            return False
        trainer.flat_w[...] = self.weights
        return True

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "weights"}

    def arrays(self, trainer) -> dict[str, np.ndarray]:
        if self.weights is None:
            return {}
        return {"best_weights": np.asarray(trainer.backend.to_numpy(self.weights), dtype=np.float32)}

    def restore(self, state: Optional[dict], arrays: dict, trainer) -> None:
        """Continue from a checkpoint's state() and arrays()."""
        names = {f.name for f in dataclasses.fields(self)} - {"weights"}
        for key, value in (state or {}).items():
            if key in names:
                setattr(self, key, value)
        best = arrays.get("best_weights")
        if best is not None:
            if best.shape != (trainer.n_trainable,):
                raise ValueError(f"best_weights has {best.shape}, this run trains {trainer.n_trainable} values")
            be = trainer.backend
            self.weights = be.asarray(np.asarray(best, dtype=np.float32).astype(be.dtype, copy=False))
