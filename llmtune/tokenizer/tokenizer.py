"""Tokenizers built from GGUF metadata, giving exactly llama.cpp's token ids.

`Tokenizer.from_gguf(gf)` reads `tokenizer.ggml.*`: model `llama` is SentencePiece-style
(`spm.py`), model `gpt2` is byte-level BPE and `gemma4` SPM-style BPE (`bpe.py`), model `bert`
is WordPiece (`wpm.py`); others (t5's UGM, rwkv, ...) are refused with a one-line error. This
file holds what they share, following llama.cpp's `llama_vocab` (src/llama-vocab.cpp):

- token attributes from `tokenizer.ggml.token_type`, plus llama.cpp's fix-ups (end-of-generation
  and fill-in-the-middle tokens recognised by their text become control tokens, ...);
- `encode`: the text is first cut at special-token strings ("tokenizer_st_partition": user-
  defined tokens always, control/unknown ones only with `parse_special`), then each raw
  fragment is tokenized; BOS/EOS are added per the model's flags when `add_special`
  (WordPiece: always BOS ... SEP);
- `decode` / `token_to_piece`: llama.cpp's detokenizer, including its space clean-up for BPE.

Ids are plain Python ints; a missing special token id is None.
"""

from __future__ import annotations

import gzip
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from llmtune.errors import LlmtuneError, require_file
from llmtune.tokenizer.bpe import CHAR_TO_BYTE, PRE_TOKENIZERS, BpeEncoder, PreTokenizer
from llmtune.tokenizer.spm import SPACE_ESCAPE, SpmEncoder
from llmtune.tokenizer.wpm import WpmEncoder

# llama_token_attr bits
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# GGUF token_type (llama_token_type 0..6) -> attribute; anything else is UNDEFINED
_TYPE_TO_ATTR = np.array(
    [ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE],
    dtype=np.int32,
)
_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN

# Texts llama.cpp treats as end-of-generation tokens and forces to control type.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
# End-of-turn tokens found by text when tokenizer.ggml.eot_token_id is absent (first match is used).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
# Fill-in-the-middle tokens found by text when their id key is absent (first match is used).
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
# Tokens llama.cpp always renders (gpt-oss).
_FORCED_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

_SPECIAL_ID_KEYS = {
    "bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
    "unk": "unknown_token_id", "sep": "seperator_token_id", "pad": "padding_token_id",
    "mask": "mask_token_id", "fim_pre": "fim_pre_token_id", "fim_suf": "fim_suf_token_id",
    "fim_mid": "fim_mid_token_id", "fim_pad": "fim_pad_token_id", "fim_rep": "fim_rep_token_id",
    "fim_sep": "fim_sep_token_id",
}  # fmt: skip
_DEPRECATED_FIM_KEYS = {"fim_pre": "prefix_token_id", "fim_suf": "suffix_token_id", "fim_mid": "middle_token_id"}

_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale
_CLEANUP_TRIGGER = re.compile(rb" [?!.,']")


@dataclass(frozen=True)
class _Flags:
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    escape_whitespaces: bool = False  # SPM-style BPE (Gemma 4): spaces become "▁" before encoding


