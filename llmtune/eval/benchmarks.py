"""HellaSwag, Winogrande and multiple-choice benchmarks scored exactly as llama-perplexity does.

tools/perplexity/perplexity.cpp (hellaswag_score, winogrande_score, multiple_choice_score):
- HellaSwag and multiple choice: each choice is tokenized as `context + " " + choice` (BOS first,
  special tokens not parsed); the tokens all choices share form the common prefix; a choice's
  score is the mean log-probability of its tokens after that prefix; the highest score wins (the
  first on a tie). HellaSwag's accuracy is acc_norm with a Wilson 95 % interval; multiple choice
  also reports its random-chance rate.
- Winogrande: the sentence's `_` is replaced by each choice; when both continuations after the
  common prefix are longer than 3 tokens, only the tokens after the choice word are scored, and
  the last token is left out when more than one remains. The logits llama.cpp uses for the first
  scored token of the second choice when the choice word is scored come from the first choice's
  last token (its FIXME); reproduced, so the chosen answers match.
- Which tasks (`tasks`): HellaSwag takes 400 random tasks by default (llama.cpp's selection,
  tasks.py), Winogrande and multiple choice all of them in file order, or N random ones.
- A task must fit in llama-perplexity's KV cache for these modes, 4 sequences of `ctx` tokens
  (shared prefix plus every choice's continuation <= 4 * ctx), else a one-line error names it.

Scores are float64 from float32 logits, accumulated like llama.cpp (HellaSwag in double,
Winogrande and multiple choice in float). The model runs through continuations.score_rows.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.errors import Interrupted, LlmtuneError
from llmtune.eval.continuations import Row, RowScores, ScoreProgress, common_prefix, score_rows
from llmtune.eval.scoring import add_bos_of, as_backend, as_model, load_models
from llmtune.eval.tasks import KINDS, detect_kind, read_tasks, select_tasks

N_PARALLEL = 4  # llama-perplexity's sequences for these modes: the KV cache holds 4 * ctx tokens
WILSON_Z = 1.95996398454
WINOGRANDE_MIN_TRAILING = 3  # k_min_trailing_ctx


# ------------------------------------------------------------------------------------ results
@dataclass
class TaskScore:
    index: int  # the task's position in the file (0-based)
    choice: int  # the chosen answer (0-based)
    gold: list[int]  # the correct answer(s) (0-based)
    scores: list[float]  # one per answer
    topic: Optional[str] = None
    base_choice: Optional[int] = None  # with kl_base

    @property
    def correct(self) -> bool:
        return self.choice in self.gold


@dataclass
class BenchmarkResult:
    kind: str
    file: str
    tasks: list[TaskScore]
    accuracy: float  # fraction of tasks answered right
    accuracy_err: float  # llama.cpp's sqrt(p (1 - p) / (n - 1))
    ci_low: float = 0.0  # Wilson 95 % interval (HellaSwag's report)
    ci_high: float = 0.0
    random_chance: float = 0.0  # multiple choice: tasks / answers
    n_tokens: int = 0  # tokens of the scored sequences (every choice with its question)
    n_computed: int = 0  # tokens run through the model (a question once for all its choices)
    n_passes: int = 0
    seconds: float = 0.0  # scoring time (tokenizing and loading not included)
    tokens_per_s: float = 0.0
    topics: dict = field(default_factory=dict)  # topic -> [correct, total]
    # with kl_base
    base_accuracy: Optional[float] = None
    same_choice: Optional[float] = None  # fraction of tasks where model and base choose alike
    kl: Optional[float] = None  # mean KL(base || model) over the scored tokens
    kl_max: Optional[float] = None
    partial: bool = False  # stopped (Ctrl-C / SIGTERM) after n_tasks of n_tasks_planned tasks
    n_tasks_planned: int = 0

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    @property
    def n_correct(self) -> int:
        return sum(t.correct for t in self.tasks)

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("base_accuracy", "same_choice", "kl", "kl_max"):
            if d[key] is None:
                del d[key]
        for t, task in zip(d["tasks"], self.tasks):
            t["correct"] = task.correct
            if t["topic"] is None:
                del t["topic"]
            if t["base_choice"] is None:
                del t["base_choice"]
        if not d["topics"]:
            del d["topics"]
        d["n_tasks"], d["n_correct"] = self.n_tasks, self.n_correct
        return d


@dataclass(frozen=True)
class BenchmarkProgress:
    tasks_done: int
    n_tasks: int
    correct: int  # among the finished tasks
    tokens_done: int
    n_tokens: int
    seconds: float
    finished: tuple = ()  # TaskScores of the tasks this pass finished, in the order they finished
    kind: str = ""  # the benchmark's kind (hellaswag, winogrande, multiple-choice)


def wilson_interval(correct: int, n: int) -> tuple[float, float]:
    """hellaswag_score's Wilson score interval (95 %) of the accuracy."""
    if n < 1:
        return 0.0, 0.0
    freq = correct / n
    z = WILSON_Z * WILSON_Z / n
    cnf = z * math.sqrt(n * (4.0 * freq * (1 - freq) + z)) / (WILSON_Z + WILSON_Z)
    return (freq + z * 0.5 - cnf) / (1.0 + z), (freq + z * 0.5 + cnf) / (1.0 + z)


