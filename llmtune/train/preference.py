"""Preference tuning: DPO, ORPO and SimPO on (prompt, chosen, rejected) pairs, as TRL computes them.

- Data (train/records.py's "preference" format): plain strings, tokenized as TRL's DPOTrainer
  (_prepare_dataset: the prompt with the tokenizer's BOS, prompt + completion + EOS, the completion
  starting where the two token lists diverge), or conversational (TRL's maybe_apply_chat_template:
  the prompt rendered with the generation prompt, prompt + chosen / rejected rendered whole).
- One window per pair, one pass: the prompt (less its last token) is a trunk, and the chosen and
  rejected completions are two branches after it, each starting with the prompt's last token.
  arch/packing.py pair_inputs gives the positions (each branch continues the prompt's) and the mask
  (a branch sees the trunk and itself), so the prompt is computed once and each completion's
  log-probabilities are those of prompt + completion alone.
- The losses are functions of per-sequence log-probability sums (Objective.loss, float64 numpy):
  DPO (trl DPOTrainer loss_type="sigmoid", label_smoothing), ORPO (trl ORPOTrainer: chosen NLL over
  prompt and completion minus beta * mean logsigmoid(log odds ratio) of mean log-probabilities),
  SimPO (trl CPOTrainer loss_type="simpo", cpo_alpha=0). A step runs a forward pass for the
  log-probabilities, then the training pass seeded with each token's weight, the loss's gradient
  wrt that token's NLL (ops.token_nll), so the gradients are those of the loss itself.
- The reference of DPO is the model as training starts (the base with a new LoRA adapter, whose B
  is 0; the base plus --lora-init's adapter, TRL's "ref" adapter copy): its log-probabilities are
  computed once, before training, for every pair (TRL's precompute_ref_log_probs), and kept in the
  checkpoints, so no second model is ever held.
- KTO (train/kto.py) reuses all of it: one example per window, its completion and a mismatched one
  (the KL estimate's) as the two branches, SeqLogps with the labels, this trainer and reference;
  its loss is kto.KTOObjective, a sibling of Objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llmtune.arch.packing import pair_inputs
from llmtune.errors import LlmtuneError
from llmtune.tokenizer.chat_template import ChatTemplate, ChatTemplateError, encode
from llmtune.train import guard
from llmtune.train.chat import _common_prefix, pad_token, prompt_ids
from llmtune.train.data import Holdout, TrainValSplit
from llmtune.train.programs import WeightedTokenNLL
from llmtune.train.records import read_records
from llmtune.train.trainer import RunningStats, Trainer

METHODS = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")  # kto: train/kto.py, grpo: train/grpo.py
REFERENCE_METHODS = ("dpo", "kto")  # the methods whose reference log-probabilities are computed before training
# what each method's loss measures (--plot's axis): a next-token loss is a mean NLL per token; a
# preference loss a mean over pairs of -log sigmoid(a margin) (nats per pair); ORPO's adds both
LOSS_LABELS = {"sft": "loss (nats per token)", "dpo": "DPO loss (nats per pair)",
               "orpo": "ORPO loss (NLL per token + beta x odds-ratio nats per pair)",
               "simpo": "SimPO loss (nats per pair)", "kto": "KTO loss (weighted 1 - sigmoid per example)",
               "grpo": "GRPO loss (clipped advantage-weighted ratio)"}
TRUNK, CHOSEN, REJECTED, PAD = 0, 1, 2, 3  # the parts of a pair's window


# ------------------------------------------------------------------------------------ data
@dataclass
class Pair:
    prompt: np.ndarray  # int32 token ids (at least one: the BOS or the prompt's first token)
    chosen: np.ndarray
    rejected: np.ndarray

    @property
    def slots(self) -> int:
        """Input slots the pair takes in its window: the prompt less its last token, then each
        completion (its first input is the prompt's last token)."""
        return len(self.prompt) - 1 + len(self.chosen) + len(self.rejected)


def tokenize_pair(tokenizer, template, item, where: str) -> Pair:
    """A record's (prompt, chosen, rejected) as token ids, as TRL's DPOTrainer._prepare_dataset:
    strings get EOS after each completion; message lists are rendered with the chat template;
    the completions start where prompt and prompt + completion stop sharing tokens."""
    prompt, chosen, rejected = item
    p_ids, (c_ids, r_ids) = tokenize_completions(tokenizer, template, prompt, (chosen, rejected), where)
    return Pair(p_ids, c_ids, r_ids)


def tokenize_completions(tokenizer, template, prompt, completions, where: str) -> tuple[np.ndarray, list]:
    """(prompt ids, [completion ids]) of a prompt and its completions (tokenize_pair's rules; KTO's
    one completion, train/kto.py): the prompt is cut where it and every prompt + completion stop
    sharing tokens."""
    if isinstance(prompt, str):
        def full(completion):
            ids = list(tokenizer.encode(prompt + completion, add_special=True))
            if tokenizer.eos_id is not None and tokenizer.eos_id >= 0 and (not ids or ids[-1] != tokenizer.eos_id):
                ids.append(tokenizer.eos_id)
            return ids
        p_ids, fulls = prompt_ids(tokenizer, prompt), [full(c) for c in completions]
    else:
        if template is None:
            raise LlmtuneError(f"{where}: conversational records need a chat template (the model has none: "
                               f"give --chat-template)")
        try:
            p_ids = encode(tokenizer, template.render(prompt, add_generation_prompt=True))
            fulls = [encode(tokenizer, template.render(prompt + c, add_generation_prompt=False)) for c in completions]
        except ChatTemplateError as exc:
            raise LlmtuneError(f"{where}: {exc}") from None
    n = min(_common_prefix(p_ids, ids) for ids in fulls)
    as_ids = lambda ids: np.asarray(ids, dtype=np.int32)  # noqa: E731
    return as_ids(fulls[0][:n]), [as_ids(ids[n:]) for ids in fulls]


@dataclass
class PairLayout:
    """What a batch of pair windows carries besides inputs and targets: each token's part (TRUNK,
    CHOSEN, REJECTED, PAD), and the pairs' reference log-probabilities (chosen, rejected); KTO's
    windows (train/kto.py) also their labels."""

    parts: np.ndarray  # int32 [n, n_ctx]
    ref: Optional[np.ndarray]  # float64 [n, 2], or None (no reference)
    labels: Optional[np.ndarray] = None  # bool [n]: KTO's desirable (True) / undesirable examples

    def __getitem__(self, rows) -> "PairLayout":
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return PairLayout(self.parts[rows], pick(self.ref), pick(self.labels))


@dataclass
class PairDataset(TrainValSplit):
    """One pair per window of n_ctx input slots (see the module docstring); a val_split of the
    pairs validate (the last ones, or drawn with --val-pick random: train/data.py's Holdout). Same
    interface as train/chat.py's datasets; gather adds a PairLayout."""

    pairs: list
    n_ctx: int
    pad_id: int
    n_train: int
    n_val: int
    n_dropped: int = 0
    format: str = "preference"
    template: object = None
    ref: Optional[np.ndarray] = None  # float64 [n_pairs, 2]: the reference's log-probabilities (DPO)

    @classmethod
    def build(cls, pairs: list[Pair], n_ctx: int, val_split, pad_id: int, source: str = "data") -> "PairDataset":
        """val_split: a train/data.py Holdout, or the fraction of pairs (the last ones) that validate."""
        kept = [p for p in pairs if len(p.prompt) >= 1 and len(p.chosen) and len(p.rejected) and p.slots <= n_ctx]
        if not kept:
            raise LlmtuneError(f"{source}: no pair fits in --ctx {n_ctx} (prompt + chosen + rejected, less one token): "
                               f"raise --ctx")
        n = len(kept)
        kept, n_train, n_val = Holdout.of(val_split).arrange(kept, source, "pair(s)")
        return cls(kept, n_ctx, int(pad_id), n_train, n_val, len(pairs) - n)

    @property
    def tokens(self) -> int:
        return int(sum(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in self.pairs))

    def gather(self, indices) -> tuple[np.ndarray, np.ndarray, PairLayout]:
        """(inputs, targets, layout) [n, n_ctx] of pairs `indices`: the trunk's targets are the
        prompt's next tokens (ORPO's NLL counts them), each branch's its completion."""
        indices = np.asarray(indices, dtype=np.int64)
        x = np.full((len(indices), self.n_ctx), self.pad_id, dtype=np.int32)
        y = np.full((len(indices), self.n_ctx), -1, dtype=np.int32)
        parts = np.full((len(indices), self.n_ctx), PAD, dtype=np.int32)
        for r, i in enumerate(indices):
            p = self.pairs[i]
            at = len(p.prompt) - 1
            x[r, :at], y[r, :at], parts[r, :at] = p.prompt[:-1], p.prompt[1:], TRUNK
            for part, completion in ((CHOSEN, p.chosen), (REJECTED, p.rejected)):
                n = len(completion)
                if not n:  # KTO's apo_zero_unpaired: no KL completion (train/kto.py)
                    continue
                x[r, at], x[r, at + 1 : at + n] = p.prompt[-1], completion[:-1]
                y[r, at : at + n], parts[r, at : at + n] = completion, part
                at += n
        return x, y, PairLayout(parts, None if self.ref is None else self.ref[indices])

    def loss_tokens(self, indices) -> int:
        return int(sum(len(self.pairs[i].chosen) + len(self.pairs[i].rejected) for i in indices))

    def padding(self, indices) -> float:
        indices = list(indices)
        return 1.0 - sum(self.pairs[i].slots for i in indices) / max(len(indices) * self.n_ctx, 1)

    def info(self, seqs_per_epoch: int) -> dict:
        """What the start report says about the pairs (train/chat.py data_info's keys)."""
        train = self.loss_tokens(range(self.n_train))
        return {"format": "preference", "examples": len(self.pairs), "dropped": self.n_dropped, "truncated": 0,
                "conversational": self.template is not None, "loss_tokens": train,
                "loss_tokens_per_epoch": int(round(train * seqs_per_epoch / max(self.n_train, 1))),
                "padding": self.padding(range(self.n_train))}


def build_pairs(model, data_path, ctx: int, val_split, fmt: str = "auto", chat_template=None,
                method: str = "dpo") -> tuple[PairDataset, int]:
    """(dataset, n_tokens) of a preference file: {"prompt", "chosen", "rejected"} records."""

    records = read_records(data_path, fmt)
    if records.format != "preference":
        raise LlmtuneError(f"--method {method}: {data_path} holds {records.format} data; preference tuning reads "
                           f"{{\"prompt\", \"chosen\", \"rejected\"}} records")
    template = records_template(model, records, chat_template, "pair")
    pairs = [tokenize_pair(model.tokenizer, template, item, where)
             for item, where in zip(records.items, records.wheres)]
    ds = PairDataset.build(pairs, ctx, val_split, pad_token(model.tokenizer), str(data_path))
    ds.template = template
    return ds, ds.tokens


def records_template(model, records, chat_template, what: str) -> Optional[ChatTemplate]:
    """The chat template of conversational records (None for plain strings), every record checked
    to be of the first one's kind; `what` names a record in the messages (pair, example)."""
    conversational = bool(records.items) and not isinstance(records.items[0][0], str)
    template = ChatTemplate.for_model(model.gguf, model.tokenizer, chat_template) if conversational else None
    if chat_template is not None and not conversational:
        raise LlmtuneError(f"--chat-template: {records.path} holds plain-string {what}s, not conversations")
    for item, where in zip(records.items, records.wheres):
        if isinstance(item[0], str) == conversational:
            kinds = ("plain-string", "conversational") if conversational else ("conversational", "plain-string")
            raise LlmtuneError(f"{where}: a {kinds[0]} {what} among {kinds[1]} ones")
    return template


# ------------------------------------------------------------------------------------ losses
def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_logsigmoid(x))


