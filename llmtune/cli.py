"""llmtune command line: parse, validate, call the library, render with llmtune.ui. No math here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

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
    from llmtune.ui.info import render_info

    out.print(render_info(model))


# --- commands added by other modules register below this line (keep one block per command) ---

# --- tokenize (llmtune/tokenizer/tokenizer.py) ---
@app.command("tokenize")
def tokenize_cmd(
    model: Path = ModelArg,
    file: str = typer.Argument("-", help="UTF-8 text file to tokenize; - reads standard input."),
    ids: bool = typer.Option(False, "--ids", help="Print only the ids, as one JSON list on one line."),
    no_bos: bool = typer.Option(False, "--no-bos", help="Do not add the BOS token the model asks for."),
    no_parse_special: bool = typer.Option(False, "--no-parse-special", help="Treat special-token strings such as <s> as plain text."),
):
    """Tokenize text exactly as llama.cpp's `llama-tokenize --no-escape` does: one `id -> 'piece'` per line.

    Example: llmtune tokenize model.gguf notes.txt --ids
    """
    from llmtune.gguf.file import load_gguf
    from llmtune.tokenizer import Tokenizer, format_ids, format_pieces, read_text

    tok = Tokenizer.from_gguf(load_gguf(model))
    text = read_text(file)
    token_ids = tok.encode(text, add_special=tok.add_bos and not no_bos, parse_special=not no_parse_special)
    if ids:
        sys.stdout.write(format_ids(token_ids) + "\n")
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(format_pieces(tok, token_ids))
    sys.stdout.flush()


# --- finetune (llmtune/train/finetune.py) ---
def _finetune_default(name: str, unset: str = "") -> str:
    """' [default: X]' for a finetune flag, X read from FinetuneConfig so --help cannot drift from
    the library; `unset` words a default that is a rule (None or 0 meaning 'derive it')."""
    from llmtune.train.config import FIELDS

    value = FIELDS[name].default
    if unset and not value:
        return f" \\[default: {unset}]"
    if isinstance(value, float):  # 1e-05 -> 1e-5, 0.0 -> 0, as one writes them on the command line
        mantissa, _, exponent = f"{value:g}".partition("e")
        value = mantissa + (f"e{int(exponent)}" if exponent else "")
    return f" \\[default: {value}]"


@app.command()
def finetune(
    model: Path = ModelArg,
    data: Path = typer.Argument(..., help="Training text: a plain UTF-8 file (tokenized whole) or .jsonl with a \"text\" field per line.", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the trained GGUF (never the input).", show_default=False),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with any of these settings (flags override it)."),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Tokens per training sequence (n_ctx)." + _finetune_default("ctx"), show_default=False),
    batch: Optional[int] = typer.Option(None, "--batch", help="Tokens per optimizer step, a multiple of --ctx." + _finetune_default("batch", unset="ctx"), show_default=False),
    ubatch: Optional[int] = typer.Option(None, "--ubatch", help="Tokens per forward/backward pass, a multiple of --ctx dividing --batch; trades memory for speed, never the result." + _finetune_default("ubatch", unset="batch"), show_default=False),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Passes over the training windows." + _finetune_default("epochs"), show_default=False),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate." + _finetune_default("lr"), show_default=False),
    lr_min: Optional[float] = typer.Option(None, "--lr-min", help="Decay the learning rate (halving steadily) down to this value." + _finetune_default("lr_min", unset="off"), show_default=False),
    decay_epochs: Optional[float] = typer.Option(None, "--decay-epochs", help="Epochs over which --lr decays to --lr-min." + _finetune_default("decay_epochs", unset="all"), show_default=False),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Linear warmup over this many optimizer steps." + _finetune_default("warmup"), show_default=False),
    wd: Optional[float] = typer.Option(None, "--wd", help="Decoupled weight decay." + _finetune_default("wd"), show_default=False),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adamw or sgd." + _finetune_default("optimizer"), show_default=False),
    val_split: Optional[float] = typer.Option(None, "--val-split", help="Fraction of windows (the last ones) held out for validation." + _finetune_default("val_split"), show_default=False),
    params: Optional[str] = typer.Option(None, "--params", help="Regex over GGUF tensor names choosing what trains, e.g. 'attn_(q|v)'." + _finetune_default("params", unset="all"), show_default=False),
    seed: Optional[int] = typer.Option(None, "--seed", help="Shuffling seed; same seed, same output file." + _finetune_default("seed"), show_default=False),
    no_shuffle: bool = typer.Option(False, "--no-shuffle", help="Keep the training windows in file order."),
    metrics: Optional[Path] = typer.Option(None, "--metrics", help="Write one JSON record per step and per validation pass here.", show_default=False),
    backend: Optional[str] = typer.Option(None, "--backend", help="cpu, cuda or auto." + _finetune_default("backend"), show_default=False),
    precision: Optional[str] = typer.Option(None, "--precision", help="Matmul precision: f32, or on cuda tf32/bf16 (f32 accumulation and master weights)." + _finetune_default("precision"), show_default=False),
):
    """Train a GGUF model on your text and write a GGUF that llama.cpp loads unchanged.

    Windows of --ctx+1 tokens are taken every --ctx/2 tokens; the last --val-split of them validate. Loss is the mean next-token cross-entropy; each epoch reports train and validation loss and accuracy with standard errors.

    Example: llmtune finetune model.gguf notes.txt -o tuned.gguf --ctx 256 --epochs 2 --lr 1e-4
    """
    from llmtune.train.finetune import finetune as run_finetune
    from llmtune.ui.finetune import FinetuneReporter

    settings = dict(ctx=ctx, batch=batch, ubatch=ubatch, epochs=epochs, lr=lr, lr_min=lr_min,
                    decay_epochs=decay_epochs, warmup=warmup, wd=wd, optimizer=optimizer, val_split=val_split,
                    params=params, seed=seed, shuffle=False if no_shuffle else None,
                    metrics=str(metrics) if metrics else None, backend=backend, precision=precision)
    with FinetuneReporter(out, err) as reporter:
        run_finetune(model, data, output, config_file=config, callback=reporter, **settings)


# --- init (llmtune/convert/init.py) ---
@app.command("init")
def init_cmd(
    config: Path = typer.Option(..., "--config", "-c", help="Model shape: a TOML [model] table, e.g. configs/llama-15m.toml.", show_default=False),
    vocab_from: Path = typer.Option(..., "--vocab-from", help="GGUF whose tokenizer (all tokenizer.* keys) the new model uses.", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the new GGUF.", show_default=False),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed writes the same file."),
):
    """Write a new randomly initialised model (to train from scratch) with another model's tokenizer."""
    from llmtune.gguf.file import load_gguf
    from llmtune.convert.init import init_model
    from llmtune.ui.format import human_bytes, human_count

    path = init_model(config, vocab_from, output, seed=seed)
    gf = load_gguf(path)
    out.print(f"wrote {path}: {gf.arch}, {human_count(gf.n_params())} parameters, "
              f"{human_bytes(gf.file_size)}, seed {seed}", highlight=False)


