"""llmtune command line: parse, validate, call the library, render with rich. No math here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from llmtune.errors import LlmtuneError

app = typer.Typer(
    name="llmtune",
    help="Finetune and evaluate GGUF (llama.cpp) language models on CPU or NVIDIA GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()  # results
err = Console(stderr=True)  # progress, warnings, errors

ModelArg = typer.Argument(..., help="Model file in GGUF format (as used by llama.cpp).", show_default=False)


@app.command()
def info(model: Path = ModelArg):
    """Show a model's architecture, hyper-parameters, tensor types and tokenizer."""
    from llmtune.model.summary import render_info

    out.print(render_info(model))


# --- commands added by other modules register below this line (keep one block per command) ---

# --- export / save (llmtune/model/export.py) ---
def _export_cmd(
    model: Path = ModelArg,
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the converted GGUF.", show_default=False),
    type: str = typer.Option(
        ..., "--type", "-t", show_default=False,
        help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, q4_k_m or q5_k_m.",
    ),
):
    """Convert a model's weights to another type (F16, Q8_0, K-quants, llama.cpp's Q4_K_M / Q5_K_M mixes)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llmtune.model.export import export, summary_table

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[tensor]}"))
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(f"export {type}", total=None, tensor="")

        def on_tensor(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, tensor=name)

        summary = export(model, output, type, progress=on_tensor)
    out.print(summary_table(summary))


app.command("export")(_export_cmd)
app.command("save", help="Alias of export.")(_export_cmd)


def main() -> None:
    """Console-script entry: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except LlmtuneError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
