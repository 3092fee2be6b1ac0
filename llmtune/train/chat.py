"""Instruction and chat data for `finetune`: rendering, loss masks, one example per window (or packed).

Records come from train/records.py (JSONL, JSON, Parquet, CSV, folders; formats detected from the
first record or named with --format):
- plain       a text file tokenized whole (what train/data.py does);
- text        {"text": ...} records, each a document;
- completion  {"prompt": ..., "completion": ...}: the text prompt + completion, BOS first (per the
              model's flag) and EOS last, as TRL's prompt-completion data;
- chat        {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}
              rendered with the model's chat template (tokenizer/chat_template.py; --chat-template
              overrides it), as transformers' apply_chat_template renders and tokenizes them;
- sharegpt    {"conversations": [{"from": "human"|"gpt"|..., "value": ...}]}: the same as chat once
              its roles are mapped (human -> user, gpt -> assistant): the gpt turns carry loss;
- alpaca      {"instruction", "input", "output", "system"}: a conversation of an optional system
              turn, one user turn (instruction, then input on the next line) and the output as the
              assistant turn, rendered with the chat template when the model has one (or
              --chat-template is given), as LLaMA-Factory renders Alpaca data; a model without one
              gets the Stanford Alpaca prompt (axolotl's `alpaca` type) as a prompt/completion
              pair. Either way only the output (and its end-of-turn token or EOS) carries loss.

Loss mask: by default only the completion, or every assistant turn's content and the end-of-turn
token after it (<|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, EOS...), carry loss; the prompt,
system and user turns and the template's scaffolding do not (train_on_prompt: every token does).
An assistant turn is found in the rendered text by walking the user and assistant messages in
order (each one's content searched after the previous one's), which works whatever a template
inserts between turns; character spans become token spans by tokenizing the text before each
boundary (a token straddling a boundary counts on the later side at a start, the earlier at an end).

Windows: by default one example per window of ctx + 1 tokens: the example at the start, its targets
after, then padding whose targets are -1 (no loss). Attention is causal, so an example never sees
the padding after it, and no example ever attends to another one; no position or mask machinery is
needed, at the price of the padding's compute. With --pack (PackedDataset) several examples share a
window, each attending only to itself with positions restarting at 0 (arch/packing.py), so the loss
and gradients are the same and the padding mostly goes. An example longer than the window is
truncated to its first ctx + 1 tokens (counted and reported); one left with no loss-carrying token is
dropped (counted). A val_split of the examples validate (the last ones, or with --val-pick random a
sample drawn with --seed: train/data.py's Holdout); training windows are shuffled each epoch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.tokenizer.chat_template import TEMPLATE_KEY, ChatTemplate, ChatTemplateError, encode, eog_ids
from llmtune.train.data import Holdout, TrainValSplit, WindowDataset, tokenize_documents
from llmtune.train.records import FORMATS, Records, read_records  # noqa: F401 - the data-reading half


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

        self.tok, self.template, self.train_on_prompt = tokenizer, template, train_on_prompt
        texts = tokenizer.tokens
        markers = {texts[i] for i in eog_ids(tokenizer)}
        self.end_markers = sorted((m for m in markers if m), key=len, reverse=True)

    def completion(self, prompt: str, completion: str) -> Example:
        tok = self.tok
        full = tok.encode(prompt + completion, add_special=True)
        if tok.eos_id is not None and (not full or full[-1] != tok.eos_id):
            full = full + [tok.eos_id]
        n_prompt = _common_prefix(prompt_ids(tok, prompt), full)
        loss = np.zeros(len(full), dtype=bool)
        loss[max(n_prompt, 1):] = True
        return self._example(full, loss)

    def alpaca(self, system, instruction: str, extra, output: str, where: str) -> Example:
        """An Alpaca record: through the chat template when there is one (the user turn: the
        instruction, then the input on the next line, as LLaMA-Factory), else the Alpaca prompt."""
        if self.template is not None:
            return self.chat(user_turns(system, instruction, extra) + [{"role": "assistant", "content": output}],
                             where)
        return self.completion(alpaca_prompt(system, instruction, extra), output)

    def chat(self, messages: list[dict], where: str) -> Example:

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
                if m["role"] != "assistant":
                    continue  # a template may rewrite user / tool text; the assistant turns still anchor
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


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids as an example starts with them: BOS per the model's flags, no EOS
    (its completion follows)."""
    ids = list(tokenizer.encode(text, add_special=True))
    if tokenizer.add_eos and ids and ids[-1] == tokenizer.eos_id:
        ids.pop()
    return ids


def user_turns(system, instruction: str, extra=None) -> list[dict]:
    """An instruction as the turns before the answer (LLaMA-Factory's Alpaca): the system turn when
    there is one, then the user turn: the instruction, and the input on the next line."""
    user = instruction if extra is None else f"{instruction}\n{extra}"
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def sample_prompt(tokenizer, template, fmt: str, text: str) -> tuple[list[int], bool]:
    """(token ids, whether they ask for an answer) of finetune's --sample-prompt `text`, rendered as
    training renders the prompts of `fmt` data, so the sample shows what the model learns to answer:
    with a chat template, a user turn and the generation prompt (chat data, Alpaca data with a
    template, conversational pairs); Alpaca data without one, the Alpaca prompt of `text` as the
    instruction; any other data, `text` as a prompt to continue."""
    if template is not None:
        return encode(tokenizer, template.render(user_turns(None, text), add_generation_prompt=True)), True
    if fmt == "alpaca":
        return prompt_ids(tokenizer, alpaca_prompt(None, text)), True
    return prompt_ids(tokenizer, text), False