@dataclass
class SeqLogps:
    """Per-pair sums of the policy's log-probabilities (float64) and their token counts; ORPO's
    NLL also reads the chosen sequence's prompt tokens (trunk: their NLL in all, and per pair)."""

    chosen: np.ndarray
    rejected: np.ndarray
    n_chosen: np.ndarray
    n_rejected: np.ndarray
    trunk_nll: float
    n_trunk: int
    trunk_rows: Optional[np.ndarray] = None  # each pair's part of trunk_nll (None: spread evenly)
    labels: Optional[np.ndarray] = None  # KTO (train/kto.py): chosen holds the completions, rejected the KL ones
    preferred = "chosen"  # the completions the loss pushes up (what guard.check_logps watches)

    @classmethod
    def of(cls, nll: np.ndarray, targets: np.ndarray, parts: np.ndarray,
           labels: Optional[np.ndarray] = None) -> "SeqLogps":
        nll = np.where(targets >= 0, np.asarray(nll, dtype=np.float64), 0.0)
        counted = targets >= 0
        s = lambda part: (-nll * (parts == part)).sum(axis=1)  # noqa: E731
        n = lambda part: ((parts == part) & counted).sum(axis=1)  # noqa: E731
        trunk = -s(TRUNK)
        return cls(s(CHOSEN), s(REJECTED), n(CHOSEN), n(REJECTED),
                   float(nll[parts == TRUNK].sum()), int(((parts == TRUNK) & counted).sum()), trunk, labels)

    def sequences(self) -> dict:
        """name -> (log-probability sums, token counts) of each kind of completion (guard.check_logps);
        KTO's: the desirable (chosen) and undesirable (rejected) completions, and the KL ones."""
        if self.labels is None:
            return {"chosen": (self.chosen, self.n_chosen), "rejected": (self.rejected, self.n_rejected)}
        y = np.asarray(self.labels, dtype=bool)
        return {"chosen": (self.chosen[y], self.n_chosen[y]), "rejected": (self.chosen[~y], self.n_chosen[~y]),
                "KL": (self.rejected, self.n_rejected)}


