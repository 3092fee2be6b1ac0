"""The divergence guard: a step whose loss or gradient is not finite, or whose loss is past the
trainer's limits.max_loss, stops the run before its update (the weights stay those of the step
before), naming the tensor; weights that are no longer finite are never written.

A loss of sequence log-probabilities (the preference methods, train/preference.py, and any later
one through its trainer) says little about the model's health: DPO's loss falls to 0 while the
model collapses. Such a step is also checked on what the loss is computed from (check_logps: the
log-probabilities finite, the preferred completions' not collapsed) and, after its update, on the
weights (check_weights: not grown a hundredfold). The limits are in Limits, set once per run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmtune.errors import LlmtuneError

# A step's mean loss above 10 x ln(n_vocab) stops the run (uniform guessing scores 1 x): a
# next-token loss is a mean NLL per token, and no model that still learns is ten times worse than
# knowing nothing.
DIVERGENCE_FACTOR = 10.0
# The completions a preference step pushes up (DPO's chosen) scoring a mean NLL per token above
# 2 x ln(n_vocab): the policy finds them less likely than two uniform guesses per token. A model
# being tuned scores them far below 1 x (stories260K starts at 0.5 x, an instruct LLM at 0.1-0.2 x),
# and DPO's likelihood displacement, which lowers them in healthy runs, stayed under 1 x in every
# run of the bundled model at the tests' rates (0.93 x at most, a full DPO finetune over 120 steps).
# The rejected completions get no such limit: pushing them down is the objective (a healthy SimPO
# run took them past 10 x ln(n_vocab)); only their finiteness is checked.
COLLAPSE_FACTOR = 2.0
# The trained weights' root mean square above 100 x where it started stops the run. Adam moves
# every weight by about the learning rate each step, so --lr 1e3 makes them ~1,000 after one step
# (16,000 x a new LoRA adapter's RMS); healthy runs of the bundled model stayed under 2 x (8 x at
# ten times the tests' rate). A start below WEIGHT_FLOOR (an all-zero start) counts as WEIGHT_FLOOR.
WEIGHT_GROWTH, WEIGHT_FLOOR = 100.0, 1e-2


@dataclass(frozen=True)
class Limits:
    """What stops a run besides non-finite values; the defaults (a trainer made outside a
    finetune run: tests, benchmarks) stop nothing else."""

    max_loss: float = math.inf  # a step's mean loss
    max_preferred_nll: float = math.inf  # preference: the preferred completions' mean NLL per token
    max_weight_rms: float = math.inf  # preference: the trained weights' RMS after an update
    start_weight_rms: float = math.nan  # (what max_weight_rms was set from, for the message)

    @classmethod
    def of(cls, tr) -> "Limits":
        """The limits of a run on `tr`, taken from the weights it starts from: before its first
        step (a resumed run's trainer holds them too until its checkpoint is restored)."""
        uniform = math.log(max(tr.model.hp.n_vocab, 2))
        start = weight_rms(tr)
        return cls(DIVERGENCE_FACTOR * uniform, COLLAPSE_FACTOR * uniform, WEIGHT_GROWTH * max(start, WEIGHT_FLOOR),
                   start)


class Diverged(LlmtuneError):
    """A training step whose loss or gradients are not finite, or past the trainer's `limits`;
    raised before that step's update (the weights stay those of the step before), except by
    check_weights, which reads the update's result (the run then writes nothing of it)."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason


def check_step(tr, loss: float) -> float:
    """Raise Diverged for a loss or gradient that is not finite, or a loss above tr.limits.max_loss;
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
    if loss > tr.limits.max_loss:
        name, rms = largest_gradient(tr)
        raise Diverged(step, f"the loss is {loss:.6g}, above the divergence limit {tr.limits.max_loss:.4g}; "
                             f"largest gradient: {name} (rms {rms:.3g})")
    return sum_squares


def check_logps(tr, sequences: dict, preferred: str) -> None:
    """Raise Diverged for a step of a loss of sequence log-probabilities whose log-probabilities are
    not finite, or whose `preferred` completions score a mean NLL per token above
    tr.limits.max_preferred_nll (a collapse). sequences: name -> (per-sequence log-probability sums,
    their token counts), as the step's forward pass gave them (before its backward)."""
    step = tr.steps_done + 1
    for name, (logps, _) in sequences.items():
        bad = int((~np.isfinite(logps)).sum())
        if bad:
            raise Diverged(step, f"the log-probabilities of {bad} of the batch's {len(logps)} {name} completions "
                                 f"are not finite")
    logps, counts = sequences[preferred]
    nll = -float(np.sum(logps)) / max(int(np.sum(counts)), 1)
    if nll > tr.limits.max_preferred_nll:
        uniform = tr.limits.max_preferred_nll / COLLAPSE_FACTOR
        raise Diverged(step, f"the {preferred} completions collapsed: their mean NLL is {nll:.4g} per token, above "
                             f"{COLLAPSE_FACTOR:g} x uniform guessing's {uniform:.4g}")


def check_weights(tr) -> None:
    """Raise Diverged when the update of the step just done left trained weights that are not
    finite, or whose RMS is above tr.limits.max_weight_rms (an explosion)."""
    rms = weight_rms(tr)
    if not math.isfinite(rms):
        check_finite(tr, tr.steps_done)
    if rms > tr.limits.max_weight_rms:
        raise Diverged(tr.steps_done, f"its update made the trained weights explode: their RMS is {rms:.4g}, "
                                      f"above the limit {tr.limits.max_weight_rms:.4g} (it was "
                                      f"{tr.limits.start_weight_rms:.3g} at the start)")


def weight_rms(tr) -> float:
    """The root mean square of the trained weights (0 when nothing trains)."""
    if tr.n_trainable == 0:
        return 0.0
    return math.sqrt(float(tr.backend.sum_squares(tr.flat_w)) / tr.n_trainable)


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
