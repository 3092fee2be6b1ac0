"""The deterministic LoRA adapter whose llama.cpp perplexity tests/data/lora/llamacpp-lora.json
records (written by `python bench/check_lora.py --bin DIR --record`, re-created by tests/test_lora.py).

Rank 4, alpha 8, on every matrix of stories260K (token_embd and output included), values from an
integer formula (no RNG, no libm), so the same bytes come out on any machine; the fixture keeps
their sha256."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmtune.model.adapter import init_adapter, write_adapter
from llmtune.model.loaded import load_model


def _values(shape, salt: int) -> np.ndarray:
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    q = (i * 7919 + salt * 104729) % 2001 - 1000  # integers in [-1000, 1000]
    return (q.astype(np.float32) * np.float32(5e-5)).reshape(shape)  # |v| <= 0.05


def fixture_adapter(model):

    adapter = init_adapter(model, 4, 8.0, r"weight$", seed=0)
    for k, pair in enumerate(adapter.pairs.values()):
        pair.a[...] = _values(pair.a.shape, 2 * k + 1) * np.float32(4.0)
        pair.b[...] = _values(pair.b.shape, 2 * k + 2)
    return adapter


def write_fixture_adapter(model_path, out) -> Path:

    return write_adapter(out, fixture_adapter(load_model(model_path)))