# --- export / save (llmtune/convert/export.py) ---
def _export_cmd(
    model: Path = ModelArg,
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the converted GGUF.", show_default=False),
    type: str = typer.Option(
        ..., "--type", "-t", show_default=False,
        help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, q4_k_m or q5_k_m.",
    ),
):
    """Convert a model's weights to another type (F16, Q8_0, K-quants, llama.cpp's Q4_K_M / Q5_K_M mixes)."""
    from llmtune.convert.export import export
    from llmtune.ui.export import export_progress, summary_table

    with export_progress(err, type) as on_tensor:
        summary = export(model, output, type, progress=on_tensor)
    out.print(summary_table(summary))


app.command("export")(_export_cmd)
app.command("save", help="Alias of export.")(_export_cmd)


# --- perplexity (llmtune/eval/perplexity.py) ---
@app.command("perplexity")
def perplexity_cmd(
    model: Path = ModelArg,
    text: Path = typer.Argument(..., help="UTF-8 text file (.gz allowed), e.g. wikitext-2-raw/wiki.test.raw.", show_default=False),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Tokens per chunk (llama-perplexity -c)."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help="Tokens per forward pass; a multiple of --ctx evaluates that many chunks at once. \\[default: 1024 on cpu, one pass per core]", show_default=False),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Evaluate only the first N chunks. \\[default: all]", show_default=False),
    backend: str = typer.Option("cpu", "--backend", help="cpu, cuda or auto."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results (running values, ppl, error, tokens/s) as JSON here.", show_default=False),
    kl_base: Optional[Path] = typer.Option(None, "--kl-base", help="Base model (same vocabulary): also report KL-divergence (base || model) and top-token agreement.", show_default=False),
    precision: str = typer.Option("f32", "--precision", help="Matmul precision: f32, or on cuda tf32/bf16."),
):
    """Perplexity over a text file, number for number as llama.cpp's llama-perplexity computes it.

    The text is cut into chunks of --ctx tokens; the second half of each chunk is scored.
    Running values print as \\[i]ppl, then `Final estimate: PPL = X +/- Y`.

    Example: llmtune perplexity model.gguf wiki.test.raw --ctx 512 --kl-base base.gguf
    """
    from llmtune.eval.perplexity import perplexity
    from llmtune.gguf.file import check_output_path
    from llmtune.ui.perplexity import format_report, perplexity_progress, write_json

    inputs = (model, text, *([kl_base] if kl_base else []))
    if json_out is not None:
        check_output_path(json_out, *inputs)  # refuse a bad --json before the (long) evaluation
    with perplexity_progress(err) as on_progress:
        result = perplexity(model, text, ctx=ctx, batch=batch, chunks=chunks, backend=backend,
                            kl_base=kl_base, progress=on_progress, precision=precision)
    out.print(format_report(result), highlight=False, soft_wrap=True)
    if json_out is not None:
        write_json(result, json_out, *inputs)


def main() -> None:
    """Console-script entry: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except LlmtuneError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
