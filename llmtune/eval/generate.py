"""`llmtune.generate(...)`: text generation with a KV cache, as llama.cpp's llama-completion.

A `Generator` holds a model on a backend, the KV cache buffers (arch/kvcache.py) and the compiled
forward programs. Feeding tokens runs one program per batch of up to `n_batch` new tokens; the
program writes their k/v into the cache at their positions and returns the last token's logits.
Programs are compiled once per (new tokens, attended cache positions) and reused: a decode step
(one token) only binds the token id and its position, so with `n_kv` rounded up to a block of
positions a whole generation runs a handful of programs. Consecutive prompts share the cached
prefix they have in common (an interactive chat evaluates only each new turn).

The prompt is tokenized as llama-completion does (BOS per the model's flag, special tokens
parsed); generation stops after `n_predict` tokens, at an end-of-generation token (EOS, EOT,
<|im_end|>, <end_of_turn>, ...: llama.cpp's special_eog_ids) or when the context is full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

import numpy as np

from llmtune.arch.kvcache import CacheShape, KVCache
from llmtune.backends import get_backend
from llmtune.errors import LlmtuneError
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.eval.scoring import warn_past_training
from llmtune.graph.planner import Program, ProgramCache, Replay
from llmtune.model.adapter import attach
from llmtune.model.loaded import Model, load_model
from llmtune.quant.qtensor import QTensor
from llmtune.tokenizer.chat_template import encode, eog_ids
from llmtune.tokenizer.tokenizer import incomplete_tail, whole_characters

DEFAULT_N_CTX = 4096  # llama.cpp's common default context; never more than the model's n_ctx_train
DEFAULT_N_BATCH = 512  # prompt tokens per forward pass
MAX_PROGRAMS = 16  # compiled programs kept (least recently used dropped)
GENERATION_LANES = 16  # GRPO's completions decoded together: the rows a compiled cpu product takes (native.MAX_ROWS)


def kv_bucket(n: int, n_ctx: int) -> int:
    """Cache positions a program attends over for n positions in use: a multiple of 64 (of 256
    past 512), at most n_ctx. Few programs, and at most a block of masked positions read."""
    block = 64 if n <= 512 else 256
    return min(n_ctx, -(-n // block) * block)


@dataclass
class GenerateResult:
    prompt_tokens: list[int]
    tokens: list[int]  # generated (the stopping EOG token included)
    text: str  # the generated text (EOG tokens render empty, as llama.cpp prints them)
    stop: str  # "eog", "length" (n_predict reached) or "context" (the context is full)
    seed: int
    n_evaluated: int = 0  # prompt tokens run through the model (less the cached prefix)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    n_ctx: int = 0
    greedy: bool = False  # --temp 0: the seed plays no part in the tokens

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.n_evaluated / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: generated tokens after the first (each one forward pass) per second."""
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