@dataclass
class Objective:
    """One of METHODS' losses over a batch of pairs (TRL's formulas, float64)."""

    method: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5

    def loss(self, lp: SeqLogps, ref: Optional[np.ndarray]) -> tuple[float, np.ndarray, np.ndarray, float, dict]:
        """(loss, dloss/dchosen_sum, dloss/drejected_sum, dloss/d(each chosen-sequence token's NLL),
        metrics) for a batch of pairs: the mean over its pairs, as TRL."""
        shares, d_c, d_r, nll_weight, metrics = self.terms(lp, ref)
        return float(shares.mean()), d_c, d_r, nll_weight, metrics

    def terms(self, lp: SeqLogps, ref: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float,
                                                                         dict]:
        """loss()'s, with each pair's share of the loss in place of the loss (float64 [n]: their mean
        is the loss; DPO, SimPO: each pair's loss; ORPO: each pair's NLL over the batch's tokens,
        times n, less beta x its log odds ratio): the units of the loss's standard error."""
        n, b, ls = len(lp.chosen), self.beta, self.label_smoothing
        metrics: dict = {}
        nll_weight = 0.0
        if self.method == "orpo":  # trl ORPOTrainer.odds_ratio_loss, on mean log-probabilities
            ac, ar = lp.chosen / lp.n_chosen, lp.rejected / lp.n_rejected
            log1mexp = lambda x: np.where(x < -math.log(2), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))  # noqa: E731
            log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
            ratio = _logsigmoid(log_odds)
            n_tok = lp.n_trunk + int(lp.n_chosen.sum())
            nll = (lp.trunk_nll - float(lp.chosen.sum())) / max(n_tok, 1)  # CrossEntropyLoss over prompt + chosen
            trunk = lp.trunk_rows if lp.trunk_rows is not None else np.full(n, lp.trunk_nll / n)
            shares = n * (trunk - lp.chosen) / max(n_tok, 1) - b * ratio
            d_odds = -b * _sigmoid(-log_odds) / n
            d_c = d_odds / -np.expm1(ac) / lp.n_chosen
            d_r = -d_odds / -np.expm1(ar) / lp.n_rejected
            nll_weight = 1.0 / max(n_tok, 1)
            d_c = d_c - nll_weight  # the NLL term: d nll / d chosen_sum
            rc, rr = b * ac, b * ar
            logps = ac, ar
            metrics.update({"nll_loss": nll, "log_odds_ratio": float(ratio.mean()),
                            "log_odds_chosen": float(log_odds.mean())})
        else:
            if self.method == "dpo":  # trl DPOTrainer, loss_type="sigmoid"
                if ref is None:
                    raise ValueError("DPO needs the reference log-probabilities")
                rc, rr = b * (lp.chosen - ref[:, 0]), b * (lp.rejected - ref[:, 1])
                z, dz_c, dz_r = rc - rr, b, -b
                logps = lp.chosen, lp.rejected
            elif self.method == "simpo":  # trl CPOTrainer, loss_type="simpo", cpo_alpha=0
                ac, ar = lp.chosen / lp.n_chosen, lp.rejected / lp.n_rejected
                z = b * (ac - ar) - self.gamma
                dz_c, dz_r = b / lp.n_chosen, -b / lp.n_rejected
                rc, rr = b * ac, b * ar
                logps = ac, ar
            else:
                raise ValueError(f"no preference loss for method {self.method!r}")
            shares = -(1 - ls) * _logsigmoid(z) - ls * _logsigmoid(-z)
            dz = (-(1 - ls) * _sigmoid(-z) + ls * _sigmoid(z)) / n
            d_c, d_r = dz * dz_c, dz * dz_r
        metrics = {"rewards/chosen": float(rc.mean()), "rewards/rejected": float(rr.mean()),
                   "rewards/accuracies": float((rc > rr).mean()), "rewards/margins": float((rc - rr).mean()),
                   "logps/chosen": float(logps[0].mean()), "logps/rejected": float(logps[1].mean()), **metrics}
        return (np.asarray(shares, dtype=np.float64), np.asarray(d_c, dtype=np.float64),
                np.asarray(d_r, dtype=np.float64), nll_weight, metrics)

    def token_weights(self, lp: SeqLogps, d_c, d_r, nll_weight: float, targets, parts) -> np.ndarray:
        """d loss / d token NLL for every token of the windows [n, n_ctx]: a completion token's
        log-probability adds to its sequence's sum (d NLL = -d logp); ORPO's NLL term also weighs
        the prompt tokens of the chosen sequence (d_c already holds its share on chosen tokens)."""
        w = np.zeros(parts.shape, dtype=np.float64)
        w += np.where(parts == CHOSEN, -d_c[:, None], 0.0)
        w += np.where(parts == REJECTED, -d_r[:, None], 0.0)
        if nll_weight:
            w += np.where(parts == TRUNK, nll_weight, 0.0)
        return np.where(targets >= 0, w, 0.0)


