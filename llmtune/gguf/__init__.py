"""GGUF files: reading (memory-mapped), writing (atomic), metadata with its value types."""

from llmtune.gguf.file import GGUFFile, MetaValue, load_gguf, write_gguf  # noqa: F401
