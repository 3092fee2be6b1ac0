"""Tokenizers read from GGUF metadata, token for token as llama.cpp's llama-vocab.cpp (SPM, BPE, WordPiece)."""

from llmtune.tokenizer.tokenizer import (  # noqa: F401
    SPACE_ESCAPE,
    Tokenizer,
    data_suffix,
    format_ids,
    format_pieces,
    json_why,
    read_bytes,
    read_text,
    require_text,
    strip_bom,
)
