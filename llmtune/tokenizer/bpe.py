"""Byte-level BPE tokenization exactly as llama.cpp's `llm_tokenizer_bpe` + `unicode_regex_split`.

Pipeline: the pre-tokenizer (a list of regexes chosen by `tokenizer.ggml.pre`) cuts the text
into words; each word is mapped byte by byte to GPT-2's printable byte alphabet; adjacent
symbols are merged by the rank of their pair in `tokenizer.ggml.merges` (lowest rank first,
ties to the leftmost pair). Words are independent, so their ids are memoized.

How llama.cpp applies the regexes, reproduced here:
- each regex further splits every piece produced by the previous one; text between matches
  stays as its own piece;
- the GPT-2 and LLaMA-3 patterns run through hand-written matchers in llama.cpp whose classes
  (\\s, \\p{L}, \\p{N}) come from tables generated with Python's `regex` module, so the
  `regex` module on the original text gives the same pieces;
- any other pattern runs through C++ std::regex (ECMAScript, ASCII-only classes). When it
  uses \\p{..}, llama.cpp first "collapses" every non-ASCII character to one placeholder byte
  per Unicode category (0x0B for whitespace) and rewrites \\p{X} as a class of that byte
  plus X's ASCII members. We do the same collapse and run Python's `re` in ASCII mode, which
  matches std::regex on these patterns (`$` is rewritten to `\\Z`: end of input only).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import regex

# -- pre-tokenizer patterns (as llama.cpp lists them) ------------------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN_CASEI = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]"]
_GPT2 = [GPT2_PATTERN]
_STARCODER = [r"\p{N}", GPT2_PATTERN]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_PATTERN, r"[0-9][0-9][0-9]"]
_DEEPSEEK_CODER = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
_LLAMA3 = [LLAMA3_PATTERN]
_QWEN2 = [QWEN2_PATTERN]


@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp derives from a `tokenizer.ggml.pre` name."""

    patterns: tuple[str, ...]
    clean_spaces: bool = True  # detokenizer removes " ." style spaces
    ignore_merges: bool = False  # a word that is a whole token skips the merges
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token


def _pre(patterns, **flags) -> PreTokenizer:
    return PreTokenizer(tuple(patterns), **flags)


# Names llama.cpp maps to these regex lists (src/llama-vocab.cpp), with the flags it sets.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _pre(_DEFAULT),
    **{n: _pre(_GPT2) for n in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "exaone4")},
    **{n: _pre(_STARCODER) for n in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b")},
    **{n: _pre(_STARCODER, clean_spaces=False) for n in ("command-r", "smollm")},
    "falcon": _pre(_FALCON),
    "deepseek-coder": _pre(_DEEPSEEK_CODER, clean_spaces=False),
    **{
        n: _pre(_LLAMA3, ignore_merges=True, add_bos=True)
        for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
    },
    **{n: _pre(_LLAMA3) for n in ("dbrx", "smaug-bpe")},
    **{n: _pre(_QWEN2, clean_spaces=False) for n in ("qwen2", "deepseek-r1-qwen")},
    **{n: _pre(_QWEN2) for n in ("stablelm2", "megrez")},
}


# -- byte <-> unicode alphabet (GPT-2) -------------------------------------------------------


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: list[str] = [""] * 256
    for b in keep:
        table[b] = chr(b)
    extra = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# bytes decoded as latin-1 give one char per byte; translate maps each to its stand-in
_LATIN1_TO_ALPHABET = str.maketrans({chr(b): c for b, c in enumerate(BYTE_TO_CHAR)})


def byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogateescape").decode("latin-1").translate(_LATIN1_TO_ALPHABET)


# -- llama.cpp's character classes --------------------------------------------------------------

# Placeholder bytes llama.cpp writes for a non-ASCII character of each category, and the ASCII
# members its rewritten \p{..} classes list next to them.
_CATEGORY_PLACEHOLDER = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_CLASS_ASCII = {
    "N": "0-9",
    "L": "A-Za-z",
    "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "M": "",
    "S": r"\$\+<->\^`\|",  # no "~": llama.cpp's table leaves it out
}
_CLASS_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
_OTHER_PLACEHOLDER = "\xd0"
_WHITESPACE_PLACEHOLDER = "\x0b"

