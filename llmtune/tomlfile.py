"""Reading the TOML configs (`init` model shapes, `finetune` settings) with one-line errors."""

from __future__ import annotations

import os

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from llmtune.errors import LlmtuneError, require_file


def read_toml(path: str | os.PathLike) -> dict:
    """The TOML document at `path`; a LlmtuneError naming the file when it is missing, a
    directory, unreadable or not valid TOML."""
    path = require_file(path, "a TOML config")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise LlmtuneError(f"{path}: invalid TOML ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmtuneError(f"{path}: cannot read ({exc})") from None
