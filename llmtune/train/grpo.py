"""GRPO with verifiable rewards (--method grpo), as TRL's GRPOTrainer computes it.

- Data: prompt records {"prompt", <columns>} (train/records.py's "prompt" format): a string
  prompt tokenized as the preference methods tokenize theirs (train/chat.py prompt_ids: BOS per the
  model's flags), a message list rendered with the chat template and its generation prompt.
- A step takes batch / ctx completions: batch / ctx / G prompts, each sampled G times
  (--num-generations) with the trainer's live weights (a rollout function handed in by the
  workflow: eval/generate.py PolicySampler, since train/ never imports eval/), at --temperature
  and --top-p, up to --max-completion-length tokens or an end-of-generation token (kept, as TRL's
  completion mask keeps the EOS). Completion j of step s is sampled with the seed
  SeedSequence([--seed, 0, s, j]): a resumed run draws what an uninterrupted one draws.
- Rewards (train/rewards.py): one column per grader, NaN for None; TRL's sum_then_normalize: the
  weighted nan-sum per completion (NaN where every grader said None), advantages the reward less
  its group's nan-mean, divided by the group's (scale_rewards group) or the batch's (batch) nan-std
  (Bessel) + 1e-4, or not (none); NaN advantages become 0.
- Windows: each completion one window laid out as a preference pair with its chosen branch only
  (train/preference.py TRUNK / CHOSEN parts): the prompt less its last token, then the completion.
  Log-probabilities come from PreferenceTrainer's forward pass, divided by the temperature first
  (TRL's logits / temperature): TemperedTokenNLL.
- The loss (grpo_loss, float64 numpy, TRL's _compute_loss line for line): ratio exp(logp - old),
  clipped to [1 - epsilon, 1 + epsilon_high], -min(ratio A, clipped A) per token, plus beta x
  TRL's k3 KL to the reference times the ratio (use_bias_correction_kl), normalised by loss_type:
  grpo (each completion's token mean, then the mean), bnpo and dapo (the batch's token mean: one
  optimizer step per generation batch makes them equal), dr_grpo (sum / (completions x
  max_completion_length)). Its gradient per token seeds the training pass (WeightedTokenNLL's
  token weights), as the preference methods' does.
- num_iterations: each generation batch trains that many optimizer steps; old_logp is the
  generation-time policy's. The batch in flight is kept in checkpoints.
- The reference (beta > 0): the trained values as training starts (a new LoRA adapter's B is 0:
  the base; --lora-init's adapter; a full finetune's tensors), kept as a copy of the trainable
  buffer (and in checkpoints) and swapped in for one forward pass per generation batch, so no
  second model is held.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.tokenizer.chat_template import ChatTemplate, ChatTemplateError, encode
from llmtune.train import guard
from llmtune.train.chat import pad_token, prompt_ids
from llmtune.train.data import Holdout, TrainValSplit
from llmtune.train.preference import CHOSEN, PAD, TRUNK, Objective, PairLayout, PreferenceTrainer
from llmtune.train.programs import WeightedTokenNLL
from llmtune.train.records import read_records
from llmtune.train.rewards import RewardError, Rewards, weighted_sum
from llmtune.train.trainer import RunningStats

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ROLLOUT_STREAM, VAL_STREAM = 0, 1  # SeedSequence keys of the training and validation samples


@dataclass(frozen=True)
class GRPOSettings:
    """The loss's and the rollouts' settings (TRL's GRPOConfig names)."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    num_iterations: int = 1

    @classmethod
    def of(cls, cfg) -> "GRPOSettings":
        return cls(cfg.num_generations, cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.loss_type,
                   cfg.scale_rewards, cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.num_iterations)


# ------------------------------------------------------------------------------------ data
@dataclass
class PromptBatch:
    """The prompts of a step (or of the validation pass), each to be sampled G times."""

    ids: list  # token ids of each prompt
    prompts: list  # as the records give them (str or messages): the rewards' `prompts`
    columns: list  # each record's other columns
    wheres: list
    iteration: int = 0  # which of num_iterations optimizer steps over its generation this is


@dataclass
class PromptDataset(TrainValSplit):
    """Prompt records as windows for the loop: training window ((p * iterations) + i) * G + g is
    completion g of training prompt p at iteration i (the loop's order keeps a step's windows one
    prompt batch at one iteration), validation window n_train + p * G + g completion g of held-out
    prompt p. Each step gathers batch / ctx windows: its prompts (PromptBatch)."""

    ids: list
    prompts: list
    columns: list
    wheres: list
    n_ctx: int
    generations: int
    iterations: int
    prompts_per_step: int
    n_train: int  # windows (train prompts x G x iterations)
    n_val: int  # windows (held-out prompts x G)
    n_dropped: int = 0
    format: str = "prompt"
    template: object = None
    pad_id: int = 0

    @property
    def n_train_prompts(self) -> int:
        return self.n_train // (self.generations * self.iterations)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: iterations per full batch of prompts (the prompts that do not
        fill a last batch wait for the next epoch, as windows do)."""
        return self.n_train_prompts // self.prompts_per_step * self.iterations

    def train_order(self, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The prompts in a shuffled order (numpy default_rng([seed, epoch]), as every dataset), in
        batches of prompts_per_step, each batch's windows repeated for its iterations; the windows
        of prompts that fill no batch last (no step reaches them)."""
        prompts = np.arange(self.n_train_prompts)
        if shuffle:
            np.random.default_rng([seed, epoch]).shuffle(prompts)
        g, it, k = self.generations, self.iterations, self.prompts_per_step
        full = len(prompts) // k * k
        order = []
        for s in range(0, full, k):
            for i in range(it):
                order += [(p * it + i) * g + j for p in prompts[s : s + k] for j in range(g)]
        order += [(p * it + i) * g + j for p in prompts[full:] for i in range(it) for j in range(g)]
        return np.asarray(order, dtype=np.int64)

    def decode(self, window: int) -> tuple[int, int]:
        """(prompt index, iteration) of a window."""
        g, it = self.generations, self.iterations
        if window >= self.n_train:
            return self.n_train_prompts + (window - self.n_train) // g, 0
        return window // g // it, (window // g) % it

    def gather(self, indices) -> tuple[np.ndarray, None, PromptBatch]:
        """(the windows, None, their prompts): the trainer samples and lays out the completions."""
        indices = np.asarray(indices, dtype=np.int64)
        seen, its = [], set()
        for w in indices:
            p, i = self.decode(int(w))
            its.add(i)
            if p not in seen:
                seen.append(p)
        return indices, None, PromptBatch([self.ids[p] for p in seen], [self.prompts[p] for p in seen],
                                          [self.columns[p] for p in seen], [self.wheres[p] for p in seen],
                                          max(its) if its else 0)

    @property
    def tokens(self) -> int:
        return int(sum(len(i) for i in self.ids))

    def info(self, seqs_per_epoch: int) -> dict:
        """What the start report says about the prompts (train/chat.py data_info's keys)."""
        return {"format": "prompt", "examples": len(self.ids), "dropped": self.n_dropped, "truncated": 0,
                "conversational": self.template is not None, "loss_tokens": 0, "loss_tokens_per_epoch": 0,
                "padding": 0.0}


