"""The divergence guard: a step whose loss or gradient is not finite, or whose loss is past the
trainer's max_loss, stops the run before its update (the weights stay those of the step before),
naming the tensor; weights that are no longer finite are never written."""

from __future__ import annotations

import math

import numpy as np

from llmtune.errors import LlmtuneError


class Diverged(LlmtuneError):
    """A training step whose loss or gradients are not finite, or whose loss is past the trainer's
    `max_loss`; raised before that step's update, so the weights stay those of the step before."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason


def check_step(tr, loss: float) -> float:
    """Raise Diverged for a loss or gradient that is not finite, or a loss above tr.max_loss;
    else return the gradient's sum of squares (its norm, squared: the same read tells both)."""
    step = tr.steps_done + 1
    sum_squares = tr.backend.sum_squares(tr.flat_g) if tr.n_trainable else 0.0
    bad = [] if math.isfinite(sum_squares) else nonfinite(tr, tr.flat_g)
    if not math.isfinite(loss) or bad:
        what = f"the loss is {loss}" if not math.isfinite(loss) else f"the loss is {loss:.4g}"
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            what += f"; the gradient of {bad[0]}{more} is not finite"
        raise Diverged(step, what)
    if loss > tr.max_loss:
        name, rms = largest_gradient(tr)
        raise Diverged(step, f"the loss is {loss:.6g}, above the divergence limit {tr.max_loss:.4g}; "
                             f"largest gradient: {name} (rms {rms:.3g})")
    return sum_squares


def check_finite(tr, step: int) -> None:
    """Raise Diverged when a trained weight is no longer finite (before a checkpoint or the output
    is written from them)."""
    bad = nonfinite(tr, tr.flat_w)
    if bad:
        raise Diverged(step, f"the weights of {bad[0]} are no longer finite")


def nonfinite(tr, flat) -> list[str]:
    """Trainable tensors (in file order) whose part of `flat` (flat_w or flat_g) holds NaN or inf.
    One reduction when all is well; per tensor only when the sum is not finite."""
    if tr.n_trainable == 0 or math.isfinite(float(tr.backend.to_numpy(flat.sum()))):
        return []
    return [name for name, view in tr._flat_views(flat).items() if not np.isfinite(tr.backend.to_numpy(view)).all()]


def largest_gradient(tr) -> tuple[str, float]:
    """The trainable tensor with the largest gradient (root mean square) in flat_g."""
    rms = {name: float(np.sqrt(np.mean(np.square(tr.backend.to_numpy(v), dtype=np.float64))))
           for name, v in tr._flat_views(tr.flat_g).items()}
    name = max(rms, key=rms.get) if rms else "-"
    return name, rms.get(name, 0.0)