# ------------------------------------------------------------------------------------ preparation
@dataclass
class _Prepared:
    """A task as rows for the engine and how its answers' scores are formed."""

    index: int
    gold: list[int]
    rows: list[Row]
    # per answer: the (row, scored position) pairs whose log-probabilities its score averages
    terms: list[list[tuple[int, int]]]
    mean: str  # "double" (HellaSwag) or "float" (Winogrande, multiple choice)
    topic: Optional[str] = None


@dataclass
class Benchmark:
    """Tasks tokenized for one tokenizer, ready to score (several times, e.g. after each epoch)."""

    kind: str
    path: Path
    tasks: list[_Prepared]
    n_answers: int  # over all tasks (for the random-chance rate)


def _choice_rows(index: int, seqs: list[np.ndarray], gold: list[int], mean: str, topic=None) -> _Prepared:
    """HellaSwag / multiple choice: answer s scores tokens prefix.. of its sequence, the first from
    the logits of the prefix's last token. Identical sequences share a row (equal scores: the first
    wins the tie, as in llama.cpp). A sequence that is all prefix (one answer's tokens begin
    another's) makes llama.cpp read one token past its end, which holds 0: it scores token 0 there."""
    cp = common_prefix(seqs)
    rows, terms, seen = [], [], {}
    for seq in seqs:
        key = seq.tobytes()
        if key not in seen:
            if seq.size > cp:
                row = Row(seq, np.arange(cp - 1, seq.size - 1), seq[cp:], group=index)
            else:
                row = Row(seq, [cp - 1], [0], group=index)
            seen[key] = len(rows)
            rows.append(row)
        r = seen[key]
        terms.append([(r, k) for k in range(rows[r].positions.size)])
    return _Prepared(index, gold, rows, terms, mean, topic)


def _required_tokens(seqs: list[np.ndarray]) -> int:
    cp = common_prefix(seqs)
    return cp + sum(s.size - cp for s in seqs)


def _winogrande_rows(index: int, seqs: list[np.ndarray], n_base: list[int], gold: list[int], path, line) -> _Prepared:
    """winogrande_score's eval pairs, mapped from its batch layout (the shared prefix's last
    token, then the continuations of choice 1 and of choice 2) to (row, position)."""
    s0, s1 = seqs
    l0, l1 = s0.size, s1.size
    cp = common_prefix(seqs)
    skip = l0 - cp > WINOGRANDE_MIN_TRAILING and l1 - cp > WINOGRANDE_MIN_TRAILING
    n_rows = 1 + (l0 - cp) + (l1 - cp)

    def layout(li: int) -> tuple[int, int]:
        if not 0 <= li < n_rows:
            raise LlmtuneError(f"{path}: line {line}: the choices' tokens merge with the context, so llama.cpp "
                               f"cannot score this task (it reads outside its batch)")
        if li <= l0 - cp:
            return 0, cp - 1 + li
        return 1, cp + li - (l0 - cp) - 1

    pairs: list[list[tuple[int, int, int]]] = [[], []]  # per row: (position, target, answer)
    terms: list[list[tuple[int, int]]] = [[], []]
    for c, (seq, other_rows) in enumerate(((s0, 0), (s1, l0 - cp))):
        nb = n_base[c] if skip else cp
        last = 1 if seq.size - nb > 1 else 0
        li = other_rows + nb - cp
        for j in range(nb - 1, seq.size - 1 - last):
            row, pos = layout(li)
            pairs[row].append((pos, int(seq[j + 1]), c))
            li += 1
    rows = []
    for r, seq in enumerate(seqs):
        rows.append(Row(seq, [p for p, _, _ in pairs[r]], [t for _, t, _ in pairs[r]], group=index))
    for r in range(2):
        for k, (_, _, c) in enumerate(pairs[r]):
            terms[c].append((r, k))
    # each answer's terms are in llama.cpp's order (j ascending): answer 2's first one may come
    # from row 0 (the FIXME), the rest from row 1
    return _Prepared(index, gold, rows, terms, "float")