def read_prompts(model, data_path, rewards: Rewards, chat_template: Optional[str],
                 room: int) -> tuple[list, int, object]:
    """(kept, dropped, template) of a prompt file (--method grpo, eval --reward): kept holds
    (ids, prompt, columns, where) of each record whose prompt has 1 to `room` tokens; a string
    prompt tokenized as the preference methods tokenize theirs, a message list rendered with the
    chat template (--chat-template or the model's) and its generation prompt. Every record must
    hold the columns the built-in graders read."""
    records = read_records(data_path, "prompt")
    conversational = not isinstance(records.items[0][0], str)
    template = ChatTemplate.for_model(model.gguf, model.tokenizer, chat_template) if conversational else None
    if chat_template is not None and not conversational:
        raise LlmtuneError(f"--chat-template: {data_path} holds plain-string prompts, not conversations")
    need = rewards.columns()
    kept, dropped = [], 0
    for (prompt, columns), where in zip(records.items, records.wheres):
        if isinstance(prompt, str) == conversational:
            raise LlmtuneError(f"{where}: a {'plain-string' if conversational else 'conversational'} prompt among "
                               f"{'conversational' if conversational else 'plain-string'} ones")
        for column, spec in need.items():
            if column not in columns:
                raise LlmtuneError(f"{where}: prompt record has no \"{column}\" column (--reward {spec} reads it)")
        if isinstance(prompt, str):
            ids = prompt_ids(model.tokenizer, prompt)
        else:
            try:
                ids = encode(model.tokenizer, template.render(prompt, add_generation_prompt=True))
            except ChatTemplateError as exc:
                raise LlmtuneError(f"{where}: {exc}") from None
        if not ids or len(ids) > room:
            dropped += 1
            continue
        kept.append((np.asarray(ids, dtype=np.int32), prompt, columns, where))
    return kept, dropped, template


