"""`llmtune generate` (llmtune/eval/generate.py): its options, the one-shot, batched, benchmark and
chat paths, and the interactive chat's line reader. cli.py registers it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from llmtune.cli_options import LoraOption, LoraScaleOption, ModelArg, backend_option, err, out, precision_option
from llmtune.errors import LlmtuneError


def generate_cmd(
    model: Path = ModelArg,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt",
                                         help="The prompt (with --chat: the first user message). Without -p or -f the "
                                              "prompt is read from standard input, unless it is a terminal.",
                                         show_default=False),
    prompt_file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from this UTF-8 file.",
                                               show_default=False),
    chat: bool = typer.Option(False, "--chat",
                              help="Render the prompt as a user turn with the model's chat template; a terminal on "
                                   "stdin then gets an interactive chat."),
    system: Optional[str] = typer.Option(None, "--system", help="With --chat: a system message first.",
                                         show_default=False),
    n_predict: int = typer.Option(-1, "-n", "--n-predict",
                                  help="Tokens to generate; -1: until an end-of-generation token or a full context."),
    temp: float = typer.Option(0.8, "--temp", help="Temperature; 0 picks the most likely token (greedy)."),
    top_k: int = typer.Option(40, "--top-k", help="Keep the K most likely tokens; 0 disables."),
    top_p: float = typer.Option(0.95, "--top-p",
                                help="Keep the most likely tokens up to this probability mass; 1 disables."),
    min_p: float = typer.Option(0.05, "--min-p",
                                help="Drop tokens less likely than this fraction of the most likely one; 0 disables."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty",
                                         help="Penalise the last --repeat-last-n tokens (divide positive logits, "
                                              "multiply negative); 1 disables."),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n",
                                      help="How many recent tokens the repeat penalty looks at."),
    seed: Optional[int] = typer.Option(None, "--seed",
                                       help="Sampling seed (llama.cpp's: the same seed gives its choices). \\[default: "
                                            "random]", show_default=False),
    ctx: Optional[int] = typer.Option(None, "-c", "--ctx",
                                      help="Context size (KV cache positions); 0: the model's. \\[default: the model's "
                                           "training context, at most 4096]", show_default=False),
    lora: Optional[List[Path]] = LoraOption,
    lora_scale: Optional[List[float]] = LoraScaleOption,
    chat_template: Optional[Path] = typer.Option(None, "--chat-template",
                                                 help="Jinja chat template for --chat, instead of the model's "
                                                      "tokenizer.chat_template.", show_default=False),
    no_display_prompt: bool = typer.Option(False, "--no-display-prompt",
                                           help="Print only the generated text, not the prompt first."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos",
                                    help="Never sample an end-of-generation token (llama.cpp's --ignore-eos: their "
                                         "logits are -inf), so generation runs to -n or a full context: fixed-length "
                                         "speed runs."),
    parallel: int = typer.Option(1, "--parallel",
                                 help="Generate G copies of the prompt together, one batched decode step for all "
                                      "(each sequence its own position, stop and random stream: seed + its index); "
                                      "prints each sequence's text and the batch's speed."),
    bench: bool = typer.Option(False, "--bench",
                               help="Measure instead of printing text: every sequence generates exactly -n tokens "
                                    "(as --ignore-eos) and stdout gets one row of llama-batched-bench's table (PP, TG, "
                                    "B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s)."),
    backend: str = backend_option(),
    precision: str = precision_option(),
):
    """Generate text with a KV cache, sampling as llama.cpp's llama-completion (greedy output is token for token llama.cpp's on f32/f16 files; docs/generate.md).

    The text streams to stdout as it comes; a summary (tokens, speed, seed) goes to stderr. Generation stops after -n tokens, at an end-of-generation token (EOS, <|im_end|>, <|eot_id|>, ...) or when the context is full.

    Example: llmtune generate model.gguf -p "Once upon a time" -n 64 --temp 0

    Example (a fixed 256 tokens, for speed): llmtune generate model.gguf -p "Once upon a time" -n 256 --ignore-eos

    Example (chat): llmtune generate tuned.gguf --chat --system "Answer briefly." -p "What is LoRA?"

    Example (batched decode speed, as llama-batched-bench): llmtune generate model.gguf -p "Once upon a time" --parallel 8 -n 128 --bench
    """  # noqa: E501 - the --help text, one line a paragraph (the help keeps its line breaks)
    from llmtune.eval.generate import ChatSession, Generator, generate, generate_parallel, load_for_generation
    from llmtune.eval.sampling import Sampler, SamplerConfig
    from llmtune.tokenizer import read_text
    from llmtune.ui.generate import Stream, bench_row, chat_loop, parallel_summary, summary

    if prompt is not None and prompt_file is not None:
        raise LlmtuneError("-p, -f: give the prompt one way")
    if system is not None and not chat:
        raise LlmtuneError("--system: needs --chat")
    if chat_template is not None and not chat:
        raise LlmtuneError("--chat-template: needs --chat")
    if n_predict < -1:
        raise LlmtuneError(f"-n: must be -1 or more, got {n_predict}")
    if parallel < 1:
        raise LlmtuneError(f"--parallel: must be positive, got {parallel}")
    if chat and (parallel > 1 or bench):
        raise LlmtuneError("--chat: one conversation (no --parallel or --bench)")
    if bench and n_predict < 1:
        raise LlmtuneError("--bench: needs -n N (the tokens each sequence generates)")
    sampling = SamplerConfig(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                             repeat_last_n=repeat_last_n, seed=seed)
    interactive = chat and sys.stdin.isatty()
    if prompt_file is not None:
        prompt = read_text(prompt_file)
    elif prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is None and not interactive:
        raise LlmtuneError("generate: no prompt (give -p TEXT or -f FILE, pipe it on stdin, "
                           "or use --chat in a terminal)")
    from llmtune.backends import get_backend

    stream = Stream()
    if parallel > 1 or bench:
        results = generate_parallel(model, prompt, parallel, n_predict=n_predict, sampler=sampling,
                                    backend=get_backend(backend, precision=precision), n_ctx=ctx, lora=lora,
                                    lora_scale=lora_scale, ignore_eos=ignore_eos or bench)
        if bench:
            out.print(bench_row(results), highlight=False, soft_wrap=True)
        else:
            for b, res in enumerate(results):
                out.print(f"--- sequence {b}", highlight=False)
                sys.stdout.write(("" if no_display_prompt else prompt) + res.text + "\n")
        err.print(f"[dim]{escape(parallel_summary(results))}[/]", highlight=False)
        return
    if not chat:
        show = None if no_display_prompt else (lambda: sys.stdout.write(prompt))  # once the prompt is known to fit
        res = generate(model, prompt, n_predict=n_predict, sampler=sampling,
                       backend=get_backend(backend, precision=precision), n_ctx=ctx, lora=lora, lora_scale=lora_scale,
                       on_token=stream, on_prompt=show, ignore_eos=ignore_eos)
    else:
        from llmtune.tokenizer.chat_template import ChatTemplate

        gen = Generator(load_for_generation(model, lora, lora_scale), get_backend(backend, precision=precision),
                        n_ctx=ctx)
        sampler = Sampler(sampling)
        if ignore_eos:
            sampler.ban(gen.eog)
        template = ChatTemplate.for_model(gen.model.gguf, gen.tokenizer, chat_template)
        session = ChatSession(gen, template, sampler, n_predict, system)
        if interactive:
            chat_loop(session, err, _read_line, first=prompt)
            return
        res = session.reply(prompt, on_token=stream)
    stream.end_line()
    err.print(f"[dim]{escape(summary(res))}[/]", highlight=False)


def _read_line():
    """A line from the terminal (None at end of input)."""
    line = sys.stdin.readline()
    return line if line else None