class Generator:
    """A model ready to generate: weights and KV cache on a backend, compiled programs."""

    n_seq = 1  # sequences the cache holds (BatchGenerator: several)

    def __init__(self, model, backend=None, *, n_ctx: Optional[int] = None, n_batch: int = DEFAULT_N_BATCH,
                 values: Optional[dict] = None):

        self.model = model
        self.backend = (backend if backend is not None and not isinstance(backend, str)
                        else get_backend(backend or "cpu"))
        hp = model.hp
        n_ctx = n_ctx or min(hp.n_ctx_train, DEFAULT_N_CTX)
        if n_ctx < 1:
            raise LlmtuneError(f"--ctx: must be positive, got {n_ctx}")
        if n_batch < 1:
            raise LlmtuneError(f"--batch: must be positive, got {n_batch}")
        if model.max_positions is not None and n_ctx > model.max_positions:
            raise LlmtuneError(f"--ctx {n_ctx}: {model.path} has learned positions for {hp.n_ctx_train} tokens only")
        self.n_ctx, self.n_batch = int(n_ctx), int(n_batch)
        warn_past_training(model, self.n_ctx)
        self.shape = CacheShape.of(hp, self.n_ctx, self.n_seq)
        be = self.backend
        # the tensors as the graph binds them (a quantized matrix as its bytes, with the float copies
        # the backend keeps for frozen weights: Backend.bind), or `values` given (a trainer's live
        # weights: samples during training cost no copy)
        self.values = values if values is not None else be.bind(model, float_copies=True)
        self.cache = self.shape.allocate(be)
        self._replays: dict = {}  # decode program -> its Replay (a backend that replays: fixed host input buffers)
        self._programs = ProgramCache(self._compile, keep=MAX_PROGRAMS,
                                      on_drop=lambda prog: self._replays.pop(prog, None))
        self.tokens: list[int] = []  # what the cache holds, position by position
        self.tokenizer = model.tokenizer
        self.eog = eog_ids(self.tokenizer)
        self._tok_buf = np.zeros((1, 1), dtype=np.int32)
        self._pos_buf = np.zeros(1, dtype=np.int32)

    # ------------------------------------------------------------------ programs
    def _compile(self, key: tuple[int, int, Optional[int]]) -> Program:
        """The forward program of n_tok new tokens attending over n_kv cache positions, of every
        sequence of the cache (lane None) or of sequence `lane` alone (its rows of the buffers)."""
        n_tok, n_kv, lane = key
        shape, bufs = self.shape, self.cache
        if lane is not None:
            shape = replace(shape, n_seq=1)
            bufs = {name: buf[lane : lane + 1] for name, buf in bufs.items()}  # views of its rows
        cache = KVCache(shape, n_kv)
        _, nodes, logits = self.model.build(shape.n_seq, n_tok, logits_start=n_tok - 1, cache=cache)
        params = {node: self.values[name] for name, node in nodes.items()}
        params.update({node: bufs[name] for name, node in cache.nodes.items()})
        return Program([logits], self.backend, params=params)

    def _decode_n_kv(self, n_used: int) -> int:
        """The cache positions a decode step attends over, n_used of them in use. A compiled decode
        step attends over the whole cache (it reads only the visible positions): one program for the
        whole generation, where buckets would compile and record one per 64."""
        be = self.backend
        return self.n_ctx if be.replays and be.compiles_steps() else kv_bucket(n_used, self.n_ctx)

    def _run(self, tokens: np.ndarray, n_past: int, lane: Optional[int] = None):
        """Logits of the last of `tokens` (evaluated at positions n_past..), as a backend array [1, V];
        lane: of that sequence of a cache of several (its prefill; None: the cache's one sequence)."""
        n = len(tokens)
        be = self.backend
        n_kv = self._decode_n_kv(n_past + n) if n == 1 else kv_bucket(n_past + n, self.n_ctx)
        prog = self._programs.get((n, n_kv, lane))
        if n == 1 and lane is None:  # the decode step: reuse the host buffers
            self._tok_buf[0, 0], self._pos_buf[0] = tokens[0], n_past
            tok, pos = self._tok_buf, self._pos_buf
            if be.replays:  # the buffers are the graph's inputs themselves: replay
                return self._replay(prog, tok, pos, {0: n_past + 1})
        else:
            tok = np.asarray(tokens, dtype=np.int32).reshape(1, n)
            pos = np.arange(n_past, n_past + n, dtype=np.int32)
        logits = prog.run(tokens=be.asarray(tok), pos=be.asarray(pos))[0]
        self._forget_unwritten({lane or 0: n_past + n})
        return logits

    def _replay(self, prog: Program, tok: np.ndarray, pos: np.ndarray, ends: dict[int, int]):
        """A decode program's logits, replayed on the host buffers tok / pos (its first run records
        the replay); ends: the positions each sequence has written after the step."""
        replay = self._replays.get(prog)
        if replay is None:
            replay = self._replays[prog] = Replay(prog, {"tokens": tok, "pos": pos}, compiled=True)
        recording = replay.calls is None
        logits = replay.run()[0]
        if recording:  # an ordinary run: it read the whole cache
            self._forget_unwritten(ends)
        return logits

    def _forget_unwritten(self, ends: dict[int, int]) -> None:
        """After a pass that read cache positions nothing has written (a prompt's bucket, a
        recording run over the whole cache), sequence g's positions from ends[g] (and past what it
        holds) handed back to the OS: zeros either way. The read mapped them to the kernel's shared
        zero page, and each first write after it would be a copy-on-write fault whose TLB flush
        interrupts the pool's other core: SmolLM2's decode spent 0.28 ms of a 4.9 ms token in its
        cache writes, 0.04 ms with the pages handed back. Only where the decode steps that follow
        read written positions alone (compiled steps); committing the whole cache instead (as
        llama.cpp clears its buffer) took 1.4 GiB more for 8 sequences of 4096."""
        be = self.backend
        if not (be.replays and be.compiles_steps()):
            return
        for g, end in ends.items():
            end = max(end, self._cached_length(g))
            for buf in self.cache.values():
                for h in range(buf.shape[1]):
                    be.release_zeros(buf[g, h, end:])

    def _cached_length(self, seq: int) -> int:
        """Positions sequence seq of the cache holds for later use."""
        return len(self.tokens)

    # ------------------------------------------------------------------ evaluation
    def feed(self, ids: Iterable[int]) -> np.ndarray:
        """Make the cache hold exactly `ids` and return the logits [V] after the last of them:
        the prefix already cached is kept, the rest evaluated in batches of n_batch."""
        ids = self.check_prompt(ids)
        keep = self._common_prefix(ids)
        self.tokens = self.tokens[:keep]
        logits = None
        for start in range(keep, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            logits = self._run(np.asarray(chunk, dtype=np.int32), start)
            self.tokens += chunk
        return np.array(self.backend.to_numpy(logits), dtype=np.float32).reshape(-1)  # (the buffer is reused)

    def check_prompt(self, ids: Iterable[int]) -> list[int]:
        """The ids as ints, or a one-line error when they cannot be fed (empty, longer than the
        context, outside the vocabulary): callable before anything is printed."""
        ids = [int(i) for i in ids]
        if not ids:
            raise LlmtuneError("generate: the prompt is empty")
        if len(ids) > self.n_ctx:
            raise LlmtuneError(f"generate: the prompt has {len(ids)} tokens, more than the context of {self.n_ctx} "
                               "(raise --ctx)")
        bad = [i for i in ids if not 0 <= i < self.model.hp.n_vocab]
        if bad:
            raise LlmtuneError(f"{self.model.path}: token id {bad[0]} is outside the vocabulary of "
                               f"{self.model.hp.n_vocab}")
        return ids

    def step(self, token: int) -> np.ndarray:
        """Append one token to the context and return the logits after it."""
        if len(self.tokens) >= self.n_ctx:
            raise LlmtuneError(f"generate: the context of {self.n_ctx} tokens is full")
        logits = self._run(np.asarray([token], dtype=np.int32), len(self.tokens))
        self.tokens.append(int(token))
        return np.array(self.backend.to_numpy(logits), dtype=np.float32).reshape(-1)  # (the buffer is reused)

    # ------------------------------------------------------------------ generation
    def tokenize_prompt(self, text: str, add_special: bool = True) -> list[int]:
        """llama-completion's common_tokenize(prompt, add_special, parse_special=true)."""
        tok = self.tokenizer
        return tok.encode(text, add_special=add_special and tok.add_bos, parse_special=True)

    def generate(self, prompt_ids: list[int], n_predict: int = -1, sampler: Optional[Sampler] = None,
                 on_token: Optional[Callable[[int, str], None]] = None, stop_at_eog: bool = True) -> GenerateResult:
        """Sample up to n_predict tokens (-1: until EOG or the context is full) after prompt_ids.
        on_token(id, text piece) is called as each token comes (streaming)."""
        sampler = sampler or Sampler(SamplerConfig())
        n_cached = self._common_prefix(prompt_ids)
        t0 = time.perf_counter()
        logits = self.feed(prompt_ids)
        prompt_seconds = time.perf_counter() - t0
        for t in prompt_ids:
            sampler.accept(t)
        out: list[int] = []
        pieces: list[bytes] = []
        t1 = time.perf_counter()
        decoder = _Utf8Stream()
        with self.backend.decode_context():
            stop = self._decode(logits, n_predict, sampler, on_token, stop_at_eog, out, pieces, decoder)
        decode_seconds = time.perf_counter() - t1
        if on_token is not None:
            tail = decoder.flush()
            if tail:
                on_token(-1, tail)
        text = b"".join(pieces).decode("utf-8", "replace")
        return GenerateResult(list(prompt_ids), out, text, stop, sampler.seed, len(prompt_ids) - n_cached,
                              prompt_seconds, decode_seconds, self.n_ctx,
                              greedy=sampler.cfg.greedy)

    def _decode(self, logits, n_predict, sampler, on_token, stop_at_eog, out, pieces, decoder) -> str:
        """The sampling loop: tokens into `out`, their bytes into `pieces`; returns why it stopped."""
        tok = self.tokenizer
        stop = "length"
        while n_predict < 0 or len(out) < n_predict:
            token = sampler.sample(logits)
            sampler.accept(token)
            out.append(token)
            piece = tok.token_to_bytes(token, special=False)
            pieces.append(piece)
            if on_token is not None:
                on_token(token, decoder.push(piece))
            if stop_at_eog and token in self.eog:
                stop = "eog"
                break
            if n_predict >= 0 and len(out) >= n_predict:
                break
            if len(self.tokens) >= self.n_ctx:
                stop = "context"
                break
            logits = self.step(token)
        return stop

    def _common_prefix(self, ids) -> int:
        """Tokens at the start of `ids` the cache holds already, the last of `ids` excepted (it is
        always run: its logits are the answer)."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return min(n, max(len(ids) - 1, 0))

    def memory_bytes(self) -> dict[str, int]:
        itemsize = np.dtype(self.backend.dtype).itemsize
        return {"weights": sum(w.nbytes if isinstance(w, QTensor) else int(np.prod(np.shape(w))) * itemsize
                               for w in self.model.tensors().values()),
                "kv cache": self.shape.nbytes(itemsize),
                "activations": sum(p.memory.planned_bytes for p in self._programs.programs())}


class BatchGenerator(Generator):
    """G sequences generated together (llama.cpp's batched decoding, llama-batched-bench's S_TG):
    the cache holds G sequences (KV buffers [G, n_head_kv, n_ctx, head_dim]) and each decode step
    is one program over G new tokens, each at its own position (positions per sequence [G, 1]:
    arch/kvcache.py), so every weight matrix is read once per step for all G sequences.

    Each prompt is prefilled alone into its own rows of the buffers (the program of a one-sequence
    Generator on views of those rows), so its logits are exactly those of a one-sequence prefill.
    A sequence that stops (an end-of-generation token, n_predict, a full context) stays in the
    batch as padding: its row keeps stepping on its last token at its last position (rewriting its
    own last cache row, which nothing reads any more) and its logits are ignored. So the decode
    program never changes shape (one compiled, replayed program for the whole generation); the
    cost is the work of the finished rows, small next to the weights' reads that every row
    shares."""

    def __init__(self, model, backend=None, *, n_seq: int, n_ctx: Optional[int] = None,
                 n_batch: int = DEFAULT_N_BATCH, values: Optional[dict] = None, share_prompts: bool = False):
        if n_seq < 1:
            raise LlmtuneError(f"--parallel: must be positive, got {n_seq}")
        self.n_seq = int(n_seq)
        self.share_prompts = share_prompts  # a prompt seen earlier in the batch: its k/v copied, not prefilled
        super().__init__(model, backend, n_ctx=n_ctx, n_batch=n_batch, values=values)
        self._tok_buf = np.zeros((self.n_seq, 1), dtype=np.int32)
        # positions per sequence [G, 1]; one sequence's graph takes them as [1] (arch/context.py Batch)
        self._pos_buf = np.zeros((self.n_seq, 1) if self.n_seq > 1 else 1, dtype=np.int32)
        self.lanes: list[list[int]] = [[] for _ in range(self.n_seq)]  # what each sequence's rows hold

    def _cached_length(self, seq: int) -> int:
        return len(self.lanes[seq])

    def prefill(self, lane: int, ids) -> np.ndarray:
        """Evaluate prompt `ids` into sequence `lane`'s rows (from position 0, in batches of
        n_batch) and return the logits [V] after its last token."""
        ids = self.check_prompt(ids)
        logits = None
        for start in range(0, len(ids), self.n_batch):
            logits = self._run(np.asarray(ids[start : start + self.n_batch], dtype=np.int32), start, lane)
        self.lanes[lane] = list(ids)
        return np.array(self.backend.to_numpy(logits), dtype=np.float32).reshape(-1)

    def share_prefix(self, src: int, dst: int) -> None:
        """Sequence dst takes sequence src's cached tokens: their k/v rows copied (what prefilling
        the same tokens into dst writes, bit for bit), as llama.cpp's llama_memory_seq_cp shares
        a prompt among sequences (llama-batched-bench -pps)."""
        n = len(self.lanes[src])
        for buf in self.cache.values():
            buf[dst, :, :n] = buf[src, :, :n]
        self.lanes[dst] = list(self.lanes[src])

    def prefill_all(self, prompts: list[list[int]]) -> np.ndarray:
        """Each prompt into its lane (prompt b into sequence b) -> the logits [len(prompts), V] after
        each; with share_prompts, a prompt equal to an earlier one copies that one's k/v."""
        first: dict[tuple, int] = {}
        rows = []
        for b, ids in enumerate(prompts):
            src = first.get(tuple(ids)) if self.share_prompts else None
            if src is None:
                first[tuple(ids)] = b
                rows.append(self.prefill(b, ids))
            else:
                self.share_prefix(src, b)
                rows.append(rows[src])
        return np.stack(rows)

    def step_all(self, tokens, positions) -> np.ndarray:
        """One decode step of every sequence: token tokens[b] at position positions[b] of sequence
        b -> logits [G, V] (a backend's host copy; the buffer is reused by the next step)."""
        be = self.backend
        self._tok_buf[:, 0], self._pos_buf.reshape(-1)[:] = tokens, positions
        prog = self._programs.get((1, self._decode_n_kv(int(self._pos_buf.max()) + 1), None))
        if be.replays:  # the buffers are the graph's inputs themselves: replay
            ends = {b: int(p) + 1 for b, p in enumerate(self._pos_buf.reshape(-1))}
            logits = self._replay(prog, self._tok_buf, self._pos_buf, ends)
        else:
            logits = prog.run(tokens=be.asarray(self._tok_buf), pos=be.asarray(self._pos_buf))[0]
        return np.asarray(be.to_numpy(logits), dtype=np.float32).reshape(self.n_seq, -1)

    def generate_batch(self, prompts: list[list[int]], n_predict=-1, samplers: Optional[list] = None,
                       stop_at_eog: bool = True) -> list[GenerateResult]:
        """Up to n_predict tokens (-1: until EOG or the context is full; an int, or one per prompt)
        after each of up to n_seq prompts (any lengths), generated together; one GenerateResult per
        prompt, each as Generator.generate gives it (prompt_seconds: all the prefills,
        decode_seconds: the steps of the whole batch). samplers: one per prompt (batch_samplers),
        or None: greedy. Sequences past the prompts idle (padding from the start)."""
        n = len(prompts)
        if not 0 < n <= self.n_seq:
            raise LlmtuneError(f"generate: {n} prompts for {self.n_seq} sequences")
        limits = list(n_predict) if isinstance(n_predict, (list, tuple)) else [n_predict] * n
        samplers = samplers or batch_samplers(SamplerConfig(temp=0.0, seed=0), n)
        t0 = time.perf_counter()
        logits = self.prefill_all(prompts)
        prompt_seconds = time.perf_counter() - t0
        for sampler, ids in zip(samplers, self.lanes):
            for t in ids:
                sampler.accept(t)
        for b in range(n, self.n_seq):  # an idle sequence steps on token 0 at position 0, in its own rows
            self.lanes[b] = [0]
        outs: list[list[int]] = [[] for _ in prompts]
        stops: list[Optional[str]] = [None] * n + ["idle"] * (self.n_seq - n)
        t1 = time.perf_counter()
        with self.backend.decode_context():
            while True:
                for b in range(n):
                    if stops[b] is None:
                        stops[b] = self._sample_one(b, logits[b], samplers[b], outs[b], limits[b], stop_at_eog)
                if all(stops):
                    break
                # each lane ends with its sampled token, evaluated now at the next position; a finished
                # sequence steps on its last token too (padding, within its own rows of the cache)
                logits = self.step_all([lane[-1] for lane in self.lanes],
                                       [min(len(lane), self.n_ctx) - 1 for lane in self.lanes])
        decode_seconds = time.perf_counter() - t1
        tok = self.tokenizer
        return [GenerateResult(list(ids), out, b"".join(tok.token_to_bytes(t, special=False) for t in out)
                               .decode("utf-8", "replace"), stop, sampler.seed, len(ids), prompt_seconds,
                               decode_seconds, self.n_ctx, greedy=sampler.cfg.greedy)
                for ids, out, stop, sampler in zip(prompts, outs, stops, samplers)]

    def _sample_one(self, b, logits, sampler, out, n_predict, stop_at_eog) -> Optional[str]:
        """Sample sequence b's next token into `out` and onto its lane's end (the token the next step
        evaluates); why it stops now, or None (Generator._decode's order: EOG, n_predict, context)."""
        token = sampler.sample(logits)
        sampler.accept(token)
        out.append(token)
        self.lanes[b].append(token)
        if stop_at_eog and token in self.eog:
            return "eog"
        if n_predict >= 0 and len(out) >= n_predict:
            return "length"
        if len(self.lanes[b]) > self.n_ctx:
            return "context"
        return None


