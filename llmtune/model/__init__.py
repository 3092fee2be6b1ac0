"""GGUF models: file I/O, hyper-parameters, tokenizers."""

from llmtune.model.gguf_io import GGUFFile, load_gguf, write_gguf  # noqa: F401
from llmtune.model.hparams import HParams  # noqa: F401
