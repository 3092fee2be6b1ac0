import gzip
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).parent.parent


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return DATA / "stories260K.gguf"


@pytest.fixture(scope="session")
def wikitext_ids() -> np.ndarray:
    """llama.cpp's token ids of the WikiText-2 test file under stories260K (BOS first)."""
    return np.load(DATA / "wikitext-2-raw-test.stories260K.ids.npz")["ids"].astype(np.int32)


@pytest.fixture(scope="session")
def wikitext_path(tmp_path_factory) -> Path:
    """The whole WikiText-2 raw test text, unpacked once per session."""
    path = tmp_path_factory.mktemp("wikitext") / "wikitext-2-raw-test.txt"
    path.write_bytes(gzip.decompress((DATA / "wikitext-2-raw-test.txt.gz").read_bytes()))
    return path


@pytest.fixture(scope="session")
def wiki100k_path() -> Path:
    """The first ~100 KB of that text (bundled for the README's demo run)."""
    return REPO / "data" / "wikitext-100k.txt"
