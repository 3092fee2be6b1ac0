"""Instruction and chat data for `finetune`: formats, rendering, loss masks, one example per window.

Formats (detected per file from its first record, or forced with --format):
- plain       a text file tokenized whole (what train/data.py does);
- text        JSONL records {"text": ...};
- completion  JSONL records {"prompt": ..., "completion": ...}: the text prompt + completion,
              BOS first (per the model's flag) and EOS last, as TRL's prompt-completion data;
- chat        JSONL records {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
              rendered with the model's chat template (tokenizer/chat_template.py; --chat-template
              overrides it), as transformers' apply_chat_template renders and tokenizes them.

Loss mask: by default only the completion, or every assistant turn's content and the end-of-turn
token after it (<|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, EOS...), carry loss; the prompt,
system and user turns and the template's scaffolding do not (train_on_prompt: every token does).
An assistant turn is found in the rendered text by walking the user and assistant messages in
order (each one's content searched after the previous one's), which works whatever a template
inserts between turns; character spans become token spans by tokenizing the text before each
boundary (a token straddling a boundary counts on the later side at a start, the earlier at an end).

Windows: one example per window of ctx + 1 tokens, never packed: the example at the start, its
targets after, then padding whose targets are -1 (no loss). Attention is causal, so an example
never sees the padding after it, and no example ever attends to another one; no position or mask
machinery is needed, at the price of the padding's compute (choose --ctx near your longest
examples). An example longer than the window is truncated to its first ctx + 1 tokens (counted and
reported); one left with no loss-carrying token is dropped (counted). The last val_split of the
examples validate; training examples are shuffled each epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.train.data import TrainValSplit

FORMATS = ("auto", "plain", "text", "completion", "chat")
ROLES = ("system", "user", "assistant")


# ------------------------------------------------------------------------------------ reading
@dataclass
class Records:
    """The records of a JSONL file (or the text of a plain file) and their format."""

    path: Path
    format: str
    items: list = field(default_factory=list)  # str (plain/text) | (prompt, completion) | messages
    lines: list = field(default_factory=list)  # 1-based line of each item


def _record_format(record: dict) -> Optional[str]:
    if "messages" in record:
        return "chat"
    if "prompt" in record or "completion" in record:
        return "completion"
    if "text" in record:
        return "text"
    return None


def read_records(path, fmt: str = "auto") -> Records:
    """The file's records in one format; every problem is one line naming the file and line."""
    from llmtune.tokenizer import json_why, read_text, require_text

    path = Path(path)
    if fmt not in FORMATS:
        raise LlmtuneError(f"--format: unknown format {fmt!r} (choose {', '.join(FORMATS)})")
    text = require_text(read_text(path), path)  # the words perplexity uses too
    is_jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    if fmt == "plain" or (fmt == "auto" and not is_jsonl):
        return Records(path, "plain", [text], [1])
    out = Records(path, fmt)
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LlmtuneError(f"{path}:{lineno}: invalid JSON ({json_why(exc)})") from None
        if not isinstance(record, dict):
            raise LlmtuneError(f"{path}:{lineno}: a record must be a JSON object")
        kind = _record_format(record)
        if out.format == "auto":
            if kind is None:
                raise LlmtuneError(f"{path}:{lineno}: record has none of \"text\", \"prompt\"/\"completion\", \"messages\"")
            out.format = kind
        out.items.append(_parse(record, out.format, path, lineno))
        out.lines.append(lineno)
    if not out.items:
        raise LlmtuneError(f"{path}: no records")
    return out


def _string(record: dict, key: str, path, lineno: int, what: str = "") -> str:
    if key not in record:
        raise LlmtuneError(f"{path}:{lineno}: {what}record has no \"{key}\" field")
    value = record[key]
    if not isinstance(value, str):
        raise LlmtuneError(f"{path}:{lineno}: {what}\"{key}\" must be a string")
    return value


