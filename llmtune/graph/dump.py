"""The debug switch for bisecting a numerical mismatch: with LLMTUNE_DUMP=FILE in the
environment, the first program run in the process writes the named intermediates of its forward
pass (the cb()-style names of arch/context.py: "attn_norm-0", "Qcur-0", "ffn_out-0", "l_out-0",
"result_output") to FILE, a numpy .npz (name -> float32 array), and FILE.txt, one line per node
in graph order as llama.cpp's eval-callback prints its tensors (name, op, shape, sum), to
compare with `llama-eval-callback` / GGML_SCHED output. Derived names ("Qcur-0 (permute)") and
leaves are not written. Only that one run keeps the named nodes' buffers alive; every other
program plans and runs as without the switch.

    LLMTUNE_DUMP=/tmp/ours.npz llmtune perplexity model.gguf text.txt --chunks 1
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import numpy as np

ENV = "LLMTUNE_DUMP"
_lock = threading.Lock()
_state = {"done": False}


def is_primary(name: str) -> bool:
    """A name a graph builder gave (cb), not one derived from an input's ("x (op)")."""
    return bool(name) and " (" not in name


def pending(order) -> Optional[list]:
    """The nodes of `order` a program should dump, or None (no LLMTUNE_DUMP, nothing named, or
    another program dumped already)."""
    if not os.environ.get(ENV) or _state["done"]:
        return None
    nodes = [n for n in order if not n.is_leaf and n.dtype == "f32" and is_primary(n.name)]
    return nodes or None


def write(nodes: list, vals: dict, backend) -> None:
    """Write the values of `nodes` (once per process) to LLMTUNE_DUMP's file and its .txt."""
    path = os.environ.get(ENV)
    with _lock:
        if _state["done"] or not path:
            return
        _state["done"] = True
        arrays, lines = {}, []
        for n in nodes:
            a = np.asarray(backend.to_numpy(vals[n.id]), dtype=np.float32)
            arrays[n.name] = a
            lines.append(f"{n.name} = {n.op}{list(a.shape)} sum = {float(a.sum(dtype=np.float64)):.6f}")
        with open(path, "wb") as fh:
            np.savez(fh, **arrays)
        with open(f"{path}.txt", "w") as fh:
            fh.write("\n".join(lines) + "\n")


def reset() -> None:
    """Let the next program run dump again (tests)."""
    _state["done"] = False
