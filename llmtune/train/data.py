"""Training data: documents (read by train/chat.py) -> token ids -> windows of n_ctx+1 tokens (llama.cpp's
common_opt_dataset_init: stride n_ctx/2, inputs = window[:-1], targets = window[1:])."""

from __future__ import annotations

from dataclasses import dataclass

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
    """How many of n items (the last ones) validate: the rounded share, at least one when a split is
    asked for and there are two; at least one must train (one line naming `source` otherwise)."""
    n_val = int(round(n * val_split)) if val_split > 0 else 0
    if val_split > 0 and n_val == 0 and n >= 2:
        n_val = 1
    if n - n_val < 1:
        raise LlmtuneError(f"{source}: only {n} {what}: too few for a validation split")
    return n_val


class TrainValSplit:
    """What every finetune dataset shares: items 0..n_train-1 train (in a per-epoch order), the
    n_val after them validate. Subclasses are dataclasses with n_train and n_val fields."""

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
    """Windows of n_ctx+1 tokens starting every `stride` tokens; the last `val_split` of them validate."""

    tokens: np.ndarray
    n_ctx: int
    stride: int
    n_train: int
    n_val: int

    @classmethod
    def build(cls, tokens: np.ndarray, n_ctx: int, val_split: float, source: str = "data") -> "WindowDataset":
        stride = max(n_ctx // 2, 1)
        n_windows = (len(tokens) - (n_ctx + 1)) // stride + 1 if len(tokens) >= n_ctx + 1 else 0
        if n_windows < 1:
            raise LlmtuneError(
                f"{source}: {len(tokens)} tokens is shorter than one training window of {n_ctx + 1} (lower --ctx)"
            )
        n_val = held_out(n_windows, val_split, source,
                         f"{'window' if n_windows == 1 else 'windows'} of {n_ctx + 1} tokens")
        return cls(np.asarray(tokens, dtype=np.int32), n_ctx, stride, n_windows - n_val, n_val)

    def window(self, i: int) -> np.ndarray:
        start = i * self.stride
        return self.tokens[start : start + self.n_ctx + 1]

    def gather(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(inputs [n, n_ctx], targets [n, n_ctx]) for window indices."""
        w = np.stack([self.window(i) for i in indices])
        return w[:, :-1], w[:, 1:]
