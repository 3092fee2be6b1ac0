"""llmtune command line: parse, validate, call the library, render with llmtune.ui. No math here."""

from __future__ import annotations

import functools
import inspect
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from llmtune.cli_generate import generate_cmd
from llmtune.cli_options import (
    SHARED_OPTIONS,
    LoraOption,
    LoraScaleOption,
    ModelArg,
    backend_option,
    err,
    force_option,
    out,
    precision_option,
    type_option,
)
from llmtune.errors import Interrupted, LlmtuneError, LlmtuneWarning
from llmtune.ui.console import survive_closed_pipes
from llmtune.ui.usage import ReadableGroup, readable_help

app = typer.Typer(
    name="llmtune",
    cls=ReadableGroup,
    help="Finetune and evaluate GGUF (llama.cpp) language models on CPU or NVIDIA GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
def _show_version(value: bool) -> None:
    if value:
        from llmtune import __version__

        out.print(f"llmtune {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _app_options(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print the version and exit."),
):
    """Finetune and evaluate GGUF (llama.cpp) language models on CPU or NVIDIA GPUs."""

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
    no_parse_special: bool = typer.Option(False, "--no-parse-special",
                                          help="Treat special-token strings such as <s> as plain text."),
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


# --- finetune (llmtune/train/finetune.py; every setting is declared once, in train/config.py) ---
def _finetune_default(name: str, unset: str = "") -> str:
    """' [default: X]' for a finetune setting, X read from FinetuneConfig so --help cannot drift from it."""
    from llmtune.train.config import default_words

    words = default_words(name)
    return f" \\[default: {words}]" if words is not None else ""


