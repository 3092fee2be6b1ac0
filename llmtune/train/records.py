"""Training records for `finetune`: files (JSONL, JSON, Parquet, CSV, a folder of them, or plain
text) read into one record format, each record checked and normalised for train/chat.py.

Files (by suffix, read through a .gz: chat.jsonl.gz is JSONL; anything else is a plain text file,
with a warning when its lines look like JSON records; a leading UTF-8 byte-order mark is dropped):
- .jsonl / .ndjson  one JSON object per line (a record names its file and line: FILE:LINE);
- .json             an array of objects, or an object holding one array (FILE: record N), never
                    plain text;
- .parquet          rows as records (pyarrow, an optional extra: pip install pyarrow), nested
                    lists of messages included, as Hugging Face datasets ship them;
- .csv              rows as records (the stdlib csv module, header row = keys); a "messages" or
                    "conversations" cell holds the JSON list;
- a folder          its .jsonl/.ndjson/.json/.parquet/.csv files in name order, one format.

Record formats (detected from the first record, or named with --format):
- text        {"text"}
- completion  {"prompt", "completion"}
- chat        {"messages": [{"role": system|user|assistant|tool, "content"}, ...]} (OpenAI/HF)
- sharegpt    {"conversations" (or "messages"): [{"from": human|gpt|system|user|assistant|tool,
              "value"}, ...]}: roles mapped to chat's (human -> user, gpt -> assistant)
- alpaca      {"instruction", "input" (optional), "output", "system" (optional)}: kept as
              (system, instruction, input, output); train/chat.py renders it.
- preference  {"prompt", "chosen", "rejected"} (TRL's preference data, for --method dpo|orpo|simpo):
              plain strings, or conversational: "prompt" a message list, "chosen" and "rejected"
              assistant message lists; kept as (prompt, chosen, rejected); train/preference.py
              renders and tokenizes them.
- unpaired    {"prompt", "completion", "label": true|false} (TRL's unpaired preference data, for
              --method kto): plain strings, or a prompt message list with a "completion" assistant
              message list; kept as (prompt, completion, label); train/kto.py tokenizes them.
- prompt      {"prompt", <other columns>} (TRL's prompt-only data, for --method grpo; never detected:
              --method grpo reads its data so): "prompt" a string or a message list, the other
              columns kept for the rewards; kept as (prompt, columns); train/grpo.py renders them.
"""

from __future__ import annotations

import csv
import io
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from llmtune.errors import LlmtuneError, LlmtuneWarning
from llmtune.tokenizer import data_suffix, json_why, read_bytes, read_text, require_text

FORMATS = ("auto", "plain", "text", "completion", "chat", "sharegpt", "alpaca", "preference", "unpaired", "prompt")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool"}
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SHAPES = ('text {"text"}, completion {"prompt", "completion"}, chat {"messages": [{"role", "content"}]}, '
          'sharegpt {"conversations": [{"from", "value"}]}, alpaca {"instruction", "input", "output"}, '
          'preference {"prompt", "chosen", "rejected"}, unpaired {"prompt", "completion", "label"}')


@dataclass
class Records:
    """The records of a data file or folder (or the text of a plain file) in one format."""

    path: Path
    format: str
    items: list = field(default_factory=list)  # str (plain, text) | (prompt, completion) | messages | alpaca 4-tuple
    wheres: list = field(default_factory=list)  # "FILE:LINE" / "FILE: record N" of each item, for errors


def data_files(path: Path) -> list[Path]:
    """The files a data path stands for: itself, or a folder's data files in name order."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and data_suffix(p) in SUFFIXES)
    if not files:
        raise LlmtuneError(f"{path}: the folder holds no data file ({', '.join(SUFFIXES)})")
    return files


def record_format(record: dict) -> Optional[str]:
    """The format a record's keys say it is in (None: unknown shape)."""
    if "chosen" in record or "rejected" in record:
        return "preference"
    if "label" in record:
        return "unpaired"
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        first = record["messages"][0] if isinstance(record["messages"], list) and record["messages"] else None
        return "sharegpt" if isinstance(first, dict) and "from" in first else "chat"
    if "instruction" in record:
        return "alpaca"
    if "prompt" in record or "completion" in record:
        return "completion"
    if "text" in record:
        return "text"
    return None


