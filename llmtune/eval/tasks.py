"""Benchmark task files as llama.cpp's llama-perplexity reads them, and its random task selection.

Formats (tools/perplexity/perplexity.cpp):
- HellaSwag (`--hellaswag`): text, 6 lines per task: context, gold ending index (0-3), 4 endings.
- Winogrande (`--winogrande`): CSV rows `index,sentence,choice1,choice2,answer` where the sentence
  holds one `_` (the blank the choices fill) and answer is 1 or 2; a sentence with commas is
  quoted. Parsed exactly as load_winogrande_from_csv does: the first four commas outside quotes
  split the row, a quoted sentence loses its outer quotes only (a `""` inside stays doubled).
- Multiple choice (`--multiple-choice -bf`): binary, little-endian: u32 n_task, n_task u32 byte
  offsets of the tasks, then per task a string (u32 length + UTF-8 bytes) question and two answer
  lists mc1 and mc2 (u32 n <= 100, n strings, n int32 labels; 1 marks a correct answer; llama.cpp
  scores mc1 only). Also JSONL, one task per line: {"question", "choices", "answer" (a 0-based
  index, or ARC's letter: "A" is the first choice), optional "topic"}, e.g. MMLU;
  `write_multiple_choice` converts any of these to the binary form. A task needs 2 choices or more.

Where llama.cpp skips a malformed task silently, crashes or reads past the end of its data, these
readers raise a one-line LlmtuneError naming the file and the task.

Random selection (llama.cpp's defaults, reproduced exactly): std::mt19937 seeded 1; HellaSwag draws
each task with libstdc++'s std::uniform_int_distribution<size_t> over the tasks not yet drawn (GCC
11+: Lemire's multiply-shift with rejection); Winogrande and multiple choice draw
int(float(2^-32) * rng() * n_left) in float32 arithmetic and move the last task into the hole.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError, require_file
from llmtune.gguf.file import check_output_path
from llmtune.resources import write_atomically
from llmtune.tokenizer import json_why, strip_bom

HELLASWAG_LINES = 6
HELLASWAG_ENDINGS = 4
MAX_ANSWERS = 100  # llama.cpp's limit on the answers of one multiple-choice list
KINDS = ("hellaswag", "winogrande", "multiple-choice")


# ------------------------------------------------------------------------------------ tasks
@dataclass
class HellaSwagTask:
    context: str
    gold: int  # index of the right ending
    endings: list[str]
    line: int  # 1-based line of the context in the file


@dataclass
class WinograndeTask:
    first: str  # the sentence before "_"
    second: str  # the sentence after "_"
    choices: list[str]  # the two fillers
    answer: int  # 1 or 2, as in the file
    line: int


@dataclass
class MultipleChoiceTask:
    question: str
    answers: list[str]  # mc1's answers
    labels: list[int]  # 1 marks a correct answer
    topic: Optional[str] = None
    where: str = ""  # "line N" (JSONL) or "offset N" (binary), for messages
    mc2_answers: list[str] = field(default_factory=list)  # carried through conversions, not scored
    mc2_labels: list[int] = field(default_factory=list)


# ------------------------------------------------------------------------------------ reading
def _read_bytes(path) -> tuple[Path, bytes]:
    path = require_file(path, "a benchmark file")
    try:
        return path, path.read_bytes()
    except OSError as exc:
        raise LlmtuneError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _decode(path: Path, data: bytes) -> str:
    """A text task file's text (a leading byte-order mark dropped)."""
    data = strip_bom(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise LlmtuneError(f"{path}: line {line} is not valid UTF-8") from None


def _prompt_lines(text: str) -> list[str]:
    """Lines as llama-perplexity -f sees them: one trailing newline dropped, then split on '\\n'."""
    if text.endswith("\n"):
        text = text[:-1]
    return text.split("\n") if text else []


def read_hellaswag(path) -> list[HellaSwagTask]:
    path, data = _read_bytes(path)
    lines = _prompt_lines(_decode(path, data))
    if not lines:
        raise LlmtuneError(f"{path}: no HellaSwag tasks")
    if len(lines) % HELLASWAG_LINES:
        n = len(lines) // HELLASWAG_LINES
        raise LlmtuneError(f"{path}: {len(lines)} lines is not a multiple of 6 (a HellaSwag task is a context, "
                           f"a label and 4 endings); task {n + 1} (line {n * HELLASWAG_LINES + 1}) is incomplete")
    tasks = []
    for i in range(0, len(lines), HELLASWAG_LINES):
        label = lines[i + 1].strip()
        if not label.isdigit() or int(label) >= HELLASWAG_ENDINGS:
            raise LlmtuneError(f"{path}: task {i // HELLASWAG_LINES + 1} (line {i + 2}): label {lines[i + 1]!r} "
                               f"is not an ending index 0-3")
        tasks.append(HellaSwagTask(lines[i], int(label), lines[i + 2:i + HELLASWAG_LINES], i + 1))
    return tasks


_LEADING_INT = re.compile(r"\s*([+-]?\d+)")


def _winogrande_row(line: str) -> Optional[tuple]:
    """(index, sentence, choice1, choice2, answer text) split as load_winogrande_from_csv does,
    or None when the row has fewer than four separating commas."""
    commas, quoted = [], False
    for i, ch in enumerate(line):
        if quoted:
            quoted = ch != '"'
        elif ch == ",":
            commas.append(i)
            if len(commas) == 4:
                break
        elif ch == '"':
            quoted = True
    if len(commas) < 4:
        return None
    c0, c1, c2, c3 = commas
    if c0 + 1 < len(line) and line[c0 + 1] == '"':
        sentence = line[c0 + 2:c0 + 2 + max(0, c1 - c0 - 3)]
    else:
        sentence = line[c0 + 1:c1]
    return line[:c0], sentence, line[c1 + 1:c2], line[c2 + 1:c3], line[c3 + 1:]


def read_winogrande(path) -> list[WinograndeTask]:
    """Every row of the CSV (a header row is skipped; blank lines too). llama.cpp also drops the
    file's last row when it ends with a single newline (its getline loop stops at end of file);
    llmtune scores every row."""
    path, data = _read_bytes(path)
    tasks, first_row = [], True
    for n, line in enumerate(_decode(path, data).split("\n"), 1):
        if not line.strip():
            continue
        row = _winogrande_row(line)
        if row is None:
            raise LlmtuneError(f"{path}: line {n}: expected index,sentence,choice1,choice2,answer "
                               f"(found fewer than 4 commas outside quotes)")
        _, sentence, choice1, choice2, answer = row
        m = _LEADING_INT.match(answer)
        if m is None and first_row:
            first_row = False
            continue  # a header row
        first_row = False
        if m is None or int(m.group(1)) not in (1, 2):
            raise LlmtuneError(f"{path}: line {n}: answer {answer.strip()!r} is not 1 or 2")
        if "_" not in sentence:
            raise LlmtuneError(f"{path}: line {n}: the sentence has no _ for the choices to fill")
        where = sentence.index("_")
        tasks.append(WinograndeTask(sentence[:where], sentence[where + 1:], [choice1, choice2], int(m.group(1)), n))
    if not tasks:
        raise LlmtuneError(f"{path}: no Winogrande tasks")
    return tasks


class _Reader:
    """Little-endian fields of llama.cpp's multiple-choice binary file, with bounds checks."""

    def __init__(self, path: Path, data: bytes):
        self.path, self.data, self.pos = path, data, 0
        self.task = ""

    def fail(self, what: str):
        raise LlmtuneError(f"{self.path}: {self.task + ': ' if self.task else ''}{what}")

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            self.fail(f"file ends inside {what} (byte {self.pos}, {n} bytes needed, {len(self.data)} in the file)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.u32(what + " length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def answers(self, name: str) -> tuple[list[str], list[int]]:
        n = self.u32(f"{name} count")
        if n > MAX_ANSWERS:
            self.fail(f"{name} has {n} answers (llama.cpp reads at most {MAX_ANSWERS})")
        answers = [self.string(f"{name} answer {k + 1}") for k in range(n)]
        labels = list(struct.unpack(f"<{n}i", self.take(4 * n, f"{name} labels")))
        return answers, labels


def _check_count(path: Path, name: str, n: int) -> None:
    if n < 2:
        raise LlmtuneError(f"{path}: {name}: {'one answer' if n else 'no answers'}; a task needs at least 2 "
                           f"choices (with one, it is always right)")


def _check_mc(path: Path, task: MultipleChoiceTask, name: str) -> MultipleChoiceTask:
    """llama.cpp refuses empty questions and answers; labels must be 0/1 with one correct answer."""
    if not task.question:
        raise LlmtuneError(f"{path}: {name}: empty question")
    _check_count(path, name, len(task.answers))
    for k, (answer, label) in enumerate(zip(task.answers, task.labels)):
        if not answer:
            raise LlmtuneError(f"{path}: {name}: answer {k + 1} is empty")
        if label not in (0, 1):
            raise LlmtuneError(f"{path}: {name}: label {label} of answer {k + 1} is out of range (0 or 1)")
    if 1 not in task.labels:
        raise LlmtuneError(f"{path}: {name}: no answer is labelled correct")
    return task


def read_multiple_choice_binary(path, data: Optional[bytes] = None) -> list[MultipleChoiceTask]:
    if data is None:
        path, data = _read_bytes(path)
    path = Path(path)
    r = _Reader(path, data)
    n_task = r.u32("the task count") if len(data) >= 4 else 0
    if n_task == 0:
        raise LlmtuneError(f"{path}: no tasks (a multiple-choice binary file starts with a nonzero u32 task count)")
    if 4 + 4 * n_task > len(data):
        raise LlmtuneError(f"{path}: {n_task} task offsets do not fit in the file ({len(data)} bytes); "
                           f"not a llama.cpp multiple-choice file?")
    offsets = struct.unpack(f"<{n_task}I", r.take(4 * n_task, "the task offsets"))
    tasks = []
    for i, offset in enumerate(offsets):
        r.task = f"task {i + 1}"
        if offset != r.pos:
            r.fail(f"offset {offset} does not point at the task (it starts at byte {r.pos})")
        question = r.string("question")
        answers, labels = r.answers("mc1")
        mc2 = r.answers("mc2")
        task = MultipleChoiceTask(question, answers, labels, None, f"offset {offset}", *mc2)
        tasks.append(_check_mc(path, task, r.task))
    return tasks


def read_multiple_choice_jsonl(path, text: Optional[str] = None) -> list[MultipleChoiceTask]:
    if text is None:
        path, data = _read_bytes(path)
        text = _decode(path, data)
    path = Path(path)
    tasks = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        name = f"line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LlmtuneError(f"{path}: {name}: not JSON ({json_why(exc)})") from None
        if not isinstance(obj, dict):
            raise LlmtuneError(f"{path}: {name}: expected an object with question, choices and answer")
        question, choices, answer = obj.get("question"), obj.get("choices"), obj.get("answer")
        if not isinstance(question, str):
            raise LlmtuneError(f"{path}: {name}: \"question\" must be a string")
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise LlmtuneError(f"{path}: {name}: \"choices\" must be a list of strings")
        if len(choices) > MAX_ANSWERS:
            raise LlmtuneError(f"{path}: {name}: {len(choices)} choices (llama.cpp reads at most {MAX_ANSWERS})")
        _check_count(path, name, len(choices))
        answer = _answer_index(answer, choices, f"{path}: {name}")
        topic = obj.get("topic", obj.get("subject"))
        labels = [int(k == answer) for k in range(len(choices))]
        tasks.append(_check_mc(path, MultipleChoiceTask(question, list(choices), labels,
                                                        None if topic is None else str(topic), name), name))
    if not tasks:
        raise LlmtuneError(f"{path}: no tasks")
    return tasks


def _answer_index(answer, choices: list, where: str) -> int:
    """A JSONL task's "answer" as a choice index: a 0-based index (MMLU), or a letter (ARC's answerKey:
    A is the first choice). A string of digits is refused: ARC's "1" is the first choice, an index's 1
    the second."""
    letters = "".join(chr(ord("A") + k) for k in range(min(len(choices), 26)))
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().upper() in letters:
        return letters.index(answer.strip().upper())
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        return answer
    if isinstance(answer, str) and answer.strip().isdigit():
        raise LlmtuneError(f"{where}: answer {answer!r} is a string of digits: give a 0-based index "
                           f"({int(answer) - 1} if {answer.strip()} counts from 1, as ARC's labels do) or a letter "
                           f"(A-{letters[-1]})")
    raise LlmtuneError(f"{where}: answer {answer!r} is out of range for {len(choices)} choices "
                       f"(a 0-based index 0-{len(choices) - 1}, or a letter A-{letters[-1]})")


def _looks_like_jsonl(data: bytes) -> bool:
    return strip_bom(data).lstrip()[:1] == b"{"


def read_multiple_choice(path) -> list[MultipleChoiceTask]:
    """llama.cpp's binary file, or JSONL (a file whose first non-blank byte is '{')."""
    path, data = _read_bytes(path)
    if _looks_like_jsonl(data):
        return read_multiple_choice_jsonl(path, _decode(path, data))
    return read_multiple_choice_binary(path, data)


def detect_kind(path) -> str:
    """hellaswag, winogrande or multiple-choice, from the file's name and first bytes."""
    path, data = _read_bytes(path)
    if path.suffix.lower() in (".jsonl", ".json") or _looks_like_jsonl(data):
        return "multiple-choice"
    if path.suffix.lower() == ".csv":
        return "winogrande"
    head = strip_bom(data)[:4096]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the sample
            return "multiple-choice"
        text = head[:exc.start].decode("utf-8")
    if "\x00" in text:
        return "multiple-choice"
    lines = text.split("\n")
    if len(lines) > 1 and lines[1].strip().isdigit():
        return "hellaswag"
    if lines and _winogrande_row(lines[0]) is not None:
        return "winogrande"
    raise LlmtuneError(f"{path}: cannot tell which benchmark this file holds; "
                       f"choose one of --hellaswag, --winogrande, --multiple-choice")


def read_tasks(path, kind: str) -> list:
    readers = {"hellaswag": read_hellaswag, "winogrande": read_winogrande, "multiple-choice": read_multiple_choice}
    if kind not in readers:
        raise LlmtuneError(f"unknown benchmark {kind!r} (choose {', '.join(KINDS)})")
    return readers[kind](path)


# ------------------------------------------------------------------------------------ writing
def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def _pack_answers(answers: list[str], labels: list[int]) -> bytes:
    return (struct.pack("<I", len(answers)) + b"".join(_pack_string(a) for a in answers)
            + struct.pack(f"<{len(labels)}i", *labels))


def multiple_choice_bytes(tasks: list[MultipleChoiceTask]) -> bytes:
    """llama.cpp's multiple-choice binary file holding `tasks` (mc2 as the tasks carry it)."""
    bodies = [_pack_string(t.question) + _pack_answers(t.answers, t.labels) + _pack_answers(t.mc2_answers, t.mc2_labels)
              for t in tasks]
    offsets, pos = [], 4 + 4 * len(tasks)
    for body in bodies:
        offsets.append(pos)
        pos += len(body)
    return struct.pack(f"<I{len(tasks)}I", len(tasks), *offsets) + b"".join(bodies)


def write_multiple_choice(tasks: list[MultipleChoiceTask], path, *inputs) -> Path:
    """Write `tasks` as llama.cpp's binary multiple-choice file (atomically; never over an input)."""

    path = check_output_path(path, *inputs)
    data = multiple_choice_bytes(tasks)
    return write_atomically(path, lambda fh: fh.write(data))


# ------------------------------------------------------------------------------------ selection
class MT19937:
    """std::mt19937 (32-bit Mersenne Twister), seeded as std::mt19937(seed)."""

    N, M = 624, 397

    def __init__(self, seed: int = 5489):
        mt = [0] * self.N
        mt[0] = seed & 0xFFFFFFFF
        for i in range(1, self.N):
            mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.mt, self.index = mt, self.N

    def _twist(self) -> None:
        mt, n, m = self.mt, self.N, self.M
        for i in range(n):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % n] & 0x7FFFFFFF)
            mt[i] = mt[(i + m) % n] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self.index = 0

    def __call__(self) -> int:
        if self.index >= self.N:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def uniform_below(rng: MT19937, n: int) -> int:
    """std::uniform_int_distribution<size_t>(0, n - 1)(rng) with a 32-bit engine, as libstdc++
    (GCC 11+) computes it: Lemire's nearly-divisionless multiply-shift (_S_nd)."""
    if not 1 <= n <= 0xFFFFFFFF:
        raise ValueError(f"range {n} not supported")
    product = rng() * n
    low = product & 0xFFFFFFFF
    if low < n:
        threshold = ((1 << 32) - n) % n
        while low < threshold:
            product = rng() * n
            low = product & 0xFFFFFFFF
    return product >> 32