def _setting_options() -> list:
    """The Typer options of every FinetuneConfig setting, from its declaration (train/config.py
    `setting`): flag, short flag, metavar, help with its default. Booleans are switches that only
    ever set the non-default value (--no-shuffle, --grad-checkpoint)."""
    import dataclasses
    import inspect

    from llmtune.train.config import FinetuneConfig, flag_name

    params = []
    for f in dataclasses.fields(FinetuneConfig):
        meta, names = f.metadata, [flag_name(f.name)] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        if f.name in SHARED_OPTIONS:  # declared once for every command
            option, annotation = SHARED_OPTIONS[f.name](None, _finetune_default(f.name)), Optional[str]
        elif f.type == "bool":
            option, annotation = typer.Option(False, *names, help=meta["help"]), bool
        else:
            kind = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float,
                    "Optional[list[str]]": list[str]}.get(f.type, str)  # a list: the flag repeated
            option = typer.Option(None, *names, metavar=meta.get("metavar"), show_default=False,
                                  help=meta["help"] + _finetune_default(f.name))
            annotation = Optional[kind]
        params.append(inspect.Parameter("opt_" + f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
    return params


def _settings_given(options: dict) -> dict:
    """The settings named on the command line (None: not given, so the config file or default holds)."""
    import dataclasses

    from llmtune.train.config import FinetuneConfig

    settings = {}
    for f in dataclasses.fields(FinetuneConfig):
        value = options["opt_" + f.name]
        if f.type == "bool":  # a switch names the value that is not the default
            value = (not f.default) if value else None
        elif f.type == "Optional[list[str]]":  # a repeated flag: not given is None
            value = list(value) if value else None
        elif value is not None and f.metadata.get("path"):
            value = str(value)
        settings[f.name] = value
    return settings


def finetune(
    model: Path = ModelArg,
    data: Path = typer.Argument(...,
                                help="Training data: a plain UTF-8 file (tokenized whole), or records in .jsonl, .json "
                                     "(an array), .parquet, .csv or a folder of them: {\"text\"}, {\"prompt\", "
                                     "\"completion\"}, {\"messages\": [{\"role\", \"content\"}, ...]} (chat), ShareGPT "
                                     "{\"conversations\": [{\"from\", \"value\"}, ...]} or Alpaca {\"instruction\", "
                                     "\"input\", \"output\"}.", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the trained GGUF (never the input).",
                                show_default=False),
    config: Optional[Path] = typer.Option(None, "--config",
                                          help="TOML file with any of these settings (flags override it).",
                                          metavar="FILE"),
    resume: Optional[Path] = typer.Option(None, "--resume",
                                          help="Continue the run saved in this checkpoint (OUT.ckpt-STEP.npz) with its "
                                               "own settings; the result is byte-identical to an uninterrupted run.",
                                          show_default=False, metavar="FILE"),
    force: bool = force_option(),
    **options,
):
    """Train a GGUF model on your text and write a GGUF that llama.cpp loads unchanged.

    Windows of --ctx+1 tokens are taken every --ctx/2 tokens; the last --val-split of them validate. Loss is the mean next-token cross-entropy; each epoch reports train and validation loss and accuracy with standard errors.

    With --lora-rank (or --lora-init) only a LoRA adapter trains and -o receives it as llama.cpp's adapter GGUF.

    A full finetune writes its trained tensors as F32 (a quantized input's type would round the training away) and scores the file as written; --out-type q4_k_m (or any export type) stores the whole trained model in that type instead.

    Prompt/completion and chat data (chat, ShareGPT and Alpaca records, rendered with the model's chat template; Alpaca without one as the Alpaca prompt) train one example per window, padded, or several per window with --pack; only the completion / assistant (gpt, output) turns with their end-of-turn token carry loss unless --train-on-prompt.

    Example: llmtune finetune model.gguf notes.txt -o tuned.gguf --ctx 256 --epochs 2 --lr 1e-4

    Example (LoRA): llmtune finetune model.gguf notes.txt -o adapter.gguf --lora-rank 8 --lr 1e-3

    Example (chat): llmtune finetune model.gguf chats.jsonl -o tuned.gguf --ctx 512 --sample-prompt "What is LoRA?"

    Checkpoints (-o's name + .ckpt-STEP.npz) are written at every epoch end, every --checkpoint-every steps, and when Ctrl-C or SIGTERM stops the run after its current step (a second Ctrl-C aborts at once). Resume: the same command plus --resume CHECKPOINT.

    Exit status: 0 done, 2 bad input, 3 training diverged (no model written), 130 / 143 stopped by Ctrl-C / SIGTERM.
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.ui.finetune import FinetuneReporter
    from llmtune.workflows import finetune as run_finetune

    with FinetuneReporter(out, err) as reporter:
        run_finetune(model, data, output, config_file=config, callback=reporter, resume=resume, force=force,
                     **_settings_given(options))


def _with_setting_options(command):
    """`command`'s signature with the finetune settings' options appended (Typer reads it)."""
    import inspect

    sig = inspect.signature(command)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in fixed] + _setting_options()
    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


app.command()(_with_setting_options(finetune))


# --- init (llmtune/convert/init.py) ---
@app.command("init")
def init_cmd(
    config: Optional[Path] = typer.Option(None, "--config",
                                          help="Model shape: a TOML \\[model] table, e.g. configs/llama-15m.toml.",
                                          show_default=False),
    # init's old short flag: -c is --ctx in every other command
    config_c: Optional[Path] = typer.Option(None, "-c", hidden=True),
    vocab_from: Path = typer.Option(..., "--vocab-from",
                                    help="GGUF whose tokenizer (all tokenizer.* keys) the new model uses.",
                                    show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the new GGUF.", show_default=False),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed writes the same file."),
    type: str = type_option("f32", " The file init, then export --type would write. \\[default: f32]"),
    force: bool = force_option(),
):
    """Write a new randomly initialised model (to train from scratch) with another model's tokenizer.

    The weights are drawn, stored as --type and written a piece at a time: memory stays small whatever the model's size.

    Example: llmtune init --config configs/llama-15m.toml --vocab-from vocab.gguf -o new.gguf --seed 0

    Example (7B shape, quantized): llmtune init --config configs/qwen2-7b.toml --vocab-from ggml-vocab-qwen2.gguf -o qwen2-7b.gguf --type q4_k_m
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.convert.init import init_model
    from llmtune.gguf.file import load_gguf
    from llmtune.ui.format import human_bytes, human_count
    from llmtune.ui.progress import tensor_progress

    if config_c is not None:
        if config is not None:
            raise LlmtuneError("-c: give the config once, with --config")
        err.print("warning: init's -c is deprecated (-c means --ctx in the other commands); write --config",
                  highlight=False)
        config = config_c
    if config is None:
        raise LlmtuneError("--config: missing; init needs a model shape, e.g. --config configs/llama-15m.toml")
    with tensor_progress(err, f"init {type}") as on_tensor:
        path = init_model(config, vocab_from, output, seed=seed, type=type, force=force, progress=on_tensor)
    gf = load_gguf(path)
    out.print(f"wrote {path}: {gf.arch}, {human_count(gf.n_params())} parameters, "
              f"{human_bytes(gf.file_size)} ({type.lower()}), seed {seed}", highlight=False)


# --- import (llmtune/convert/hf_import.py) ---
@app.command("import")
def import_cmd(
    folder: Path = typer.Argument(..., metavar="HF_DIR", show_default=False,
                                  help="A local Hugging Face model folder (config.json, *.safetensors, "
                                       "tokenizer.json)."),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the GGUF.", show_default=False),
    type: str = type_option("f16", " f32, f16, bf16, q8_0: as convert_hf_to_gguf.py --outtype (1-D tensors and "
                                   "norms F32); the others: as import to f32, then export --type. \\[default: f16]"),
    force: bool = force_option(),
):
    """Convert a local Hugging Face model folder to GGUF, as llama.cpp's convert_hf_to_gguf.py does (same tensors, bytes and metadata).

    Families: llama (SmolLM2, Llama 2 / 3, TinyLlama), qwen2, qwen3, gemma2, gemma3, phi3, gpt2, with a SentencePiece tokenizer.model (read first, as the converter does) or a byte-level BPE tokenizer.json. The weights are read and written one piece at a time; never the network (a hub name is refused).

    Gemma 3 4B / 12B / 27B (Gemma3ForConditionalGeneration): the text model, as the converter writes it; the vision tower and projector (the converter's --mmproj file) are not written.

    Example: llmtune import SmolLM2-135M-Instruct/ -o smollm2.gguf --type q8_0

    Example (K-quants in one pass): llmtune import SmolLM2-135M-Instruct/ -o smollm2-q4_k_m.gguf --type q4_k_m
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.convert.hf_import import import_hf
    from llmtune.gguf.file import load_gguf
    from llmtune.ui.format import human_bytes, human_count
    from llmtune.ui.progress import tensor_progress

    with tensor_progress(err, f"import {type}") as on_tensor:
        path = import_hf(folder, output, type=type, force=force, progress=on_tensor)
    gf = load_gguf(path)
    out.print(f"wrote {path}: {gf.arch}, {human_count(gf.n_params())} parameters, "
              f"{human_bytes(gf.file_size)} ({type.lower()})", highlight=False)


# --- export / save (llmtune/convert/export.py) ---
def _export_cmd(
    model: Path = ModelArg,
    output: Optional[Path] = typer.Option(None, "-o", "--output", show_default=False,
                                          help="Where to write the converted GGUF (required, unless --peft)."),
    type: Optional[str] = type_option(None, " (required, unless --peft)"),
    lora: Optional[List[Path]] = LoraOption,
    lora_scale: Optional[List[float]] = LoraScaleOption,
    peft: Optional[Path] = typer.Option(None, "--peft", metavar="DIR", show_default=False,
                                        help="Write the adapter (MODEL an adapter GGUF, or a base with one --lora) "
                                             "as PEFT's adapter folder DIR instead (adapter_config.json, "
                                             "adapter_model.safetensors; needs safetensors)."),
    hf: Optional[Path] = typer.Option(None, "--hf", metavar="DIR", show_default=False,
                                      help="Write the model (adapters given with --lora merged first) as a Hugging "
                                           "Face transformers folder DIR instead: config.json, model.safetensors, "
                                           "tokenizer files (llama, qwen2, qwen3, gemma2, gemma3, phi3; nothing else "
                                           "needed)."),
    hf_dtype: str = typer.Option("f32", "--hf-dtype", metavar="TYPE",
                                 help="With --hf: the safetensors' type, f32, bf16 or f16 (quantized weights are "
                                      "dequantized)."),
    force: bool = force_option(),
):
    """Convert a model's weights to another type (F16, Q8_0, K-quants, llama.cpp's Q4_K_M / Q5_K_M mixes).

    With --lora, the adapters are merged first (W + scale * B A in float32): one step from a trained adapter to a deployable file.

    With --peft, an adapter GGUF becomes PEFT's adapter folder (for transformers / PEFT); --lora and generate, perplexity and eval take such a folder too.

    Example: llmtune export model.gguf --lora adapter.gguf --type q4_k_m -o merged-q4_k_m.gguf

    With --hf, the model becomes a Hugging Face transformers folder (AutoModelForCausalLM and AutoTokenizer load it).

    Example (PEFT): llmtune export adapter.gguf --peft adapter-peft/

    Example (transformers): llmtune export model.gguf --lora adapter.gguf --hf merged-hf/
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.convert.export import export, export_hf, export_peft
    from llmtune.ui.export import summary_notes, summary_table
    from llmtune.ui.format import human_count
    from llmtune.ui.progress import tensor_progress

    if hf is not None:
        given = [flag for flag, value in (("-o", output), ("--type", type), ("--peft", peft), ("--force", force))
                 if value]
        if given:
            raise LlmtuneError(f"{given[0]}: not with --hf (the model is written into the folder)")
        with tensor_progress(err, f"export --hf {hf_dtype.lower()}") as on_tensor:
            done = export_hf(model, hf, hf_dtype.lower(), lora=lora, lora_scale=lora_scale, progress=on_tensor)
        out.print(f"wrote {done.folder}: {done.architecture}, {human_count(done.n_params)} parameters as "
                  f"{done.dtype}, {done.n_tensors} tensors ({', '.join(done.files)})", highlight=False, soft_wrap=True)
        return
    if hf_dtype.lower() != "f32":
        raise LlmtuneError("--hf-dtype: needs --hf (the folder it sets the type of)")
    if peft is not None:
        given = [flag for flag, value in (("-o", output), ("--type", type), ("--lora-scale", lora_scale),
                                          ("--force", force)) if value]
        if given:
            raise LlmtuneError(f"{given[0]}: not with --peft (the adapter is written as it is, into the folder)")
        done = export_peft(model, peft, lora=lora)
        scale = f"rsLoRA lora_alpha {done.lora_alpha:g}" if done.use_rslora else f"lora_alpha {done.lora_alpha:g}"
        out.print(f"wrote {done.folder}: PEFT LoRA adapter, rank {done.rank}, {scale}, {done.n_pairs} matrices "
                  f"({', '.join(done.target_modules)})" + (f", base {done.base!r}" if done.base else ""),
                  highlight=False, soft_wrap=True)
        return
    for flag, value in (("-o", output), ("--type", type)):
        if value is None:
            raise LlmtuneError(f"{flag}: missing (llmtune export --help)")
    with tensor_progress(err, f"export {type}") as on_tensor:
        summary = export(model, output, type, progress=on_tensor, lora=lora, lora_scale=lora_scale, force=force)
    out.print(summary_table(summary))
    for line in summary_notes(summary):
        out.print(line, highlight=False, soft_wrap=True)


app.command("export")(_export_cmd)
app.command("save", help="Alias of export.")(_export_cmd)


# --- perplexity (llmtune/eval/perplexity.py) ---
@app.command("perplexity")
def perplexity_cmd(
    model: Path = ModelArg,
    text: Path = typer.Argument(..., help="UTF-8 text file (.gz allowed), e.g. wikitext-2-raw/wiki.test.raw.",
                                show_default=False),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Tokens per chunk (llama-perplexity -c)."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b",
                                        help="Tokens per forward pass; a multiple of --ctx evaluates that many chunks "
                                             "at once. \\[default: 1024 on cpu, one pass per core]",
                                        show_default=False),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Evaluate only the first N chunks. \\[default: all]",
                                         show_default=False),
    backend: str = backend_option(),
    json_out: Optional[Path] = typer.Option(None, "--json",
                                            help="Also write the results (running values, ppl, error, tokens/s) as "
                                                 "JSON here.", show_default=False),
    kl_base: Optional[Path] = typer.Option(None, "--kl-base",
                                           help="Base model (same vocabulary): also report KL-divergence (base || "
                                                "model) and top-token agreement.", show_default=False),
    precision: str = precision_option(),
    lora: Optional[List[Path]] = LoraOption,
    lora_scale: Optional[List[float]] = LoraScaleOption,
):
    """Perplexity over a text file, number for number as llama.cpp's llama-perplexity computes it.

    The text is cut into chunks of --ctx tokens; the second half of each chunk is scored.
    Running values print as \\[i]ppl, then `Final estimate: PPL = X +/- Y`.

    Example: llmtune perplexity model.gguf wiki.test.raw --ctx 512 --kl-base base.gguf
    """
    from llmtune.eval.perplexity import perplexity
    from llmtune.gguf.file import check_output_path
    from llmtune.ui.perplexity import format_report, perplexity_progress, write_json

    inputs = (model, text, *([kl_base] if kl_base else []), *(lora or []))
    if json_out is not None:
        check_output_path(json_out, *inputs, flag="--json")  # refuse a bad --json before the (long) evaluation
    try:
        with perplexity_progress(err, out) as on_progress:  # the running values stream to stdout
            result = perplexity(model, text, ctx=ctx, batch=batch, chunks=chunks, backend=backend, kl_base=kl_base,
                                progress=on_progress, precision=precision, lora=lora, lora_scale=lora_scale)
    except Interrupted as exc:  # Ctrl-C: the estimate and --json over the chunks done, then exit 130
        if exc.partial is not None:
            _report(exc.partial, format_report(exc.partial, running=False), write_json, json_out, inputs)
        raise
    _report(result, format_report(result, running=False), write_json, json_out, inputs)


