"""What `llmtune generate` shows: the text streamed to stdout as tokens come, a one-line summary
on stderr, and the interactive chat loop (a terminal on stdin)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Callable, Optional

from rich.markup import escape

from llmtune.errors import LlmtuneError, plural

STOP_WORDS = {"eog": "end of generation", "length": "-n reached", "context": "context full"}


class Stream:
    """on_token callback: each piece of text written (and flushed) to a text stream as it comes."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.ended_with_newline = True

    def __call__(self, token_id: int, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.ended_with_newline = text.endswith("\n")

    def end_line(self) -> None:
        if not self.ended_with_newline:
            self.stream.write("\n")
            self.stream.flush()
            self.ended_with_newline = True


def summary(res) -> str:
    """One line: tokens, why it stopped, prompt and decode speed, the seed (greedy: none matters)."""
    prompt = f"prompt {plural(res.n_evaluated, 'new token')}" + (f" at {res.prompt_tokens_per_s:,.0f} tok/s"
                                                                 if res.n_evaluated else "")
    return (f"{plural(len(res.tokens), 'token')} ({STOP_WORDS.get(res.stop, res.stop)}); {prompt}; "
            f"generation {res.tokens_per_s:,.1f} tok/s; "
            f"{'greedy' if getattr(res, 'greedy', False) else f'seed {res.seed}'}; "
            f"ctx {len(res.prompt_tokens) + max(len(res.tokens) - 1, 0)}/{res.n_ctx}")


def _batch_times(results) -> tuple[int, int, int, float, float]:
    """(sequences, prompt tokens, decode steps, prompt seconds, decode seconds) of a batch: every
    sequence's prompt evaluated; a step evaluates one token of every sequence (the first token of
    each comes from its prompt's logits, as llama-batched-bench's TG counts its decode calls)."""
    r0 = results[0]
    steps = max(max(len(r.tokens) for r in results) - 1, 0)
    return len(results), sum(r.n_evaluated for r in results), steps, r0.prompt_seconds, r0.decode_seconds


def parallel_summary(results) -> str:
    """One line for a batch of sequences: tokens, stops, prompt and aggregate generation speed."""
    n, n_pp, steps, t_pp, t_tg = _batch_times(results)
    stops = ", ".join(f"{k} {v}" for k, v in sorted(Counter(STOP_WORDS.get(r.stop, r.stop) for r in results).items()))
    r0 = results[0]
    seed = "greedy" if r0.greedy else f"seeds {r0.seed}..{results[-1].seed}"
    return (f"{n} sequences, {plural(sum(len(r.tokens) for r in results), 'token')} ({stops}); "
            f"prompts {n_pp} tokens at {n_pp / t_pp if t_pp else 0:,.0f} tok/s; "
            f"generation {n * steps / t_tg if t_tg else 0:,.1f} tok/s ({n} x {steps} steps); {seed}")


def bench_row(results) -> str:
    """llama-batched-bench's row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    (PP: prompt tokens per sequence, TG: decode steps, B: sequences)."""
    n, n_pp, steps, t_pp, t_tg = _batch_times(results)
    pp = n_pp // n
    n_kv = n * (pp + steps)
    total = t_pp + t_tg
    def rate(tokens, seconds):
        return f"{tokens / seconds if seconds else 0:.2f}"

    cells = [pp, steps, n, n_kv, f"{t_pp:.3f}", rate(n_pp, t_pp), f"{t_tg:.3f}", rate(n * steps, t_tg),
             f"{total:.3f}", rate(n_pp + n * steps, total)]
    return "| " + " | ".join(f"{c:>6}" if isinstance(c, int) else c for c in cells) + " |"


def chat_loop(session, err, read_line: Callable[[], Optional[str]], out=None, first: Optional[str] = None) -> None:
    """The interactive chat: a user line in, the model's answer streamed out, until /exit or end
    of input. /reset starts the conversation over."""
    stream = Stream(out)
    err.print("[dim]chat: type a message, /reset to start over, /exit or Ctrl-D to quit[/]", highlight=False)
    text = first
    while True:
        if text is None:
            err.print("[bold]> [/]", end="")
            line = read_line()
            if line is None:
                err.print()
                return
            text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            session.reset()
            err.print("[dim](conversation reset)[/]")
        elif text.strip():
            try:
                res = session.reply(text, on_token=stream)
            except LlmtuneError as exc:  # e.g. a full context: say so, the user may /reset
                stream.end_line()
                err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            else:
                stream.end_line()
                err.print(f"[dim]{escape(summary(res))}[/]", highlight=False)
        text = None