def _encode(tok, text: str) -> np.ndarray:
    return np.asarray(tok.encode(text, add_special=True, parse_special=False), dtype=np.int32)


def _check_fits(path, name: str, seqs: list[np.ndarray], ctx: int) -> None:
    """The task fits llama-perplexity's cache, and its answers share a first token to be scored after."""
    if common_prefix(seqs) < 1:
        raise LlmtuneError(f"{path}: {name}: the answers' token sequences share no first token (the model adds no "
                           f"BOS and the text is empty or differs at once), so no answer token can be scored")
    required = _required_tokens(seqs)
    if required > N_PARALLEL * ctx:
        raise LlmtuneError(f"{path}: {name} needs {required} tokens (shared prefix plus every answer) but --ctx {ctx} "
                           f"holds {N_PARALLEL * ctx} ({N_PARALLEL} sequences of {ctx}, as llama-perplexity); "
                           f"raise --ctx")


def prepare_benchmark(model, path, kind: Optional[str] = None, *, tasks: Optional[int] = None,
                      ctx: int = 512) -> Benchmark:
    """Read, select and tokenize the tasks of a benchmark file for `model`'s tokenizer.

    kind: "hellaswag", "winogrande" or "multiple-choice" (None: from the file). tasks: how many
    (llama.cpp's selection; None: its default, 400 for HellaSwag, all for the others)."""
    path = Path(path)
    kind = kind or detect_kind(path)
    if kind not in KINDS:
        raise LlmtuneError(f"unknown benchmark {kind!r} (choose {', '.join(KINDS)})")
    if tasks is not None and tasks < 1:
        raise LlmtuneError(f"--tasks: must be positive (got {tasks})")
    if ctx < 1:
        raise LlmtuneError(f"--ctx: must be positive (got {ctx})")
    items = read_tasks(path, kind)
    add_bos_of(model)  # a tokenizer that adds BOS must name it
    tok = model.tokenizer
    prepared, n_answers = [], 0
    for i in select_tasks(kind, len(items), tasks):
        t = items[i]
        if kind == "hellaswag":
            seqs = [_encode(tok, t.context + " " + e) for e in t.endings]
            _check_fits(path, f"task {i + 1} (line {t.line})", seqs, ctx)
            prepared.append(_choice_rows(i, seqs, [t.gold], "double"))
        elif kind == "multiple-choice":
            seqs = [_encode(tok, t.question + " " + a) for a in t.answers]
            _check_fits(path, f"task {i + 1} ({t.where})", seqs, ctx)
            gold = [k for k, label in enumerate(t.labels) if label == 1]
            prepared.append(_choice_rows(i, seqs, gold, "float", t.topic))
        else:
            seqs = [_encode(tok, t.first + c + t.second) for c in t.choices]
            _check_fits(path, f"task {i + 1} (line {t.line})", seqs, ctx)
            n_base = [_encode(tok, t.first + c).size for c in t.choices]
            prepared.append(_winogrande_rows(i, seqs, n_base, [t.answer - 1], path, t.line))
        n_answers += len(prepared[-1].terms)
    return Benchmark(kind, path, prepared, n_answers)


# ------------------------------------------------------------------------------------ scoring
def _answer_scores(task: _Prepared, logprob: list[np.ndarray]) -> list[float]:
    out = []
    for terms in task.terms:
        values = [logprob[r][k] for r, k in terms]
        if task.mean == "double":
            out.append(math.fsum(values) / len(values) if values else float("nan"))
        else:  # float accumulation and division, as llama.cpp's float score
            acc = np.float32(0.0)
            for v in values:
                acc = np.float32(acc + np.float32(v))
            with np.errstate(invalid="ignore", divide="ignore"):
                out.append(float(acc / np.float32(len(values))))
    return out


def _choose(kind: str, scores: list[float]) -> int:
    if kind == "winogrande":
        return 0 if scores[0] > scores[1] else 1  # llama.cpp: score_1st > score_2nd ? 1 : 2
    best = 0
    for s in range(1, len(scores)):
        if scores[s] > scores[best]:
            best = s
    return best


