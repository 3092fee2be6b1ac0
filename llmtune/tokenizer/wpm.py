"""WordPiece (BERT) tokenization exactly as llama.cpp's `llm_tokenizer_wpm`.

The text is normalized code point by code point and cut into words: whitespace ends a word;
NUL, U+FFFD and control characters are dropped; with `strip_accents` every code point becomes
the first code point of its canonical decomposition and combining marks are dropped; with
`lowercase` it is lower-cased (simple one-to-one mapping); punctuation, ASCII symbols and CJK
ideographs are words of their own. Each word, prefixed with "▁", is then covered greedily by
the longest vocabulary pieces from the left; a word that cannot be covered entirely becomes
the unknown token. Classes and mappings follow llama.cpp's Unicode 15.1 tables
(`unicode_data`). Words are independent, so their ids are memoized.
"""

from __future__ import annotations

from llmtune.tokenizer.unicode_data import WHITESPACE, category, nfd_first, tolower

_WORD_PREFIX = "\u2581"
_MEMO_LIMIT = 1 << 20

# CJK ideograph blocks that are split into one-character words (as Hugging Face's BERT, whose
# table starts Extension C+ at 0x2B920: llama.cpp copies that)
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))  # fmt: skip

# per code point: 0 append to the word, 1 end the word (whitespace), 2 drop, 3 a word by itself
_APPEND, _BREAK, _DROP, _ALONE = range(4)


def _is_cjk(cp: int) -> bool:
    return any(a <= cp <= b for a, b in _CJK)


class WpmEncoder:
    """Greedy longest-match WordPiece over normalized words (llama.cpp `llm_tokenizer_wpm_session`)."""

    def __init__(self, token_to_id: dict[str, int], unk_id: int | None, lowercase: bool, strip_accents: bool):
        self._token_to_id = token_to_id
        self._unk_id = unk_id
        self._lowercase = lowercase
        self._strip_accents = strip_accents
        self._max_len = max(map(len, token_to_id), default=1)
        self._char_cache: dict[str, tuple[int, str]] = {}
        self._memo: dict[str, list[int]] = {}

    def _classify(self, ch: str) -> tuple[int, str]:
        """What the normalizer does with one (input) code point, and the text it contributes."""
        hit = self._char_cache.get(ch)
        if hit is not None:
            return hit
        if self._strip_accents:
            ch2 = nfd_first(ch)
        else:
            ch2 = ch
        cp = ord(ch2)
        cat = category(cp)
        if cp in WHITESPACE:
            result = (_BREAK, "")
        elif cp == 0 or cp == 0xFFFD or cat == "C" or (self._strip_accents and cat == "M"):
            result = (_DROP, "")
        else:
            text = tolower(ch2) if self._lowercase else ch2
            alone = cat == "P" or (cp < 0x7F and cat == "S") or _is_cjk(cp)
            result = (_ALONE if alone else _APPEND, text)
        self._char_cache[ch] = result
        return result

    def words(self, text: str) -> list[str]:
        """llama.cpp's `preprocess`: the normalized words of `text`."""
        words: list[str] = []
        current: list[str] = []
        classify = self._classify
        for ch in text:
            action, piece = classify(ch)
            if action == _APPEND:
                current.append(piece)
            elif action == _DROP:
                continue
            else:
                if current:
                    words.append("".join(current))
                    current = []
                if action == _ALONE:
                    words.append(piece)
        if current:
            words.append("".join(current))
        return words

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        memo = self._memo
        for word in self.words(text):
            ids = memo.get(word)
            if ids is None:
                ids = self._encode_word(word)
                if len(memo) >= _MEMO_LIMIT:
                    memo.clear()
                memo[word] = ids
            out.extend(ids)
        return out

    def _encode_word(self, word: str) -> list[int]:
        lookup = self._token_to_id.get
        text = _WORD_PREFIX + word
        n = len(text)
        ids: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + self._max_len), i, -1):
                tid = lookup(text[i:j])
                if tid is not None:
                    ids.append(tid)
                    i = j
                    break
            else:  # no piece starts here: the whole word is unknown
                ids = []
                break
        if not ids:
            return [] if self._unk_id is None else [self._unk_id]
        return ids
