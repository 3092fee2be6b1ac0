"""`llmtune info`: what a GGUF file holds, as a rich renderable.

Works on any readable GGUF, including tokenizer-only files (no tensors) and architectures
llmtune cannot run: it shows what exists and says what is missing instead of failing.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import gguf
from rich.console import Group
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from llmtune.arch import read_hparams, supported
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import GGUFFile, load_gguf
from llmtune.model.adapter import adapter_facts
from llmtune.model.adapter.provenance import INIT, RSLORA, SHORT
from llmtune.model.loaded import check_model
from llmtune.ui.format import human_bytes, human_count

# tokenizer.ggml.model -> llama.cpp's vocabulary type
TOKENIZER_KINDS = {
    "llama": "SPM (SentencePiece)",
    "gpt2": "BPE (byte-level)",
    "bert": "WPM (WordPiece)",
    "t5": "UGM (Unigram)",
    "rwkv": "RWKV",
    "no": "none",
    "none": "none",
}

# role -> metadata key holding its token id
SPECIAL_TOKEN_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
}

NO_TOKEN = 0xFFFFFFFF  # -1 stored as uint32: "no such token"


def render_info(path: str | os.PathLike) -> "_Printable":
    gf = load_gguf(path)
    if gf.get("general.type") == "adapter":  # no hyper-parameters or tokenizer: what it adapts, and on what
        return _Printable(Group(_overview(gf), _adapter_table(gf), _tensor_type_table(gf)))
    return _Printable(Group(
        _overview(gf),
        _hparams_table(gf),
        _tensor_type_table(gf),
        _tokenizer_table(gf),
    ))  # fmt: skip


_SURROGATES = re.compile("[\ud800-\udfff]")


class _Printable:
    """Renders as its content, with lone surrogates (a metadata string's undecodable bytes, kept
    so the file can be written back unchanged) shown as U+FFFD: a strict UTF-8 stdout cannot
    print them."""

    def __init__(self, renderable):
        self.renderable = renderable

    def __rich_console__(self, console, options):
        for segment in console.render(self.renderable, options):
            text = segment.text
            if not text.isascii() and _SURROGATES.search(text):
                segment = Segment(_SURROGATES.sub("\ufffd", text), segment.style, segment.control)
            yield segment


# -- number formatting --------------------------------------------------------------------------


def _fmt_float(x: float) -> str:
    return f"{x:.7g}"  # metadata floats are float32: 7 significant digits say it all


# -- sections -----------------------------------------------------------------------------------


def _section(title: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column(overflow="fold")
    table.add_column(style="dim", overflow="fold")
    return table


def _overview(gf: GGUFFile) -> Table:
    table = _section(f"{gf.path.name}")
    arch = gf.get("general.architecture")
    if arch is None:
        arch_note = "missing general.architecture"
    elif arch not in supported():
        arch_note = f"llmtune cannot run it (supported: {', '.join(supported())})"
    elif not gf.tensors:
        arch_note = "supported family (no tensors in this file)"
    elif gf.get("general.type") == "adapter":
        arch_note = f"a LoRA adapter ({gf.get('adapter.type')}): apply it to a {arch} model with --lora"
    else:
        arch_note = _loader_verdict(gf)
    table.add_row("file", Text(str(gf.path)), f"GGUF v{gf.version}")
    table.add_row("size", human_bytes(gf.file_size), f"{gf.file_size:,} bytes")
    table.add_row("architecture", Text(str(arch if arch is not None else "—")), arch_note)
    if gf.get("general.name") is not None:
        table.add_row("name", Text(str(gf.get("general.name"))), "")
    table.add_row("file type", _file_type(gf), "general.file_type")
    n_params = gf.n_params()
    if gf.tensors:
        table.add_row("parameters", human_count(n_params), f"{n_params:,} in {len(gf.tensors)} tensors")
    else:
        table.add_row("parameters", "none", "tokenizer-only file (no tensors)")
    return table


def _loader_verdict(gf: GGUFFile) -> str:
    """'supported' only when the model loader accepts the file (hyper-parameters and tensors)."""
    try:
        check_model(gf)
    except LlmtuneError as exc:
        return f"llmtune cannot run it: {str(exc).split(': ', 1)[-1]}"
    return "supported"


def _file_type(gf: GGUFFile) -> str:
    ftype = gf.get("general.file_type")
    if ftype is None:
        return "—"
    try:
        return gguf.LlamaFileType(ftype).name
    except ValueError:
        return f"unknown ({ftype})"


def _hparams_table(gf: GGUFFile) -> Table:
    table = _section("Hyper-parameters")
    md = gf.metadata
    try:
        hp = read_hparams(md, set(gf.tensors), str(gf.path), any_arch=True)
    except LlmtuneError as exc:
        table.add_row("not available", Text(str(exc).split(": ", 1)[-1]), "")
        return table

    def source(*keys: str) -> str:
        found = [f"{hp.arch}.{k}" for k in keys if f"{hp.arch}.{k}" in md]
        return found[0] if found else "default"

    vocab_source = source("vocab_size")
    if vocab_source == "default":
        vocab_source = "tokenizer.ggml.tokens" if "tokenizer.ggml.tokens" in md else "unknown"
    rows = [
        ("n_vocab", hp.n_vocab, vocab_source),
        ("n_ctx_train", hp.n_ctx_train, source("context_length")),
        ("n_embd", hp.n_embd, source("embedding_length")),
        ("n_layer", hp.n_layer, source("block_count")),
        ("n_head", hp.n_head, source("attention.head_count")),
        ("n_head_kv", hp.n_head_kv, source("attention.head_count_kv")),
        ("head_dim", hp.head_dim, source("attention.key_length") if hp.head_dim_kq else "n_embd / n_head"),
        ("n_ff", hp.n_ff, source("feed_forward_length")),
        ("n_rot", hp.n_rot, source("rope.dimension_count")),
        ("rope base", _fmt_float(hp.rope_freq_base), source("rope.freq_base")),
        ("rope scale", _fmt_float(hp.rope_freq_scale), source("rope.scaling.factor")),
        ("norm eps", _fmt_float(hp.norm_eps),
         source("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon")),
        ("rope mode", hp.rope_mode or "none", f"{hp.arch} family"),
        ("norm", {"rms": "RMSNorm", "layer": "LayerNorm"}.get(hp.norm_kind, hp.norm_kind), f"{hp.arch} family"),
        ("feed-forward", f"{hp.activation}, {'gated' if hp.ffn_gated else 'sequential'}", f"{hp.arch} family"),
        *_attention_rows(hp, source),
        ("tied output", *_tied_output(gf)),
    ]
    for name, value, src in rows:
        table.add_row(name, str(value), src)
    return table


def _attention_rows(hp, source) -> list[tuple]:
    """Rows only for the attention features a family uses (sliding window, softcaps, local rope base)."""
    rows = []
    if hp.sliding_window:
        local = "every layer" if hp.swa_layers is None else f"{sum(map(bool, hp.swa_layers))} of {hp.n_layer} layers"
        rows.append(("sliding window", f"{hp.sliding_window} ({local})", source("attention.sliding_window")))
        if hp.rope_freq_base_swa is not None and hp.rope_freq_base_swa != hp.rope_freq_base:
            rows.append(("rope base (local)", _fmt_float(hp.rope_freq_base_swa), source("rope.freq_base_swa")))
    if hp.attn_softcap:
        rows.append(("attention softcap", _fmt_float(hp.attn_softcap), source("attn_logit_softcapping")))
    if hp.final_softcap:
        rows.append(("final softcap", _fmt_float(hp.final_softcap), source("final_logit_softcapping")))
    return rows


def _adapter_table(gf: GGUFFile) -> Table:
    """A LoRA adapter: rank, alpha and scale, variant, targets, and the base it was trained on."""
    table = _section("LoRA adapter")
    facts = adapter_facts(gf)
    ranks = sorted(set(facts.ranks.values()))
    rank_words = ", ".join(map(str, ranks)) if ranks else "—"
    if facts.init == "pissa":
        rank_words += " (PiSSA: the trained rank-r pair and its start, as one rank-2r pair)"
    table.add_row("rank", rank_words, "lora_b's ne[0]")
    if not facts.alpha:
        table.add_row("alpha", "none", "scale = --lora-scale alone (adapter.lora.alpha absent or 0)")
    else:
        scale = " / ".join(f"{facts.alpha / r:.4g}" for r in ranks)
        table.add_row("alpha", _fmt_float(facts.alpha), f"adapter.lora.alpha; scale alpha / rank = {scale}")
    table.add_row("method", *_variant(facts, ranks))
    table.add_row("targets", Text(_targets(list(facts.ranks))),
                  f"{len(facts.ranks)} matrices, {facts.n_params:,} parameters")
    base = facts.base
    if base is None:
        table.add_row("base", "unknown", "no llmtune.base.* metadata (an older llmtune's or another tool's adapter)")
        return table
    file = f" ({base.file})" if base.file != base.name else ""
    table.add_row("base", Text(f"{base.name}{file}"), "llmtune.base.name, llmtune.base.file")
    table.add_row("base tensors", f"{len(base.tensors)}, mostly {base.main_type()}", "llmtune.base.tensors")
    table.add_row("base fingerprint", base.sha256[:SHORT], "llmtune.base.sha256 (token_embd's first rows, output_norm)")
    return table


def _variant(facts, ranks: list[int]) -> tuple[str, str]:
    """The LoRA variant in words (with the --lora-alpha it was trained with), and where that comes from."""
    if not facts.init:
        return "LoRA", f"no {INIT} (variant unknown: an older llmtune's or another tool's adapter)"
    pissa = facts.init == "pissa"
    words = "PiSSA" + (" + rsLoRA" if facts.rslora else "") if pissa else "rsLoRA" if facts.rslora else "LoRA"
    if facts.init == "gaussian":
        words += " (gaussian init)"
    if facts.alpha and ranks:  # as_plain doubles PiSSA's alpha with its rank; rsLoRA stores alpha * sqrt(r)
        trained = [r // 2 if pissa else r for r in ranks]
        given = [facts.alpha / (2 if pissa else 1) / (r ** 0.5 if facts.rslora else 1) for r in trained]
        words += f", --lora-alpha {' / '.join(f'{a:.4g}' for a in given)}"
        if facts.rslora:
            words += " (scale alpha / sqrt(rank); the file stores alpha x sqrt(rank))"
    return words, f"{INIT}, {RSLORA}"


def _targets(names: list[str]) -> str:
    """Adapted tensors in short: 'attn_q, attn_v in blocks 0-4; output'."""
    kinds: dict[str, list[int]] = {}
    others = []
    for name in names:
        match = re.fullmatch(r"blk\.(\d+)\.(.+?)(\.weight)?", name)
        if match:
            kinds.setdefault(match.group(2), []).append(int(match.group(1)))
        else:
            others.append(name.removesuffix(".weight"))
    groups: dict[str, list[str]] = {}  # blocks in words -> kinds
    for kind, blocks in kinds.items():
        groups.setdefault(_ranges(blocks), []).append(kind)
    parts = [f"{', '.join(k)} in block{'s' if ',' in b or '-' in b else ''} {b}" for b, k in groups.items()]
    return "; ".join(parts + ([", ".join(others)] if others else [])) or "none"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 4] -> '0-2, 4'."""
    out, values = [], sorted(set(values))
    start = prev = values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if v is not None:
            start = prev = v
    return ", ".join(out)


