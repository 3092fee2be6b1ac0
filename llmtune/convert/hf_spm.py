"""A SentencePiece tokenizer.model as GGUF `tokenizer.*` metadata, as llama.cpp's converter writes it.

convert_hf_to_gguf.py's `_set_vocab_sentencepiece` / `_create_vocab_sentencepiece` (conversion/base.py):
model "llama", pre "default", every piece with its score and type, config.json's vocab_size ids (the
missing ones as [PAD{i}], UNUSED, score -10000), then added_tokens.json and tokenizer_config.json's
added_tokens_decoder laid over them. The converter reads the model with the sentencepiece library; here
the file's ModelProto is read with a small protobuf wire-format reader (only the pieces are needed), so
llmtune needs neither sentencepiece nor protobuf.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

from gguf import GGUFValueType as VT, TokenType

from llmtune.errors import LlmtuneError
from llmtune.gguf.file import MetaValue

# sentencepiece_model.proto: ModelProto.pieces = 1; SentencePiece.piece = 1, score = 2, type = 3
_PIECES, _PIECE, _SCORE, _TYPE = 1, 1, 2, 3
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED, _BYTE = 1, 2, 3, 5, 6  # SentencePiece.Type (USER_DEFINED = 4: NORMAL here)


class _Damaged(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Damaged("a varint runs past its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of one protobuf message: an int (varint, fixed32, fixed64) or the
    bytes of a length-delimited field."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > len(buf):
                raise _Damaged("a fixed-width field runs past its message")
            value, pos = int.from_bytes(buf[pos:pos + width], "little"), pos + width
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise _Damaged("a length-delimited field runs past its message")
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise _Damaged(f"wire type {wire} (field {field})")
        yield field, wire, value


def read_pieces(path: Path) -> list[tuple[str, float, int]]:
    """(piece, score, SentencePiece.Type) of every piece of the ModelProto in `path`, in id order
    (SentencePieceProcessor's IdToPiece / GetScore; the type defaults to NORMAL as in the proto)."""
    try:
        buf = path.read_bytes()
        pieces = []
        for field, wire, value in _fields(buf):
            if field != _PIECES or wire != 2:
                continue
            piece, score, kind = None, 0.0, _NORMAL
            for f, w, v in _fields(value):
                if f == _PIECE and w == 2:
                    piece = v.decode("utf-8")
                elif f == _SCORE and w == 5:
                    score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                elif f == _TYPE and w == 0:
                    kind = v
            if piece is None:
                raise _Damaged(f"piece {len(pieces)} has no text")
            pieces.append((piece, score, kind))
    except (OSError, UnicodeDecodeError, _Damaged) as exc:
        raise LlmtuneError(f"{path}: not a readable SentencePiece model ({exc})") from None
    if not pieces:
        raise LlmtuneError(f"{path}: not a SentencePiece model (no pieces)")
    return pieces


def _token_type(kind: int) -> int:
    """_create_vocab_sentencepiece's IsUnknown / IsControl / IsUnused / IsByte tests, else NORMAL."""
    return {_UNKNOWN: TokenType.UNKNOWN, _CONTROL: TokenType.CONTROL, _UNUSED: TokenType.UNUSED,
            _BYTE: TokenType.BYTE}.get(kind, TokenType.NORMAL)


def spm_vocab(path: Path, config: dict, added: dict, decoder: dict, looks_special,
              json_added: list | None = None) -> dict[str, MetaValue]:
    """_set_vocab_sentencepiece's tokens, scores and types for the tokenizer.model at `path`, with
    added_tokens.json's `added` and tokenizer_config.json's added_tokens_decoder `decoder` laid over them
    (the special ids, flags and chat template are SpecialVocab's: hf_vocab.special_metadata).
    `json_added` (phi3: tokenizer.json's added_tokens, [] without one): Phi3MiniModel.set_vocab's
    variant instead, where every decoder or tokenizer.json added token is USER_DEFINED, CONTROL when
    special, its text as written."""
    pieces = read_pieces(path)
    size = int(config.get("vocab_size_per_layer_input") or config.get("vocab_size") or len(pieces))
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [-10000.0] * size
    types = [int(TokenType.UNUSED)] * size
    for i, (piece, score, kind) in enumerate(pieces[:size]):  # the converter ignores ids past vocab_size
        tokens[i], scores[i], types[i] = piece, score, int(_token_type(kind))
    for token, tid in added.items():
        if isinstance(tid, int) and 0 <= tid < size:
            tokens[tid], scores[tid], types[tid] = token, -1000.0, int(TokenType.USER_DEFINED)
    if json_added is not None:
        entries = [(int(k), d) for k, d in decoder.items()] + [(int(d["id"]), d) for d in json_added]
        for tid, data in entries:
            if 0 <= tid < size:
                kind = TokenType.CONTROL if data.get("special") else TokenType.USER_DEFINED
                tokens[tid], scores[tid], types[tid] = data["content"], -1000.0, int(kind)
        return _vocab_keys(tokens, scores, types)
    for key, data in decoder.items():
        tid, token = int(key), data["content"]
        if tid >= size:
            continue
        if data.get("special") or looks_special(token):
            types[tid] = int(TokenType.CONTROL)
        else:
            token = token.replace("\u2581", " ")  # the converter pre-normalises user-defined spaces
            types[tid] = int(TokenType.USER_DEFINED)
        tokens[tid], scores[tid] = token, -1000.0
    return _vocab_keys(tokens, scores, types)


def _vocab_keys(tokens: list[str], scores: list[float], types: list[int]) -> dict[str, MetaValue]:
    return {
        "tokenizer.ggml.model": MetaValue("llama", VT.STRING),
        "tokenizer.ggml.pre": MetaValue("default", VT.STRING),
        "tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.scores": MetaValue(scores, VT.ARRAY, VT.FLOAT32),
        "tokenizer.ggml.token_type": MetaValue(types, VT.ARRAY, VT.INT32),
    }