def build_prompts(model, data_path, cfg, rewards: Rewards) -> tuple[PromptDataset, int]:
    """(dataset, n prompt tokens) of a prompt file for --method grpo; every record must hold the
    columns the built-in graders read, and every prompt leave --max-completion-length tokens of --ctx."""
    fmt = "prompt" if cfg.format == "auto" else cfg.format
    if fmt != "prompt":
        raise LlmtuneError(f"--method grpo: --format {fmt}: GRPO reads prompt records {{\"prompt\", <columns>}} "
                           f"(--format prompt or auto)")
    room = cfg.ctx - cfg.max_completion_length
    kept, dropped, template = read_prompts(model, data_path, rewards, cfg.chat_template, room)
    if not kept:
        raise LlmtuneError(f"{data_path}: no prompt leaves --max-completion-length {cfg.max_completion_length} tokens "
                           f"of --ctx {cfg.ctx}: raise --ctx or lower --max-completion-length")
    kept, n_train, n_val = Holdout.of(cfg.holdout).arrange(kept, str(data_path), "prompt(s)")
    g, it = cfg.num_generations, cfg.num_iterations
    ds = PromptDataset([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept], [k[3] for k in kept],
                       cfg.ctx, g, it, cfg.batch // cfg.ctx // g, n_train * g * it, n_val * g, dropped,
                       template=template, pad_id=pad_token(model.tokenizer))
    return ds, ds.tokens


# ------------------------------------------------------------------------------------ rewards -> advantages
def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """TRL's nanstd: Bessel-corrected over the non-NaN values, NaN where there are fewer than 2."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
        count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
        var = np.where(count > 1, var * count / np.maximum(count - 1, 1), np.nan)
        std = np.sqrt(var)
    return std.squeeze() if axis is None else np.squeeze(std, axis=axis)


def advantages(rewards_per_func: np.ndarray, weights: np.ndarray, generations: int,
               scale: str = "group") -> tuple[np.ndarray, np.ndarray, dict]:
    """(advantages [n], rewards [n] (NaN: no grader scored it), metrics) of rewards per grader [n, k]
    in groups of `generations` consecutive completions: TRL's sum_then_normalize."""
    with np.errstate(invalid="ignore"):
        rewards = weighted_sum(rewards_per_func, weights)
        grouped = rewards.reshape(-1, generations)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.repeat(np.nanmean(grouped, axis=1), generations)
            group_std = np.repeat(_nanstd(grouped, axis=1), generations)
            std = group_std if scale in ("group", "none") else np.full_like(rewards, _nanstd(rewards))
            adv = rewards - mean
            if scale != "none":
                adv = adv / (std + 1e-4)
            adv = np.nan_to_num(adv, nan=0.0)
            metrics = {"reward": float(np.nanmean(rewards)), "reward_std": float(_nanstd(rewards)),
                       "frac_reward_zero_std": float(np.isclose(std, 0.0).mean())}
    return adv, rewards, metrics


