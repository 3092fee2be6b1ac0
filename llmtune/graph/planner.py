"""Planner and executor: topological order, buffer reuse by liveness, then a flat run loop.

A Program is compiled once per graph shape and run many times; each run only binds new
inputs. Every intermediate is a view at a planned offset of ONE arena: its bytes return to the
free list after its last reader (views extend the life of the buffer they alias), and
elementwise ops may write over an input that dies at that op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from llmtune.graph import dump
from llmtune.graph.node import Node, topo_order
from llmtune.graph.ops import OPS

_FOREVER = 1 << 62


@dataclass
class MemoryReport:
    planned_bytes: int  # the arena's size (high-water mark of live buffers, with fragmentation)
    naive_bytes: int  # sum of every intermediate's size (no reuse)
    n_nodes: int


class ArenaTooLarge(MemoryError):
    """A program whose planned arena is larger than the bytes its caller can give it: raised
    before anything is allocated, so the caller can refuse the run in one line."""

    def __init__(self, needed: int, limit: int):
        super().__init__(f"the planned arena needs {needed} bytes, {limit} are available")
        self.needed, self.limit = needed, limit


class Step(NamedTuple):
    """One kernel call of a planned program: node `nid`'s value = kernel(out, *values of ins,
    **attrs); `out` is its arena view (None for views of an input); `sink`, when set, receives the
    value (+= in a run, = in an assigning run)."""

    nid: int
    kernel: Callable
    out: Any
    ins: tuple
    attrs: dict
    sink: Any
    op: str


class Program:
    def __init__(self, outputs: list[Node], backend, params: dict[Node, object] | None = None,
                 accumulate: dict[Node, object] | None = None, allocate: bool = True,
                 max_bytes: int | None = None, arena=None):
        """outputs: nodes whose values `run` returns. params: leaf node -> backend array bound
        for every run. accumulate: node -> backend array that receives `+= value` as soon as the
        node is computed (gradient accumulation into parameter-gradient buffers). allocate=False
        plans only: `memory` says what the arena would need, nothing is allocated or runnable
        (memory checks before a run). max_bytes: the most the arena may take (ArenaTooLarge,
        before allocating, when the plan needs more). arena: another program's arena to plan into
        when this plan fits it (programs that never run at once share one: a trainer's passes of
        one worker with different output rows); `owns_arena` says whether a new one was made."""
        self.max_bytes, self._shared_arena = max_bytes, arena
        self.owns_arena = False
        self.backend = backend
        self.outputs = list(outputs)
        self.accumulate = dict(accumulate or {})
        self.order = _sinks_early(topo_order(self.outputs + list(self.accumulate)), set(self.accumulate), self.outputs)
        self.inputs = {n.name: n for n in self.order if n.op == "input"}
        self._dump = dump.pending(self.order)  # LLMTUNE_DUMP: the named nodes the first run writes out
        self._leaf_values = {}
        for n in self.order:
            if n.op == "param":
                if params is None or n not in params:
                    raise ValueError(f"unbound parameter {n}")
                self._leaf_values[n.id] = params[n]
            elif n.op == "const":
                self._leaf_values[n.id] = backend.asarray(np.full(n.shape, n.attrs["value"], dtype=backend.dtype))
        self._plan(allocate)

    # ------------------------------------------------------------------ planning
    def _dtype(self, node: Node):
        return np.int32 if node.dtype == "i32" else self.backend.dtype

    def _nbytes(self, node: Node) -> int:
        return node.size * np.dtype(self._dtype(node)).itemsize

    def _plan(self, allocate: bool = True) -> None:
        """ggml_gallocr_alloc_graph's steps: whose buffer each node uses, when each buffer is last
        read, where in one arena each buffer lives, then the kernel calls that fill them."""
        owner = _buffer_owners(self.order)
        last_use = _last_uses(self.order, self.outputs + (self._dump or []), owner)
        offsets, self.memory = self._allocate(owner, last_use)
        if not allocate:
            return
        arena = self._shared_arena
        if arena is None or arena.nbytes < self.memory.planned_bytes:
            if self.max_bytes is not None and self.memory.planned_bytes > self.max_bytes:
                raise ArenaTooLarge(self.memory.planned_bytes, self.max_bytes)
            arena, self.owns_arena = self.backend.arena(self.memory.planned_bytes), True
        self.arena = arena
        self._steps, self._assign_steps = self._build_steps(arena, owner, offsets)

    def _allocate(self, owner, last_use) -> tuple[dict[int, int], MemoryReport]:
        """Arena offset of every owned buffer, walking the graph in order: a buffer is allocated
        when its node runs (or takes over an input that dies there) and freed after its last
        reader, as ggml_gallocr_allocate_node / ggml_gallocr_free_node do."""
        alloc = _ArenaAllocator()
        offset_of: dict[int, int] = {}
        size_of: dict[int, int] = {}
        dying: dict[int, list[int]] = {}  # step -> buffers whose last reader it is
        naive = 0
        for i, n in enumerate(self.order):
            if owner[n.id] == n.id:
                need = self._nbytes(n)
                naive += need
                reuse = self._inplace_source(n, i, owner, last_use)
                if reuse is not None:
                    offset_of[n.id], size_of[n.id] = offset_of[reuse], size_of[reuse]
                    dying[i].remove(reuse)  # the buffer lives on as this node's
                else:
                    offset_of[n.id], size_of[n.id] = alloc.alloc(need), need
                end = last_use.get(n.id, i)  # never read: free right after computing
                dying.setdefault(end, []).append(n.id)
            for o in dying.pop(i, []):
                alloc.free(offset_of[o], size_of[o])
        return offset_of, MemoryReport(alloc.high_water, naive, len(self.order))

    def _build_steps(self, arena, owner, offsets) -> tuple[list[Step], list[Step]]:
        """One Step per computed node, for `run` and for `run(assign=True)`."""
        steps, assign_steps = [], []
        for n in self.order:
            if n.is_leaf:
                continue
            out = None
            if owner[n.id] == n.id:
                out = self.backend.view(arena, n.shape, self._dtype(n), offsets[n.id])
            kernel = self.backend.kernels.get(n.op)
            if kernel is None:
                raise NotImplementedError(f"backend {self.backend.name} has no kernel for op {n.op!r}")
            ins = tuple(inp.id for inp in n.inputs)
            sink = self.accumulate.get(n)
            steps.append(Step(n.id, kernel, out, ins, n.attrs, sink, n.op))
            # assign mode: a sink computed into its own buffer writes straight into the target
            direct = sink is not None and out is not None and tuple(sink.shape) == n.shape
            assign_steps.append(Step(n.id, kernel, sink if direct else out, ins, n.attrs, None if direct else sink,
                                     n.op))
        return steps, assign_steps

    def _inplace_source(self, n: Node, i: int, owner, last_use):
        """An input buffer this elementwise op may overwrite: same shape, dies here, not a view."""
        if not OPS[n.op].inplace or not n.inputs:
            return None
        src = n.inputs[0]
        if owner[src.id] != src.id or src.shape != n.shape or src.dtype != n.dtype:
            return None
        return src.id if last_use.get(src.id) == i else None

    # ------------------------------------------------------------------ execution
    def steps(self, assign: bool = False) -> list[Step]:
        """The kernel calls of a run (assign: of a run that assigns its accumulate targets)."""
        return self._assign_steps if assign else self._steps

    def bind(self, inputs: dict) -> dict:
        """Node id -> value of every leaf: the bound parameters and constants, and `inputs` by name."""
        vals = dict(self._leaf_values)
        for name, node in self.inputs.items():
            if name not in inputs:
                raise ValueError(f"missing input {name!r}")
            vals[node.id] = inputs[name]
        return vals

    def finish(self, vals: dict) -> list:
        """The output values of a run whose node values are `vals` (and, once, LLMTUNE_DUMP's file)."""
        if self._dump is not None:
            dump.write(self._dump, vals, self.backend)
            self._dump = None
        return [vals[n.id] for n in self.outputs]

    def run(self, *, assign: bool = False, **inputs) -> list:
        """Bind inputs by name, execute, return the output arrays (valid until the next run).

        Accumulate targets receive `+= value`; with assign=True they receive `= value` instead
        (the first micro-batch of a step), mostly by computing straight into them."""
        vals = self.bind(inputs)
        if assign:
            for nid, kernel, out, ins, attrs, sink, _ in self._assign_steps:
                val = kernel(out, *[vals[j] for j in ins], **attrs)
                vals[nid] = val
                if sink is not None:
                    sink[...] = val
        else:
            accumulate = self.backend.accumulate
            for nid, kernel, out, ins, attrs, sink, _ in self._steps:
                val = kernel(out, *[vals[j] for j in ins], **attrs)
                vals[nid] = val
                if sink is not None:
                    accumulate(sink, val)
        return self.finish(vals)


class ProgramCache:
    """Compiled programs by key (a graph's shape), made by `make(key)` on first use. keep: the most
    recently used programs kept compiled (None: every one); the least recently used is dropped,
    and `on_drop(program)` told, before a new one is compiled, so the arenas of at most `keep`
    programs are alive at once."""

    def __init__(self, make, keep: int | None = None, on_drop=None):
        self.make, self.keep, self.on_drop = make, keep, on_drop
        self._programs: dict = {}  # insertion order = least recently used first

    def get(self, key) -> Program:
        prog = self._programs.pop(key, None)
        if prog is None:
            while self.keep is not None and len(self._programs) >= max(1, self.keep):
                dropped = self._programs.pop(next(iter(self._programs)))
                if self.on_drop is not None:
                    self.on_drop(dropped)
            prog = self.make(key)
        self._programs[key] = prog
        return prog

    def __len__(self) -> int:
        return len(self._programs)

    def programs(self) -> list[Program]:
        return list(self._programs.values())


def _sinks_early(order: list[Node], sinks: set, outputs: list[Node]) -> list[Node]:
    """`order` with every node that only feeds accumulate sinks (a weight's gradient product and
    the sums into it) moved to right after its last input. Depth-first order from the outputs
    puts those nodes after the whole backward, which keeps every activation and gradient they
    read alive to the end; run early, they free them as the backward goes."""
    consumers: dict[int, list[Node]] = {}
    for n in order:
        for inp in n.inputs:
            consumers.setdefault(inp.id, []).append(n)
    keep = {n.id for n in outputs}
    sink_only: set[int] = set()
    for n in reversed(order):  # consumers before producers
        if n.is_leaf or n.id in keep:
            continue
        users = consumers.get(n.id, [])
        if n in sinks and not users or users and all(u.id in sink_only for u in users):
            sink_only.add(n.id)
    if not sink_only:
        return order
    pending = {n.id: sum(1 for i in n.inputs if not i.is_leaf) for n in order if n.id in sink_only}
    out: list[Node] = []

    def emit(n: Node) -> None:
        stack = [n]
        while stack:
            node = stack.pop()
            out.append(node)
            if node.is_leaf:  # not counted in `pending`
                continue
            for c in consumers.get(node.id, []):
                if c.id in pending:
                    pending[c.id] -= 1
                    if pending[c.id] == 0:
                        stack.append(c)

    leaves_only = {n.id for n in order if pending.get(n.id) == 0}  # nothing else releases these
    for n in order:
        if n.id not in sink_only or n.id in leaves_only:
            emit(n)
    return out


# ops whose value is a view of their first input and nothing else (no side effect): with the same
# buffers every run, the same view every run
_PURE_VIEWS = frozenset({"reshape", "permute", "slice", "broadcast_to", "after"})


class Replay:
    """A Program re-run on the same input buffers every time (the caller writes each run's values
    into the arrays of `feed`): after one ordinary run every value is a fixed buffer (the planned
    arena views, the bound parameters, the input buffers), so the pure view steps are dropped and
    every kernel, and every accumulate sink's add or copy, is one pre-bound call (or the call the
    kernel's `bind(out, *args, **attrs)` returns, e.g. a compiled product with its addresses
    converted once, backends/cpu.py). That removes most
    of the Python work per kernel (argument lists, dict look-ups); kernels still run in order.
    compiled=True (a decode step): each run of consecutive kernels that encode themselves as steps
    of a compiled program (`kernel.encode`, native/program.py) is one backend call
    (`backend.compile_steps`), no Python between them.

    Used only when the check holds: every kernel returned its planned `out` (or, for cache_write,
    the cache itself) on the recording run; otherwise every run is an ordinary `Program.run`."""

    def __init__(self, prog: Program, feed: dict, *, assign: bool = False, compiled: bool = False):
        self.prog, self.feed, self.assign = prog, feed, assign
        self.compiled = compiled  # runs of kernels the backend compiles become one call each (decode)
        self.calls = None
        self.fixed = False  # whether runs after the first replay pre-bound calls

    def run(self) -> list:
        if self.calls is None:
            return self._record()
        for call in self.calls:
            call()
        return self.outputs

    def _record(self) -> list:
        prog = self.prog
        vals = prog.bind(self.feed)
        sink_call = _copy_into if self.assign else prog.backend.accumulate
        calls, fixed = [], True  # calls: (the Python call, the compiled step or None, the op)
        for nid, kernel, out, ins, attrs, sink, op in prog.steps(self.assign):
            args = tuple(vals[j] for j in ins)
            val = vals[nid] = kernel(out, *args, **attrs)
            if sink is not None:
                sink_call(sink, val)
            if op in _PURE_VIEWS:  # the same view every run; its sink (a gradient sliced from a
                if sink is not None:  # packed buffer, ops.lora_back) still takes each run's value
                    calls.append((functools.partial(sink_call, sink, val), None, "accumulate", None, ()))
                continue
            if not (val is out or (op == "cache_write" and val is args[0])):
                fixed = False
            # a kernel (backends/base.py Kernel) may offer a faster call for fixed buffers ...
            call = kernel.bind(out, *args, **attrs) if kernel.bind is not None else None
            encode = kernel.encode  # ... or its step of a compiled program
            step = encode(out, *args, **attrs) if self.compiled and encode is not None and sink is None else None
            calls.append((call or functools.partial(kernel, out, *args, **attrs), step, op, nid, ins))
            if sink is not None:
                calls.append((functools.partial(sink_call, sink, val), None, "accumulate", None, ()))
        self.outputs = prog.finish(vals)
        self.fixed = fixed
        if fixed:
            self.calls = _compiled_runs(prog.backend, calls, _reader_counts(prog))
        else:  # the ordinary path from now on (the same result, the Python work included)
            self.calls = [functools.partial(self._run_plain)]
        return self.outputs

    def _run_plain(self) -> None:
        self.outputs = self.prog.run(assign=self.assign, **self.feed)


def _reader_counts(prog: Program) -> dict[int, int]:
    """Node id -> how many nodes read its value (an output counts as one more)."""
    counts: dict[int, int] = {}
    for n in prog.order:
        for inp in n.inputs:
            counts[inp.id] = counts.get(inp.id, 0) + 1
    for n in prog.outputs:
        counts[n.id] = counts.get(n.id, 0) + 1
    return counts


def _compiled_runs(backend, calls, readers) -> list:
    """The calls of a replay with each run of consecutive compiled steps as one call
    (backend.compile_steps; its Python calls where the backend compiles none). With each run goes,
    for each step, the one later step of the run that reads its value (the backend may fuse them)."""
    out, run = [], []

    def flush():
        group = None
        if len(run) > 1:
            at = {e[3]: k for k, e in enumerate(run)}
            sole = [-1] * len(run)  # the index of the one step reading each step's value, else -1
            for j, e in enumerate(run):
                for i in set(e[4]):
                    if i in at and readers.get(i, 0) == 1:
                        sole[at[i]] = j
            group = backend.compile_steps([e[1] for e in run], [e[2] for e in run], sole)
        out.extend([group] if group is not None else [e[0] for e in run])
        run.clear()

    for entry in calls:
        if entry[1] is not None:
            run.append(entry)
            continue
        flush()
        out.append(entry[0])
    flush()
    return out


def _copy_into(dst, src) -> None:
    dst[...] = src


def _buffer_owners(order: list[Node]) -> dict[int, int | None]:
    """Node id -> id of the node whose buffer holds its value (ggml's view_src): itself, the
    owner of its first input for views, None for leaves (memory bound from outside)."""
    owner: dict[int, int | None] = {}
    for n in order:
        if n.is_leaf:
            owner[n.id] = None
        elif OPS[n.op].view:
            owner[n.id] = owner[n.inputs[0].id]
        else:
            owner[n.id] = n.id
    return owner


def _last_uses(order: list[Node], outputs: list[Node], owner) -> dict[int, int]:
    """Owner id -> index in `order` of the last node reading its buffer (through any view):
    ggml-alloc's child and view counts as positions. Outputs live forever."""
    last_use: dict[int, int] = {}
    for i, n in enumerate(order):
        for inp in n.inputs:
            o = owner[inp.id]
            if o is not None:
                last_use[o] = max(last_use.get(o, -1), i)
    for n in outputs:
        if owner[n.id] is not None:
            last_use[owner[n.id]] = _FOREVER
    return last_use


class _ArenaAllocator:
    """Offsets in one arena: best-fit over a coalescing free list (as ggml-alloc does); the
    arena's size is the high-water mark."""

    ALIGN = 64

    def __init__(self):
        self.free_blocks: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self.high_water = 0

    def alloc(self, size: int) -> int:
        size = -(-max(size, 1) // self.ALIGN) * self.ALIGN
        best = None
        for k, (off, sz) in enumerate(self.free_blocks):
            if sz >= size and (best is None or sz < self.free_blocks[best][1]):
                best = k
        if best is not None:
            off, sz = self.free_blocks[best]
            if sz == size:
                del self.free_blocks[best]
            else:
                self.free_blocks[best] = (off + size, sz - size)
            return off
        if self.free_blocks and sum(self.free_blocks[-1]) == self.high_water:
            off, _ = self.free_blocks.pop()  # extend the free block at the end
        else:
            off = self.high_water
        self.high_water = off + size
        return off

    def free(self, offset: int, size: int) -> None:
        size = -(-max(size, 1) // self.ALIGN) * self.ALIGN
        blocks = self.free_blocks
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        blocks.insert(lo, (offset, size))
        if lo + 1 < len(blocks) and offset + size == blocks[lo + 1][0]:  # merge with next
            blocks[lo] = (offset, size + blocks[lo + 1][1])
            del blocks[lo + 1]
        if lo > 0 and sum(blocks[lo - 1]) == offset:  # merge with previous
            blocks[lo - 1] = (blocks[lo - 1][0], blocks[lo - 1][1] + blocks[lo][1])
            del blocks[lo]