def _report(result, text: str, write_json, json_out: Optional[Path], inputs) -> None:
    """An evaluation's final lines on stdout (raw: llama.cpp's lines hold tabs), then its --json."""
    if not out.quiet:  # under MPI rank 0 alone prints (dist.quiet_other_ranks)
        out.file.write(text + "\n")
        out.file.flush()
    if json_out is not None:
        write_json(result, json_out, *inputs)


# --- eval (llmtune/eval/benchmarks.py) ---
@app.command("eval")
def eval_cmd(
    model: Path = ModelArg,
    file: Path = typer.Argument(..., help="Tasks: HellaSwag text (6 lines per task), Winogrande CSV, llama.cpp's "
                                          "multiple-choice binary file, JSONL with question, choices, answer "
                                          "(e.g. MMLU), or with --reward prompt records as finetune --method grpo "
                                          "reads them.", show_default=False),
    hellaswag: bool = typer.Option(False, "--hellaswag",
                                   help="HellaSwag: acc_norm of the 4 endings (llama-perplexity --hellaswag)."),
    winogrande: bool = typer.Option(False, "--winogrande",
                                    help="Winogrande: which of 2 choices fills the blank "
                                         "(llama-perplexity --winogrande)."),
    multiple_choice: bool = typer.Option(False, "--multiple-choice",
                                         help="Multiple choice: MMLU, ARC, TruthfulQA (llama-perplexity "
                                              "--multiple-choice)."),
    tasks: Optional[int] = typer.Option(None, "--tasks",
                                        help="Score N tasks, chosen at random as llama.cpp chooses them. \\[default: "
                                             "HellaSwag 400, the others all]", show_default=False),
    ctx: int = typer.Option(512, "--ctx", "-c",
                            help="llama-perplexity's -c: a task (shared prefix plus every answer) must fit "
                                 "in 4 x ctx tokens."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b",
                                        help="Tokens per forward pass (several tasks per pass). \\[default: 1024 on "
                                             "cpu, one pass per core]", show_default=False),
    backend: str = backend_option(),
    precision: str = precision_option(),
    json_out: Optional[Path] = typer.Option(None, "--json",
                                            help="Also write every task's scores and choice, the totals and timings as "
                                                 "JSON here.", show_default=False),
    kl_base: Optional[Path] = typer.Option(None, "--kl-base",
                                           help="Base model (same vocabulary): also report its accuracy, how often "
                                                "both choose alike, and KL(base || model) over the scored tokens.",
                                           show_default=False),
    topics: bool = typer.Option(False, "--topics",
                                help="Multiple choice from JSONL with a \"topic\" field (MMLU): accuracy per topic."),
    summary: bool = typer.Option(False, "--summary",
                                 help="Print only the final lines, not llama.cpp's running line per task."),
    lora: Optional[List[Path]] = LoraOption,
    lora_scale: Optional[List[float]] = LoraScaleOption,
    reward: Optional[List[str]] = typer.Option(None, "--reward", help="Grade completions of FILE's prompts (your "
                                               "own task): exact:COLUMN, number:COLUMN, regex:PATTERN, length:N or "
                                               "FILE.py:FUNCTION, as finetune --method grpo; repeat for several.",
                                               show_default=False),
    reward_weights: Optional[str] = typer.Option(None, "--reward-weights", help="--reward: the graders' weights, "
                                                 "comma-separated. \\[default: 1 each]", show_default=False),
    samples: Optional[int] = typer.Option(None, "--samples", help="--reward: K sampled completions per prompt "
                                          "(mean reward, pass@1, pass@K). \\[default: one greedy]", show_default=False),
    n_predict: int = typer.Option(256, "--max-completion-length", help="--reward: a completion's most tokens."),
    temp: float = typer.Option(0.8, "--temp", help="--reward --samples: the sampling temperature."),
    seed: int = typer.Option(0, "--seed", help="--reward --samples: completion j of prompt p draws with "
                             "SeedSequence(\\[seed, p, j])."),
    pass_reward: Optional[float] = typer.Option(None, "--pass-reward", help="--reward: a completion passes at this "
                                                "reward. \\[default: every grader's best]", show_default=False),
):
    """Benchmarks scored exactly as llama.cpp's llama-perplexity --hellaswag / --winogrande / --multiple-choice.

    Each answer is scored by the mean log-probability of its tokens after the question; the best wins. The kind follows from the file when no flag is given. Prints llama.cpp's running lines, then its final result.

    With --reward: your own task. Each prompt record of FILE is completed (greedy, or --samples K), the completions graded as finetune --method grpo grades them; a table of each grader's mean, the weighted reward and pass@k; with --lora the base and the adapted model side by side; a confusion table when an exact:COLUMN answer is a label.

    Example: llmtune eval model.gguf mmlu-test.jsonl --multiple-choice --topics --json mmlu.json

    Example: llmtune eval model.gguf sums.jsonl --reward number:answer --lora sums.gguf --max-completion-length 32 --json sums.json
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.eval.benchmarks import evaluate
    from llmtune.gguf.file import check_output_path
    from llmtune.ui.benchmarks import benchmark_progress, format_report, topics_table, write_json

    if reward:
        if hellaswag or winogrande or multiple_choice or kl_base or topics:
            raise LlmtuneError("--reward: grades your own prompts; --hellaswag, --winogrande, --multiple-choice, "
                               "--kl-base and --topics are for benchmarks")
        return _eval_graded(model, file, reward, reward_weights, lora, lora_scale, json_out, backend,
                            dict(max_completion_length=n_predict, samples=samples, temp=temp, seed=seed, ctx=ctx,
                                 limit=tasks, pass_reward=pass_reward))
    kinds = [k for k, on in (("hellaswag", hellaswag), ("winogrande", winogrande), ("multiple-choice", multiple_choice))
             if on]
    if len(kinds) > 1:
        raise LlmtuneError("--hellaswag, --winogrande, --multiple-choice: choose one")
    inputs = (model, file, *([kl_base] if kl_base else []), *(lora or []))
    if json_out is not None:
        check_output_path(json_out, *inputs, flag="--json")  # refuse a bad --json before the (long) evaluation
    try:
        with benchmark_progress(err, None if summary else out) as on_progress:  # running lines stream to stdout
            result = evaluate(model, file, kinds[0] if kinds else None, tasks=tasks, ctx=ctx, batch=batch,
                              backend=backend,
                              kl_base=kl_base, progress=on_progress, precision=precision, lora=lora,
                              lora_scale=lora_scale)
    except Interrupted as exc:  # Ctrl-C: the results and --json over the tasks done, then exit 130
        if exc.partial is not None:
            _report(exc.partial, format_report(exc.partial, running=False), write_json, json_out, inputs)
        raise
    _report(result, format_report(result, running=False), write_json, json_out, inputs)
    if topics:
        if not result.topics:
            err.print(f"--topics: {file} names no topics (a JSONL \"topic\" field)", highlight=False)
        else:
            out.print(topics_table(result))


def _eval_graded(model, file, reward, reward_weights, lora, lora_scale, json_out, backend, settings: dict) -> None:
    """eval --reward (llmtune/eval/graded.py): progress, the tables, --json; Ctrl-C reports the prompts done."""
    from llmtune.eval.graded import GradedSettings, evaluate_graded
    from llmtune.gguf.file import check_output_path
    from llmtune.train.rewards import parse_weights
    from llmtune.ui.graded import graded_progress, report

    inputs = (model, file, *(lora or []))
    if json_out is not None:
        check_output_path(json_out, *inputs, flag="--json")  # refuse a bad --json before the (long) evaluation
    try:
        with graded_progress(err) as on_progress:
            result = evaluate_graded(model, file, reward, parse_weights(reward_weights, len(reward)),
                                     settings=GradedSettings(**settings), backend=backend, lora=lora,
                                     lora_scale=lora_scale, progress=on_progress)
    except Interrupted as exc:  # Ctrl-C: the prompts done, then exit 130
        if exc.partial is not None:
            report(out, exc.partial, json_out, inputs)
        raise
    report(out, result, json_out, inputs)


app.command("generate")(generate_cmd)  # llmtune/cli_generate.py


# --- plot (llmtune/train/observe.py) ---
@app.command("plot")
def plot_cmd(
    metrics: Path = typer.Argument(..., help="A finetune --metrics file (JSON lines).", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the picture: PNG, or the format its "
                                "extension names (.jpg, .svg, .pdf...).", show_default=False),
    force: bool = force_option("a picture in -o's format"),
):
    """Draw a finished or running finetune's --metrics file as finetune --plot draws it: train and validation loss and the learning rate against steps, the best validation pass and an early stop marked, and a preference run's reward margin and accuracy below, as a PNG or the format -o's extension names (needs matplotlib).

    Example: llmtune plot out/demo-metrics.jsonl -o out/demo.png
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.train.observe import plot_metrics
    from llmtune.ui.finetune import loss_line

    curves = plot_metrics(metrics, output, force=force)
    marks = f", best: step {curves.best_step}" if curves.best_step else ""
    marks += f", stopped early at step {curves.stopped_at}" if curves.stopped_at else ""
    out.print(f"wrote {output}: {len(curves.steps)} steps, {len(curves.val_steps)} validation passes{marks}",
              highlight=False, soft_wrap=True)
    out.print(loss_line(list(zip(curves.steps, curves.loss))), highlight=False, soft_wrap=True)