# ------------------------------------------------------------------------------------ the loss
def grpo_loss(logp: np.ndarray, old: np.ndarray, ref: Optional[np.ndarray], mask: np.ndarray, adv: np.ndarray,
              s: GRPOSettings) -> tuple[float, np.ndarray, dict]:
    """(loss, d loss / d logp [n, T], metrics) of completions' per-token log-probabilities logp [n, T]
    under the policy, old (the generation-time policy's) and ref (the reference's; with beta > 0),
    mask [n, T] (1: a completion token), advantages [n]: TRL's GRPOTrainer._compute_loss in float64
    (importance_sampling_level token, use_bias_correction_kl, no delta, no entropy mask)."""
    m = np.asarray(mask, dtype=np.float64)
    on = m > 0
    lp = np.where(on, np.asarray(logp, dtype=np.float64), 0.0)
    a = np.asarray(adv, dtype=np.float64)[:, None]
    lo, hi = 1.0 - s.epsilon, 1.0 + (s.epsilon if s.epsilon_high is None else s.epsilon_high)
    ratio = np.exp(lp - np.where(on, old, 0.0))
    clipped = np.clip(ratio, lo, hi)
    un, cl = ratio * a, clipped * a
    per_token = -np.minimum(un, cl)
    # torch.minimum's gradient: to the smaller, split evenly on a tie; clamp's passes within [lo, hi]
    w_un = np.where(un < cl, 1.0, np.where(un == cl, 0.5, 0.0))
    inside = (ratio >= lo) & (ratio <= hi)
    d = -(w_un * un + (1.0 - w_un) * np.where(inside, un, 0.0))  # d(ratio)/d(logp) = ratio
    metrics: dict = {}
    n_tok = max(m.sum(), 1.0)
    if s.beta:
        diff = np.where(on, np.asarray(ref, dtype=np.float64), 0.0) - lp
        kl = np.exp(diff) - diff - 1.0
        per_token = per_token + s.beta * kl * ratio
        d = d + s.beta * ((1.0 - np.exp(diff)) * ratio + kl * ratio)
        metrics["kl"] = float((kl * ratio * m).sum() / n_tok)  # TRL logs the corrected per-token KL
    n = lp.shape[0]
    if s.loss_type == "grpo":
        per_seq = np.maximum(m.sum(axis=1, keepdims=True), 1.0)
        scale = m / per_seq / n
    elif s.loss_type in ("bnpo", "dapo"):
        scale = m / n_tok
    elif s.loss_type == "dr_grpo":
        scale = m / (n * s.max_completion_length)
    else:
        raise ValueError(f"unknown GRPO loss type {s.loss_type!r}")
    loss = float((per_token * scale).sum())
    low = (ratio < lo) & (a < 0)
    high = (ratio > hi) & (a > 0)
    metrics.update({"clip_ratio/low_mean": float((low * m).sum() / n_tok),
                    "clip_ratio/high_mean": float((high * m).sum() / n_tok),
                    "clip_ratio/region_mean": float(((low | high) * m).sum() / n_tok)})
    return loss, d * scale, metrics


class TemperedTokenNLL:
    """programs.WeightedTokenNLL of the logits divided by the sampling temperature (TRL's
    logits / temperature before its log-softmax)."""

    selects_rows = False

    def __init__(self, temperature: float):
        self.inv = 1.0 / float(temperature)

    def _logits(self, logits):
        return logits if self.inv == 1.0 else ops.scale(logits, self.inv)

    def train(self, logits, targets):
        nll = ops.token_nll(self._logits(logits), targets)
        return [nll], nll, ops.input((targets.shape[0],), name="token_weights")

    def train_chunked(self, x, w, targets, chunk: int, cap: float):
        """train over vocabulary chunks (programs.StepPrograms.loss_of): logits / T = (x / T) W^T;
        None (the whole logits) under a final softcap, which comes before the temperature."""
        return None if cap else WeightedTokenNLL.train_chunked(self._logits(x), w, targets, chunk, cap)

    def evaluate(self, logits, targets):
        return [ops.token_nll(self._logits(logits), targets)]