def read_records(path, fmt: str = "auto") -> Records:
    """The records of a file or folder in one format; every problem is one line naming the file
    and the record."""
    path = Path(path)
    if fmt not in FORMATS:
        raise LlmtuneError(f"--format: unknown format {fmt!r} (choose {', '.join(FORMATS)})")
    if not path.exists():
        raise LlmtuneError(f"{path}: no such file")
    structured = path.is_dir() or data_suffix(path) in SUFFIXES
    if fmt == "plain" and structured:
        what = "a folder" if path.is_dir() else f"a {data_suffix(path)} file"
        raise LlmtuneError(f"--format plain: {path} is {what} "
                           f"of records, not plain text (choose auto, {', '.join(FORMATS[2:])})")
    if fmt == "plain" or (fmt == "auto" and not structured):
        text = require_text(read_text(path), path)  # the words perplexity uses too
        if fmt == "auto" and (warning := _records_warning(path, text)):
            warnings.warn(warning, LlmtuneWarning, stacklevel=2)
        return Records(path, "plain", [text], [str(path)])
    out = Records(path, fmt)
    for file in data_files(path):
        for where, record in _raw_records(file, fmt):
            if not isinstance(record, dict):
                raise LlmtuneError(f"{where}: a record must be an object (got {type(record).__name__})")
            if out.format == "auto":
                kind = record_format(record)
                if kind is None:
                    keys = ", ".join(map(str, list(record)[:8])) + (", ..." if len(record) > 8 else "")
                    raise LlmtuneError(f"{where}: unknown record shape (keys: {keys or 'none'}); accepted: {SHAPES}")
                out.format = kind
            out.items.append(parse_record(record, out.format, where))
            out.wheres.append(where)
    if not out.items:
        raise LlmtuneError(f"{path}: no records")
    return out


# ------------------------------------------------------------------------------------ files
def _raw_records(path: Path, fmt: str = "auto") -> Iterator[tuple[str, object]]:
    """(where, record) of each record of one file, by its suffix; a record format named with
    --format reads any other file as JSONL."""
    kind = SUFFIXES.get(data_suffix(path), "jsonl")
    if kind == "parquet":
        yield from _parquet_rows(path)
        return
    text = read_text(path)
    if kind == "jsonl":
        # a plain text file given a record format: say how it trains as text
        hint = (f"; --format {fmt} reads JSON records, one per line: plain text is --format plain (or auto)"
                if data_suffix(path) not in SUFFIXES else "")
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield f"{path}:{lineno}", _json(line, f"{path}:{lineno}", hint)
    elif kind == "json":
        for i, record in enumerate(_json_array(_json(text, str(path)), path), 1):
            yield f"{path}: record {i}", record
    else:
        for i, row in enumerate(csv.DictReader(io.StringIO(text, newline="")), 1):
            yield f"{path}: row {i}", _csv_record(row, f"{path}: row {i}")


def _json(text: str, where: str, hint: str = ""):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        why = json_why(exc) if "\n" not in text else f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        extra = exc.msg == "Extra data" and "\n" in text
        hint = "; one record per line is JSONL: name the file .jsonl" if extra else hint
        raise LlmtuneError(f"{where}: invalid JSON ({why}){hint}") from None


SNIFF_LINES = 100  # the lines of a plain text file _records_warning looks at


def _records_warning(path: Path, text: str) -> Optional[str]:
    """The warning for plain text that looks like JSON records (None when it does not): most of its
    first non-empty lines are JSON objects (JSONL), or the whole text is a JSON array of objects."""
    lines = [line for line in text[:1 << 20].splitlines() if line.strip()][:SNIFF_LINES]
    objects = []
    for line in lines:
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                objects.append(record)
    kind_of_file = f"{data_suffix(path)} file" if data_suffix(path) else "file without a data suffix"
    plain = f"but a {kind_of_file} trains as plain text; to train the records name it"
    quiet = "(--format plain: the text, without this warning)"
    if lines and len(objects) * 2 > len(lines):
        kind = next((k for k in map(record_format, objects) if k), None)
        return (f"{path}: {len(objects)} of its first {len(lines)} lines are JSON records"
                f"{f' ({kind})' if kind else ''}, {plain} .jsonl or add --format {kind or 'NAME'} {quiet}")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return None
        if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
            return f"{path}: it is a JSON array of records, {plain} .json {quiet}"
    return None