def batch_samplers(cfg: SamplerConfig, n_seq: int, banned=()) -> list[Sampler]:
    """One sampler chain per sequence of a batch, each with its own random stream: sequence b draws
    from mt19937(seed + b) (mod 2^32), so sequence 0 draws what a one-sequence generation with the
    seed draws, and each sequence's tokens depend only on the seed, its index and its prompt (a
    random seed, None, is drawn once for the batch)."""
    seed = Sampler(cfg).seed
    samplers = [Sampler(replace(cfg, seed=(seed + b) % 2**32)) for b in range(n_seq)]
    for s in samplers:
        if len(banned):
            s.ban(banned)
    return samplers


class _Utf8Stream:
    """Bytes of token pieces -> text, holding back an incomplete UTF-8 sequence until it completes
    (a character split over byte tokens prints once, whole)."""

    def __init__(self):
        self.buf = b""

    def push(self, piece: bytes) -> str:
        data = self.buf + piece
        cut = len(data) - incomplete_tail(data)
        self.buf = data[cut:]
        return data[:cut].decode("utf-8", "replace")

    def flush(self) -> str:
        data, self.buf = self.buf, b""
        return data.decode("utf-8", "replace")


class ChatSession:
    """A conversation with a model: its messages, rendered with the chat template before each
    answer (add_generation_prompt) and tokenized as transformers does; the KV cache keeps the
    conversation so far, so each turn evaluates only what is new."""

    def __init__(self, gen: Generator, template, sampler: Sampler, n_predict: int = -1, system: Optional[str] = None):
        self.gen, self.template, self.sampler, self.n_predict = gen, template, sampler, n_predict
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, on_token: Optional[Callable[[int, str], None]] = None) -> GenerateResult:
        """The model's answer to a user message (appended to the conversation, as is the answer)."""

        messages = self.messages + [{"role": "user", "content": text}]
        ids = encode(self.gen.tokenizer, self.template.render(messages, add_generation_prompt=True))
        if len(ids) >= self.gen.n_ctx:
            raise LlmtuneError(f"generate: the conversation has {len(ids)} tokens, the context is {self.gen.n_ctx} "
                               "(raise --ctx)")
        n = self.n_predict if self.n_predict >= 0 else self.gen.n_ctx - len(ids)
        res = self.gen.generate(ids, min(n, self.gen.n_ctx - len(ids)), self.sampler, on_token=on_token)
        self.messages = messages + [{"role": "assistant", "content": res.text}]
        return res