_CATEGORY_TESTS = [(cat, regex.compile(rf"\p{{{cat}}}")) for cat in ("N", "L", "Z", "M", "P", "S", "C")]
_WHITESPACE = regex.compile(r"\s")


@lru_cache(maxsize=None)
def _category(ch: str) -> str | None:
    """The single Unicode category letter llama.cpp's flag table gives `ch` (None if several)."""
    hits = [cat for cat, test in _CATEGORY_TESTS if test.match(ch)]
    return hits[0] if len(hits) == 1 else None


class _CollapseTable(dict):
    """str.translate table: non-ASCII chars -> llama.cpp's per-category placeholder byte."""

    def __missing__(self, code: int) -> str | int:
        if code < 128:
            value: str | int = code
        else:
            ch = chr(code)
            if _WHITESPACE.match(ch):
                value = _WHITESPACE_PLACEHOLDER
            else:
                value = _CATEGORY_PLACEHOLDER.get(_category(ch) or "", _OTHER_PLACEHOLDER)
        self[code] = value
        return value


class _WideTable(dict):
    """str.translate table for std::wregex: only non-ASCII whitespace becomes 0x0B."""

    def __missing__(self, code: int) -> str | int:
        value: str | int = code
        if code >= 128 and _WHITESPACE.match(chr(code)):
            value = _WHITESPACE_PLACEHOLDER
        self[code] = value
        return value


_COLLAPSE = _CollapseTable()
_WIDE = _WideTable()


def _collapse_pattern(pattern: str) -> str:
    """llama.cpp's rewrite of \\p{X} into `[<placeholder><ASCII members of X>]` (no [] inside [])."""
    out = []
    inside = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "[" and (i == 0 or pattern[i - 1] != "\\"):
            inside = True
        elif inside and ch == "]" and pattern[i - 1] != "\\":
            inside = False
        elif pattern.startswith("\\p{", i):
            close = pattern.find("}", i + 3)
            name = pattern[i + 3 : close] if close != -1 and close <= i + 10 else None
            if name in _CLASS_NAMES:
                cat = _CLASS_NAMES[name]
                body = _CATEGORY_PLACEHOLDER[cat] + _CLASS_ASCII[cat]
                out.append(body if inside else f"[{body}]")
                i = close + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _ecmascript_anchors(pattern: str) -> str:
    """ECMAScript `$` (no multiline) matches only at the end of input: Python's `\\Z`."""
    out = []
    inside = escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "[":
            inside = True
        elif ch == "]":
            inside = False
        elif ch == "$" and not inside:
            out.append(r"\Z")
            continue
        out.append(ch)
    return "".join(out)


class _PatternSplit:
    """One pattern applied to one piece: its matches and the gaps between them, in order.

    `table` (if any) maps the piece to the view the pattern runs on (llama.cpp's collapsed or
    wide text); views have one character per character of the piece, so spans carry over.
    """

    def __init__(self, compiled, table: dict | None = None):
        self._finditer = compiled.finditer
        self._table = table
        engine = re if isinstance(compiled, re.Pattern) else regex
        wrapped = engine.compile(f"({compiled.pattern})", compiled.flags)
        # split() with one capturing group returns gap, match, gap, ... without a Python loop
        self._split = wrapped.split if wrapped.groups == 1 else None

    def __call__(self, piece: str) -> list[str]:
        if self._split is not None and (self._table is None or piece.isascii()):
            return [part for part in self._split(piece) if part]
        view = piece if self._table is None else piece.translate(self._table)
        out = []
        start = 0
        for m in self._finditer(view):
            a, b = m.span()
            if a > start:
                out.append(piece[start:a])
            if b > a:
                out.append(piece[a:b])
            start = b
        if start < len(piece):
            out.append(piece[start:])
        return out


def _make_splitter(pattern: str) -> _PatternSplit:
    if pattern == GPT2_PATTERN:  # llama.cpp's hand-written matcher also takes a trailing \s+
        return _PatternSplit(regex.compile(pattern + r"|\s+"))
    if pattern in (LLAMA3_PATTERN, LLAMA3_PATTERN_CASEI):
        return _PatternSplit(regex.compile(LLAMA3_PATTERN))
    uses_categories = any(f"\\p{{{name}}}" in pattern for name in _CLASS_NAMES)
    if uses_categories:
        if any(ord(c) >= 128 for c in pattern):
            raise ValueError("pattern mixes unicode categories and non-ASCII characters")
        return _PatternSplit(re.compile(_ecmascript_anchors(_collapse_pattern(pattern)), re.ASCII), _COLLAPSE)
    return _PatternSplit(re.compile(_ecmascript_anchors(pattern), re.ASCII), _WIDE)


