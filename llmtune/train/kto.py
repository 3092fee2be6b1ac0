"""KTO on unpaired preference records {prompt, completion, label}, as TRL's KTOTrainer computes it.

- Data (train/records.py's "unpaired" format): plain strings or conversational, tokenized as DPO's
  completions are (preference.py tokenize_completions: EOS after a plain completion, the
  completion starting where prompt and prompt + completion stop sharing tokens).
- The KL estimate: TRL's KTOTrainer._prepare_dataset gives example i of each run of
  per_device_train_batch_size examples (in dataset order) the completion of example i - 1 of the
  same run (the first gets the last's: completions rotated by +1), and estimates
  z0 = max(0, mean over the batch of log pi(y_{i-1}|x_i) - log ref(y_{i-1}|x_i)), detached. Here
  the runs are the steps' batches (--batch / --ctx examples) over the training examples in file
  order, then over the validation ones; so with --no-shuffle each step's KL pairs are TRL's
  (its batch composition). --shuffle keeps these pairs (fixed with the data, as TRL fixes them)
  and mixes which of them a step averages: still mismatched pairs of the same data. A validation
  pass scores the held-out examples as one batch: its z0 is the mean over all their pairs.
- One window per example, one pass: the prompt (less its last token) is the trunk, its own
  completion the first branch (preference.py's CHOSEN part) and the mismatched KL completion the
  second (REJECTED part), each branch seeing the trunk and itself (arch/packing.py pair_inputs), so
  the prompt is computed once for both. A KL completion too long for the window is cut to the
  slots left (TRL cuts KL sequences at max_length); it carries no gradient (the KL is detached:
  its tokens' weight is 0).
- The loss (KTOObjective, float64): TRL's loss_type "kto": desirable examples
  1 - sigmoid(beta (logratio - z0)), undesirable 1 - sigmoid(beta (z0 - logratio)), each times
  desirable_weight / undesirable_weight, the mean over the batch's examples; "apo_zero_unpaired"
  (--kto-loss) is the same with z0 = 0, and its windows hold no KL completion (TRL's calculate_KL
  False).
- The reference is the model as training starts: each example's (completion, KL completion)
  log-probabilities are computed once before training (TRL's precompute_ref_log_probs, preference.py
  PreferenceTrainer.reference_logps) and kept in checkpoints as DPO's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.train.chat import pad_token
from llmtune.train.data import Holdout
from llmtune.train.preference import (
    Objective,
    Pair,
    PairDataset,
    SeqLogps,
    _logsigmoid,
    _sigmoid,
    records_template,
    tokenize_completions,
)
from llmtune.train.records import read_records

LOSS_TYPES = ("kto", "apo_zero_unpaired")


# ------------------------------------------------------------------------------------ data
@dataclass
class KTODataset(PairDataset):
    """One example per window: Pair(prompt, completion, KL completion) with its label (see the module
    docstring); gather's layout carries the labels. PairDataset's interface otherwise."""

    labels: Optional[np.ndarray] = None  # bool [n]: desirable
    n_truncated: int = 0  # KL completions cut to fit the window
    format: str = "unpaired"

    @classmethod
    def of_examples(cls, examples: list[tuple], n_ctx: int, val_split, pad_id: int, per_step: int,
                    source: str = "data", kl: bool = True) -> "KTODataset":
        """examples: (prompt ids, completion ids, label); per_step: the examples of a step, the runs
        the KL completions rotate within (TRL's per_device_train_batch_size); kl False: none
        (loss_type apo_zero_unpaired)."""
        kept = [e for e in examples if len(e[0]) >= 1 and len(e[1]) and len(e[0]) - 1 + len(e[1]) + kl <= n_ctx]
        if not kept:
            room = ", and one slot for the KL completion" if kl else ""
            raise LlmtuneError(f"{source}: no example fits in --ctx {n_ctx} (prompt + completion{room}): raise --ctx")
        n = len(kept)
        kept, n_train, n_val = Holdout.of(val_split).arrange(kept, source, "example(s)")
        pairs, truncated = [], 0
        for start, stop in ((0, n_train), (n_train, n_train + n_val)):
            part = kept[start:stop]
            for s in range(0, len(part), per_step):
                run = part[s : s + per_step]
                for (prompt, completion, _), (_, other, _) in zip(run, run[-1:] + run[:-1]):
                    room = n_ctx - (len(prompt) - 1 + len(completion)) if kl else 0
                    truncated += kl and len(other) > room
                    pairs.append(Pair(prompt, completion, other[:room]))
        labels = np.array([e[2] for e in kept], dtype=bool)
        return cls(pairs, n_ctx, int(pad_id), n_train, n_val, len(examples) - n, labels=labels, n_truncated=truncated)

    @property
    def tokens(self) -> int:
        return int(sum(len(p.prompt) + len(p.chosen) for p in self.pairs))

    def gather(self, indices):
        x, y, layout = super().gather(indices)
        layout.labels = self.labels[np.asarray(indices, dtype=np.int64)]
        return x, y, layout

    def loss_tokens(self, indices) -> int:
        return int(sum(len(self.pairs[i].chosen) for i in indices))

    def info(self, seqs_per_epoch: int) -> dict:
        desirable = int(self.labels.sum())
        return {**super().info(seqs_per_epoch), "format": "unpaired", "truncated": self.n_truncated,
                "desirable": desirable, "undesirable": len(self.labels) - desirable,
                "kl": any(len(p.rejected) for p in self.pairs)}


def build_unpaired(model, data_path, ctx: int, val_split, per_step: int, fmt: str = "auto",
                   chat_template=None, kl: bool = True) -> tuple[KTODataset, int]:
    """(dataset, n_tokens) of an unpaired preference file: {"prompt", "completion", "label"} records."""
    records = read_records(data_path, fmt)
    if records.format != "unpaired":
        missing = " (no \"label\")" if records.format == "completion" else ""
        raise LlmtuneError(f"--method kto: {data_path} holds {records.format} data{missing}; KTO reads "
                           f"{{\"prompt\", \"completion\", \"label\": true|false}} records")
    template = records_template(model, records, chat_template, "example")
    examples = []
    for (prompt, completion, label), where in zip(records.items, records.wheres):
        p_ids, (c_ids,) = tokenize_completions(model.tokenizer, template, prompt, (completion,), where)
        examples.append((p_ids, c_ids, label))
    ds = KTODataset.of_examples(examples, ctx, val_split, pad_token(model.tokenizer), per_step, str(data_path), kl)
    ds.template = template
    return ds, ds.tokens


def balance_warning(ds: KTODataset, desirable_weight: float, undesirable_weight: float) -> Optional[str]:
    """TRL's warning (KTOTrainer._prepare_dataset, from eq. 8 of the KTO paper) when the training
    examples' classes are unbalanced and neither weight is in the range that balances them."""
    labels = ds.labels[: ds.n_train]
    n_d = max(int(labels.sum()), 1)
    n_u = max(len(labels) - n_d, 1)
    if n_d == n_u:
        return None
    d_lo, d_hi = round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo, u_hi = round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (f"--method kto: {n_d} desirable and {n_u} undesirable training examples, and the weights do not balance "
            f"them: give EITHER --desirable-weight in [{d_lo}, {d_hi}] or --undesirable-weight in [{u_lo}, {u_hi}] "
            f"(TRL's advice, KTO paper eq. 8)")


# ------------------------------------------------------------------------------------ loss
@dataclass
class KTOObjective(Objective):
    """TRL's KTOTrainer loss over a batch of examples (SeqLogps with labels: chosen holds each
    example's completion log-probability sum, rejected its KL completion's)."""

    method: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    def terms(self, lp: SeqLogps, ref: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float,
                                                                         dict]:
        """Objective.terms for KTO: each example's weighted loss (their mean is the loss, as TRL's
        nanmean over the concatenated desirable and undesirable losses), d loss / d completion sum,
        zeros for the KL completions (the KL is detached), and TRL's metrics (kl; rewards/ and logps/
        chosen and rejected over the examples of that label, when there are any; rewards/margins
        when there are both). rewards/accuracies, which TRL's KTOTrainer does not log, is the share
        of examples on their label's side of the KL reference point (a loss below half their weight)."""
        if ref is None or lp.labels is None:
            raise ValueError("KTO needs the reference log-probabilities and the labels")
        y, b, n = np.asarray(lp.labels, dtype=bool), self.beta, len(lp.chosen)
        logratio = lp.chosen - ref[:, 0]
        kl = max(float(np.mean(lp.rejected - ref[:, 1])), 0.0) if self.loss_type == "kto" else 0.0
        sign = np.where(y, 1.0, -1.0)
        z = b * sign * (logratio - kl)  # loss_type apo_zero_unpaired: kl = 0
        weight = np.where(y, self.desirable_weight, self.undesirable_weight)
        shares = weight * _sigmoid(-z)  # 1 - sigmoid(z)
        d_c = -weight * np.exp(_logsigmoid(z) + _logsigmoid(-z)) * b * sign / n
        rewards = b * logratio
        metrics: dict = {"kl": kl}
        for name, rows in (("chosen", y), ("rejected", ~y)):
            if rows.any():
                metrics[f"rewards/{name}"] = float(rewards[rows].mean())
                metrics[f"logps/{name}"] = float(lp.chosen[rows].mean())
        if y.any() and (~y).any():
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        metrics["rewards/accuracies"] = float((z > 0).mean())
        return shares, d_c, np.zeros(n), 0.0, metrics
