"""Token samplers exactly as llama.cpp's default chain (common/sampling.cpp, src/llama-sampler.cpp):

    logits -> penalties -> top-k -> top-p -> min-p -> temperature -> dist

- penalties: each of the last `repeat_last_n` tokens (prompt included, as llama-completion
  accepts it) has its logit divided by `repeat_penalty` when positive, multiplied when not;
- top-k keeps the k largest logits (sorted, descending); 0 disables it;
- top-p keeps the smallest sorted prefix whose softmax mass reaches p; 1 disables it;
- min-p keeps the logits within log(p) of the largest; 0 disables it;
- temperature divides the logits; temp <= 0 keeps only the largest (greedy);
- dist draws one candidate from the softmax of what is left, with std::mt19937 seeded by `seed`
  and std::uniform_real_distribution<double> (libstdc++'s generate_canonical: two 32-bit draws),
  so a seed gives llama.cpp's choices whenever the logits agree closely enough.

Candidate order matters to dist (the cumulative sum walks it), so it is kept as llama.cpp keeps it:
token-id order until a sampler sorts, descending afterwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llmtune.errors import LlmtuneError

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a random one


@dataclass
class SamplerConfig:
    """llama.cpp's defaults (common_params_sampling)."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: Optional[int] = None  # None: a random seed (reported in the result)

    def checked(self) -> "SamplerConfig":
        if not np.isfinite(self.temp):
            raise LlmtuneError(f"--temp: must be a number, got {self.temp}")
        if not 0 <= self.top_p <= 1 or not np.isfinite(self.top_p):
            raise LlmtuneError(f"--top-p: must be in [0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1 or not np.isfinite(self.min_p):
            raise LlmtuneError(f"--min-p: must be in [0, 1], got {self.min_p}")
        if not self.repeat_penalty > 0 or not np.isfinite(self.repeat_penalty):
            raise LlmtuneError(f"--repeat-penalty: must be positive, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise LlmtuneError(f"--repeat-last-n: must be >= 0, got {self.repeat_last_n}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise LlmtuneError(f"--seed: must be in [0, 2^32), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temp <= 0


class CanonicalUniform:
    """std::uniform_real_distribution<double>(0, 1) over std::mt19937(seed), as libstdc++ draws it:
    (a + b * 2^32) / 2^64 from two consecutive 32-bit outputs. numpy's legacy RandomState seeded
    with an integer is the same generator (init_genrand), and its 32-bit draws are mt19937's."""

    def __init__(self, seed: int):
        self._rs = np.random.RandomState(seed & 0xFFFFFFFF)

    def __call__(self) -> float:
        a, b = self._rs.randint(0, 2**32, size=2, dtype=np.uint64).tolist()
        value = (a + b * 4294967296.0) / 18446744073709551616.0
        return value if value < 1.0 else float(np.nextafter(1.0, 0.0))


class Sampler:
    """One generation's sampler: its configuration, the penalty history and the random state."""

    def __init__(self, cfg: SamplerConfig):
        self.cfg = cfg.checked()
        self.seed = int(cfg.seed) if cfg.seed is not None else int(np.random.SeedSequence().entropy % DEFAULT_SEED)
        self.uniform = CanonicalUniform(self.seed)
        self.prev: deque[int] = deque(maxlen=max(cfg.repeat_last_n, 1))
        self.penalties_on = cfg.repeat_last_n > 0 and cfg.repeat_penalty != 1.0
        self.banned = np.zeros(0, dtype=np.int64)
        self._buf: Optional[tuple] = None  # _dist's scratch arrays

    def ban(self, tokens) -> None:
        """Never sample these tokens: llama.cpp's logit bias of -inf, the first sampler of its
        chain (--ignore-eos bans every end-of-generation token this way)."""
        self.banned = np.asarray(sorted(set(int(t) for t in tokens)), dtype=np.int64)

    def accept(self, token: int) -> None:
        """Record a token of the context (prompt or generated) for the repetition penalty."""
        if self.penalties_on:
            self.prev.append(int(token))

    def sample(self, logits: np.ndarray) -> int:
        """The next token from logits [n_vocab] (not modified)."""
        cfg = self.cfg
        if self.banned.size:
            logits = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
            logits[self.banned[self.banned < logits.size]] = -np.inf
        if cfg.greedy and not self.penalties_on:
            self.uniform()  # llama.cpp's dist still draws once per token
            return int(np.argmax(logits))
        logit = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        ids = np.arange(logit.size)
        sorted_ = False
        if self.penalties_on and self.prev:
            seen = np.unique(np.fromiter(self.prev, dtype=np.int64))
            seen = seen[seen < logit.size]
            vals = logit[seen]
            logit[seen] = np.where(vals <= 0, vals * np.float32(cfg.repeat_penalty),
                                   vals / np.float32(cfg.repeat_penalty))
        # top-k
        if cfg.top_k > 0:
            k = min(cfg.top_k, logit.size)
            top = np.argpartition(-logit, k - 1)[:k] if k < logit.size else np.arange(logit.size)
            top = top[np.argsort(-logit[top], kind="stable")]
            ids, logit, sorted_ = ids[top], logit[top], True
        # top-p
        if cfg.top_p < 1.0:
            if not sorted_:
                order = np.argsort(-logit, kind="stable")
                ids, logit, sorted_ = ids[order], logit[order], True
            p = np.exp(logit - logit[0])
            p /= p.sum(dtype=np.float32)
            cum = np.cumsum(p, dtype=np.float32)
            hit = np.flatnonzero(cum >= np.float32(cfg.top_p))
            last = int(hit[0]) + 1 if hit.size else logit.size
            ids, logit = ids[:last], logit[:last]
        # min-p
        if cfg.min_p > 0.0 and logit.size:
            if not sorted_:
                keep = logit >= logit.max() + np.float32(np.log(cfg.min_p))
                ids, logit = ids[keep], logit[keep]
            else:
                min_logit = logit[0] + np.float32(np.log(cfg.min_p))
                below = np.flatnonzero(logit[1:] < min_logit)
                last = int(below[0]) + 1 if below.size else logit.size
                ids, logit = ids[:last], logit[:last]
        # temperature
        if cfg.temp <= 0:
            best = int(np.argmax(logit))
            self.uniform()
            return int(ids[best])
        logit = logit / np.float32(cfg.temp)
        return int(ids[self._dist(logit, sorted_)])

    def _dist(self, logit: np.ndarray, sorted_: bool) -> int:
        """llama_sampler_dist_apply: walk the cumulative probabilities in candidate order. (Into
        buffers kept between tokens: a vocabulary's fresh arrays cost more in page faults than in
        arithmetic, and a batch samples many per step; the first cumulative sum >= the target
        found by bisection: the sums only grow.)"""
        rnd = self.uniform()
        n = logit.size
        if n == 1:
            return 0
        if self._buf is None or self._buf[0].size < n:
            self._buf = (np.empty(n, np.float32), np.empty(n, np.float64), np.empty(n, np.float64))
        e, p, cum = (b[:n] for b in self._buf)
        max_l = logit[0] if sorted_ else logit.max()
        np.exp(np.subtract(logit, max_l, out=e), out=e)
        p[...] = e
        target = float(p.sum()) * rnd
        return min(int(np.searchsorted(np.cumsum(p, out=cum), target, side="left")), n - 1)