# ------------------------------------------------------------------------------------ trainer
@dataclass
class Generation:
    """A generation batch: its completions laid out as windows, and what its optimizer steps read."""

    inputs: np.ndarray  # int32 [n, n_ctx]
    targets: np.ndarray  # int32 [n, n_ctx] (-1 off the completions)
    parts: np.ndarray  # int32 [n, n_ctx] (TRUNK, CHOSEN, PAD)
    old: np.ndarray  # float64 [n, n_ctx]: the generation-time policy's log-probabilities
    ref: Optional[np.ndarray]  # float64 [n, n_ctx]: the reference's (beta > 0)
    adv: np.ndarray  # float64 [n]
    rewards: np.ndarray  # float64 [n, k] per grader (NaN: None)
    lengths: np.ndarray  # int64 [n]: completion tokens
    truncated: np.ndarray  # bool [n]: stopped at --max-completion-length
    metrics: dict = field(default_factory=dict)

    @property
    def mask(self) -> np.ndarray:
        return (self.targets >= 0) & (self.parts == CHOSEN)

    def arrays(self) -> dict:
        out = {"grpo_inputs": self.inputs, "grpo_targets": self.targets, "grpo_parts": self.parts,
               "grpo_old": self.old, "grpo_adv": self.adv, "grpo_rewards": self.rewards,
               "grpo_lengths": self.lengths, "grpo_truncated": self.truncated.astype(np.uint8)}
        return out if self.ref is None else {**out, "grpo_ref": self.ref}

    @classmethod
    def from_arrays(cls, a: dict) -> "Generation":
        return cls(a["grpo_inputs"], a["grpo_targets"], a["grpo_parts"], a["grpo_old"], a.get("grpo_ref"),
                   a["grpo_adv"], a["grpo_rewards"], a["grpo_lengths"], a["grpo_truncated"].astype(bool))


def sample_seeds(seed: int, stream: int, step: int, n: int) -> list[int]:
    """The sampler seed of each of a step's n completions."""
    return [int(np.random.SeedSequence([seed, stream, step, j]).generate_state(1)[0]) for j in range(n)]


