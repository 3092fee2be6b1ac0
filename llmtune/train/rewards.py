"""GRPO's verifiable rewards (--reward KIND:ARG, repeated; train/grpo.py sums them with --reward-weights).

Built-in graders (each 1.0 or 0.0 unless said):
- exact:COLUMN   the completion equals the record's COLUMN after normalising both: surrounding
                 whitespace and punctuation stripped ("Positive." and "**positive**" read
                 "positive"; a leading sign or "." stays: "-1" is not "1"), inner runs of
                 whitespace collapsed to one space, case-folded (str.casefold); a non-string
                 column is compared as its JSON text (42 -> "42").
- number:COLUMN  the first number in the completion (an optional sign, digits with "," thousands
                 separators dropped, an optional fraction and exponent) equals the column's number
                 (a JSON number, or the first number in its text) to 1e-9 relative; no number: 0.0.
- regex:PATTERN  Python's re.search(PATTERN, completion) finds a match.
- length:N       -|n - N| / N for a completion of n tokens (its end-of-generation token included):
                 0 at N tokens, -1 at none or 2N.
- FILE.py:NAME   a user's function with TRL's reward-function signature,
                 NAME(prompts, completions, completion_ids=..., **columns) -> list[float | None]:
                 one reward per completion, None where it does not apply (TRL's NaN: a completion's
                 reward is the weighted nan-sum over the graders; one no grader scores gets no
                 advantage). Conversational prompts come as message lists, completions as
                 [{"role": "assistant", "content": text}], as TRL passes them (TRL's trainer_state,
                 log_extra and log_metric are not: take **kwargs). The file is user code:
                 imported (importlib, from that path) only when named on the command line.

A grader's name (TRL's reward_func_names, the metrics' rewards/<name>/mean) is its spec for a
built-in (regex:cat) and the function's name for a user's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.errors import LlmtuneError

KINDS = ("exact", "number", "regex", "length")
NEEDS_COLUMN = ("exact", "number")
SPEC_WORDS = "exact:COLUMN, number:COLUMN, regex:PATTERN, length:N or FILE.py:FUNCTION"
# exact:'s stripped ends: ASCII punctuation, curly quotes, guillemets and the ellipsis
EDGE_PUNCTUATION = string.punctuation + "\u2018\u2019\u201c\u201d\u00ab\u00bb\u2026"
LEADING_PUNCTUATION = EDGE_PUNCTUATION.translate({ord(c): None for c in "+-."})  # a sign or ".5" is the answer's
WHITESPACE = " \t\n\r\f\v"
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(LlmtuneError):
    """A reward that could not be computed (a user's function crashed or returned what is not one
    reward per completion): the run stops, its last checkpoint kept."""


def normalise(text) -> str:
    """exact:'s normal form: whitespace and punctuation stripped from both ends (a one-word answer
    ends with a full stop as often as not), inner whitespace collapsed, case-folded."""
    if not isinstance(text, str):
        text = json.dumps(text)
    text = text.strip(WHITESPACE).lstrip(LEADING_PUNCTUATION + WHITESPACE).rstrip(EDGE_PUNCTUATION + WHITESPACE)
    return " ".join(text.split()).casefold()


def first_number(text) -> Optional[float]:
    """number:'s reading of a completion or column: a JSON number as it is, else the first number in the text."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = NUMBER.search(text if isinstance(text, str) else json.dumps(text))
    if m is None:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


def _text(completion) -> str:
    """A completion's text: itself, or a conversational completion's last message content."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return completion


@dataclass
class Grader:
    spec: str
    name: str
    fn: Callable  # TRL's signature: fn(prompts, completions, completion_ids=..., **columns) -> list
    column: Optional[str] = None  # the record column a built-in reads (checked when the data is read)
    path: Optional[Path] = None  # a user's file
    best: float = 1.0  # the reward of a perfect completion (eval --reward's pass threshold): length's is 0

    @property
    def kind(self) -> str:
        """exact, number, regex, length, or "function" for a user's."""
        return "function" if self.path is not None else self.spec.partition(":")[0]

    def score(self, prompts, completions, completion_ids, columns: dict, wheres: list[str]) -> np.ndarray:
        """One reward per completion (NaN: None), or a one-line RewardError naming the grader,
        its file and the batch's first prompt (where)."""
        n = len(completions)
        at = f"prompt {wheres[0]}" + (f" and {len(set(wheres)) - 1} more" if len(set(wheres)) > 1 else "")
        source = f" in {self.path}" if self.path else ""
        try:
            out = self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:  # noqa: BLE001 - user code: any failure is one line
            why = str(exc).splitlines()[0] if str(exc) else ""
            raise RewardError(f"--reward {self.spec}: {type(exc).__name__}{': ' + why if why else ''}{source} "
                              f"({at})") from None
        try:
            values = list(out)
        except TypeError:
            raise RewardError(f"--reward {self.spec}: returned {type(out).__name__}, not a list of rewards{source} "
                              f"({at})") from None
        if len(values) != n:
            raise RewardError(f"--reward {self.spec}: returned {len(values)} rewards for {n} completions (one per "
                              f"completion){source} ({at})")
        rewards = np.empty(n, dtype=np.float64)
        for i, v in enumerate(values):
            if v is None:
                rewards[i] = math.nan
            elif isinstance(v, (int, float, np.integer, np.floating)):
                rewards[i] = float(v)
            else:
                raise RewardError(f"--reward {self.spec}: reward {i + 1} is {type(v).__name__} {str(v)[:40]!r}, not a "
                                  f"number or None{source} (prompt {wheres[i]})")
        return rewards


