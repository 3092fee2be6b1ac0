"""BPE tokenization exactly as llama.cpp's `llm_tokenizer_bpe` + `unicode_regex_split`.

Pipeline: the pre-tokenizer (a list of regexes chosen by `tokenizer.ggml.pre`) cuts the text
into words; each word is mapped byte by byte to GPT-2's printable byte alphabet (or, for
SPM-style BPE such as Gemma 4, kept as UTF-8 text with spaces escaped to "▁"); adjacent
symbols are merged by the rank of their pair in `tokenizer.ggml.merges` (lowest rank first,
ties to the leftmost pair). Words are independent, so their ids are memoized.

How llama.cpp applies the regexes, reproduced here:
- each regex further splits every piece produced by the previous one; text between matches
  stays as its own piece;
- a pattern runs through C++ std::regex (ECMAScript, ASCII-only classes). When it uses
  \\p{..}, llama.cpp first "collapses" every non-ASCII character to one placeholder byte per
  Unicode category (0x0B for whitespace) and rewrites \\p{X} as a class of that byte plus X's
  ASCII members. We do the same collapse and run Python's `re` in ASCII mode, which matches
  std::regex on these patterns (`$` is rewritten to `\\Z`: end of input only);
- the GPT-2, LLaMA-3, Qwen2 and Qwen3.5 patterns (and the newline split) run through
  hand-written matchers instead, which behave exactly as their regex would with Unicode
  classes: that is the regex on the collapsed text too, so they take the same path.
Categories and whitespace come from llama.cpp's own Unicode 15.1 table (`unicode_data`), not
from Python's Unicode version.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Sequence

from llmtune.tokenizer.spm import SPACE_ESCAPE
from llmtune.tokenizer.unicode_data import WHITESPACE, category

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
QWEN35_PATTERN = (  # Qwen2's, with combining marks (\p{M}) joining letter runs
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NEWLINES_PATTERN = "[^\\n]+|[\\n]+"

_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]"]
_GPT2 = [GPT2_PATTERN]
_STARCODER = [r"\p{N}", GPT2_PATTERN]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", GPT2_PATTERN, r"[0-9][0-9][0-9]"]
_DEEPSEEK_CODER = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
# letters, punctuation (full-width too), CJK: written with escapes, as the source has
# compatibility characters (KELVIN SIGN, OHM SIGN, ...) that editors may normalize away
_DEEPSEEK_LLM = [
    "[\r\n]",
    (
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
        "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
        "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-"
        "\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18"
        "-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
        "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2"
        "-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-"
        "\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-"
        "\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-"
        "\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-"
        "\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-"
        "\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
    ),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
]
_LLAMA3 = [LLAMA3_PATTERN]
_QWEN2 = [QWEN2_PATTERN]
_QWEN35 = [QWEN35_PATTERN]
_NEWLINES = [NEWLINES_PATTERN]


@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp derives from a `tokenizer.ggml.pre` name."""

    patterns: tuple[str, ...]
    clean_spaces: bool = True  # detokenizer removes " ." style spaces
    ignore_merges: bool = False  # a word that is a whole token skips the merges
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token
    # SPM-style BPE (Gemma 4): spaces become "▁", words stay UTF-8 text (no GPT-2 byte
    # alphabet), unknown bytes fall back to <0xXX> tokens, BOS is always added, and a word
    # made only of newlines that is a token is taken whole.
    spm_style: bool = False


def _pre(patterns, **flags) -> PreTokenizer:
    return PreTokenizer(tuple(patterns), **flags)


# Names llama.cpp maps to these regex lists (src/llama-vocab.cpp), with the flags it sets.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _pre(_DEFAULT),
    **{
        n: _pre(_GPT2)
        for n in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "exaone4", "jina-es", "jina-de",
                  "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert")
    },  # fmt: skip
    **{n: _pre(_GPT2, clean_spaces=False) for n in ("trillion", "granite-docling")},
    **{n: _pre(_STARCODER) for n in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2")},
    **{n: _pre(_STARCODER, clean_spaces=False) for n in ("command-r", "smollm")},
    "falcon": _pre(_FALCON),
    "deepseek-coder": _pre(_DEEPSEEK_CODER, clean_spaces=False),
    "deepseek-llm": _pre(_DEEPSEEK_LLM, clean_spaces=False),
    **{
        n: _pre(_LLAMA3, ignore_merges=True, add_bos=True)
        for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano")
    },  # fmt: skip
    **{n: _pre(_LLAMA3) for n in ("dbrx", "smaug-bpe")},
    **{
        n: _pre(_QWEN2, clean_spaces=False)
        for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2")
    },
    **{n: _pre(_QWEN2) for n in ("stablelm2", "megrez")},
    "qwen35": _pre(_QWEN35, clean_spaces=False),
    "laguna": _pre([NEWLINES_PATTERN, QWEN2_PATTERN], clean_spaces=False),
    **{n: _pre(_NEWLINES, spm_style=True) for n in ("gemma4", "granite-embed-multi-311m")},
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
    "S": r"\$\+<->\^`\|~",
}
_CLASS_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}
_OTHER_PLACEHOLDER = "\xd0"
_WHITESPACE_PLACEHOLDER = "\x0b"


class _CollapseTable(dict):
    """str.translate table: non-ASCII chars -> llama.cpp's per-category placeholder byte."""

    def __missing__(self, code: int) -> str | int:
        if code < 128:
            value: str | int = code
        elif code in WHITESPACE:
            value = _WHITESPACE_PLACEHOLDER
        else:
            value = _CATEGORY_PLACEHOLDER.get(category(code), _OTHER_PLACEHOLDER)
        self[code] = value
        return value