def _resume_command(checkpoint) -> str:
    """This very command line with `--resume CHECKPOINT` (replacing any --resume it had)."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--resume="):
            skip = False
            continue
        if arg == "--resume":
            skip = True
            continue
        args.append(arg)
    return shlex.join(["llmtune", *args, "--resume", str(checkpoint)])


def _on_signal(signum, frame) -> None:
    """SIGINT / SIGTERM outside a training loop: unwind (every `finally` removes its temp files),
    then main() says so and exits 130 / 143. Typer would turn Ctrl-C into a silent exit 130."""
    from llmtune.train.signals import signal_name

    raise Interrupted(signum, f"interrupted by {signal_name(signum)}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, LlmtuneWarning):
        err.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def _start_ranks() -> None:
    """Under an MPI launcher (mpirun -n N llmtune ...): rank 0 alone prints, and MPI starts now
    (a missing mpi4py is one line from rank 0). A plain process: nothing (llmtune/backends/dist.py)."""
    from llmtune.backends.dist import launched, quiet_other_ranks, world

    if launched() is not None:
        quiet_other_ranks(out, err)
        if world().rank != 0 and sys.argv[1:2] not in (["finetune"], ["perplexity"], ["eval"]):
            sys.exit(0)  # a command that does not split its work: rank 0 alone runs it (and writes its files)


def _set_memory_limit(value: Optional[str]) -> None:
    from llmtune.resources import set_memory_limit

    set_memory_limit(value)  # before the command runs: its every memory decision reads it


MemoryLimitOption = typer.Option(
    None, "--memory-limit", metavar="SIZE", expose_value=False, callback=_set_memory_limit, show_default=False,
    help="The most memory the run may take (3.5G, 800M: K, M, G, T), its runtime included: float and packed copies, "
    "activations and gradient checkpointing are planned to fit, the plan and its cost printed; what cannot fit is "
    "refused. \\[default: $LLMTUNE_MEMORY_LIMIT, else the free memory]")


def _with_shared_options(app: typer.Typer) -> None:
    """Every command takes --memory-limit (declared once here, not in each signature): its callback
    sets the limit while the flags are parsed, so the command's function never sees it."""
    for info in app.registered_commands:
        fn = info.callback
        sig = inspect.signature(fn)
        if "memory_limit" in sig.parameters:
            continue

        @functools.wraps(fn)
        def command(*args, _fn=fn, **kwargs):
            kwargs.pop("memory_limit", None)  # set already, by its callback
            return _fn(*args, **kwargs)

        shared = inspect.Parameter("memory_limit", inspect.Parameter.KEYWORD_ONLY, default=MemoryLimitOption,
                                   annotation=Optional[str])
        command.__signature__ = sig.replace(parameters=[*sig.parameters.values(), shared])
        info.callback = command