_SPLIT_MEMO_LIMIT = 1 << 18
_SPLIT_MEMO_MAX_PIECE = 32


class RegexSplitter:
    """llama.cpp's `unicode_regex_split`: each pattern re-splits every piece of the previous one.

    A piece's split depends only on the piece, so short pieces (words, mostly) are memoized.
    """

    def __init__(self, patterns: Sequence[str]):
        self._splitters = [_make_splitter(p) for p in patterns]
        self._memos: list[dict[str, list[str]]] = [{} for _ in patterns]

    def __call__(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for split, memo in zip(self._splitters, self._memos):
            out: list[str] = []
            for piece in pieces:
                parts = memo.get(piece)
                if parts is None:
                    parts = split(piece)
                    if len(piece) <= _SPLIT_MEMO_MAX_PIECE:
                        if len(memo) >= _SPLIT_MEMO_LIMIT:
                            memo.clear()
                        memo[piece] = parts
                out.extend(parts)
            pieces = out
        return pieces


# -- the encoder ------------------------------------------------------------------------------

_MEMO_LIMIT = 1 << 20


class BpeEncoder:
    """Ranked-merge BPE over pre-tokenized words (llama.cpp `llm_tokenizer_bpe_session`)."""

    def __init__(self, token_to_id: dict[str, int], merges: Sequence[str], pre: PreTokenizer):
        self._token_to_id = token_to_id
        # llama.cpp keys ranks by the pair split at the first space after index 0; pieces never
        # contain spaces, so "left right" is the same key. First occurrence wins (emplace).
        n = len(merges)
        self._ranks = dict(zip(reversed(merges), range(n - 1, -1, -1)))
        self._ignore_merges = pre.ignore_merges
        self._split = RegexSplitter(pre.patterns)
        self._memo: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        memo = self._memo
        for word in self._split(text):
            ids = memo.get(word)
            if ids is None:
                ids = self._encode_word(byte_encode(word))
                if len(memo) >= _MEMO_LIMIT:
                    memo.clear()
                memo[word] = ids
            out.extend(ids)
        return out

    def _encode_word(self, word: str) -> list[int]:
        lookup = self._token_to_id.get
        if self._ignore_merges:
            tid = lookup(word)
            if tid is not None:
                return [tid]
        out: list[int] = []
        for start, size in self._merge(word):
            piece = word[start : start + size]
            tid = lookup(piece)
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp looks up every UTF-8 byte of the piece as a one-byte token and drops misses
            for b in piece.encode("utf-8", "surrogateescape"):
                tid = lookup(chr(b) if b < 0x80 else chr(0xDC00 + b))
                if tid is not None:
                    out.append(tid)
        return out

    def _merge(self, word: str) -> list[tuple[int, int]]:
        """(start, size) of the final symbols after applying merges lowest rank first."""
        n = len(word)
        ranks = self._ranks
        length = [1] * n
        nxt = list(range(1, n + 1))
        if n:
            nxt[-1] = -1
        prev = list(range(-1, n - 1))

        def rank_of(a: int, b: int, end: int):
            return ranks.get(word[a:b] + " " + word[b:end])

        heap = []
        for i in range(n - 1):
            r = rank_of(i, i + 1, i + 2)
            if r is not None:
                heap.append((r, i, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, size = pop(heap)
            n_left = length[left]
            right = nxt[left]
            if n_left == 0 or right < 0 or length[right] == 0 or n_left + length[right] != size:
                continue  # stale: one side was merged since this pair was queued
            length[left] = size
            length[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                r = rank_of(before, left, left + size)
                if r is not None:
                    push(heap, (r, before, left + size - before))
            if after >= 0:
                end = after + length[after]
                r = rank_of(left, after, end)
                if r is not None:
                    push(heap, (r, left, end - left))
        out = []
        i = 0 if n else -1
        while i >= 0:
            out.append((i, length[i]))
            i = nxt[i]
        return out