def load_for_generation(model_path, lora=None, lora_scale=None):
    """The model with its adapters (llama.cpp's --lora / --lora-scaled)."""

    return attach(load_model(model_path), lora, lora_scale)


def generate(model, prompt: str, *, n_predict: int = -1, sampler: Optional[SamplerConfig] = None,
             backend="cpu", n_ctx: Optional[int] = None, lora=None, lora_scale=None,
             on_token: Optional[Callable[[int, str], None]] = None, on_prompt: Optional[Callable[[], None]] = None,
             ignore_eos: bool = False) -> GenerateResult:
    """Generate a continuation of `prompt` (a string: tokenized as llama-completion does) with
    `model` (a path or a loaded Model). on_prompt: called once the prompt is known to fit, before
    the first token (the CLI prints the prompt there); ignore_eos: llama.cpp's --ignore-eos."""

    if isinstance(model, Model):

        model = attach(model, lora, lora_scale)
    else:
        model = load_for_generation(model, lora, lora_scale)
    gen = Generator(model, backend, n_ctx=n_ctx)
    ids = gen.tokenize_prompt(prompt)
    if not ids:
        raise LlmtuneError("generate: the prompt is empty (and the model adds no BOS)")
    ids = gen.check_prompt(ids)
    chain = Sampler(sampler or SamplerConfig())
    if ignore_eos:
        chain.ban(gen.eog)
    if on_prompt is not None:
        on_prompt()
    return gen.generate(ids, n_predict, chain, on_token=on_token)