def alpaca_prompt(system, instruction: str, extra=None) -> str:
    """The Stanford Alpaca prompt (tatsu-lab/stanford_alpaca's PROMPT_DICT, axolotl's `alpaca`):
    its preamble (or the record's system text), the instruction and input, then "### Response:"."""
    if extra is not None:
        preamble = system or ("Below is an instruction that describes a task, paired with an input that provides "
                              "further context. Write a response that appropriately completes the request.")
        return f"{preamble}\n\n### Instruction:\n{instruction}\n\n### Input:\n{extra}\n\n### Response:\n"
    preamble = system or ("Below is an instruction that describes a task. "
                          "Write a response that appropriately completes the request.")
    return f"{preamble}\n\n### Instruction:\n{instruction}\n\n### Response:\n"


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
    def build(cls, examples: list[Example], n_ctx: int, val_split, pad_id: int, source: str = "data",
              fmt: str = "chat") -> "ExampleDataset":
        """val_split: a train/data.py Holdout, or the fraction of examples (the last ones) that validate."""
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
        kept, n_train, n_val = Holdout.of(val_split).arrange(kept, source, "example(s)")
        return cls(kept, n_ctx, int(pad_id), n_train, n_val, truncated, dropped, fmt)

    @property
    def tokens(self) -> int:
        return int(sum(len(ex.ids) for ex in self.examples))

    def gather(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(inputs [n, n_ctx], targets [n, n_ctx]); targets -1 where no loss (prompt, padding)."""
        x, y, _ = self._rows([[i] for i in indices])
        return x, y

    def _rows(self, windows: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, segments) [len(windows), n_ctx] of windows of examples laid back to
        back: example s of a window is segment s, the padding after them segment len(window)."""
        x = np.full((len(windows), self.n_ctx), self.pad_id, dtype=np.int32)
        y = np.full((len(windows), self.n_ctx), -1, dtype=np.int32)
        seg = np.empty((len(windows), self.n_ctx), dtype=np.int32)
        for r, window in enumerate(windows):
            at = 0
            for s, i in enumerate(window):
                ex = self.examples[i]
                n = len(ex.ids) - 1
                x[r, at : at + n] = ex.ids[:-1]
                y[r, at : at + n] = np.where(ex.loss[1:], ex.ids[1:], -1)
                seg[r, at : at + n] = s
                at += n
            seg[r, at:] = len(window)
        return x, y, seg

    def loss_tokens(self, indices) -> int:
        return int(sum(int(self.examples[i].loss[1:].sum()) for i in indices))

    def slots(self, indices) -> int:
        """Input slots the examples take in windows (each example of n tokens: n - 1)."""
        return int(sum(len(self.examples[i].ids) - 1 for i in indices))

    def padding(self, indices) -> float:
        """The share of the windows' input slots that are padding, one example per window."""
        indices = list(indices)
        return 1.0 - self.slots(indices) / max(len(indices) * self.n_ctx, 1)


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to at most `capacity`: best-fit decreasing (TRL's
    pack_dataset strategy "bfd"): longest first, each into the fullest bin it fits in. Bins are
    ordered by their first item, items within a bin by index (file order)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = bisect.bisect_left(free, (lengths[i], -1))
        if j == len(free):
            bins.append([])
            room, b = capacity, len(bins) - 1
        else:
            room, b = free.pop(j)
        bins[b].append(i)
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], b))
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


@dataclass
class PackedDataset(TrainValSplit):
    """--pack: the examples of an ExampleDataset several to a window (pack_lengths over the input
    slots each takes, len(ids) - 1), training examples into the training windows and validation
    ones into the validation windows. Packed once; the windows are shuffled each epoch. gather also
    returns each window's segments, from which the trainer makes the positions (restarting at every
    example) and the block-diagonal causal masks (arch/packing.py): every example's loss and
    gradient are those it has in a window of its own."""

    source: ExampleDataset
    windows: list  # example indices of each window, the training windows first
    n_train: int
    n_val: int

    @classmethod
    def build(cls, source: ExampleDataset) -> "PackedDataset":
        windows = []
        for part in (range(source.n_train), range(source.n_train, source.n_train + source.n_val)):
            bins = pack_lengths([len(source.examples[i].ids) - 1 for i in part], source.n_ctx)
            windows.append([[part[j] for j in b] for b in bins])
        return cls(source, windows[0] + windows[1], len(windows[0]), len(windows[1]))

    n_ctx = property(lambda self: self.source.n_ctx)
    format = property(lambda self: self.source.format)
    template = property(lambda self: self.source.template)  # what --sample-prompt renders with
    tokens = property(lambda self: self.source.tokens)

    def gather(self, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, segments) [n, n_ctx] of windows `indices`."""
        return self.source._rows([self.windows[i] for i in indices])

    def examples_of(self, indices) -> list[int]:
        return [i for w in indices for i in self.windows[w]]

    def loss_tokens(self, indices) -> int:
        return self.source.loss_tokens(self.examples_of(indices))

    def padding(self, indices) -> float:
        """The share of the windows' input slots that are padding."""
        indices = list(indices)
        return 1.0 - self.source.slots(self.examples_of(indices)) / max(len(indices) * self.n_ctx, 1)