def hellaswag_selection(n_tasks: int, n_select: int) -> list[int]:
    """The tasks hellaswag_score evaluates, in its order: min(n_select, n_tasks) random draws
    from the tasks not yet drawn (llama.cpp always shuffles, even when it takes them all)."""
    rng, left = MT19937(1), list(range(n_tasks))
    return [left.pop(uniform_below(rng, len(left))) for _ in range(min(n_select, n_tasks))]


def float_scale_selection(n_tasks: int, n_select: int) -> list[int]:
    """The tasks winogrande_score / multiple_choice_score evaluate when asked for fewer than there
    are: j = int(2^-32f * float(rng()) * float(n_left)) in float32, the last task moved into j's slot."""
    rng, aux = MT19937(1), list(range(n_tasks))
    scale = np.float32(1.0) / (np.float32(1.0) + np.float32(0xFFFFFFFF))
    out = []
    for _ in range(n_select):
        j = int(scale * np.float32(rng()) * np.float32(len(aux)))
        j = min(j, len(aux) - 1)  # float rounding can reach len(aux); llama.cpp would read past the end
        out.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return out


def select_tasks(kind: str, n_tasks: int, n_select: Optional[int]) -> list[int]:
    """Indices (into the file's tasks) that llama-perplexity scores, in its order. n_select None:
    its defaults (HellaSwag 400 random tasks; Winogrande and multiple choice all, in file order)."""
    if kind == "hellaswag":
        return hellaswag_selection(n_tasks, 400 if n_select is None else n_select)
    if n_select is None or n_select == 0 or n_select >= n_tasks:
        return list(range(n_tasks))
    return float_scale_selection(n_tasks, n_select)
