"""What llmtune's commands share on the command line, declared once: the two consoles (results on
stdout, progress and errors on stderr) and the options several commands take, so each reads the
same everywhere (cli.py registers the commands; cli_generate.py is one of them)."""

from __future__ import annotations

from typing import Optional

import typer

from llmtune.ui.console import NoWrapConsole

out = NoWrapConsole()  # results (unwrapped when piped)
err = NoWrapConsole(stderr=True)  # progress, warnings, errors

ModelArg = typer.Argument(..., help="Model file in GGUF format (as used by llama.cpp).", show_default=False)

# options several commands take, declared once so each reads the same everywhere
LoraOption = typer.Option(None, "--lora",
                          help="LoRA adapter GGUF (or PEFT adapter folder) applied to the model (repeat for several, "
                          "as llama.cpp's --lora; export merges it into the weights, as llama-export-lora).",
                          show_default=False)
LoraScaleOption = typer.Option(None, "--lora-scale", help="Scale of the adapters: one value for all, or one per --lora "
                               "(llama.cpp's --lora-scaled). \\[default: 1]", show_default=False)


def backend_option(default: Optional[str] = "cpu", default_text: str = " \\[default: cpu]"):
    """--backend; finetune gives default None (its config decides) and the config's default as text."""
    return typer.Option(default, "--backend", help="cpu, cuda or auto." + default_text, show_default=False)


def precision_option(default: Optional[str] = "f32", default_text: str = " \\[default: f32]"):
    """--precision; finetune gives default None (its config decides) and the config's default as text."""
    return typer.Option(default, "--precision", help="Matmul precision: f32, or on cuda tf32/bf16 (f32 accumulation; "
                        "finetune keeps f32 master weights)." + default_text, show_default=False)


def type_option(default: Optional[str] = ..., default_text: str = ""):
    """--type of the commands that store weights (export, init): an export type (quant/plan.py)."""
    return typer.Option(default, "--type", "-t", show_default=False,
                        help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, q4_k_m or q5_k_m."
                        + default_text)


def force_option(kind: str = "a GGUF"):
    """--force of a command that writes -o: `kind` words what it writes (what -o may replace without it)."""
    return typer.Option(False, "--force", help=f"Replace an existing -o file that is not {kind} (refused without it: "
                        "a mistyped -o must not destroy a data file).")


SHARED_OPTIONS = {"backend": backend_option,
                  "precision": precision_option}  # finetune's settings that other commands share
