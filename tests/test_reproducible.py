"""The same inputs give the same bytes whatever the thread counts: OpenBLAS's (its own count, the
step tuner's choices, OPENBLAS_NUM_THREADS) and the compiled kernels' (LLMTUNE_NATIVE_THREADS).

Where OpenBLAS's bits follow its thread count (threads.blas_threads.keeps_bits is False: its
Haswell kernels, OPENBLAS_CORETYPE=Haswell) every pass runs it single-threaded, as every worker
and rank does; elsewhere any count gives the same bits. `.ci/run` runs the `determinism` tests a
second time with OPENBLAS_CORETYPE=Haswell OPENBLAS_L2_SIZE=512, so both sides are checked on
every machine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from llmtune.backends.cpu import threads

pytestmark = pytest.mark.determinism


def _fake_blas(monkeypatch, keeps_bits: bool, count: int = 2) -> list:
    """OpenBLAS's thread control replaced by a recorder starting at `count` threads; -> the counts set."""
    state = {"n": count}
    sets: list = []
    monkeypatch.setattr(threads.blas_threads, "_funcs",
                        (lambda: state["n"], lambda n: sets.append(n) or state.update(n=n)))
    monkeypatch.setattr(threads.blas_threads, "keeps_bits", lambda: keeps_bits)
    return sets


@pytest.mark.parametrize("keeps_bits", [True, False])
def test_passes_run_openblas_single_threaded_where_its_count_changes_the_bits(monkeypatch, keeps_bits):
    """reproducible() leaves OpenBLAS's count alone where any count gives the same bits, and makes
    it one thread for the block elsewhere; a single-worker run_in_order and the step tuner's block
    (with nothing to choose from) take it."""
    sets = _fake_blas(monkeypatch, keeps_bits)
    seen = []
    with threads.blas_threads.reproducible():
        seen.append(threads.blas_threads.current())
    list(threads.run_in_order(lambda _, item: seen.append(threads.blas_threads.current()), lambda: None, [0, 1], 1))
    tuner = threads.BlasTuner()
    assert bool(tuner.candidates) == keeps_bits  # where it tunes, both counts give the same bits
    if not keeps_bits:
        with tuner():
            seen.append(threads.blas_threads.current())
    assert seen == ([2, 2, 2] if keeps_bits else [1, 1, 1, 1])
    assert threads.blas_threads.current() == 2 and (sets == [] if keeps_bits else sets[-1] == 2)


@pytest.mark.parametrize("keeps_bits", [True, False])
def test_a_step_runs_workers_whichever_side_of_the_bits_probe(monkeypatch, keeps_bits):
    """One worker per core either way: single-threaded passes make the caller's thread and the
    workers' equal, so the probe no longer decides the layout (and with it the gradient sum)."""
    _fake_blas(monkeypatch, keeps_bits)
    monkeypatch.setattr(threads, "n_cores", lambda: 2)
    assert threads.cpu_workers(None, 4) == 2 and threads.cpu_workers(None, 1) == 1


def _finetune_sha256(tmp_path, stories_path, text, name: str, env: dict, *flags) -> str:
    out = tmp_path / f"{name}.gguf"
    cmd = [sys.executable, "-m", "llmtune", "finetune", str(stories_path), str(text), "-o", str(out), "--ctx", "64",
           "--epochs", "1", "--lr", "1e-3", "--val-split", "0.2", "--seed", "3", *map(str, flags)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert res.returncode == 0, res.stderr[-2000:]
    return hashlib.sha256(out.read_bytes()).hexdigest()


@pytest.mark.parametrize("run", ["full, two micro-batches a step", "lora, one micro-batch a step"])
def test_the_output_is_the_same_file_whatever_the_thread_counts(tmp_path, stories_path, wiki100k_path, run):
    """A finetune (validation included) writes the same bytes with OpenBLAS and the compiled
    kernels at one thread and at two: the counts a machine, a user's OPENBLAS_NUM_THREADS or the
    step tuner may give. Two micro-batches a step run on two workers; one runs on the caller's
    thread, through the tuner (or beside the compiled packed products)."""
    text = tmp_path / "text.txt"
    text.write_text(wiki100k_path.read_text(encoding="utf-8")[:5000], encoding="utf-8")
    flags = ["--batch", "128", "--ubatch", "64"] if run.startswith("full") else ["--batch", "64", "--lora-rank", "4"]
    digests = {n: _finetune_sha256(tmp_path, stories_path, text, f"t{n}",
                                   {"OPENBLAS_NUM_THREADS": str(n), "LLMTUNE_NATIVE_THREADS": str(n)}, *flags)
               for n in (1, 2)}
    assert digests[1] == digests[2], digests