class Tokenizer:
    """A llama.cpp-exact tokenizer for one GGUF vocabulary (`kind`: "spm", "bpe" or "wpm")."""

    def __init__(
        self,
        *,
        kind: str,
        pre: str,
        tokens: list[str],
        token_to_id: dict[str, int],
        attrs: np.ndarray,
        special: dict[str, int | None],
        flags: _Flags,
        encoder: SpmEncoder | BpeEncoder,
        source: str = "",
    ):
        self.kind = kind
        self.pre = pre
        self.source = source
        self._tokens = tokens
        self._token_to_id = token_to_id
        self._attrs = attrs
        self._special = special
        self._flags = flags
        self._encoder = encoder
        self._partition_tokens = _partition_order(tokens, attrs)
        self._piece_cache: dict[int, bytes] = {}

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf) -> "Tokenizer":
        """Build from a loaded `llmtune.gguf.file.GGUFFile`."""
        return cls.from_metadata(gf.metadata, source=str(gf.path))

    @classmethod
    def from_metadata(cls, md: dict[str, Any], source: str = "") -> "Tokenizer":
        """Build from GGUF metadata (key -> value), with llama.cpp's defaults for missing keys."""
        return _build(md, source or "<metadata>")

    # -- properties ---------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._special["eos"]

    @property
    def unk_id(self) -> int | None:
        return self._special["unk"]

    @property
    def pad_id(self) -> int | None:
        return self._special["pad"]

    @property
    def eot_id(self) -> int | None:
        return self._special["eot"]

    @property
    def add_bos(self) -> bool:
        return self._flags.add_bos

    @property
    def add_eos(self) -> bool:
        return self._flags.add_eos

    @property
    def add_space_prefix(self) -> bool:
        return self._flags.add_space_prefix

    @property
    def tokens(self) -> Sequence[str]:
        """Token texts by id, as stored in the GGUF (SPM pieces keep their ▁)."""
        return self._tokens

    def token_attr(self, token_id: int) -> int:
        """llama.cpp's attribute bits of a token (ATTR_CONTROL, ATTR_USER_DEFINED, ...), after its fixes."""
        return int(self._attrs[token_id])

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, source={self.source!r})"

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(..., add_special, parse_special)`.

        max_tokens: only the first ids are needed (perplexity over --chunks of a long file). SPM
        and BPE tokenizers then stop at the first boundary no merge crosses past that many ids (the
        ids are the whole text's first ones, at least max_tokens of them when the text has them, no
        EOS after a cut); WordPiece encodes everything."""
        flags = self._flags
        out: list[int] = []
        wpm = self.kind == "wpm"  # WordPiece: BOS ([CLS]) ... SEP whenever add_special, whatever the flags
        if add_special and (flags.add_bos or wpm):
            out.append(self._special["bos"])
        prev_special = True  # SPM: a fragment at the start or after a special token gets a space
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.kind == "spm":
                if flags.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", SPACE_ESCAPE)
            elif flags.escape_whitespaces:
                frag = frag.replace(" ", SPACE_ESCAPE)
            cut = max_tokens is not None and self.kind in ("spm", "bpe")  # no merge crosses their pieces: stop early
            out.extend(self._encoder.encode(frag, limit=max_tokens - len(out)) if cut else self._encoder.encode(frag))
            prev_special = False
            if cut and len(out) >= max_tokens:
                return out  # the whole text's first ids; no EOS after a cut
        if add_special and wpm:
            out.append(self._special["sep"])
        elif add_special and flags.add_eos:
            out.append(self._special["eos"])
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut `text` at special-token strings, longest tokens first (tokenizer_st_partition)."""
        fragments: list[str | int] = [text] if text else []
        for token_id, token_text, attr in self._partition_tokens:
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            if not any(isinstance(f, str) and token_text in f for f in fragments):
                continue
            fragments = [
                part
                for frag in fragments
                for part in ([frag] if isinstance(frag, int) else _split_on(frag, token_text, token_id, attr))
            ]
        return fragments

    # -- decoding -----------------------------------------------------------------------------
    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes llama.cpp's `llama_token_to_piece` gives (control tokens: empty unless special)."""
        if not 0 <= token_id < len(self._tokens):
            self._check_ids([token_id])
        attr = int(self._attrs[token_id])
        if not special and attr & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._render(token_id, attr)
            self._piece_cache[token_id] = piece
        return piece

    def token_to_piece(self, token_id: int, special: bool = True) -> str:
        """`token_to_bytes` as text (a lone byte of a multi-byte character shows as U+FFFD)."""
        return self.token_to_bytes(token_id, special).decode("utf-8", "replace")

    def decode(self, ids: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp's `llama_detokenize` (invalid UTF-8 becomes U+FFFD).

        Like llama.cpp, with a space-prefix vocabulary only the very first piece loses one
        leading space, so `decode(encode(t, add_special=False)) == t` while a leading BOS
        (rendered empty unless `unparse_special`) keeps the space: " " + t.
        """
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        flags = self._flags
        remove_space = flags.add_space_prefix
        if remove_special and flags.add_bos and ids and ids[0] == self._special["bos"]:
            remove_space = False
            ids = ids[1:]
        if remove_special and flags.add_eos and ids and ids[-1] == self._special["eos"]:
            ids = ids[:-1]
        parts = []
        for token_id in ids:
            piece = self.token_to_bytes(token_id, unparse_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        data = b"".join(parts)
        if flags.clean_spaces and _CLEANUP_TRIGGER.search(data):
            data = _clean_spaces(data)
        return data.decode("utf-8", "replace")

    def _check_ids(self, ids: list[int]) -> None:
        n = len(self._tokens)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise LlmtuneError(f"{self.source}: token id {bad[0]} is out of range (vocabulary has {n} tokens)")

    def _render(self, token_id: int, attr: int) -> bytes:
        text = self._tokens[token_id]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return _to_bytes(text)
        if attr & ATTR_NORMAL:
            if self.kind != "bpe" or self._flags.escape_whitespaces:
                return _to_bytes(text.replace(SPACE_ESCAPE, " "))
            return _bpe_token_bytes(text)
        if attr & ATTR_BYTE:
            return bytes([_hex_byte(text[3:5])])
        return b""


# -- helpers -------------------------------------------------------------------------------------


def _to_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _hex_byte(digits: str) -> int:
    """The byte of a `<0xXX>` token as llama.cpp reads it (strtol: a damaged one gives 0, not an error)."""
    m = re.match(r"[0-9a-fA-F]+", digits)
    return int(m.group(), 16) if m else 0


def _bpe_token_bytes(text: str) -> bytes:
    """Undo GPT-2's byte alphabet; unknown characters render as llama.cpp's [UNK_BYTE_0x..]."""
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + _to_bytes(ch).hex().encode() + _to_bytes(text) + b"]"
    return bytes(out)


def _split_on(frag: str, token_text: str, token_id: int, attr: int) -> list[str | int]:
    """One raw fragment cut at every occurrence of a special token (with its strip rules)."""
    parts: list[str | int] = []
    pos = 0
    while True:
        hit = frag.find(token_text, pos)
        if hit < 0:
            break
        left = frag[pos:hit]
        if attr & ATTR_LSTRIP:
            left = left.rstrip(_C_SPACE)
        if left:
            parts.append(left)
        parts.append(token_id)
        pos = hit + len(token_text)
        if attr & ATTR_RSTRIP:
            while pos < len(frag) and frag[pos] in _C_SPACE:
                pos += 1
    if pos < len(frag):
        parts.append(frag[pos:])
    return parts


def _partition_order(tokens: list[str], attrs: np.ndarray) -> list[tuple[int, str, int]]:
    """Control, user-defined and unknown tokens, longest (in UTF-8 bytes) first."""
    ids = np.flatnonzero(attrs & _SPECIAL_ATTRS).tolist()
    entries = [(i, tokens[i], int(attrs[i])) for i in ids]
    entries.sort(key=lambda e: -len(_to_bytes(e[1])))
    return entries


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's three in-place clean-up passes (detokenize with clean_spaces)."""
    buf = bytearray(text)
    # 1: drop the space in " ?", " !", " .", " ,"
    total = _pass_punct(buf, len(buf))
    # 2: " ' " -> "'"  (the space after is blanked to NUL in place, as llama.cpp does)
    total = _pass_lone_apostrophe(buf, total)
    # 3: " 's", " 'm", " 're", " 've" -> no space
    total = _pass_contractions(buf, total)
    return bytes(buf[:total])


def _pass_punct(t: bytearray, n: int) -> int:
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    return total


def _pass_lone_apostrophe(t: bytearray, n: int) -> int:
    total = 1 if n else 0
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    return total


def _pass_contractions(t: bytearray, n: int) -> int:
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n and bytes((x1, t[i + 2])) in (b"re", b"ve"):
                total -= 1
        t[total] = x
        total += 1
    return total


# -- building from metadata ----------------------------------------------------------------------

_KEY = "tokenizer.ggml."

# tokenizer.ggml.model -> our tokenizer kind, and llama.cpp's default special ids for it
_MODEL_KINDS = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe", "bert": "wpm"}
_DEFAULT_SPECIAL_IDS: dict[str, dict[str, int]] = {
    "llama": dict(bos=1, eos=2, unk=0),
    "gpt2": dict(bos=11, eos=11),
    "gemma4": {},
    "bert": dict(bos=101, unk=100, sep=102, pad=0, mask=103),
}


def _build(md: dict[str, Any], source: str) -> Tokenizer:
    model = md.get(_KEY + "model")
    if model is None:
        raise LlmtuneError(f"{source}: no tokenizer in this file (missing {_KEY}model)")
    kind = _MODEL_KINDS.get(model) if isinstance(model, str) else None
    if kind is None:
        raise LlmtuneError(
            f"{source}: unsupported tokenizer model {model!r} "
            "(supported: 'llama' (SPM), 'gpt2' and 'gemma4' (BPE), 'bert' (WordPiece))"
        )
    # llama.cpp gives model gemma4 its own pre-tokenizer whatever tokenizer.ggml.pre says
    pre_name = "gemma4" if model == "gemma4" else md.get(_KEY + "pre") or "default"
    pre = _pre_tokenizer(kind, pre_name, source)

    tokens = _read_tokens(md, source)
    token_to_id = dict(zip(tokens, range(len(tokens))))
    if len(token_to_id) != len(tokens):
        raise LlmtuneError(f"{source}: duplicate token {_first_duplicate(tokens)!r} in the vocabulary")
    n = len(tokens)
    types = _read_array(md, _KEY + "token_type", n, np.int64, source, default=1)
    known = (types >= 0) & (types < len(_TYPE_TO_ATTR))
    attrs = np.where(known, _TYPE_TO_ATTR[np.where(known, types, 0)], ATTR_UNDEFINED).astype(np.int32)
    special = _special_ids(md, model, n, source)
    _fix_attributes(attrs, token_to_id, special, md, tokens)
    flags = _read_flags(md, kind, pre, special, source)

    if kind == "spm":
        scores = _read_array(md, _KEY + "scores", n, np.float32, source, default=0.0).tolist()
        encoder: SpmEncoder | BpeEncoder | WpmEncoder = SpmEncoder(
            token_to_id, scores, _byte_lookup(token_to_id, source), tokens
        )
    elif kind == "wpm":
        lowercase = _flag(md, "normalizer.lowercase", source, True)
        strip_accents = _flag(md, "normalizer.strip_accents", source, lowercase)
        encoder = WpmEncoder(token_to_id, special["unk"], lowercase, strip_accents)
    else:
        merges = md.get(_KEY + "merges")
        if merges is None:
            raise LlmtuneError(f"{source}: BPE tokenizer without {_KEY}merges")
        encoder = BpeEncoder(token_to_id, _strings(merges, _KEY + "merges", source), pre)
    return Tokenizer(
        kind=kind, pre=pre_name, tokens=tokens, token_to_id=token_to_id, attrs=attrs,
        special=special, flags=flags, encoder=encoder, source=source,
    )  # fmt: skip


def _read_flags(md: dict[str, Any], kind: str, pre: PreTokenizer, special: dict, source: str) -> _Flags:
    """add_bos/add_eos/add_space_prefix from metadata, else llama.cpp's per-model defaults."""
    flags = _Flags(
        add_bos=_flag(md, "add_bos_token", source, True if kind != "bpe" else pre.add_bos) or pre.spm_style,
        add_eos=_flag(md, "add_eos_token", source, False),
        add_space_prefix=_flag(md, "add_space_prefix", source, kind == "spm"),
        clean_spaces=False if kind == "spm" else kind == "wpm" or pre.clean_spaces,
        escape_whitespaces=pre.spm_style,  # (and llama.cpp always adds BOS for these: Gemma 4)
    )
    for flag, which in ((flags.add_bos, "bos"), (flags.add_eos, "eos")):
        if flag and special[which] is None:
            raise LlmtuneError(f"{source}: add_{which}_token is true but {which}_token_id is not set")
    if kind == "wpm" and (special["bos"] is None or special["sep"] is None):  # [CLS] ... [SEP]
        raise LlmtuneError(f"{source}: a WordPiece vocabulary needs bos_token_id and seperator_token_id")
    return flags


def _flag(md: dict[str, Any], name: str, source: str, default: bool) -> bool:
    value = md.get(_KEY + name, default)
    if not isinstance(value, (bool, int)):  # GGUF stores flags as bool (a number will do)
        raise LlmtuneError(f"{source}: {_KEY}{name} must be true or false, got {value!r}")
    return bool(value)


def _pre_tokenizer(kind: str, name: str, source: str) -> PreTokenizer:
    if not isinstance(name, str):
        raise LlmtuneError(f"{source}: {_KEY}pre must be a string, got {name!r}")
    if kind != "bpe":  # llama.cpp ignores the pre-tokenizer for SPM and WordPiece vocabularies
        return PreTokenizer(())
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise LlmtuneError(
            f"{source}: unsupported pre-tokenizer {name!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return pre


def _read_tokens(md: dict[str, Any], source: str) -> list[str]:
    tokens = md.get(_KEY + "tokens")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise LlmtuneError(f"{source}: missing or empty {_KEY}tokens")
    tokens = _strings(tokens, _KEY + "tokens", source)
    if "" in tokens:  # llama.cpp renames empty pieces so they stay unique and visible
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    return tokens


def _strings(values: Any, key: str, source: str) -> list[str]:
    """A metadata array of strings as a list; any other value is a one-line error."""
    if not isinstance(values, (list, tuple)) or not set(map(type, values)) <= {str}:
        raise LlmtuneError(f"{source}: {key} must be an array of strings")
    return list(values)


def _first_duplicate(tokens: list[str]) -> str:
    seen: set[str] = set()
    for t in tokens:
        if t in seen:
            return t
        seen.add(t)
    return ""


def _read_array(md, key, n, dtype, source, default) -> np.ndarray:
    values = md.get(key)
    if values is None:
        return np.full(n, default, dtype=dtype)
    try:
        arr = np.asarray(values) if isinstance(values, (list, tuple)) else None
    except (ValueError, TypeError):  # ragged arrays of arrays
        arr = None
    kinds = "iub" if np.dtype(dtype).kind in "iu" else "iubf"
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
        raise LlmtuneError(f"{source}: {key} must be an array of {'integers' if kinds == 'iub' else 'numbers'}")
    if len(arr) < n:
        raise LlmtuneError(f"{source}: {key} has {arr.size} entries for {n} tokens")
    return arr[:n].astype(dtype, copy=False)


def _special_ids(md: dict[str, Any], model: str, n: int, source: str = "<metadata>") -> dict[str, int | None]:
    """Special token ids: llama.cpp's per-model defaults, overridden by in-range metadata ids."""
    ids: dict[str, int | None] = {name: None for name in _SPECIAL_ID_KEYS}
    ids.update(_DEFAULT_SPECIAL_IDS[model])
    for name in ids:
        if ids[name] is not None and ids[name] >= n:
            ids[name] = None
    keys = [(name, key) for name, key in _SPECIAL_ID_KEYS.items()] + list(_DEPRECATED_FIM_KEYS.items())
    for name, key in keys:
        value = md.get(_KEY + key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):  # llama.cpp: "key has wrong type"
            raise LlmtuneError(f"{source}: {_KEY}{key} must be an integer token id, got {value!r}")
        if 0 <= value < n:
            ids[name] = value
    return ids


def _fix_attributes(attrs: np.ndarray, token_to_id: dict[str, int], special: dict, md: dict, tokens) -> None:
    """llama.cpp's text-based fix-ups of token attributes and special ids (in place)."""

    def force_control(token_id: int) -> None:
        attrs[token_id] |= ATTR_CONTROL

    if special["eot"] is None:
        special["eot"] = _first_present(token_to_id, _EOT_TEXTS)
    if special["eom"] is None:
        special["eom"] = token_to_id.get("<|eom_id|>")
    for name, texts in _FIM_TEXTS.items():
        if special[name] is None:
            special[name] = _first_present(token_to_id, texts)
            if special[name] is not None:
                force_control(special[name])
    # (EOT/EOM found by text are end-of-generation texts, made control just below)
    eog = {token_to_id[t] for t in _EOG_TEXTS if t in token_to_id}
    for token_id in eog:
        force_control(token_id)
    for text in _FORCED_USER_DEFINED:
        if text in token_to_id:
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    # harmony / solar-open: "<|end|>" is not end-of-generation there and is rendered as text
    has = {tokens[i] for i in eog}.__contains__
    has_call = has("<|call|>") or has("<|calls|>")
    if has("<|end|>") and has_call and (has("<|return|>") or has("<|flush|>")):
        attrs[token_to_id["<|end|>"]] = ATTR_USER_DEFINED
    if has("<|tool_response>") and has("</s>"):  # gemma4, paddleocr
        attrs[token_to_id["</s>"]] = ATTR_NORMAL
    _model_specific_strips(attrs, token_to_id, md)



def _first_present(token_to_id: dict[str, int], texts: Sequence[str]) -> int | None:
    for text in texts:
        if text in token_to_id:
            return token_to_id[text]
    return None


def _model_specific_strips(attrs: np.ndarray, token_to_id: dict[str, int], md: dict) -> None:
    """Per-model LSTRIP/RSTRIP that llama.cpp sets by model/pre-tokenizer/architecture name."""
    name = str(md.get("general.name", "")).lower()
    pre = str(md.get(_KEY + "pre", ""))
    arch = str(md.get("general.architecture", ""))
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in token_to_id:
            attrs[token_to_id["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        attrs[np.flatnonzero(attrs & _SPECIAL_ATTRS)] |= ATTR_RSTRIP
        if "</s>" in token_to_id:
            attrs[token_to_id["</s>"]] |= ATTR_RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in token_to_id:
                attrs[token_to_id[text]] &= ~ATTR_RSTRIP
    elif "modern-bert" in name and "[MASK]" in token_to_id:
        attrs[token_to_id["[MASK]"]] |= ATTR_LSTRIP


def _byte_lookup(token_to_id: dict[str, int], source: str):
    """SPM byte fallback: `<0xXX>`, else the byte itself as a one-character piece."""
    table: list[int | None] = []
    for b in range(256):
        tid = token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b:  # (llama.cpp's one-char C string for byte 0 is empty: no token)
            tid = token_to_id.get(chr(b) if b < 0x80 else chr(0xDC00 + b))
        table.append(tid)

    def byte_to_id(b: int) -> int:
        tid = table[b]
        if tid is None:
            raise LlmtuneError(f"{source}: the text needs byte 0x{b:02X} but the vocabulary has no token for it")
        return tid

    return byte_to_id


# -- file helpers (used by `llmtune tokenize`) --------------------------------------------------


GZIP_SUFFIX = ".gz"  # the one compression data files may carry (read_text gunzips it)
UTF8_BOM = b"\xef\xbb\xbf"  # Excel's "CSV UTF-8", Notepad: dropped where text is read, as Python's utf-8-sig


def data_suffix(path: str | Path) -> str:
    """The suffix that says what a file holds, lower case, read through a .gz: ".jsonl" for
    chat.jsonl.gz, ".txt" for notes.txt and notes.txt.gz, "" for a name without one (data.gz)."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] == GZIP_SUFFIX:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def strip_bom(data: bytes) -> bytes:
    """`data` without a leading UTF-8 byte-order mark (every reader of data text drops it)."""
    return data[len(UTF8_BOM):] if data.startswith(UTF8_BOM) else data


def read_bytes(path: str | Path) -> bytes:
    """The bytes of a file, gunzipped when its name ends in .gz; unreadable input is a one-line error."""
    p = require_file(path, "a text file")
    try:
        data = p.read_bytes()
        return gzip.decompress(data) if p.suffix.lower() == GZIP_SUFFIX else data
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise LlmtuneError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None


def read_text(path: str | Path | None) -> str:
    """UTF-8 text of a file (gunzipped when its name ends in .gz), or of stdin for None / "-",
    without a leading byte-order mark; unreadable input is a one-line error."""
    if path is None or str(path) == "-":
        name, data = "<stdin>", sys.stdin.buffer.read()
    else:
        name, data = str(path), read_bytes(path)
    skip = len(data) - len(strip_bom(data))
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start  # the offset in the file
        line = data[:at].count(b"\n") + 1
        raise LlmtuneError(f"{name}:{line}: not valid UTF-8 text (byte 0x{data[at]:02x} at offset {at})") from None


def require_text(text: str, name) -> str:
    """`text` unchanged, or the one error every command gives for a file with nothing to read
    (empty, or whitespace only): "NAME: file is empty"."""
    if not text.strip():
        raise LlmtuneError(f"{name}: file is empty")
    return text


def json_why(exc) -> str:
    """Why a JSONL line does not parse, with its column: "unterminated string starting at column 9"
    (a cut line), "expecting ',' delimiter at column 30"; the caller names file and line."""
    why = exc.msg[:1].lower() + exc.msg[1:]
    return f"{why}{'' if why.endswith(' at') else ' at'} column {exc.colno}"


def incomplete_tail(data: bytes) -> int:
    """Bytes at the end of `data` that begin a UTF-8 character without finishing it (0 when it
    ends on a character boundary): a lead byte within the last 4 whose sequence runs past the end."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:
            continue  # continuation byte
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back if need > back else 0
    return 0


def whole_characters(pieces: Sequence[bytes]) -> str:
    """The text of token pieces cut short at a character boundary: at the last token boundary that
    ends a whole UTF-8 character when there is one, else inside the last token, so a preview cut at
    a token count never ends in a broken character (U+FFFD)."""
    data = b"".join(pieces)
    k = len(pieces)
    while k and incomplete_tail(data):
        data = data[: len(data) - len(pieces[k - 1])]
        k -= 1
    if not k:  # no token boundary ends a character: cut the bytes instead
        data = b"".join(pieces)
        data = data[: len(data) - incomplete_tail(data)]
    return data.decode("utf-8", "replace")


def format_pieces(tok: Tokenizer, ids: Sequence[int]) -> bytes:
    """llama-tokenize's listing: one `%6d -> '<piece>'` line per token, pieces as raw bytes, but
    a carriage return shown as \\r (raw, it would send the terminal's cursor back over the line)."""
    return b"".join(b"%6d -> '%s'\n" % (i, tok.token_to_bytes(i).replace(b"\r", b"\\r")) for i in ids)


def format_ids(ids: Sequence[int]) -> str:
    """llama-tokenize --ids: `[1, 2, 3]` (also a JSON list)."""
    return "[" + ", ".join(map(str, ids)) + "]"
