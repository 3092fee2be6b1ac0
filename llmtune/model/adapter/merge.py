"""A base tensor with every attached adapter's change added, as llama-export-lora merges them."""

from __future__ import annotations

from typing import Optional

import numpy as np

# annotations name model/loaded.py's Model, which imports this package (no import here: no circle)


def merged_weight(model: "Model", name: str, base: Optional[np.ndarray] = None) -> np.ndarray:
    """Base tensor `name` (float32) plus every attached adapter's delta, in adapter order."""
    w = np.array(model.weights[name] if base is None else base, dtype=np.float32)
    for adapter in model.adapters:
        if name in adapter.pairs:
            w = adapter.delta(name) + w  # llama-export-lora: cur = delta + cur
    return w