def _builtin(kind: str, arg: str, spec: str) -> Grader:
    if kind in NEEDS_COLUMN and not arg:
        raise LlmtuneError(f"--reward {spec}: {kind}: needs the column to compare with ({kind}:COLUMN)")
    if kind == "exact":
        def exact(prompts, completions, **columns):
            return [float(normalise(_text(c)) == normalise(want)) for c, want in zip(completions, columns[arg])]
        return Grader(spec, spec, exact, arg)
    if kind == "number":
        def number(prompts, completions, **columns):
            out = []
            for c, want in zip(completions, columns[arg]):
                got, target = first_number(_text(c)), first_number(want)
                out.append(float(got is not None and target is not None and math.isclose(got, target, rel_tol=1e-9)))
            return out
        return Grader(spec, spec, number, arg)
    if kind == "regex":
        try:
            pattern = re.compile(arg)
        except re.error as exc:
            raise LlmtuneError(f"--reward {spec}: not a regular expression ({exc})") from None

        def regex(prompts, completions, **columns):
            return [float(pattern.search(_text(c)) is not None) for c in completions]
        return Grader(spec, spec, regex)
    try:
        target = int(arg)
    except ValueError:
        target = 0
    if target < 1:
        raise LlmtuneError(f"--reward {spec}: length: needs a positive whole number of tokens (length:N)")

    def length(prompts, completions, completion_ids, **columns):
        return [-abs(len(ids) - target) / target for ids in completion_ids]
    return Grader(spec, spec, length, best=0.0)


def load_function(spec: str, path: Path, name: str) -> Grader:
    """A user's reward function NAME from FILE.py, imported from that path."""
    if not path.is_file():
        raise LlmtuneError(f"--reward {spec}: {path}: no such file")
    module_name = f"llmtune_reward_{abs(hash(str(path.resolve())))}"
    try:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up here
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is one line
        sys.modules.pop(module_name, None)
        why = str(exc).splitlines()[0] if str(exc) else ""
        raise LlmtuneError(f"--reward {spec}: importing {path} failed: {type(exc).__name__}"
                           f"{': ' + why if why else ''}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise LlmtuneError(f"--reward {spec}: {path} defines no {name!r}")
    if not callable(fn):
        raise LlmtuneError(f"--reward {spec}: {path}'s {name!r} is not a function")
    return Grader(spec, getattr(fn, "__name__", name), fn, path=path)


def parse_reward(spec: str) -> Grader:
    """One --reward: a built-in KIND:ARG or a user's FILE.py:FUNCTION (one line for anything else)."""
    kind, sep, arg = spec.partition(":")
    if sep and kind in KINDS:
        return _builtin(kind, arg, spec)
    file, sep, name = spec.rpartition(":")
    if sep and file.endswith(".py") and name.isidentifier():
        return load_function(spec, Path(file), name)
    if sep and file.endswith(".py"):
        raise LlmtuneError(f"--reward {spec}: {name!r} is not a function name (FILE.py:FUNCTION)")
    raise LlmtuneError(f"--reward {spec}: unknown reward kind {kind!r} (choose {SPEC_WORDS})")


def check_spec(spec: str) -> None:
    """The config's check of a --reward before anything is loaded: a known kind or a .py file."""
    kind, sep, _ = spec.partition(":")
    if not (sep and kind in KINDS) and not spec.rpartition(":")[0].endswith(".py"):
        raise LlmtuneError(f"--reward {spec}: unknown reward kind {kind!r} (choose {SPEC_WORDS})")


def parse_weights(text: Optional[str], n_rewards: int) -> Optional[list[float]]:
    """--reward-weights "1,0.5": one finite number per --reward (None: 1 each)."""
    if text is None:
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise LlmtuneError(f"--reward-weights: {text!r} is not comma-separated numbers") from None
    if len(weights) != n_rewards or not all(map(math.isfinite, weights)):
        raise LlmtuneError(f"--reward-weights: {len(weights)} weight(s) for {n_rewards} --reward(s) "
                           f"(one finite number each)")
    return weights


def weighted_sum(rewards_per_func: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each completion's reward [n] of its rewards per grader [n, k]: TRL's weighted nan-sum, NaN
    where every grader said None."""
    r = np.asarray(rewards_per_func, dtype=np.float64)
    total = np.nansum(r * np.asarray(weights, dtype=np.float64)[None, :], axis=1)
    total[np.isnan(r).all(axis=1)] = np.nan
    return total


@dataclass
class Rewards:
    """The run's graders and their weights (TRL's reward_weights; 1 each by default)."""

    graders: list
    weights: np.ndarray
    names: list = field(default_factory=list)

    @classmethod
    def of(cls, specs: list[str], weights: Optional[list[float]] = None) -> "Rewards":
        graders = [parse_reward(s) for s in specs]
        w = np.ones(len(graders)) if weights is None else np.asarray(weights, dtype=np.float64)
        names, seen = [], {}
        for g in graders:  # two graders of one name: the second is name_2 (the metrics keep both)
            seen[g.name] = seen.get(g.name, 0) + 1
            names.append(g.name if seen[g.name] == 1 else f"{g.name}_{seen[g.name]}")
        return cls(graders, w, names)

    def columns(self) -> dict[str, str]:
        """column -> the --reward that reads it (checked against every prompt record)."""
        return {g.column: g.spec for g in self.graders if g.column is not None}

    def score(self, prompts, completions, completion_ids, columns: dict, wheres: list[str]) -> np.ndarray:
        """float64 [n completions, n graders] (NaN: no reward)."""
        return np.stack([g.score(prompts, completions, completion_ids, columns, wheres) for g in self.graders], axis=1)
