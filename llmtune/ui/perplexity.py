"""`llmtune perplexity` output: a progress bar, llama-perplexity's report, the JSON results file."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmtune.eval.perplexity import PerplexityProgress, PerplexityResult
from llmtune.gguf.file import check_output_path
from llmtune.ui.progress import progress_bar


@contextmanager
def perplexity_progress(console: Console) -> Iterator[Callable[[PerplexityProgress], None]]:
    """A transient bar over the tokens evaluated, with speed and running perplexity; yields the
    `progress` callback of perplexity()."""
    columns = (TextColumn("tokens"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn(), TextColumn("{task.fields[ppl]}"))
    with progress_bar(console, *columns, redirect_stdout=False) as bar:
        task = bar.add_task("perplexity", total=None, rate="", ppl="")

        def on_progress(p: PerplexityProgress) -> None:
            bar.update(task, completed=p.tokens_done, total=p.n_tokens, ppl=f"ppl {p.ppl:.4f}",
                       rate=f"{p.tokens_done / max(p.seconds, 1e-9):,.0f} tok/s")

        yield on_progress


def format_report(res: PerplexityResult) -> str:
    """llama-perplexity's output (perplexity.cpp's printf lines): running values, the final
    estimate, KL statistics when present."""
    lines = ["".join(f"[{i}]{v:.4f}," for i, v in enumerate(res.chunks, 1)),
             f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_err:.5f}"]
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
    """Write the result as JSON atomically (a temp file renamed into place); never over an input file."""
    path = check_output_path(path, *inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(result.to_dict(), fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
