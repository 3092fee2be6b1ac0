"""Training data: documents (read by train/chat.py) -> token ids -> windows of n_ctx+1 tokens (llama.cpp's
common_opt_dataset_init: stride n_ctx/2, inputs = window[:-1], targets = window[1:])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError


def tokenize_documents(tokenizer, docs: list[str], jsonl: bool) -> np.ndarray:
    """Plain text: tokenized whole, BOS first. JSONL: each record its own document with BOS/EOS
    per the model's flags (EOS always closes a record so documents stay apart), concatenated."""
    if not jsonl:
        return np.asarray(tokenizer.encode(docs[0], add_special=True), dtype=np.int32)
    parts = []
    for doc in docs:
        ids = tokenizer.encode(doc, add_special=True)
        if tokenizer.eos_id is not None and tokenizer.eos_id >= 0 and (not ids or ids[-1] != tokenizer.eos_id):
            ids = list(ids) + [tokenizer.eos_id]
        parts.append(np.asarray(ids, dtype=np.int32))
    return np.concatenate(parts)


def held_out(n: int, val_split: float, source: str, what: str) -> int:
    """How many of n items validate: the rounded share, at least one when a split is asked for and
    there are two; at least one must train (one line naming `source` otherwise)."""
    n_val = int(round(n * val_split)) if val_split > 0 else 0
    if val_split > 0 and n_val == 0 and n >= 2:
        n_val = 1
    if n - n_val < 1:
        raise LlmtuneError(f"{source}: only {n} {what}: too few for a validation split")
    return n_val


VAL_PICKS = ("last", "random")
VAL_STREAM = 1  # the spawn key of --val-pick random's generator: a stream apart from the epoch orders' [seed, epoch]


@dataclass(frozen=True)
class Holdout:
    """--val-split and --val-pick: which of a dataset's n items validate. `last`: the last ones (what
    llama.cpp's finetune does). `random`: a sample drawn with --seed from a generator of its own
    (np.random.default_rng(SeedSequence(seed, spawn_key=(VAL_STREAM,)))), so a resumed run and every
    MPI rank, which build the dataset from the same file and settings, draw the same items."""

    fraction: float = 0.0
    pick: str = "last"
    seed: int = 0

    @classmethod
    def of(cls, val_split) -> "Holdout":
        """A Holdout, or a bare --val-split fraction (the last items)."""
        return val_split if isinstance(val_split, Holdout) else cls(float(val_split))

    def split(self, n: int, source: str, what: str, overlapping: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(the training items, the validation items), each in file order. `overlapping`: item i
        shares tokens with items i - 1 and i + 1 (text windows every ctx / 2 tokens), so a random
        pick leaves those neighbours out of training, lest every validation token be trained on."""
        n_val = held_out(n, self.fraction, source, what)
        if self.pick == "last" or n_val == 0:
            return np.arange(n - n_val), np.arange(n - n_val, n)
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(VAL_STREAM,)))
        val = np.sort(rng.choice(n, n_val, replace=False))
        taken = np.zeros(n, dtype=bool)
        taken[val] = True
        if overlapping:
            taken[np.maximum(val - 1, 0)] = taken[np.minimum(val + 1, n - 1)] = True
        train = np.flatnonzero(~taken)
        if not len(train):
            raise LlmtuneError(f"{source}: only {n} {what}: too few for a random validation split that leaves "
                               f"the windows overlapping it out of training (lower --val-split, or --val-pick last)")
        return train, val

    def arrange(self, items: list, source: str, what: str) -> tuple[list, int, int]:
        """(`items` with the training ones first and the validation ones after, each in file order,
        n_train, n_val): the layout TrainValSplit reads, for datasets of separate items."""
        train, val = self.split(len(items), source, what)
        return [items[i] for i in train] + [items[i] for i in val], len(train), len(val)


class TrainValSplit:
    """What every finetune dataset shares: items 0..n_train-1 train (in a per-epoch order), the
    n_val after them validate (a dataset built with --val-pick random puts its drawn items there,
    Holdout.arrange). Subclasses are dataclasses with n_train and n_val fields."""

    n_train: int
    n_val: int

    def train_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        order = np.arange(self.n_train)
        if shuffle:
            np.random.default_rng([seed, epoch]).shuffle(order)
        return order

    def val_indices(self) -> np.ndarray:
        return np.arange(self.n_train, self.n_train + self.n_val)


@dataclass
class WindowDataset(TrainValSplit):
    """Windows of n_ctx+1 tokens starting every `stride` tokens; a `val_split` of them validate
    (Holdout: the last ones, or a random sample whose overlapping neighbours then do not train).
    Window i of the dataset starts at token starts[i]: the training windows first, then the
    validation ones, each in file order (None: window i starts at i * stride, nothing reordered)."""

    tokens: np.ndarray
    n_ctx: int
    stride: int
    n_train: int
    n_val: int
    starts: Optional[np.ndarray] = None
    n_left_out: int = 0  # --val-pick random: training windows overlapping a validation window

    @classmethod
    def build(cls, tokens: np.ndarray, n_ctx: int, val_split, source: str = "data") -> "WindowDataset":
        """val_split: a Holdout, or the fraction of windows (the last ones) that validate."""
        stride = max(n_ctx // 2, 1)
        n_windows = (len(tokens) - (n_ctx + 1)) // stride + 1 if len(tokens) >= n_ctx + 1 else 0
        if n_windows < 1:
            raise LlmtuneError(
                f"{source}: {len(tokens)} tokens is shorter than one training window of {n_ctx + 1} (lower --ctx)"
            )
        holdout = Holdout.of(val_split)
        train, val = holdout.split(n_windows, source, f"{'window' if n_windows == 1 else 'windows'} of "
                                   f"{n_ctx + 1} tokens", overlapping=True)
        starts = None if holdout.pick == "last" else np.concatenate([train, val]) * stride
        return cls(np.asarray(tokens, dtype=np.int32), n_ctx, stride, len(train), len(val), starts,
                   n_windows - len(train) - len(val))

    def window(self, i: int) -> np.ndarray:
        start = i * self.stride if self.starts is None else int(self.starts[i])
        return self.tokens[start : start + self.n_ctx + 1]

    def gather(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(inputs [n, n_ctx], targets [n, n_ctx]) for window indices."""
        w = np.stack([self.window(i) for i in indices])
        return w[:, :-1], w[:, 1:]
