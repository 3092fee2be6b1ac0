"""Symbolic tensors: a Node is the result of one op applied to input nodes."""

from __future__ import annotations

import itertools
from typing import Any

_ids = itertools.count()


class Node:
    """A value in the compute graph. Leaves are inputs, parameters or constants.

    shape: logical numpy shape. dtype: "f32" (the backend's float type), "i32", or "q" (a frozen
    matrix kept as GGUF block bytes, ops.qweight).
    contiguous: False for strided views (permute, some slices); `reshape` needs a contiguous input.
    """

    __slots__ = ("id", "op", "inputs", "attrs", "shape", "dtype", "requires_grad", "name", "contiguous")

    def __init__(self, op: str, inputs: tuple, attrs: dict, shape: tuple, dtype: str = "f32",
                 requires_grad: bool = False, name: str = "", contiguous: bool = True):
        self.id = next(_ids)
        self.op = op
        self.inputs = tuple(inputs)
        self.attrs = attrs
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.name = name
        self.contiguous = contiguous

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_leaf(self) -> bool:
        return not self.inputs and self.op in ("input", "param", "const")

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"Node#{self.id}({self.op}{label}, {self.shape}, {self.dtype})"

    __hash__ = object.__hash__

    def __eq__(self, other: Any) -> bool:  # identity semantics; keeps dict/set use cheap
        return self is other


def topo_order(outputs) -> list[Node]:
    """Nodes reachable from `outputs`, each after all its inputs (iterative DFS)."""
    order: list[Node] = []
    seen: set[int] = set()
    stack = [(n, False) for n in reversed(list(outputs))]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node.id in seen:
            continue
        seen.add(node.id)
        stack.append((node, True))
        for inp in reversed(node.inputs):
            if inp.id not in seen:
                stack.append((inp, False))
    return order


def name_intermediates(order) -> None:
    """Give every unnamed computed node of `order` (topological) a name derived from its first named
    input, as ggml names a view after its source ("Qcur-0 (permute)"); nodes a graph builder named
    (arch/context.py cb) keep theirs."""
    for n in order:
        if n.name or n.is_leaf:
            continue
        src = next((i.name for i in n.inputs if i.name), "")
        base = src.split(" (", 1)[0]
        n.name = f"{base} ({n.op})" if base else n.op
