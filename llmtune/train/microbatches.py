"""A step's micro-batches: each one's inputs (tokens, targets, its windows' layout, dropout masks
and the loss's seed) fed to a training pass, the passes run by one worker per core (each with
single-threaded BLAS, summing into a gradient buffer of its own that the step adds up) or, with one
worker, in a block whose OpenBLAS thread count a tuner picks. Under data parallel, this rank's
micro-batches r, r + N, ... only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from llmtune.backends.cpu import blas_threads
from llmtune.model.adapter import dropout_masks


class MicroBatches:
    """The worker side of a trainer `tr`: n_workers gradient buffers (worker 0's is tr.flat_g, the
    others summed into it per step), their thread pool, and the one-worker block (`tuner`, set by
    the trainer once it knows its products)."""

    def __init__(self, tr, n_workers: int):
        self.tr, self.n_workers = tr, n_workers
        self.grads = [tr.flat_g] + [tr.backend.zeros((tr.n_trainable,)) for _ in range(n_workers - 1)]
        self.pool = ThreadPoolExecutor(n_workers, thread_name_prefix="llmtune-train") if n_workers > 1 else None
        self.tuner: Callable | None = None

    def grad_views(self, w: int) -> dict:
        """Worker w's gradient buffer as per-tensor views (the sinks of its passes)."""
        return self.tr._flat_views(self.grads[w])

    def feed(self, inputs: np.ndarray, targets: np.ndarray, seqs: range | None = None, segments=None,
             n_out: int | None = None) -> dict:
        """Inputs of one pass; `seqs` (training passes): the micro-batch's sequence indices within
        the step, which pick its dropout masks; `segments` (packed windows): their positions and
        masks; n_out (a pass scoring fewer rows, out_rows): the rows whose targets carry loss,
        padded with the last row and target -1 (no loss, no gradient) to n_out."""
        tr, be = self.tr, self.tr.backend
        flat = np.ascontiguousarray(targets, dtype=np.int32).reshape(-1)
        feed = {"tokens": be.asarray(np.ascontiguousarray(inputs, dtype=np.int32)), "pos": tr.programs.pos}
        if n_out is not None and n_out < flat.size:
            rows = np.full(n_out, flat.size - 1, dtype=np.int32)
            counted = np.flatnonzero(flat >= 0)
            rows[: counted.size] = counted
            picked = np.full(n_out, -1, dtype=np.int32)
            picked[: counted.size] = flat[counted]
            feed["out_ids"], flat = be.asarray(rows), picked
        feed["targets"] = be.asarray(flat)
        if tr.packed:
            if segments is None:
                raise ValueError("a packed trainer's passes need the windows' segments")
            for name, value in tr.layout_inputs(tr.model.hp, segments).items():  # masks in the backend's float type
                feed[name] = be.asarray(value if value.dtype == np.int32 else value.astype(be.dtype, copy=False))
        if seqs is not None and tr.masks:
            masks = dropout_masks(tr.masks, tr.lora_dropout, tr.seed, tr.steps_done, seqs)
            feed.update({n: be.asarray(m.astype(be.dtype, copy=False)) for n, m in masks.items()})
        return feed

    def counts(self, targets: np.ndarray) -> np.ndarray:
        """Each micro-batch's loss-carrying targets (a target of -1, a masked prompt or padding
        token, carries none)."""
        return (np.asarray(targets).reshape(self.tr.ubatches_per_step, -1) >= 0).sum(axis=1)

    def run(self, inputs: np.ndarray, targets: np.ndarray, segments, counts: np.ndarray, extra: Callable,
            collect: Callable) -> list:
        """The step's gradient in flat_g (this rank's share): each of its micro-batches' training
        pass (counts: theirs, self.counts), extra(u) added to micro-batch u's inputs (the loss's
        seed), collect(u, outputs) taken before the worker's next pass overwrites them; ->
        collect's values by micro-batch."""
        tr = self.tr
        be, k, n_w = tr.backend, tr.seqs_per_ubatch, self.n_workers
        results: list = [None] * tr.ubatches_per_step

        def work(w: int) -> None:  # worker w takes this rank's micro-batches w, w + n_w, ...
            for j, u in enumerate(tr.my_ubatches[w::n_w]):
                part = slice(u * k, (u + 1) * k)
                n_out = tr.out_rows(int(counts[u]))
                feed = self.feed(inputs[part], targets[part], range(u * k, (u + 1) * k),
                                 None if segments is None else segments[part], n_out)
                feed.update(extra(u))
                bufs = tr.programs.worker_pass(w, self.grad_views, n_out)[1]
                for name, value in feed.items():
                    if bufs[name] is not value:
                        bufs[name][...] = value
                # a worker's first pass assigns its gradients, later ones add to them
                results[u] = collect(u, tr.programs.run(w, j == 0, self.grad_views, n_out))

        if n_w == 1:
            with self.tuner():
                work(0)
        else:
            with blas_threads(1, compiled=True):
                list(self.pool.map(work, range(n_w)))
            for extra_g in self.grads[1:]:
                be.accumulate(tr.flat_g, extra_g)
        return results