def _tied_output(gf: GGUFFile) -> tuple[str, str]:
    if not gf.tensors:
        return "—", "no tensors"
    if "output.weight" in gf.tensors:
        return "no", "output.weight present"
    return "yes", "output reuses token_embd.weight"


def _tensor_type_table(gf: GGUFFile) -> Table:
    table = Table(title="Tensor types", title_justify="left", title_style="bold", box=None, padding=(0, 2))
    for name, justify in (("type", "left"), ("tensors", "right"), ("elements", "right"), ("bytes", "right")):
        table.add_column(name, justify=justify, style="cyan" if name == "type" else None)
    if not gf.tensors:
        table.add_row("none", "0", "0", "0 B")
        return table
    counts, elements, sizes = Counter(), Counter(), Counter()
    for t in gf.tensors.values():
        counts[t.type.name] += 1
        elements[t.type.name] += t.n_elements
        sizes[t.type.name] += t.n_bytes
    for name in sorted(counts, key=lambda n: -sizes[n]):
        table.add_row(name, str(counts[name]), f"{elements[name]:,}", human_bytes(sizes[name]))
    if len(counts) > 1:
        total = sum(sizes.values())
        table.add_row("total", str(len(gf.tensors)), f"{sum(elements.values()):,}", human_bytes(total), style="bold")
    return table