def _parse(record: dict, fmt: str, path, lineno: int):
    if fmt == "text":
        return _string(record, "text", path, lineno)
    if fmt == "completion":
        return _string(record, "prompt", path, lineno), _string(record, "completion", path, lineno)
    messages = record.get("messages")
    if "messages" not in record:
        raise LlmtuneError(f"{path}:{lineno}: record has no \"messages\" field")
    if not isinstance(messages, list) or not messages:
        raise LlmtuneError(f"{path}:{lineno}: \"messages\" must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        what = f"message {i + 1}: "
        if not isinstance(m, dict):
            raise LlmtuneError(f"{path}:{lineno}: {what}must be an object with \"role\" and \"content\"")
        role = _string(m, "role", path, lineno, what)
        if role not in ROLES:
            raise LlmtuneError(f"{path}:{lineno}: {what}unknown role {role!r} (use {', '.join(ROLES)})")
        clean.append({**m, "role": role, "content": _string(m, "content", path, lineno, what)})
    if not any(m["role"] == "assistant" for m in clean):
        raise LlmtuneError(f"{path}:{lineno}: the conversation has no assistant turn (nothing to learn)")
    return clean


# ------------------------------------------------------------------------------------ examples
@dataclass
class Example:
    ids: np.ndarray  # int32 [n]
    loss: np.ndarray  # bool [n]: token i is a target that carries loss (i >= 1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ExampleBuilder:
    """Token ids and loss masks of records, for one tokenizer (and chat template)."""

    def __init__(self, tokenizer, template=None, train_on_prompt: bool = False):
        from llmtune.tokenizer.chat_template import eog_ids

        self.tok, self.template, self.train_on_prompt = tokenizer, template, train_on_prompt
        texts = tokenizer.tokens
        markers = {texts[i] for i in eog_ids(tokenizer)}
        self.end_markers = sorted((m for m in markers if m), key=len, reverse=True)

    def completion(self, prompt: str, completion: str) -> Example:
        tok = self.tok
        full = tok.encode(prompt + completion, add_special=True)
        if tok.eos_id is not None and (not full or full[-1] != tok.eos_id):
            full = full + [tok.eos_id]
        n_prompt = _common_prefix(tok.encode(prompt, add_special=True), full)
        loss = np.zeros(len(full), dtype=bool)
        loss[max(n_prompt, 1):] = True
        return self._example(full, loss)

    def chat(self, messages: list[dict], where: str) -> Example:
        from llmtune.tokenizer.chat_template import ChatTemplateError, encode

        try:
            text = self.template.render(messages, add_generation_prompt=False)
        except ChatTemplateError as exc:
            raise LlmtuneError(f"{where}: {exc}") from None
        ids = encode(self.tok, text)
        loss = np.zeros(len(ids), dtype=bool)
        for start, end in self._assistant_spans(text, messages, where):
            a = _common_prefix(encode(self.tok, text[:start]), ids)
            b = _common_prefix(encode(self.tok, text[:end]), ids)
            loss[max(a, 1):b] = True
        return self._example(ids, loss)

    def _assistant_spans(self, text: str, messages: list[dict], where: str) -> list[tuple[int, int]]:
        """Character spans of each assistant turn's content and the end-of-turn marker after it."""
        spans, cursor = [], 0
        for n, m in enumerate(messages, 1):
            if m["role"] == "system":  # templates may move it (Mistral: into the last user turn)
                continue
            content = m["content"].strip()
            at = text.find(content, cursor) if content else cursor
            if at < 0:
                if m["role"] == "user":
                    continue  # a template may rewrite user text; the assistant turns still anchor
                raise LlmtuneError(f"{where}: message {n} (assistant) does not appear in the chat template's "
                                   f"rendering of the conversation, so its tokens cannot be masked")
            end = at + len(content)
            cursor = end
            if m["role"] != "assistant":
                continue
            rest = text[end:]
            stripped = rest.lstrip()
            for marker in self.end_markers:
                if stripped.startswith(marker):
                    end += len(rest) - len(stripped) + len(marker)
                    break
            spans.append((at, end))
            cursor = end
        return spans

    def _example(self, ids, loss) -> Example:
        ids = np.asarray(ids, dtype=np.int32)
        loss = np.asarray(loss, dtype=bool)
        if self.train_on_prompt:
            loss = np.ones(len(ids), dtype=bool)
        if len(loss):
            loss[0] = False  # the first token is never a target
        return Example(ids, loss)


# ------------------------------------------------------------------------------------ dataset
@dataclass
class ExampleDataset(TrainValSplit):
    """One example per window of n_ctx + 1 tokens (see the module docstring). Same interface as
    train/data.py's WindowDataset: gather, train_order, val_indices, n_train, n_val."""

    examples: list
    n_ctx: int
    pad_id: int
    n_train: int
    n_val: int
    n_truncated: int = 0
    n_dropped: int = 0
    format: str = "chat"
    template: object = None  # the chat template the examples were rendered with (chat data)

    @classmethod
    def build(cls, examples: list[Example], n_ctx: int, val_split: float, pad_id: int, source: str = "data",
              fmt: str = "chat") -> "ExampleDataset":
        kept, truncated, dropped = [], 0, 0
        for ex in examples:
            if len(ex.ids) > n_ctx + 1:
                truncated += 1
                ex = Example(ex.ids[: n_ctx + 1], ex.loss[: n_ctx + 1])
            if len(ex.ids) < 2 or not ex.loss[1:].any():
                dropped += 1
                continue
            kept.append(ex)
        if not kept:
            raise LlmtuneError(f"{source}: no example has a loss-carrying token within --ctx {n_ctx} "
                               f"({truncated} truncated, {dropped} dropped): raise --ctx")
        n = len(kept)
        n_val = int(round(n * val_split)) if val_split > 0 else 0
        if val_split > 0 and n_val == 0 and n >= 2:
            n_val = 1
        if n - n_val < 1:
            raise LlmtuneError(f"{source}: only {n} example(s): too few for a validation split")
        return cls(kept, n_ctx, int(pad_id), n - n_val, n_val, truncated, dropped, fmt)

    @property
    def tokens(self) -> int:
        return int(sum(len(ex.ids) for ex in self.examples))

    def gather(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(inputs [n, n_ctx], targets [n, n_ctx]); targets -1 where no loss (prompt, padding)."""
        indices = list(indices)
        x = np.full((len(indices), self.n_ctx), self.pad_id, dtype=np.int32)
        y = np.full((len(indices), self.n_ctx), -1, dtype=np.int32)
        for r, i in enumerate(indices):
            ex = self.examples[i]
            n = len(ex.ids) - 1
            x[r, :n] = ex.ids[:-1]
            y[r, :n] = np.where(ex.loss[1:], ex.ids[1:], -1)
        return x, y

    def loss_tokens(self, indices) -> int:
        return int(sum(int(self.examples[i].loss[1:].sum()) for i in indices))


def pad_token(tokenizer) -> int:
    """The id padding inputs use (never a target): PAD, else EOS, else 0."""
    for i in (tokenizer.pad_id, tokenizer.eos_id):
        if i is not None and 0 <= i < tokenizer.n_vocab:
            return int(i)
    return 0


# ------------------------------------------------------------------------------------ entry
def build_dataset(model, data_path, ctx: int, val_split: float, fmt: str = "auto", chat_template=None,
                  train_on_prompt: bool = False):
    """(dataset, n_tokens) for finetune: plain text and {"text"} records as train/data.py's
    overlapping windows (every token carries loss), completion and chat records one example per
    window with their loss masks."""
    from llmtune.train.data import WindowDataset, tokenize_documents

    records = read_records(data_path, fmt)
    if records.format in ("plain", "text"):
        if train_on_prompt:
            raise LlmtuneError("--train-on-prompt: only prompt/completion and chat data have a prompt to mask")
        if chat_template is not None:
            raise LlmtuneError(f"--chat-template: {data_path} holds {records.format} data, not conversations")
        tokens = tokenize_documents(model.tokenizer, records.items, records.format == "text")
        return WindowDataset.build(tokens, ctx, val_split, source=str(data_path)), len(tokens)
    template = None
    if records.format == "chat":
        from llmtune.tokenizer.chat_template import ChatTemplate

        template = ChatTemplate.for_model(model.gguf, model.tokenizer, chat_template)
    elif chat_template is not None:
        raise LlmtuneError(f"--chat-template: {data_path} holds prompt/completion records, not conversations")
    builder = ExampleBuilder(model.tokenizer, template, train_on_prompt)
    examples = []
    for item, line in zip(records.items, records.lines):
        if records.format == "completion":
            examples.append(builder.completion(*item))
        else:
            examples.append(builder.chat(item, f"{data_path}:{line}"))
    ds = ExampleDataset.build(examples, ctx, val_split, pad_token(model.tokenizer), str(data_path), records.format)
    ds.template = template
    return ds, ds.tokens


def data_info(ds, seqs_per_epoch: int) -> dict:
    """What finetune's start report says about the data: its format and the tokens that carry
    loss in an epoch (windows or examples not filling a last batch wait for the next epoch)."""
    if not isinstance(ds, ExampleDataset):
        return {"format": "text", "loss_tokens_per_epoch": seqs_per_epoch * ds.n_ctx}
    train = ds.loss_tokens(range(ds.n_train))
    return {"format": ds.format, "examples": ds.n_train + ds.n_val, "truncated": ds.n_truncated,
            "dropped": ds.n_dropped, "loss_tokens": train,
            "loss_tokens_per_epoch": int(round(train * seqs_per_epoch / max(ds.n_train, 1)))}