def generate_parallel(model, prompt: str, n_seq: int, *, n_predict: int = -1, sampler: Optional[SamplerConfig] = None,
                      backend="cpu", n_ctx: Optional[int] = None, lora=None, lora_scale=None,
                      ignore_eos: bool = False) -> list[GenerateResult]:
    """n_seq continuations of `prompt` generated together (BatchGenerator; generate --parallel):
    sequence b samples with seed + b (batch_samplers). One result per sequence."""
    model = (attach(model, lora, lora_scale) if isinstance(model, Model)
             else load_for_generation(model, lora, lora_scale))
    gen = BatchGenerator(model, backend, n_seq=n_seq, n_ctx=n_ctx)
    ids = gen.tokenize_prompt(prompt)
    if not ids:
        raise LlmtuneError("generate: the prompt is empty (and the model adds no BOS)")
    ids = gen.check_prompt(ids)
    samplers = batch_samplers(sampler or SamplerConfig(), n_seq, gen.eog if ignore_eos else ())
    return gen.generate_batch([ids] * n_seq, n_predict, samplers)


class TrainingSampler:
    """finetune --sample-prompt: a short greedy continuation with the trainer's live weights
    (its backend arrays bound directly, nothing copied) of the prompt's ids as training renders
    its prompts (train/chat.py sample_prompt: with chat or Alpaca data a user turn or the Alpaca
    prompt), so a sample shows whether the model answers in the trained format."""

    N_PREDICT = 48

    def __init__(self, trainer, ids: list[int]):
        self.ids = list(ids)
        if not self.ids:
            raise LlmtuneError("--sample-prompt: the prompt is empty")
        hp = trainer.model.hp
        n_ctx = min(hp.n_ctx_train, max(len(self.ids) + self.N_PREDICT, 64))
        if len(self.ids) >= n_ctx:
            raise LlmtuneError(f"--sample-prompt: {len(self.ids)} tokens leave no room in the model's "
                               f"context of {n_ctx}")
        self.gen = Generator(trainer.model, trainer.backend, n_ctx=n_ctx, values=trainer.values)

    def sample(self) -> str:
        self.gen.tokens = []  # the weights changed: nothing cached is valid
        n = min(self.N_PREDICT, self.gen.n_ctx - len(self.ids))
        res = self.gen.generate(self.ids, n, Sampler(SamplerConfig(temp=0.0, seed=0)))
        tok = self.gen.tokenizer  # cut at N_PREDICT tokens: end on a whole character, at a token boundary
        return whole_characters([tok.token_to_bytes(t, special=False) for t in res.tokens])