def _json_array(data, path: Path) -> list:
    """A .json file's records: the array itself, a record object alone, or the one array an object holds."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        if record_format(data) is not None:
            return [data]
        arrays = [k for k, v in data.items() if isinstance(v, list)]
        if len(arrays) == 1:
            return data[arrays[0]]
        keys = ", ".join(map(str, list(data)[:8]))
        raise LlmtuneError(f"{path}: a JSON object must be a record or hold one array of records "
                           f"(it has {len(arrays)} arrays; keys: {keys or 'none'})")
    raise LlmtuneError(f"{path}: JSON data must be an array of records (got {type(data).__name__})")


def _csv_record(row: dict, where: str) -> dict:
    """A CSV row as a record: empty cells are missing values, message lists are JSON cells."""
    if None in row:
        raise LlmtuneError(f"{where}: more cells than the header has columns")
    record = {k: v for k, v in row.items() if v not in ("", None)}
    if isinstance(record.get("label"), str) and record["label"].lower() in ("true", "false"):
        record["label"] = record["label"].lower() == "true"  # unpaired preference data's label
    for key in ("messages", "conversations"):
        if isinstance(record.get(key), str):
            record[key] = _json(record[key], f"{where}: \"{key}\"")
    return record


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional (the Parquet extra), loaded for .parquet files
    except ImportError:
        raise LlmtuneError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow, or pip install "
                           "-e \".[parquet]\")") from None
    try:
        source = path if path.suffix.lower() == ".parquet" else io.BytesIO(read_bytes(path))  # .parquet.gz
        rows = pq.read_table(source).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
        raise LlmtuneError(f"{path}: cannot read as Parquet "
                           f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    for i, row in enumerate(rows, 1):
        yield f"{path}: row {i}", {k: v for k, v in row.items() if v is not None}


# ------------------------------------------------------------------------------------ records
def _string(record: dict, key: str, where: str, what: str = "", optional: bool = False) -> Optional[str]:
    if key not in record or (optional and record[key] is None):
        if optional:
            return None
        raise LlmtuneError(f"{where}: {what}record has no \"{key}\" field")
    value = record[key]
    if not isinstance(value, str):
        raise LlmtuneError(f"{where}: {what}\"{key}\" must be a string")
    return value


def parse_record(record: dict, fmt: str, where: str):
    """One record of format `fmt`, checked: str (text), (prompt, completion), messages (chat,
    sharegpt) or (system, instruction, input, output) (alpaca; system and input None when absent)."""
    if fmt == "text":
        return _string(record, "text", where)
    if fmt == "completion":
        return _string(record, "prompt", where), _string(record, "completion", where)
    if fmt == "alpaca":
        instruction, output = _string(record, "instruction", where), _string(record, "output", where)
        extra = _string(record, "input", where, optional=True)
        system = _string(record, "system", where, optional=True)
        return system or None, instruction, extra if extra and extra.strip() else None, output
    if fmt == "preference":
        return preference_record(record, where)
    if fmt == "unpaired":
        return unpaired_record(record, where)
    if fmt == "prompt":
        return prompt_record(record, where)
    if fmt == "sharegpt":
        key = "conversations" if "conversations" in record or "messages" not in record else "messages"
        return _messages(record, key, where, ("from", "value"), SHAREGPT_ROLES)
    return _messages(record, "messages", where, ("role", "content"), {r: r for r in ROLES})


def _messages(record: dict, key: str, where: str, fields: tuple[str, str], roles: dict,
              need_assistant: bool = True) -> list[dict]:
    """A conversation as chat messages [{"role", "content"}]; ShareGPT's from/value mapped (a
    message may also use role/content)."""
    if key not in record:
        raise LlmtuneError(f"{where}: record has no \"{key}\" field")
    messages = record[key]
    if not isinstance(messages, list) or not messages:
        raise LlmtuneError(f"{where}: \"{key}\" must be a non-empty list")
    clean = []
    for i, m in enumerate(messages):
        what = f"message {i + 1}: "
        if not isinstance(m, dict):
            raise LlmtuneError(f"{where}: {what}must be an object with \"{fields[0]}\" and \"{fields[1]}\"")
        role_key, text_key = fields if fields[0] in m or "role" not in m else ("role", "content")
        name = _string(m, role_key, where, what)
        if name not in roles:
            raise LlmtuneError(f"{where}: {what}unknown role {name!r} (use {', '.join(roles)})")
        rest = {k: v for k, v in m.items() if k not in (role_key, text_key)}
        clean.append({**rest, "role": roles[name], "content": _string(m, text_key, where, what)})
    if need_assistant and not any(m["role"] == "assistant" for m in clean):
        raise LlmtuneError(f"{where}: the conversation has no assistant turn (nothing to learn)")
    return clean


def preference_record(record: dict, where: str) -> tuple:
    """(prompt, chosen, rejected) of a preference record in either of TRL's forms: three strings,
    or a prompt message list with chosen / rejected assistant message lists (conversational)."""
    for key in ("prompt", "chosen", "rejected"):
        if key not in record:
            raise LlmtuneError(f"{where}: preference record has no \"{key}\" field (TRL's implicit prompt is not "
                               f"read: give the prompt apart)")
    if isinstance(record["prompt"], str):
        return tuple(_string(record, key, where, "preference ") for key in ("prompt", "chosen", "rejected"))
    if not isinstance(record["prompt"], list):
        raise LlmtuneError(f"{where}: \"prompt\" must be a string or a list of messages")
    roles = {r: r for r in ROLES}
    prompt = _messages({"m": record["prompt"]}, "m", where, ("role", "content"), roles, need_assistant=False)
    return (prompt, *(_answer(record, key, where) for key in ("chosen", "rejected")))


def _answer(record: dict, key: str, where: str) -> list[dict]:
    """A completion of a conversational preference record: a list of assistant messages."""
    if not isinstance(record[key], list):
        raise LlmtuneError(f"{where}: \"{key}\" must be a list of assistant messages when the prompt is one")
    msgs = _messages(record, key, where, ("role", "content"), {r: r for r in ROLES}, need_assistant=False)
    if any(m["role"] != "assistant" for m in msgs):
        raise LlmtuneError(f"{where}: \"{key}\" must hold assistant messages only")
    return msgs


def unpaired_record(record: dict, where: str) -> tuple:
    """(prompt, completion, label) of an unpaired preference record (TRL's KTO data): two strings,
    or a prompt message list with a completion assistant message list; the label a JSON boolean
    (desirable: true), as TRL's "label" column."""
    for key in ("prompt", "completion", "label"):
        if key not in record:
            raise LlmtuneError(f"{where}: unpaired preference record has no \"{key}\" field")
    label = record["label"]
    if not isinstance(label, bool):
        raise LlmtuneError(f"{where}: \"label\" must be true (desirable) or false (undesirable), got "
                           f"{json.dumps(label, default=str)}")
    if isinstance(record["prompt"], str):
        return _string(record, "prompt", where), _string(record, "completion", where, "unpaired preference "), label
    if not isinstance(record["prompt"], list):
        raise LlmtuneError(f"{where}: \"prompt\" must be a string or a list of messages")
    roles = {r: r for r in ROLES}
    prompt = _messages({"m": record["prompt"]}, "m", where, ("role", "content"), roles, need_assistant=False)
    return prompt, _answer(record, "completion", where), label


def prompt_record(record: dict, where: str) -> tuple:
    """(prompt, columns) of a prompt-only record (TRL's GRPO data): "prompt" a string or a message
    list (conversational: rendered with the generation prompt), every other key a column the
    rewards may read."""
    if "prompt" not in record:
        raise LlmtuneError(f"{where}: prompt record has no \"prompt\" field")
    columns = {k: v for k, v in record.items() if k != "prompt"}
    if isinstance(record["prompt"], str):
        return record["prompt"], columns
    if not isinstance(record["prompt"], list):
        raise LlmtuneError(f"{where}: \"prompt\" must be a string or a list of messages")
    roles = {r: r for r in ROLES}
    return _messages({"m": record["prompt"]}, "m", where, ("role", "content"), roles, need_assistant=False), columns