def _tokenizer_table(gf: GGUFFile) -> Table:
    table = _section("Tokenizer")
    model = gf.get("tokenizer.ggml.model")
    tokens = gf.get("tokenizer.ggml.tokens")
    if model is None and tokens is None:
        table.add_row("none", "no tokenizer.* metadata", "")
        return table
    kind = "—" if model is None else TOKENIZER_KINDS.get(model, "unknown") if isinstance(model, str) else "unknown"
    tokens = tokens if isinstance(tokens, list) else None  # (a damaged file may hold anything)
    table.add_row("kind", kind, f"tokenizer.ggml.model = {model!r}")
    pre = gf.get("tokenizer.ggml.pre")
    if pre is not None:
        table.add_row("pre-tokenizer", Text(str(pre)), "tokenizer.ggml.pre")
    table.add_row("vocab size", f"{len(tokens):,}" if tokens is not None else "—", "tokenizer.ggml.tokens")
    merges = gf.get("tokenizer.ggml.merges")
    if merges is not None:
        table.add_row("merges", f"{len(merges):,}" if isinstance(merges, list) else "—", "tokenizer.ggml.merges")
    for role, key in SPECIAL_TOKEN_KEYS.items():
        token_id = gf.get(key)
        if token_id is not None:
            table.add_row(f"{role} token", _token_text(token_id, tokens), key)
    for flag in ("add_bos_token", "add_eos_token"):
        value = gf.get(f"tokenizer.ggml.{flag}")
        if value is not None:
            table.add_row(flag.replace("_token", ""), "yes" if value else "no", f"tokenizer.ggml.{flag}")
    return table


def _token_text(token_id: int, tokens: list[str] | None) -> Text:
    if not isinstance(token_id, int) or isinstance(token_id, bool):
        return Text(f"{token_id!r} (not a token id)", style="red")
    if token_id in (NO_TOKEN, -1):
        return Text("none")
    if tokens is None or not 0 <= token_id < len(tokens):
        return Text(f"{token_id} (out of range)", style="red")
    return Text(f"{token_id} {tokens[token_id]!r}")
