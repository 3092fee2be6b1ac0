"""llmtune eval MODEL TASK.jsonl --reward ...: the user's own generative task, graded.

- Prompts: the prompt records finetune --method grpo reads (train/grpo.py read_prompts: a plain
  "prompt" string tokenized with the model's BOS, or chat messages rendered with the model's chat
  template and its generation prompt), each with the columns its graders read.
- Completions: greedy by default (one per prompt), or --samples k per prompt sampled at --temp
  with llama.cpp's other sampler defaults (top-k 40, top-p 0.95, min-p 0.05); completion j of
  prompt p draws from mt19937 seeded SeedSequence([--seed, p, j]), so the samples do not depend
  on how completions are batched. Decoded together by eval/generate.py BatchGenerator (llama.cpp's
  batched decoding), up to --max-completion-length tokens or an end-of-generation token (kept in
  the completion's tokens, as GRPO keeps it; not in its text).
- Grades: train/rewards.py's graders, as GRPO scores its rollouts (one column per grader, NaN for
  None; the completion's reward the weighted nan-sum, train/rewards.py weighted_sum).
- pass@j: a completion passes when its reward reaches --pass-reward (default: the weighted sum of
  every grader's best, 1 for exact / number / regex / a user's function, 0 for length: every
  grader satisfied). pass@j is Chen et al. 2021's unbiased estimator over a prompt's k samples,
  1 - C(k - c, j) / C(k, j) with c of them passing, averaged over the prompts; greedy: j = k = 1.
- Confusion: for an exact:COLUMN grader whose column holds at most MAX_LABELS distinct (normalised)
  values, fewer than the prompts (a value repeats: labels, not a value per prompt), the counts of
  (gold, predicted), predicted the normalised completion, or "other".
- With --lora, the base and the base + adapters are evaluated on the same prompts (Comparison).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from llmtune.errors import Interrupted, LlmtuneError
from llmtune.eval.generate import BatchGenerator
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.eval.scoring import as_model
from llmtune.model.adapter import attach
from llmtune.train.grpo import read_prompts
from llmtune.train.rewards import Rewards, normalise, weighted_sum

MAX_LABELS = 20  # an exact:COLUMN with at most this many gold values gets a confusion table
DEFAULT_N_SEQ = 8  # completions decoded together


@dataclass(frozen=True)
class GradedSettings:
    """eval --reward's settings (the CLI's flags)."""

    max_completion_length: int = 256
    samples: Optional[int] = None  # None: greedy, one completion per prompt
    temp: float = 0.8
    seed: int = 0
    ctx: int = 512
    limit: Optional[int] = None  # the first N prompts
    pass_reward: Optional[float] = None
    n_seq: int = DEFAULT_N_SEQ

    @property
    def k(self) -> int:
        return self.samples or 1

    def check(self) -> "GradedSettings":
        if self.samples is not None and self.samples < 1:
            raise LlmtuneError(f"--samples: must be at least 1, got {self.samples}")
        if self.samples is not None and not (self.temp > 0 and math.isfinite(self.temp)):
            raise LlmtuneError(f"--temp: --samples draws at a positive temperature, got {self.temp}")
        if not 1 <= self.max_completion_length < self.ctx:
            raise LlmtuneError(f"--max-completion-length: must be in [1, --ctx {self.ctx}), got "
                               f"{self.max_completion_length}")
        if self.limit is not None and self.limit < 1:
            raise LlmtuneError(f"--tasks: must be positive, got {self.limit}")
        return self


@dataclass
class GradedPrompt:
    """One prompt's completions (k of them) and their grades."""

    where: str
    prompt: object  # str or messages, as the record gives it
    columns: dict
    texts: list = field(default_factory=list)
    n_tokens: list = field(default_factory=list)
    stops: list = field(default_factory=list)
    scores: list = field(default_factory=list)  # [k][n graders], NaN: None
    rewards: list = field(default_factory=list)  # [k] weighted sums

    def to_dict(self, names: list[str]) -> dict:
        nan = lambda v: None if math.isnan(v) else v  # noqa: E731 - JSON has no NaN
        return {"where": self.where, "prompt": self.prompt,
                "completions": [{"text": t, "tokens": n, "stop": s, "rewards": dict(zip(names, map(nan, sc))),
                                 "reward": nan(r)}
                                for t, n, s, sc, r in zip(self.texts, self.n_tokens, self.stops, self.scores,
                                                          self.rewards)]}


def pass_at(n: int, c: int, j: int) -> float:
    """Chen et al. 2021's unbiased pass@j of n samples, c of them correct: 1 - C(n - c, j) / C(n, j)."""
    if n - c < j:
        return 1.0
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


