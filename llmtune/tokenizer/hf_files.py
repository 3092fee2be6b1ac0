"""A GGUF vocabulary as Hugging Face tokenizer files: tokenizer.json (the `tokenizers` library's
serialization), tokenizer_config.json and special_tokens_map.json, which transformers'
AutoTokenizer loads (as PreTrainedTokenizerFast) and which tokenize as llama.cpp does.

- byte-level BPE (tokenizer.ggml.model "gpt2"): a BPE model with the file's vocabulary and merges;
  the pre-tokenizer is llama.cpp's regex list for `tokenizer.ggml.pre` (bpe.PRE_TOKENIZERS), each
  regex a Split (behaviour "isolated": matches and the text between them both kept, as
  unicode_regex_split does), then ByteLevel without its own regex; a ByteLevel decoder;
  `ignore_merges` as llama.cpp sets it for the llama3 names.
- SPM (model "llama"): the form transformers gives Llama's sentencepiece vocabularies
  (convert_slow_tokenizer.py LlamaConverter, and its GGUF loader): BPE with byte_fallback, merges
  derived from the scores (every split of a token into two tokens, the best score first: llama.cpp's
  llm_tokenizer_spm merges the pair whose joined token scores highest), a normalizer that prepends
  "▁" (add_space_prefix) and turns spaces into "▁", a decoder undoing it.
Control, unknown and user-defined tokens are added tokens (matched whole before the model runs, as
llama.cpp's special-token partition); BOS/EOS added by a TemplateProcessing post-processor when the
file's add_bos_token / add_eos_token say so.
"""

from __future__ import annotations

from typing import Any, Optional

from llmtune.errors import LlmtuneError
from llmtune.tokenizer.bpe import PRE_TOKENIZERS
from llmtune.tokenizer.chat_template import TEMPLATE_KEY
from llmtune.tokenizer.tokenizer import (
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Tokenizer,
)

SPACE = "\u2581"
_ADDED = ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED


def tokenizer_files(tok: Tokenizer, md: dict, n_ctx: int, source: str) -> dict[str, Any]:
    """file name -> JSON object: tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    if tok.kind == "bpe" and tok.pre in PRE_TOKENIZERS and not PRE_TOKENIZERS[tok.pre].spm_style:
        model, pre, normalizer, decoder = _bpe_parts(tok, md)
    elif tok.kind == "spm":
        model, pre, normalizer, decoder = _spm_parts(tok, md)
    else:
        raise LlmtuneError(f"{source}: a {tok.kind} vocabulary (pre-tokenizer {tok.pre!r}) has no Hugging Face "
                           "tokenizer.json form in llmtune (byte-level BPE and SPM have)")
    added = _added_tokens(tok)
    tokenizer_json = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                      "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": _post_processor(tok),
                      "decoder": decoder, "model": model}
    names = special_tokens(tok)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok.add_bos, "add_eos_token": tok.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": n_ctx,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        **names,
    }
    template = md.get(TEMPLATE_KEY)
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config, "special_tokens_map.json": names}


def special_tokens(tok: Tokenizer) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token: the texts of the file's special ids present."""
    ids = {"bos_token": tok.bos_id, "eos_token": tok.eos_id, "unk_token": tok.unk_id, "pad_token": tok.pad_id}
    return {k: tok.tokens[i] for k, i in ids.items() if i is not None}


def _added_tokens(tok: Tokenizer) -> list[dict]:
    """Control, unknown and user-defined tokens, matched whole in text (llama.cpp parses control
    tokens only when asked; transformers always matches added tokens), with llama.cpp's lstrip /
    rstrip attributes (phi-3's <|end|> eats the whitespace after it)."""
    out = []
    for i, text in enumerate(tok.tokens):
        attr = tok.token_attr(i)
        if attr & _ADDED and text:
            out.append({"id": i, "content": text, "single_word": False, "lstrip": bool(attr & ATTR_LSTRIP),
                        "rstrip": bool(attr & ATTR_RSTRIP), "normalized": False,
                        "special": not attr & ATTR_USER_DEFINED})
    return out


def _post_processor(tok: Tokenizer) -> Optional[dict]:
    """BOS before and EOS after the text when the vocabulary adds them (llama.cpp's add_bos/add_eos)."""
    ends = [(tok.add_bos, tok.bos_id), (tok.add_eos, tok.eos_id)]
    if not any(flag and i is not None for flag, i in ends):
        return None

    def special(i):
        return {"SpecialToken": {"id": tok.tokens[i], "type_id": 0}}

    def template(seq: str) -> list:
        body = [{"Sequence": {"id": seq, "type_id": 0}}]
        head = [special(tok.bos_id)] if tok.add_bos and tok.bos_id is not None else []
        tail = [special(tok.eos_id)] if tok.add_eos and tok.eos_id is not None else []
        return head + body + tail

    used = {tok.tokens[i]: i for flag, i in ends if flag and i is not None}
    return {"type": "TemplateProcessing", "single": template("A"), "pair": template("A") + template("B"),
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in used.items()}}


def _bpe_model(vocab: dict, merges: list, **flags) -> dict:
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    model.update(flags)
    return model


def _bpe_parts(tok: Tokenizer, md: dict) -> tuple:
    pre = PRE_TOKENIZERS[tok.pre]
    vocab = {t: i for i, t in enumerate(tok.tokens)}
    # a merge whose pieces or result are no token (stripped test vocabularies) is refused by the
    # tokenizers library; llama.cpp merges and then spells the non-token out in bytes: dropped here
    merges = [m for m in (m.split(" ", 1) for m in md.get("tokenizer.ggml.merges") or [])
              if len(m) == 2 and m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    splits = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
              for p in pre.patterns]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    pre_tokenizer = {"type": "Sequence", "pretokenizers": splits + [byte_level]}
    return (_bpe_model(vocab, merges, ignore_merges=pre.ignore_merges), pre_tokenizer, None,
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True})


def spm_merges(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """BPE merges equivalent to llama.cpp's SPM merging: every split of a token into two tokens,
    ranked by the joined token's score (highest first; ties: the shorter left piece first, then the
    token's id)."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, text in enumerate(tokens):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in index and right in index:
                found.append((-scores[i], i, cut, left, right))
    found.sort()
    return [[left, right] for *_, left, right in found]


def _spm_parts(tok: Tokenizer, md: dict) -> tuple:
    scores = md.get("tokenizer.ggml.scores") or [0.0] * tok.n_vocab
    tokens = list(tok.tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[tok.unk_id] if tok.unk_id is not None else None
    model = _bpe_model(vocab, spm_merges(tokens, [float(s) for s in scores]), unk_token=unk, fuse_unk=True,
                       byte_fallback=True)
    steps = [{"type": "Prepend", "prepend": SPACE}] if tok.add_space_prefix else []
    normalizer = {"type": "Sequence",
                  "normalizers": steps + [{"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if tok.add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return model, None, normalizer, {"type": "Sequence", "decoders": decoders}