def score_benchmark(
    model,
    bench: Benchmark,
    *,
    backend="cpu",
    batch: Optional[int] = None,
    kl_base=None,
    progress: Optional[Callable[[BenchmarkProgress], None]] = None,
    precision: str = "f32",
    workers: Optional[int] = None,
    lora=None,
    lora_scale=None,
    float_copies: bool = False,
) -> BenchmarkResult:
    """Score prepared tasks with `model` (Model or GGUF path; `kl_base` adds the base's answers and
    KL(base || model) over the scored tokens). float_copies: the weights stay frozen for the whole
    run (the eval command; not a finetune's benchmark hook), see scoring.scorer_factory."""
    models = load_models(model, kl_base, lora, lora_scale)
    backend = as_backend(backend, precision)
    rows, owner, offsets = [], [], []
    for t, task in enumerate(bench.tasks):
        offsets.append(len(rows))
        rows += task.rows
        owner += [t] * len(task.rows)
    left = [len(task.rows) for task in bench.tasks]
    done: dict[int, TaskScore] = {}  # task -> its score, in the order the tasks finished
    state = {"tokens": 0, "passes": 0}

    def task_score(t: int, scores) -> TaskScore:
        task, rows_of = bench.tasks[t], slice(offsets[t], offsets[t] + len(bench.tasks[t].rows))
        s = _answer_scores(task, scores.logprob[rows_of])
        ts = TaskScore(task.index, _choose(bench.kind, s), task.gold, s, task.topic)
        if scores.base_logprob is not None:
            ts.base_choice = _choose(bench.kind, _answer_scores(task, scores.base_logprob[rows_of]))
        return ts

    def on_pass(p: ScoreProgress) -> None:
        finished = []
        for j in p.rows:
            t = owner[j]
            left[t] -= 1
            if left[t] == 0:
                done[t] = task_score(t, p.scores)
                finished.append(done[t])
        state["tokens"], state["passes"] = p.tokens_done, state["passes"] + 1
        if progress is not None:
            progress(BenchmarkProgress(len(done), len(bench.tasks), sum(ts.correct for ts in done.values()),
                                       p.tokens_done, p.n_tokens, p.seconds, tuple(finished), bench.kind))

    t0 = time.perf_counter()
    try:
        res = score_rows(models, rows, backend=backend, batch=batch, workers=workers, progress=on_pass,
                         float_copies=float_copies)
    except Interrupted as exc:  # Ctrl-C: the result over the tasks finished (file order), marked partial
        if done:
            partial = RowScores([], n_passes=state["passes"], n_tokens=state["tokens"])
            exc.partial = _result(bench, [done[t] for t in sorted(done)], partial, time.perf_counter() - t0)
        raise
    return _result(bench, [done[t] for t in range(len(bench.tasks))], res, time.perf_counter() - t0)


def _result(bench: Benchmark, scores: list[TaskScore], res, seconds: float) -> BenchmarkResult:
    n = len(scores)
    correct = sum(t.correct for t in scores)
    p = correct / n if n else 0.0
    err = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0
    lo, hi = wilson_interval(correct, n)
    out = BenchmarkResult(bench.kind, str(bench.path), scores, p, err, lo, hi,
                          random_chance=n / bench.n_answers if bench.n_answers else 0.0,
                          partial=n < len(bench.tasks), n_tasks_planned=len(bench.tasks),
                          n_tokens=res.n_tokens, n_computed=res.n_computed, n_passes=res.n_passes, seconds=seconds,
                          tokens_per_s=res.n_tokens / seconds if seconds > 0 else 0.0)
    if any(t.topic is not None for t in scores):
        total, right = Counter(t.topic for t in scores), Counter(t.topic for t in scores if t.correct)
        out.topics = {k: [right[k], total[k]] for k in sorted(total, key=str)}
    if res.kl is not None:
        out.base_accuracy = sum(t.base_choice in t.gold for t in scores) / n if n else 0.0
        out.same_choice = sum(t.base_choice == t.choice for t in scores) / n if n else 0.0
        kl = np.concatenate([k for k in res.kl if k.size] or [np.zeros(0)])
        out.kl = float(kl.mean()) if kl.size else 0.0
        out.kl_max = float(kl.max()) if kl.size else 0.0
    return out


def evaluate(
    model_path,
    path,
    kind: Optional[str] = None,
    *,
    tasks: Optional[int] = None,
    ctx: int = 512,
    batch: Optional[int] = None,
    backend="cpu",
    kl_base=None,
    progress: Optional[Callable[[BenchmarkProgress], None]] = None,
    precision: str = "f32",
    workers: Optional[int] = None,
    lora=None,
    lora_scale=None,
) -> BenchmarkResult:
    """llama-perplexity --hellaswag / --winogrande / --multiple-choice on `path` (see the module
    docstring). `model_path`: a GGUF path or a loaded Model."""
    model = as_model(model_path)
    bench = prepare_benchmark(model, path, kind, tasks=tasks, ctx=ctx)
    return score_benchmark(model, bench, backend=backend, batch=batch, kl_base=kl_base, progress=progress,
                           precision=precision, workers=workers, lora=lora, lora_scale=lora_scale, float_copies=True)