@dataclass
class GradedResult:
    """One model's grades over the prompts."""

    names: list
    weights: list
    threshold: float
    k: int
    prompts: list  # GradedPrompt
    n_planned: int
    seconds: float = 0.0
    n_tokens: int = 0
    confusion_of: list = field(default_factory=list)  # (grader name, column) of label graders

    @property
    def partial(self) -> bool:
        return len(self.prompts) < self.n_planned

    def _scores(self) -> np.ndarray:
        rows = [s for p in self.prompts for s in p.scores]
        return np.asarray(rows, dtype=np.float64).reshape(-1, len(self.names))

    @property
    def rewards(self) -> dict[str, Optional[float]]:
        """Each grader's mean over the completions it scored (None: it scored none)."""
        s = self._scores()
        return {n: (float(np.nanmean(s[:, i])) if (~np.isnan(s[:, i])).any() else None)
                for i, n in enumerate(self.names)}

    @property
    def reward(self) -> Optional[float]:
        r = np.asarray([r for p in self.prompts for r in p.rewards], dtype=np.float64)
        return float(np.nanmean(r)) if (~np.isnan(r)).any() else None

    def pass_at(self) -> dict[int, float]:
        """pass@j for j = 1..k, averaged over the prompts."""
        if not self.prompts:
            return {}
        out = {}
        for j in range(1, self.k + 1):
            out[j] = float(np.mean([pass_at(len(p.rewards), self._passed(p), j) for p in self.prompts]))
        return out

    def _passed(self, p: GradedPrompt) -> int:
        return sum(1 for r in p.rewards if not math.isnan(r) and r >= self.threshold - 1e-9)

    def confusion(self) -> dict[str, dict]:
        """name -> {"gold": labels, "predicted": labels + ["other"], "counts": [gold][predicted]}."""
        out = {}
        for name, column in self.confusion_of:
            labels = sorted({normalise(p.columns[column]) for p in self.prompts})
            if not labels or len(labels) > MAX_LABELS or len(labels) == len(self.prompts):
                continue  # free text (or a value per prompt): not labels
            index = {lab: i for i, lab in enumerate(labels)}
            counts = np.zeros((len(labels), len(labels) + 1), dtype=np.int64)
            for p in self.prompts:
                gold = index[normalise(p.columns[column])]
                for text in p.texts:
                    counts[gold, index.get(normalise(text), len(labels))] += 1
            out[name] = {"gold": labels, "predicted": labels + ["other"], "counts": counts.tolist()}
        return out

    def to_dict(self) -> dict:
        return {"rewards": self.rewards, "reward": self.reward,
                "pass_at": {str(j): v for j, v in self.pass_at().items()}, "confusion": self.confusion(),
                "prompts_done": len(self.prompts), "prompts_planned": self.n_planned, "partial": self.partial,
                "completion_tokens": self.n_tokens, "seconds": self.seconds,
                "prompts": [p.to_dict(self.names) for p in self.prompts]}


@dataclass
class Comparison:
    """The model's grades (the base + adapters with --lora) and, with --lora, the base's."""

    task: str
    graders: list  # (name, spec, weight)
    settings: GradedSettings
    model: GradedResult
    base: Optional[GradedResult] = None

    @property
    def partial(self) -> bool:
        return self.model.partial

    def to_dict(self) -> dict:
        s = self.settings
        out = {"task": self.task, "graders": [{"name": n, "spec": sp, "weight": w} for n, sp, w in self.graders],
               "samples": s.samples, "temp": s.temp if s.samples else 0.0, "seed": s.seed,
               "max_completion_length": s.max_completion_length, "pass_reward": self.model.threshold,
               **self.model.to_dict()}
        if self.base is not None:
            b = self.base.to_dict()
            out["base"] = b
            out["difference"] = {"rewards": {n: _diff(out["rewards"][n], b["rewards"][n]) for n in out["rewards"]},
                                 "reward": _diff(out["reward"], b["reward"])}
        return out


def _diff(a, b):
    return None if a is None or b is None else a - b


@dataclass
class GradedProgress:
    stage: str  # "base" or "adapter" or "model"
    done: int  # completions
    total: int
    seconds: float
    tokens: int
    reward: Optional[float]  # the running mean reward


def sample_seed(seed: int, prompt: int, j: int) -> int:
    """The mt19937 seed of completion j of prompt `prompt` (independent of the batching)."""
    return int(np.random.SeedSequence([seed, prompt, j]).generate_state(1)[0])


def _sampler(s: GradedSettings, prompt: int, j: int) -> Sampler:
    if s.samples is None:
        return Sampler(SamplerConfig(temp=0.0, seed=0))
    return Sampler(SamplerConfig(temp=s.temp, seed=sample_seed(s.seed, prompt, j)))