class _WideTable(dict):
    """str.translate table for std::wregex: only non-ASCII whitespace becomes 0x0B."""

    def __missing__(self, code: int) -> str | int:
        value: str | int = _WHITESPACE_PLACEHOLDER if code >= 128 and code in WHITESPACE else code
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
        wrapped = re.compile(f"({compiled.pattern})", compiled.flags)
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


# Patterns llama.cpp runs through hand-written matchers (unicode_regex_split_custom) on the
# original text, with its own Unicode classes; the GPT-2 matcher also takes a trailing \s+.
_HAND_WRITTEN = {
    GPT2_PATTERN: GPT2_PATTERN + r"|\s+",
    LLAMA3_PATTERN: LLAMA3_PATTERN,
    LLAMA3_PATTERN_CASEI: LLAMA3_PATTERN,  # its (?i:..) matcher lower-cases; only ASCII letters matter
    QWEN2_PATTERN: QWEN2_PATTERN,
    QWEN35_PATTERN: QWEN35_PATTERN,
    NEWLINES_PATTERN: NEWLINES_PATTERN,
}


def _make_splitter(pattern: str) -> _PatternSplit:
    # The hand-written matchers behave as their regex with llama.cpp's classes, which is what
    # the regex does on the collapsed text (one placeholder per category, see above).
    pattern = _HAND_WRITTEN.get(pattern, pattern)
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


def _space_chunker(merges: Sequence[str]):
    """For SPM-style BPE, whose pre-tokenizer leaves whole lines: a splitter that cuts before a
    "▁" wherever no merge joins a symbol ending in the previous character to one starting with
    "▁". Merges never cross such a cut, so the pieces merge independently, as the whole line
    would (and repeat, so they memoize). Pairs are split as llama.cpp splits merges: at the
    first space after the first character."""
    blocked = {SPACE_ESCAPE}
    for merge in merges:
        pos = merge.find(" ", 1)
        if pos > 0 and merge.startswith(SPACE_ESCAPE, pos + 1):
            blocked.add(merge[pos - 1])
    cut = re.compile(f"(?<=[^{''.join(re.escape(c) for c in sorted(blocked))}])(?={SPACE_ESCAPE})")
    return cut.split

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
        self._spm_style = pre.spm_style
        self._split = RegexSplitter(pre.patterns)
        self._memo: dict[str, list[int]] = {}
        # A piece that is no token falls back to one token per UTF-8 byte (misses are dropped):
        # the one-byte string itself for GPT-2-style vocabularies, <0xXX> for SPM-style ones.
        if pre.spm_style:
            self._byte_tokens = [token_to_id.get(f"<0x{b:02X}>") for b in range(256)]
        else:
            self._byte_tokens = [token_to_id.get(chr(b) if b < 0x80 else chr(0xDC00 + b)) for b in range(256)]
        self._chunk = _space_chunker(merges) if pre.spm_style else None

    # with a limit, text is split in prefixes of this many characters per wanted id (doubled until
    # enough ids come out); the pieces that end within _CUT_MARGIN characters of a prefix's end are
    # not trusted (a piece the cut split, a look-ahead that saw the end instead of the next character)
    _CHARS_PER_ID, _CUT_MARGIN = 8, 256

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of one raw-text fragment (already "▁"-escaped for an SPM-style vocabulary).
        limit: only the first ids are needed. Merges never cross a pre-tokenizer piece, so the ids
        of the pieces of a prefix of the text are the whole text's first ids: the text is split a
        prefix at a time, and encoding stops at the piece that brings the ids to `limit` or more."""
        size = self._CHARS_PER_ID * max(limit, 1) + self._CUT_MARGIN if limit is not None else len(text)
        while size < len(text):
            prefix = text[:size]
            words = self._words(prefix)
            if sum(map(len, words)) != size:
                break  # pieces that do not tile the text: no safe prefix, encode it whole
            out, end, trusted = [], 0, size - self._CUT_MARGIN
            for word in words:
                end += len(word)
                if end > trusted:
                    break
                out.extend(self._ids(word))
                if len(out) >= limit:
                    return out
            size *= 2
        out = []
        for word in self._words(text):
            out.extend(self._ids(word))
        return out

    def _words(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces of `text` (their concatenation is the text)."""
        words = self._split(text)
        if self._chunk is not None:  # SPM-style words are whole lines: cut them where no merge can cross
            words = [chunk for word in words for chunk in self._chunk(word)]
        return words

    def _ids(self, word: str) -> list[int]:
        """One piece's ids (memoized: text repeats its words)."""
        memo = self._memo
        ids = memo.get(word)
        if ids is None:
            ids = self._encode_word(word if self._spm_style else byte_encode(word))
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            memo[word] = ids
        return ids

    def _encode_word(self, word: str) -> list[int]:
        lookup = self._token_to_id.get
        if self._ignore_merges or (self._spm_style and not word.strip("\n")):
            # (Gemma 4: a run of newlines that is a token is taken whole, not merged)
            tid = lookup(word)
            if tid is not None:
                return [tid]
        out: list[int] = []
        byte_tokens = self._byte_tokens
        for start, size in self._merge(word):
            piece = word[start : start + size]
            tid = lookup(piece)
            if tid is not None:
                out.append(tid)
                continue
            for b in piece.encode("utf-8", "surrogateescape"):
                tid = byte_tokens[b]
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
