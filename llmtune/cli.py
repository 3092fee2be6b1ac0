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
