"""Reverse-mode autodiff: builds the backward graph from each op's backward rule, optionally
with gradient checkpointing (activations recomputed segment by segment in the backward)."""

from __future__ import annotations

from llmtune.graph import ops
from llmtune.graph.node import Node, topo_order


def grad(loss: Node, wrt: list[Node], seed: Node | None = None, checkpoint: bool = False) -> dict[Node, Node]:
    """Gradient nodes d(loss)/d(w) for each w in `wrt` that the loss depends on.

    `seed` is d(final)/d(loss) (default 1); pass an input node to scale the loss per run
    (gradient accumulation over micro-batches). Gradients that fan in are summed.

    checkpoint: the backward reads no activation of the forward but those at the cuts between
    segments (checkpoint_segments: the residual stream between half-layers of a transformer);
    each segment's forward is cloned and run again when its output's gradient is complete, so
    only one segment's activations are alive at a time (PyTorch's checkpoint_sequential).
    """
    if seed is None:
        seed = ops.const(1.0, loss.shape)
    grads: dict[Node, Node] = {loss: seed}
    order = topo_order([loss])
    segments = checkpoint_segments(order) if checkpoint else {}
    recomputed: set[int] = set()
    for node in reversed(order):
        if node.id in recomputed:
            continue
        seg = segments.get(node.id)
        if seg is not None and node in grads:
            start, nodes = seg
            clones = _recompute(start, nodes, grads[node])
            grads[clones[node.id]] = grads.pop(node)
            for clone in reversed([clones[start.id]] + [clones[n.id] for n in nodes]):
                _backprop(clone, grads)
            recomputed.update(n.id for n in nodes)
            continue
        _backprop(node, grads)
    return {w: grads[w] for w in wrt if w in grads}


def _backprop(node: Node, grads: dict) -> None:
    """Apply node's backward rule to its (complete) gradient, summing into its inputs' gradients."""
    g = grads.get(node)
    if g is None or node.is_leaf or not node.requires_grad:
        return
    rule = ops.OPS[node.op].backward
    if rule is None:
        raise NotImplementedError(f"op {node.op} has no backward rule")
    for inp, g_inp in zip(node.inputs, rule(node, g)):
        if g_inp is None or not inp.requires_grad:
            continue
        prev = grads.get(inp)
        grads[inp] = g_inp if prev is None else ops.add(prev, g_inp)


def _recompute(start: Node, nodes: list[Node], g_out: Node) -> dict[int, Node]:
    """Clones of a segment's nodes (forward order) reading `start` through ops.after(start, g_out):
    scheduled after the gradient of the segment's output exists. Node id -> clone."""
    clones = {start.id: ops.after(start, g_out)}
    for n in nodes:
        inputs = tuple(clones.get(i.id, i) for i in n.inputs)
        clones[n.id] = Node(n.op, inputs, n.attrs, n.shape, n.dtype, requires_grad=n.requires_grad, name=n.name,
                            contiguous=n.contiguous)
    return clones


def checkpoint_segments(order: list[Node]) -> dict[int, tuple[Node, list[Node]]]:
    """Segments of a forward graph worth recomputing: end node id -> (start, nodes after start up
    to the end, in order). Cuts are the nodes that are, once computed, the only value of the
    batch still needed later (leaves, and nodes computed from leaves only such as a decoded
    weight, are kept anyway and do not count); in a transformer, the residual stream after each
    attention and each feed-forward block. The part before the first cut (the embedding) and
    after the last (the output and the loss, whose backward runs first) are not recomputed."""
    dynamic: set[int] = set()  # nodes that depend on the batch
    last_read: dict[int, int] = {}
    for i, n in enumerate(order):
        if n.op == "input" or any(inp.id in dynamic for inp in n.inputs):
            dynamic.add(n.id)
        for inp in n.inputs:
            last_read[inp.id] = i
    live: set[int] = set()
    cuts: list[int] = []
    for i, n in enumerate(order):
        for inp in n.inputs:
            if last_read.get(inp.id) == i:
                live.discard(inp.id)
        if n.id in dynamic and not n.is_leaf and last_read.get(n.id, -1) > i:
            live.add(n.id)
            if live == {n.id}:
                cuts.append(i)
    segments = {}
    for a, b in zip(cuts, cuts[1:]):
        nodes = [n for n in order[a + 1 : b + 1] if n.id in dynamic and not n.is_leaf]
        segments[order[b].id] = (order[a], nodes)
    return segments
