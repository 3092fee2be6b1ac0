"""Reverse-mode autodiff: builds the backward graph from each op's backward rule."""

from __future__ import annotations

from llmtune.graph import ops
from llmtune.graph.node import Node, topo_order


def grad(loss: Node, wrt: list[Node], seed: Node | None = None) -> dict[Node, Node]:
    """Gradient nodes d(loss)/d(w) for each w in `wrt` that the loss depends on.

    `seed` is d(final)/d(loss) (default 1); pass an input node to scale the loss per run
    (gradient accumulation over micro-batches). Gradients that fan in are summed.
    """
    if seed is None:
        seed = ops.const(1.0, loss.shape)
    grads: dict[Node, Node] = {loss: seed}
    for node in reversed(topo_order([loss])):
        g = grads.get(node)
        if g is None or node.is_leaf or not node.requires_grad:
            continue
        rule = ops.OPS[node.op].backward
        if rule is None:
            raise NotImplementedError(f"op {node.op} has no backward rule")
        for inp, g_inp in zip(node.inputs, rule(node, g)):
            if g_inp is None or not inp.requires_grad:
                continue
            prev = grads.get(inp)
            grads[inp] = g_inp if prev is None else ops.add(prev, g_inp)
    return {w: grads[w] for w in wrt if w in grads}