# ------------------------------------------------------------------------------------ trainer
class PreferenceTrainer(Trainer):
    """The trainer of --method dpo|orpo|simpo|kto: one pair (KTO: one example) per window (PairDataset), each step a
    forward pass for the pairs' log-probabilities, then the same micro-batch passes as any step,
    ending in every token's NLL seeded by its weight (programs.WeightedTokenNLL, the weights from
    Objective.token_weights). train_step / evaluate take the windows' layout where the packed
    trainer takes segments; step_metrics / eval_metrics hold TRL's metrics."""

    def __init__(self, model, backend, *, objective: Objective, loss=WeightedTokenNLL, **kw):
        self.objective = objective
        if kw.get("lora_dropout"):
            raise LlmtuneError("--lora-dropout: preference methods train without dropout (as TRL's disable_dropout)")
        super().__init__(model, backend, packed=True, workers=1, loss=loss, layout_inputs=_pair_inputs,
                         forward_pass=True, **kw)
        if self.comm.size > 1:
            raise LlmtuneError(f"--method {objective.method}: preference tuning runs in one process (no data parallel)")
        # OpenBLAS threads by timing, per forward pass (single-threaded beside packed base products:
        # Trainer.__init__ chose the same for the step)
        self._forward_tuner = self.blas_tuner if self.packed_products else backend.step_tuner(1)

    def token_nll(self, inputs: np.ndarray, targets: np.ndarray, layout: PairLayout) -> np.ndarray:
        """Every token's NLL under the current weights [n, n_ctx] (forward passes of n_ubatch
        tokens; a short last chunk padded with windows of padding)."""
        k, out = self.seqs_per_ubatch, []
        for s in range(0, len(inputs), k):
            x, y, parts = inputs[s : s + k], targets[s : s + k], layout.parts[s : s + k]
            n = len(x)
            if n < k:
                pad = ((0, k - n), (0, 0))
                x, y = np.pad(x, pad), np.pad(y, pad, constant_values=-1)
                parts = np.pad(parts, pad, constant_values=PAD)
            with self._forward_tuner():
                (nll,) = self.forward.run(**self.batches.feed(x, y, segments=parts))
            out.append(np.asarray(self.backend.to_numpy(nll), dtype=np.float64).reshape(k, -1)[:n])
        return np.concatenate(out)

    def _logps(self, inputs, targets, layout) -> SeqLogps:
        return SeqLogps.of(self.token_nll(inputs, targets, layout), targets, layout.parts, layout.labels)

    def train_step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, stats: RunningStats,
                   layout: PairLayout = None) -> float:
        """One optimizer step over the batch's pairs; returns the step's loss (the mean over its pairs).
        The guard reads the log-probabilities before the backward, the loss and gradient before the
        update, the weights after it (train/guard.py: a preference loss alone misses a collapse)."""
        be = self.backend
        lp = self._logps(inputs, targets, layout)
        guard.check_logps(self, lp.sequences(), lp.preferred)
        loss, d_c, d_r, nll_w, metrics = self.objective.loss(lp, layout.ref)
        weights = self.objective.token_weights(lp, d_c, d_r, nll_w, targets, layout.parts)
        per_pass = weights.reshape(self.ubatches_per_step, -1).astype(be.dtype)
        self.batches.run(inputs, targets, layout.parts, self.batches.counts(targets),
                         lambda u: {"token_weights": be.asarray(per_pass[u])}, lambda u, out: None)
        sum_squares = guard.check_step(self, loss)
        stats.add(loss, int(round(metrics["rewards/accuracies"] * len(inputs))), len(inputs))
        self.step_metrics = metrics
        self.update(lr, sum_squares)
        guard.check_weights(self)
        return loss

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray, stats: RunningStats,
                 layout: PairLayout = None) -> None:
        """The loss and metrics over the pairs at once (one batch), without gradients: each pair's
        share of the loss recorded (their mean is the loss, their spread its standard error); the
        accuracy recorded is rewards/accuracies."""
        shares, _, _, _, metrics = self.objective.terms(self._logps(inputs, targets, layout), layout.ref)
        stats.add_many(shares, int(round(metrics["rewards/accuracies"] * len(inputs))), len(inputs))
        self.eval_metrics = metrics

    def reference_logps(self, dataset: PairDataset) -> np.ndarray:
        """Every pair's (chosen, rejected) log-probability sums under the current weights: DPO's
        reference, computed before the first step (TRL's precompute_ref_log_probs); KTO's: each
        example's (completion, KL completion) log-probability sums."""
        n = len(dataset.pairs)
        out = np.zeros((n, 2), dtype=np.float64)
        chunk = max(self.seqs_per_ubatch, 1)
        for s in range(0, n, chunk):
            idx = np.arange(s, min(s + chunk, n))
            x, y, layout = dataset.gather(idx)
            lp = SeqLogps.of(self.token_nll(x, y, layout), y, layout.parts)
            out[idx, 0], out[idx, 1] = lp.chosen, lp.rejected
        return out


def _pair_inputs(hp, parts) -> dict:
    """Positions and masks of pair windows (arch/packing.py pair_inputs) from a PairLayout or its parts."""
    return pair_inputs(hp, parts.parts if isinstance(parts, PairLayout) else parts)