class PolicySampler:
    """finetune --method grpo's rollouts (train/grpo.py GRPOTrainer): completions sampled with the
    trainer's live weights, as TrainingSampler samples (its backend arrays bound, nothing copied:
    LoRA's A and B and a full finetune's tensors as the training step sees them), each with its
    own seed, at a temperature and top-p (TRL's top_k 0 and min_p off; llmtune's sampler chain:
    top-p before the temperature), stopping at an end-of-generation token (kept) or after
    max_tokens. Called with a batch of prompts, each sampled n times (prompt-major), decoded
    together as a BatchGenerator decodes (as TRL's vLLM / generate batch them): up to `lanes`
    completions at a time, whole groups of n where n <= lanes, a prompt prefilled once per chunk
    and its k/v copied into its other lanes. Each completion's tokens are those it would draw
    alone (a Generator with the same n_batch): its own sampler (seed), its own stop, its own rows
    of the cache."""

    # prompt tokens a prefill pass evaluates: the compiled cpu products' rows (a longer pass goes to
    # BLAS over dequantized blocks: 2-5x slower per token on SmolLM2 Q4_1's 48-token prompts, measured)
    PREFILL_BATCH = GENERATION_LANES

    def __init__(self, trainer, n_ctx: int, lanes: int = GENERATION_LANES, share_prompts: bool = True):
        self.trainer, self.n_ctx, self.lanes, self.share_prompts = trainer, int(n_ctx), int(lanes), share_prompts
        self.gen: Optional[BatchGenerator] = None
        self.eog = eog_ids(trainer.model.tokenizer)
        self.results: list[GenerateResult] = []  # the last call's (each chunk's prefill and decode times)

    def chunk(self, n: int) -> int:
        """Completions decoded together: whole groups of n when n <= lanes."""
        return self.lanes // n * n if n <= self.lanes else self.lanes

    def generator(self, n_seq: int) -> BatchGenerator:
        """The batched generator over the live weights, made once (again only when more sequences are asked)."""
        if self.gen is None or self.gen.n_seq < n_seq:
            tr = self.trainer
            self.gen = None  # its cache released before the next one is allocated
            self.gen = BatchGenerator(tr.model, tr.backend, n_seq=n_seq, n_ctx=self.n_ctx, values=tr.values,
                                      n_batch=self.PREFILL_BATCH, share_prompts=self.share_prompts)
        return self.gen

    def memory_bytes(self, n_prompts: int, n: int) -> dict[str, int]:
        """The generator's KV cache for calls of n_prompts x n completions, made or not (the run's estimate)."""
        n_seq = min(self.chunk(n), n_prompts * n)
        itemsize = np.dtype(self.trainer.backend.dtype).itemsize
        return {"generation kv cache": CacheShape.of(self.trainer.model.hp, self.n_ctx, n_seq).nbytes(itemsize)}

    def __call__(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float,
                 seeds: list[int]) -> list[list[int]]:
        jobs = [(list(ids), seeds[i * n + g]) for i, ids in enumerate(prompts) for g in range(n)]
        step = self.chunk(n)
        gen = self.generator(min(step, len(jobs)))
        self.results = []
        for start in range(0, len(jobs), step):
            part = jobs[start : start + step]
            samplers = [Sampler(SamplerConfig(temp=temperature, top_k=0, top_p=top_p, min_p=0.0, seed=seed))
                        for _, seed in part]
            limits = [min(max_tokens, self.n_ctx - len(ids)) for ids, _ in part]
            self.results += gen.generate_batch([ids for ids, _ in part], limits, samplers)
        return [r.tokens for r in self.results]