def pad_token(tokenizer) -> int:
    """The id padding inputs use (never a target): PAD, else EOS, else 0."""
    for i in (tokenizer.pad_id, tokenizer.eos_id):
        if i is not None and 0 <= i < tokenizer.n_vocab:
            return int(i)
    return 0


# ------------------------------------------------------------------------------------ entry
def build_dataset(model, data_path, ctx: int, val_split, fmt: str = "auto", chat_template=None,
                  train_on_prompt: bool = False, pack: bool = False):
    """(dataset, n_tokens) for finetune: plain text and {"text"} records as train/data.py's
    overlapping windows (every token carries loss), completion, chat, sharegpt and alpaca records
    one example per window with their loss masks, or several per window with `pack`. val_split:
    a train/data.py Holdout (--val-split, --val-pick), or the fraction that validates (the last)."""

    records = read_records(data_path, fmt)
    if records.format == "preference":
        raise LlmtuneError(f"{data_path}: preference pairs (prompt, chosen, rejected): train them with "
                           f"--method dpo, orpo or simpo")
    if records.format == "unpaired":
        raise LlmtuneError(f"{data_path}: unpaired preference records (prompt, completion, label): train them with "
                           f"--method kto")
    if records.format == "prompt":
        raise LlmtuneError(f"--format prompt: {data_path}'s prompts (no completions) train with --method grpo")
    if records.format in ("plain", "text"):
        if train_on_prompt:
            raise LlmtuneError("--train-on-prompt: only prompt/completion and chat data (chat, sharegpt, alpaca) "
                               "have a prompt to mask")
        if pack:
            raise LlmtuneError(f"--pack: {data_path} holds {records.format} data, cut into full windows already; "
                               f"--pack is for prompt/completion and chat records")
        if chat_template is not None:
            raise LlmtuneError(f"--chat-template: {data_path} holds {records.format} data, not conversations")
        tokens = tokenize_documents(model.tokenizer, records.items, records.format == "text")
        return WindowDataset.build(tokens, ctx, val_split, source=str(data_path)), len(tokens)
    template = _template(model, records, data_path, chat_template)
    builder = ExampleBuilder(model.tokenizer, template, train_on_prompt)
    examples = []
    for item, where in zip(records.items, records.wheres):
        if records.format == "completion":
            examples.append(builder.completion(*item))
        elif records.format == "alpaca":
            examples.append(builder.alpaca(*item, where))
        else:
            examples.append(builder.chat(item, where))
    ds = ExampleDataset.build(examples, ctx, val_split, pad_token(model.tokenizer), str(data_path), records.format)
    ds.template = template
    return (PackedDataset.build(ds) if pack else ds), ds.tokens


def _template(model, records: Records, data_path, override):
    """The chat template the records render with: conversations need one (the model's or
    --chat-template's), Alpaca records use it when there is one, prompt/completion records never."""

    if records.format == "completion":
        if override is not None:
            raise LlmtuneError(f"--chat-template: {data_path} holds prompt/completion records, not conversations")
        return None
    if records.format == "alpaca" and override is None and not model.gguf.metadata.get(TEMPLATE_KEY):
        return None  # the Alpaca prompt (alpaca_prompt)
    return ChatTemplate.for_model(model.gguf, model.tokenizer, override)


def data_info(ds, seqs_per_epoch: int) -> dict:
    """What finetune's start report says about the data: its format, the tokens that carry loss
    in an epoch (windows or examples not filling a last batch wait for the next epoch) and, for
    examples, how they fill the windows (examples per window, the padding left)."""
    if hasattr(ds, "info"):  # a dataset that reports itself (train/preference.py's pairs)
        return ds.info(seqs_per_epoch)
    if not isinstance(ds, (ExampleDataset, PackedDataset)):
        return {"format": "text", "loss_tokens_per_epoch": seqs_per_epoch * ds.n_ctx, "left_out": ds.n_left_out}
    examples = ds.source if isinstance(ds, PackedDataset) else ds
    train = ds.loss_tokens(range(ds.n_train))
    return {"format": ds.format, "examples": examples.n_train + examples.n_val, "truncated": examples.n_truncated,
            "dropped": examples.n_dropped, "loss_tokens": train,
            "loss_tokens_per_epoch": int(round(train * seqs_per_epoch / max(ds.n_train, 1))),
            "packed": isinstance(ds, PackedDataset), "windows": ds.n_train + ds.n_val,
            "per_window": (examples.n_train + examples.n_val) / max(ds.n_train + ds.n_val, 1),
            "padding": ds.padding(range(ds.n_train))}
