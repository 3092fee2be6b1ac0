"""`llmtune perplexity` output: a progress bar, llama-perplexity's report, the JSON results file."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmtune.errors import Interrupted
from llmtune.eval.perplexity import PerplexityProgress, PerplexityResult
from llmtune.gguf.file import check_output_path
from llmtune.resources import write_atomically
from llmtune.train.signals import signals_held
from llmtune.ui.progress import progress_bar


def stream_writer(out: Console, shown: bool = True):
    """-> (write, end): write(text) puts text on `out`'s stream and flushes it at once (a pipe or
    file gets each piece as it is computed), end() closes the line begun. Nothing under MPI's other
    ranks (a quiet console) or when not `shown`."""
    state = {"open": False}

    def write(text: str) -> None:
        if shown and not out.quiet and text:
            out.file.write(text)
            out.file.flush()
            state["open"] = not text.endswith("\n")

    def end() -> None:
        if state["open"]:
            write("\n")

    return write, end


@contextmanager
def perplexity_progress(console: Console, out: Console = None) -> Iterator[Callable[[PerplexityProgress], None]]:
    """A transient bar over the tokens evaluated, with speed and running perplexity; yields the
    `progress` callback of perplexity(). With `out`, llama.cpp's running values ([1]5.1234,...)
    stream there as each pass ends; the bar then shows only when `out` is not a terminal (on a
    terminal the values themselves are the progress). Stopped by a signal between a pass's sums
    and its report, the values of the chunks its partial estimate holds are written first, so
    the line shows every chunk the estimate counts."""
    columns = (TextColumn("tokens"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn(), TextColumn("{task.fields[ppl]}"))
    write, end = stream_writer(out) if out is not None else (None, None)
    hide = out is not None and out.is_terminal
    try:
        with progress_bar(console, *columns, redirect_stdout=False,
                          **({"disable": True} if hide else {})) as bar:
            task = bar.add_task("perplexity", total=None, rate="", ppl="")

            written = [0]  # chunks whose running value is out

            def on_progress(p: PerplexityProgress) -> None:
                if write is not None:
                    first = p.chunks_done - len(p.running) + 1
                    with signals_held():  # a signal between the two would write these values twice
                        write(running_values(p.running, first))
                        written[0] = p.chunks_done
                bar.update(task, completed=p.tokens_done, total=p.n_tokens, ppl=f"ppl {p.ppl:.4f}",
                           rate=f"{p.tokens_done / max(p.seconds, 1e-9):,.0f} tok/s")

            try:
                yield on_progress
            except Interrupted as exc:
                missing = exc.partial.chunks[written[0]:] if exc.partial is not None else []
                if write is not None and missing:
                    write(running_values(missing, written[0] + 1))
                raise
    finally:
        if end is not None:
            end()


def running_values(values, first: int = 1) -> str:
    """llama-perplexity's running line (or a piece of it): [i]ppl, for chunks first, first + 1..."""
    return "".join(f"[{i}]{v:.4f}," for i, v in enumerate(values, first))


def format_report(res: PerplexityResult, running: bool = True) -> str:
    """llama-perplexity's output (perplexity.cpp's printf lines): running values (unless they
    streamed already), the final estimate, KL statistics when present. A partial result (a run
    stopped by Ctrl-C) says over how many chunks its estimate is."""
    lines = [running_values(res.chunks)] if running else []
    if res.partial:
        lines.append(f"Estimate over the {len(res.chunks)} of {res.n_chunks_planned} chunks done (interrupted): "
                     f"PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
    else:
        lines.append(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}")
    if res.kl is not None:
        lines += [
            f"Mean PPL(base): {res.ppl_base:.4f} +/- {res.ppl_base_err:.5f}",
            f"Mean    KLD: {res.kl:10.6f} +/- {res.kl_err:10.6f}",
            f"Maximum KLD: {res.kl_max:10.6f}",
            f"Median  KLD: {res.kl_median:10.6f}",
            f"Same top p: {100 * res.same_top:7.3f} +/- {100 * res.same_top_err:5.3f} %",
        ]
    lines.append(f"{res.n_tokens} tokens in {res.seconds:.2f} s: {res.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)


def write_json(result: PerplexityResult, path, *inputs) -> Path:
    """Write the result as JSON atomically (resources.write_atomically: a temp file renamed into place,
    with the mode every output gets); never over an input file."""
    path = check_output_path(path, *inputs)
    text = json.dumps(result.to_dict(), indent=1) + "\n"
    return write_atomically(path, lambda fh: fh.write(text.encode("utf-8")))