_with_shared_options(app)
readable_help(app)  # every command above: --help with FILE, N, X, TEXT


# the flags that shrink each command's memory, named when it does not fit (resources.memory_refusal)
SHRINK_FLAGS = {"finetune": "--ubatch, --ctx or --grad-checkpoint", "perplexity": "--batch or --ctx",
                "eval": "--batch or --ctx", "generate": "--ctx"}


def _error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True, emoji=False)


def main() -> None:
    """Console-script entry: user errors (flag mistakes included) become one line on stderr and
    exit code 2 (a run that diverged: 3), as does memory that runs out; Ctrl-C / SIGTERM exit
    130 / 143 after saying what was kept; a reader that closes the pipe stops the output only."""
    import threading

    from llmtune.resources import out_of_memory_message, prefer_small_pages
    from llmtune.ui.usage import errors, usage_error_line

    prefer_small_pages()  # before any big array: numpy's huge-page advice stalls first touches

    in_main = threading.current_thread() is threading.main_thread()  # only there can handlers be set
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    warnings.showwarning = _show_warning
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        with survive_closed_pipes():
            try:
                _start_ranks()
                code = app(standalone_mode=False)  # click's errors come here, not to typer's boxes
                sys.exit(code if isinstance(code, int) else 0)
            except errors.NoArgsIsHelpError:  # the help is printed already
                sys.exit(2)
            except errors.UsageError as exc:
                _error(usage_error_line(exc))
                sys.exit(2)
            except errors.ClickException as exc:
                _error(" ".join(exc.format_message().split()))
                sys.exit(exc.exit_code)
            except typer.Abort:
                _error("aborted")
                sys.exit(1)
            except LlmtuneError as exc:
                _error(str(exc))
                if getattr(exc, "resumable", False) and getattr(exc, "checkpoint", None):
                    err.print(f"resume with: {escape(_resume_command(exc.checkpoint))}", highlight=False,
                              soft_wrap=True)
                sys.exit(exc.exit_code)
            except MemoryError as exc:  # what the estimate before the run did not foresee (cupy's too)
                _error(out_of_memory_message(exc, f"llmtune {command}".strip(), SHRINK_FLAGS.get(command, "")))
                sys.exit(2)
            except Interrupted as exc:
                err.print(escape(exc.message or "interrupted"), highlight=False, soft_wrap=True)
                if exc.checkpoint is not None:
                    err.print(f"resume with: {escape(_resume_command(exc.checkpoint))}", highlight=False,
                              soft_wrap=True)
                sys.exit(exc.exit_code)
            except KeyboardInterrupt:
                err.print("interrupted")
                sys.exit(130)
    finally:
        warnings.showwarning = _default_showwarning
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    main()