def grade_model(model, backend, kept: list, rewards: Rewards, s: GradedSettings, threshold: float,
                confusion_of: list, stage: str = "model",
                progress: Optional[Callable[[GradedProgress], None]] = None) -> GradedResult:
    """Complete and grade every prompt of `kept` (read_prompts' tuples) with `model`. Stopped by
    Ctrl-C, Interrupted carries the result over the prompts whose k completions are all graded."""
    k = s.k
    jobs = [(p, j) for p in range(len(kept)) for j in range(k)]
    res = GradedResult(list(rewards.names), [float(w) for w in rewards.weights], threshold, k,
                       [], len(kept), confusion_of=confusion_of)
    graded = [GradedPrompt(where, prompt, columns) for _, prompt, columns, where in kept]
    # a prompt's k samples share its prefill (the k/v copied into their lanes: the same values)
    gen = BatchGenerator(model, backend, n_seq=min(s.n_seq, len(jobs)), n_ctx=s.ctx, share_prompts=True)
    t0 = time.perf_counter()
    try:
        for start in range(0, len(jobs), gen.n_seq):
            chunk = jobs[start : start + gen.n_seq]
            outs = gen.generate_batch([list(kept[p][0]) for p, _ in chunk], s.max_completion_length,
                                      [_sampler(s, p, j) for p, j in chunk])  # a short last batch: lanes idle
            _grade_chunk(rewards, kept, graded, chunk, outs)
            res.n_tokens += sum(len(o.tokens) for o in outs)
            res.prompts = graded[: (start + len(chunk)) // k]
            res.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(GradedProgress(stage, start + len(chunk), len(jobs), res.seconds, res.n_tokens,
                                        _running_reward(graded, chunk)))
    except Interrupted as exc:
        exc.partial = res
        raise
    return res


def _running_reward(graded: list, chunk: list) -> Optional[float]:
    done = {p for p, _ in chunk}
    r = np.asarray([r for g in graded[: max(done) + 1] for r in g.rewards], dtype=np.float64)
    return float(np.nanmean(r)) if (~np.isnan(r)).any() else None


def _grade_chunk(rewards: Rewards, kept: list, graded: list, chunk: list, outs: list) -> None:
    """Grade a batch's completions as GRPO grades its rollouts (train/grpo.py GRPOTrainer.generate)."""
    conversational = not isinstance(kept[0][1], str)
    prompts = [kept[p][1] for p, _ in chunk]
    shown = [[{"role": "assistant", "content": o.text}] for o in outs] if conversational else [o.text for o in outs]
    keys = list(kept[chunk[0][0]][2])
    columns = {key: [kept[p][2].get(key) for p, _ in chunk] for key in keys}
    wheres = [kept[p][3] for p, _ in chunk]
    scores = rewards.score(prompts, shown, [list(o.tokens) for o in outs], columns, wheres)
    total = weighted_sum(scores, rewards.weights)
    for (p, _), o, sc, r in zip(chunk, outs, scores, total):
        g = graded[p]
        g.texts.append(o.text)
        g.n_tokens.append(len(o.tokens))
        g.stops.append(o.stop)
        g.scores.append([float(v) for v in sc])
        g.rewards.append(float(r))


def evaluate_graded(model_path, task_path, reward_specs: list[str], weights: Optional[list[float]] = None, *,
                    settings: GradedSettings = GradedSettings(), backend="cpu", lora=None, lora_scale=None,
                    progress: Optional[Callable[[GradedProgress], None]] = None) -> Comparison:
    """eval MODEL TASK.jsonl --reward ...: the model's (with `lora`: the base's and the adapted
    model's) completions of the task's prompts, graded (see the module docstring)."""
    s = settings.check()
    rewards = Rewards.of(reward_specs, weights)  # a user's reward file is imported here
    base = as_model(model_path)
    kept, dropped, _ = read_prompts(base, task_path, rewards, None, s.ctx - s.max_completion_length)
    if dropped:  # GRPO skips them; an evaluation that skipped prompts would not be over the task
        raise LlmtuneError(f"{task_path}: {dropped} prompt(s) leave no room for --max-completion-length "
                           f"{s.max_completion_length} tokens in --ctx {s.ctx}: raise --ctx or lower "
                           f"--max-completion-length")
    kept = kept[: s.limit] if s.limit else kept
    threshold = (s.pass_reward if s.pass_reward is not None
                 else float(sum(w * g.best for w, g in zip(rewards.weights, rewards.graders))))
    confusion_of = [(n, g.column) for n, g in zip(rewards.names, rewards.graders) if g.kind == "exact"]
    graders = [(n, g.spec, float(w)) for n, g, w in zip(rewards.names, rewards.graders, rewards.weights)]
    adapted = attach(base, lora, lora_scale)  # checks the adapters before the (long) base run
    run = lambda m, stage: grade_model(m, backend, kept, rewards, s, threshold, confusion_of, stage,  # noqa: E731
                                       progress)
    if not lora:
        try:
            return Comparison(str(task_path), graders, s, run(base, "model"))
        except Interrupted as exc:
            exc.partial = Comparison(str(task_path), graders, s, exc.partial) if exc.partial.prompts else None
            raise
    try:
        base_res = run(base, "base")
    except Interrupted as exc:
        exc.partial = None  # no adapter column yet: nothing to compare
        raise
    try:
        return Comparison(str(task_path), graders, s, run(adapted, "adapter"), base_res)
    except Interrupted as exc:
        part = exc.partial
        if part.prompts:
            base_res.prompts = base_res.prompts[: len(part.prompts)]
            exc.partial = Comparison(str(task_path), graders, s, part, base_res)
        else:
            exc.partial = None
        raise