class GRPOTrainer(PreferenceTrainer):
    """The trainer of --method grpo: PreferenceTrainer's forward pass and weighted training pass
    over completion windows, the completions sampled by `rollout(trainer, n_ctx)` (a callable
    sample(prompt_ids, n, max_tokens, temperature, top_p, seeds) -> completions' token ids, built
    at the first step), the loss grpo_loss. train_step / evaluate take the step's PromptBatch."""

    def __init__(self, model, backend, *, settings: GRPOSettings, rewards: Rewards, rollout: Callable,
                 completions_log: Optional[str] = None, **kw):
        self.settings, self.rewards, self.rollout_factory = settings, rewards, rollout
        self.completions_log = Path(completions_log) if completions_log else None
        self.sampler = None
        self.generation: Optional[Generation] = None
        self.ref_weights: Optional[np.ndarray] = None
        self.template = None
        super().__init__(model, backend, objective=Objective("grpo"), loss=TemperedTokenNLL(settings.temperature), **kw)
        if settings.beta:  # the reference: the trained values as they start
            self.ref_weights = np.array(self.backend.to_numpy(self.flat_w), dtype=np.float32)

    # ------------------------------------------------------------------ rollouts
    def rollout(self):
        """The sampler of completions, made once (its generator's buffers when it first samples)."""
        if self.sampler is None and self.rollout_factory is not None:
            self.sampler = self.rollout_factory(self, self.n_ctx)
        return self.sampler

    def memory_bytes(self) -> dict[str, int]:
        """The training estimate, plus the rollout's (its KV cache) for a step's prompts x G."""
        g = self.settings.num_generations
        rollout_bytes = getattr(self.rollout(), "memory_bytes", lambda n_prompts, n: {})
        return {**super().memory_bytes(), **rollout_bytes(max(1, self.n_batch // self.n_ctx // g), g)}

    def _sample(self, batch: PromptBatch, seeds: list[int]) -> list[list[int]]:
        self.rollout()
        s = self.settings
        return self.sampler([list(map(int, ids)) for ids in batch.ids], s.num_generations, s.max_completion_length,
                            s.temperature, s.top_p, seeds)

    def _windows(self, prompts: list, completions: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each completion's window: the prompt less its last token (TRUNK), then the completion
        (CHOSEN, its first input the prompt's last token), then padding."""
        n = len(completions)
        x = np.full((n, self.n_ctx), self.model.tokenizer.eos_id or 0, dtype=np.int32)
        y = np.full((n, self.n_ctx), -1, dtype=np.int32)
        parts = np.full((n, self.n_ctx), PAD, dtype=np.int32)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            at = len(p) - 1
            x[r, :at], parts[r, :at] = p[:-1], TRUNK
            if not c:
                continue
            x[r, at], x[r, at + 1 : at + len(c)] = p[-1], c[:-1]
            y[r, at : at + len(c)], parts[r, at : at + len(c)] = c, CHOSEN
        return x, y, parts

    def logps(self, x: np.ndarray, y: np.ndarray, parts: np.ndarray) -> np.ndarray:
        """Per-token log-probabilities (tempered) under the current weights, 0 off the completions."""
        nll = self.token_nll(x, y, PairLayout(parts, None))
        return np.where((y >= 0) & (parts == CHOSEN), -nll, 0.0)

    def reference_logps(self, x, y, parts) -> np.ndarray:
        """The reference's: its values swapped into the trainable buffer for one forward pass."""
        be = self.backend
        now = np.array(be.to_numpy(self.flat_w), dtype=np.float32)
        self.flat_w[...] = be.asarray(self.ref_weights.astype(be.dtype, copy=False))
        try:
            return self.logps(x, y, parts)
        finally:
            self.flat_w[...] = be.asarray(now.astype(be.dtype, copy=False))

    def generate(self, batch: PromptBatch, stream: int, step: int) -> Generation:
        """A generation batch: G completions of each prompt, their rewards and advantages, the
        generation-time and reference log-probabilities."""
        s, tok = self.settings, self.model.tokenizer
        g = s.num_generations
        n = len(batch.ids) * g
        completions = self._sample(batch, sample_seeds(self.seed, stream, step, n))
        texts = [b"".join(tok.token_to_bytes(t, special=False) for t in c).decode("utf-8", "replace")
                 for c in completions]
        conversational = not isinstance(batch.prompts[0], str)
        shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        prompts = [p for p in batch.prompts for _ in range(g)]
        wheres = [w for w in batch.wheres for _ in range(g)]
        keys = list(batch.columns[0])
        columns = {k: [c.get(k) for c in batch.columns for _ in range(g)] for k in keys}
        rewards = self.rewards.score(prompts, shown, [list(c) for c in completions], columns, wheres)
        adv, total, metrics = advantages(rewards, self.rewards.weights, g, s.scale_rewards)
        x, y, parts = self._windows([ids for ids in batch.ids for _ in range(g)], completions)
        old = self.logps(x, y, parts)
        ref = self.reference_logps(x, y, parts) if s.beta else None
        lengths = np.asarray([len(c) for c in completions], dtype=np.int64)
        eog = self._eog()
        truncated = np.asarray([not c or c[-1] not in eog for c in completions], dtype=bool)
        gen = Generation(x, y, parts, old, ref, adv, rewards, lengths, truncated)
        gen.metrics = {**metrics, **self._reward_metrics(gen)}
        self._log_completions(step + 1 if stream == ROLLOUT_STREAM else step, prompts, texts, gen,
                              "train" if stream == ROLLOUT_STREAM else "validation")
        return gen

    def _eog(self) -> set:
        from_sampler = getattr(self.sampler, "eog", None)
        return set(from_sampler) if from_sampler is not None else {self.model.tokenizer.eos_id}

    def _reward_metrics(self, gen: Generation) -> dict:
        """TRL's per-grader and completion-length metrics."""
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for i, name in enumerate(self.rewards.names):
                out[f"rewards/{name}/mean"] = float(np.nanmean(gen.rewards[:, i]))
                out[f"rewards/{name}/std"] = float(_nanstd(gen.rewards[:, i]))
        lengths = gen.lengths.astype(np.float64)
        out.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                    "completions/max_length": float(lengths.max()),
                    "completions/clipped_ratio": float(gen.truncated.mean())})
        return out

    def _log_completions(self, step: int, prompts: list, texts: list, gen: Generation, split: str) -> None:
        """--completions-log: one JSON line per completion (the step it trains, or after which it
        validates; train or validation; prompt, completion, rewards, reward, advantage, tokens)."""
        if self.completions_log is None or not self.comm.is_root:
            return
        total = np.nansum(gen.rewards * self.rewards.weights[None, :], axis=1)
        with open(self.completions_log, "a", encoding="utf-8") as fh:
            for j, (p, t) in enumerate(zip(prompts, texts)):
                rec = {"step": step, "split": split, "prompt": p, "completion": t,
                       "rewards": {name: (None if math.isnan(v) else float(v))
                                   for name, v in zip(self.rewards.names, gen.rewards[j])},
                       "reward": float(total[j]), "advantage": float(gen.adv[j]), "tokens": int(gen.lengths[j])}
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs, targets, lr: float, stats: RunningStats, batch: PromptBatch = None) -> float:
        """One optimizer step: a new generation batch at a batch's first iteration (the one in
        flight at the others), the loss and its gradient per token, the weighted training pass."""
        if batch.iteration == 0 or self.generation is None:
            self.generation = self.generate(batch, ROLLOUT_STREAM, self.steps_done)
            logp = self.generation.old
        else:
            logp = self.logps(self.generation.inputs, self.generation.targets, self.generation.parts)
        gen = self.generation
        mask = gen.mask
        guard.check_logps(self, {"sampled": ((logp * mask).sum(axis=1), mask.sum(axis=1))}, "sampled")
        loss, metrics = self.gradient(gen, logp)
        sum_squares = guard.check_step(self, loss)
        stats.add(loss, 0, 0)
        self.step_metrics = {**gen.metrics, **metrics}
        self.update(lr, sum_squares)
        guard.check_weights(self)
        return loss

    def gradient(self, gen: Generation, logp: np.ndarray) -> tuple[float, dict]:
        """The loss of a generation batch given the policy's log-probabilities logp, and its
        gradient in flat_g: the training pass seeded with each token's d loss / d NLL."""
        be = self.backend
        mask = gen.mask
        loss, d_logp, metrics = grpo_loss(logp, gen.old, gen.ref, mask, gen.adv, self.settings)
        weights = np.where(mask, -d_logp, 0.0)  # d loss / d NLL = - d loss / d logp
        per_pass = weights.reshape(self.ubatches_per_step, -1).astype(be.dtype)
        self.batches.run(gen.inputs, gen.targets, gen.parts, self.batches.counts(gen.targets),
                         lambda u: {"token_weights": be.asarray(per_pass[u])}, lambda u, out: None)
        return loss, metrics

    def evaluate(self, inputs, targets, stats: RunningStats, batch: PromptBatch = None) -> None:
        """The held-out prompts sampled G times (seeds of their own stream, by the step): each
        completion's negative reward recorded as its loss (val_loss = -mean reward), the reward
        metrics as eval_metrics."""
        gen = self.generate(batch, VAL_STREAM, self.steps_done) if batch.ids else None
        if gen is None:
            return
        total = np.nansum(gen.rewards * self.rewards.weights[None, :], axis=1)
        scored = ~np.isnan(gen.rewards).all(axis=1)
        stats.add_many(-total[scored], 0, 0)
        self.eval_metrics = {k: v for k, v in gen.metrics.items() if k.startswith(("reward", "completions/"))}

    # ------------------------------------------------------------------ checkpoints
    def state_arrays(self) -> dict:
        out = super().state_arrays()
        if self.ref_weights is not None:
            out["grpo_ref_weights"] = self.ref_weights
        return out if self.generation is None else {**out, **self.generation.arrays()}

    def load_state(self, arrays: dict, steps_done: int) -> None:
        super().load_state(arrays, steps_done)
        if self.settings.beta:
            ref = arrays.get("grpo_ref_weights")
            if ref is None or ref.shape != (self.n_trainable,):
                raise LlmtuneError("damaged checkpoint (no reference weights for --beta)")
            self.ref_weights = np.asarray(ref, dtype=np.float32)
        self.generation = Generation.from_arrays(arrays) if "grpo_inputs" in arrays else None
        if self.completions_log is not None and self.completions_log.exists():
            self._trim_log(steps_done)

    def _trim_log(self, steps_done: int) -> None:
        """--completions-log as it was at the checkpoint: lines of later steps (an interrupted run's) dropped."""
        keep = []
        for line in self.completions_log.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                if json.loads(line).get("step", 0) > steps_done:
                    continue
            except json.JSONDecodeError:
                continue
            keep.append(line)
        self.completions_log.write_text("".join(keep), encoding="utf-8")


def reward_error(exc: RewardError, last_checkpoint) -> RewardError:
    """A reward's failure mid-run, naming the checkpoint the run keeps."""
    tail = f"; the last checkpoint is {last_checkpoint}" if last_checkpoint else ""
    return RewardError(f"{exc}{tail}")
