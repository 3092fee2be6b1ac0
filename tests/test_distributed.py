"""Data-parallel training over MPI (llmtune/backends/dist.py): `mpirun -n 2 llmtune finetune` equals
a single-process run, ranks that die, hang or disagree end the run with one line, checkpoints
resume on another number of ranks; and, without MPI or a GPU, the communicator's pieces with
fakes (deadlines, launcher detection, NCCL bootstrap and all-reduce, GPU per rank).

The MPI tests need the `mpi` extra (mpi4py + MPICH: pip install -e ".[mpi]") and skip without it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import gguf
import numpy as np
import pytest

from cli_helpers import run_cli
from llmtune import cli
from llmtune.backends import dist, get_backend
from llmtune.backends.dist import (
    Communicator,
    DistributedError,
    MPICommunicator,
    NCCLCommunicator,
    Watchdog,
    device_for_rank,
    launched,
    use_local_device,
)
from llmtune.errors import LlmtuneError
from llmtune.eval.benchmarks import evaluate
from llmtune.eval.perplexity import perplexity
from llmtune.model.loaded import load_model
from llmtune.train.checkpoint import resume_workers, same_gradient_sum
from llmtune.train.finetune import finetune
from llmtune.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RANK = Path(__file__).resolve().parent / "dist_rank.py"
# stories260K, batch 4 x ctx, one ctx per micro-batch: 2 micro-batches per rank with 2 ranks
RUN = ["--ctx", "64", "--batch", "256", "--ubatch", "64", "--epochs", "1", "--lr", "1e-3"]


# ------------------------------------------------------------------------------ helpers
def _mpiexec() -> str | None:
    try:
        import mpi4py  # noqa: PLC0415, F401
    except ImportError:
        return None
    here = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        if (here / name).exists():
            return str(here / name)
    return shutil.which("mpiexec") or shutil.which("mpirun")


MPIEXEC = _mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason='needs the mpi extra: pip install -e ".[mpi]"')


def mpirun(*ranks: list, timeout_s: float = 60, env: dict | None = None, limit: float = 120) -> tuple:
    """Run one rank per entry of `ranks` (each: argv after the interpreter, MPMD style);
    -> (exit code, stdout, stderr, seconds)."""
    cmd = [MPIEXEC]
    for i, argv in enumerate(ranks):
        cmd += ([":"] if i else []) + ["-n", "1", *map(str, argv)]
    full_env = {**os.environ, dist.TIMEOUT_ENV: str(timeout_s), "PYTHONPATH": str(REPO / "tests"), **(env or {})}
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit, env=full_env)
    return res.returncode, res.stdout, res.stderr, time.monotonic() - t0


def rank_argv(*args, fault: tuple = ()) -> list:
    return [sys.executable, RANK, *fault, "--", *map(str, args)]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory, wiki100k_path) -> Path:
    path = tmp_path_factory.mktemp("dist") / "small.txt"
    path.write_text(wiki100k_path.read_text()[:6000])  # 28 optimizer steps of 4 x 64 tokens
    return path


def weights(path) -> dict:

    return {k: np.asarray(v, dtype=np.float64) for k, v in load_model(path).weights.items()}


def assert_same_weights(a, b, rtol: float = 0.0) -> None:
    """Bit for bit: two ranks of one worker each run the same passes, single-threaded, and sum the
    gradients in the same order as one process running a worker per core on two cores (and where
    OpenBLAS's bits follow its thread count, every pass runs it single-threaded:
    threads.blas_threads.reproducible). The worst relative difference is named when they differ;
    rtol: the GPUs' (their atomics' order varies)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max((np.abs(wa[n] - wb[n]).max() / max(np.abs(wa[n]).max(), 1e-30), n) for n in wa)
    assert worst[0] <= rtol, worst


def records(path, kind) -> list[dict]:
    return [r for r in map(json.loads, Path(path).read_text().splitlines()) if r["type"] == kind]


def single_process(model, data, out, **settings):

    flags = dict(zip(RUN[::2], RUN[1::2]))
    base = {k.lstrip("-"): (float(v) if k == "--lr" else int(v)) for k, v in flags.items()}
    return finetune(model, data, out, **{**base, **settings})


# ------------------------------------------------------------------------------ MPI: results
@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, stories_path, small_text):
    """The acceptance run: mpirun -n 2 finetune (checkpoints every 7 steps kept for the resume test)."""
    if MPIEXEC is None:
        pytest.skip('needs the mpi extra: pip install -e ".[mpi]"')
    d = tmp_path_factory.mktemp("two")
    args = ["finetune", stories_path, small_text, "-o", d / "two.gguf", "--metrics", d / "two.jsonl", *RUN,
            "--checkpoint-every", "7", "--keep-checkpoints", "10"]
    code, out, err, _ = mpirun([sys.executable, "-m", "llmtune", *args], [sys.executable, "-m", "llmtune", *args])
    assert code == 0, out + err
    return d, out, err


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, stories_path, small_text):
    """The same run in one process (in-process library call)."""
    d = tmp_path_factory.mktemp("one")
    single_process(stories_path, small_text, d / "one.gguf", metrics=str(d / "one.jsonl"), checkpoint_every=7,
                   keep_checkpoints=10)
    return d


@pytest.mark.determinism
@needs_mpi
def test_two_ranks_equal_one_process(two_rank_run, one_process_run, stories_path, small_text):
    d, out, err = two_rank_run
    one = one_process_run / "one.gguf"
    assert_same_weights(one, d / "two.gguf")
    # the same loss curve, step by step, and the same validation (split across the ranks)
    a, b = records(one_process_run / "one.jsonl", "train_step"), records(d / "two.jsonl", "train_step")
    assert len(a) == len(b) == 28
    assert [r["loss"] for r in b] == [r["loss"] for r in a]
    assert [r["accuracy"] for r in b] == [r["accuracy"] for r in a]
    va, vb = records(one_process_run / "one.jsonl", "validation"), records(d / "two.jsonl", "validation")
    assert len(va) == len(vb) == 1 and vb[0]["loss"] == va[0]["loss"]
    # rank 0 alone printed and wrote: one summary, one metrics line per step, its checkpoints
    assert out.count("finetune summary") == 1 and "Traceback" not in err
    assert sorted(p.name for p in d.glob("two.gguf.ckpt-*.npz")) == [f"two.gguf.ckpt-{s:06d}.npz"
                                                                     for s in (7, 14, 21, 28)]


@pytest.mark.determinism
@needs_mpi
def test_checkpoints_resume_on_another_number_of_ranks(two_rank_run, one_process_run, tmp_path, stories_path,
                                                       small_text):
    d, _, _ = two_rank_run
    # 2 ranks -> 1 process: resume the 2-rank run's step-14 checkpoint alone
    alone = tmp_path / "alone.gguf"
    warnings = []
    single_process(stories_path, small_text, alone, resume=d / "two.gguf.ckpt-000014.npz",
                   callback=lambda e: warnings.append(e.message) if e.kind == "warning" else None)
    assert_same_weights(d / "two.gguf", alone)
    assert warnings == []  # 2 ranks x 1 worker -> 1 process x 2 workers: the same sum, a + b
    # 1 process -> 2 ranks: the single-process run's checkpoint continued by mpirun -n 2
    resumed = tmp_path / "one.gguf"
    shutil.copy(one_process_run / "one.gguf.ckpt-000014.npz", tmp_path / "one.gguf.ckpt-000014.npz")
    args = [sys.executable, "-m", "llmtune", "finetune", stories_path, small_text, "-o", resumed, *RUN,
            "--resume", tmp_path / "one.gguf.ckpt-000014.npz", "--metrics", tmp_path / "resumed.jsonl"]
    code, out, err, _ = mpirun(args, args)
    assert code == 0, out + err
    assert_same_weights(one_process_run / "one.gguf", resumed)
    steps = [r["global_step"] for r in records(tmp_path / "resumed.jsonl", "train_step")]
    assert steps == list(range(15, 29))  # written once (by rank 0)


@pytest.mark.determinism
@needs_mpi
def test_lora_two_ranks_equal_one_process(tmp_path, stories_path, small_text):

    lora = ["--lora-rank", "4", "--lora-dropout", "0.1"]  # dropout masks follow the sequence, not the rank
    args = [sys.executable, "-m", "llmtune", "finetune", stories_path, small_text, "-o", tmp_path / "two.gguf", *RUN,
            *lora]
    code, out, err, _ = mpirun(args, args)
    assert code == 0, out + err
    single_process(stories_path, small_text, tmp_path / "one.gguf", lora_rank=4, lora_dropout=0.1)
    one, two = ({t.name: np.asarray(t.data, np.float64) for t in gguf.GGUFReader(tmp_path / f"{n}.gguf").tensors}
                for n in ("one", "two"))
    assert one.keys() == two.keys() and len(one) > 0
    for name in one:
        assert np.array_equal(one[name], two[name]), name  # as assert_same_weights


@pytest.mark.determinism
@needs_mpi
def test_grad_clip_two_ranks_equal_one_process(tmp_path, stories_path, small_text):
    """--grad-clip under mpirun -n 2 clips the all-reduced gradient: the same norm before clipping
    at every step as one process (each rank alone would see about half of it), and the same model."""
    clip = ["--grad-clip", "0.05", "--checkpoint-every", "0"]
    args = [sys.executable, "-m", "llmtune", "finetune", stories_path, small_text, "-o", tmp_path / "two.gguf", *RUN,
            *clip, "--metrics", tmp_path / "two.jsonl"]
    code, out, err, _ = mpirun(args, args)
    assert code == 0, out + err
    single_process(stories_path, small_text, tmp_path / "one.gguf", grad_clip=0.05, metrics=str(tmp_path / "one.jsonl"))
    norms = [[r["grad_norm"] for r in records(tmp_path / f"{n}.jsonl", "train_step")] for n in ("one", "two")]
    assert len(norms[0]) == 28 and min(norms[0]) > 0.05  # every step clipped
    assert norms[1] == norms[0]
    assert_same_weights(tmp_path / "one.gguf", tmp_path / "two.gguf")


@pytest.mark.determinism
@needs_mpi
def test_early_stop_two_ranks_equal_one_process(tmp_path, stories_path, small_text):
    """Every rank sees the same validation losses (split across them, gathered), so all stop at
    the same step and -o holds the same best weights as one process's run."""
    sel = ["--eval-every", "4", "--early-stop", "1", "--min-delta", "0.05", "--save-best", "--lr", "3e-3"]
    run = [*RUN[:-2], *sel]  # RUN ends with --lr 1e-3
    args = [sys.executable, "-m", "llmtune", "finetune", stories_path, small_text, "-o", tmp_path / "two.gguf", *run,
            "--metrics", tmp_path / "two.jsonl"]
    code, out, err, _ = mpirun(args, args)
    assert code == 0, out + err
    one = single_process(stories_path, small_text, tmp_path / "one.gguf", lr=3e-3, eval_every=4, early_stop=1,
                         min_delta=0.05, save_best=True, metrics=str(tmp_path / "one.jsonl"))
    assert 0 < one.best_step < one.stopped_at < 28
    (a,), (b,) = records(tmp_path / "one.jsonl", "selected"), records(tmp_path / "two.jsonl", "selected")
    assert b == a
    assert_same_weights(tmp_path / "one.gguf", tmp_path / "two.gguf")


# ------------------------------------------------------------------------------ MPI: failures
@needs_mpi
def test_a_killed_rank_ends_the_run(tmp_path, stories_path, small_text):
    """mpirun sees the death and ends every rank at once: no hang."""
    args = ["finetune", stories_path, small_text, "-o", tmp_path / "x.gguf", *RUN]
    code, out, err, seconds = mpirun(rank_argv(*args), rank_argv(*args, fault=("--kill-at", 3)), timeout_s=30)
    assert code != 0 and seconds < 30, (code, seconds, out + err)
    assert not (tmp_path / "x.gguf").exists()


@needs_mpi
def test_a_killed_rank_the_launcher_misses_ends_the_others_with_one_line(tmp_path, stories_path, small_text):
    """Rank 1 dies where its launcher does not notice (its shell lives on, as on a lost machine or
    under srun --kill-on-bad-exit=0): rank 0 stops within the collective timeout, with one line."""
    args = ["finetune", stories_path, small_text, "-o", tmp_path / "x.gguf", *RUN]
    hidden = ["sh", "-c", " ".join(map(str, rank_argv(*args, fault=("--kill-at", 3)))) + "; sleep 60"]
    code, out, err, seconds = mpirun(rank_argv(*args), hidden, timeout_s=6)
    lines = error_lines(err)
    assert code != 0 and seconds < 6 + 30, (code, seconds, out + err)  # mpirun's status: the cleaned-up rank's
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: ") and "step 3" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "x.gguf").exists()


@needs_mpi
def test_a_hung_rank_ends_the_others_with_one_line(tmp_path, stories_path, small_text):
    args = ["finetune", stories_path, small_text, "-o", tmp_path / "x.gguf", *RUN]
    code, out, err, seconds = mpirun(rank_argv(*args), rank_argv(*args, fault=("--stop-at", 2)), timeout_s=6)
    lines = error_lines(err)
    assert code != 0 and seconds < 6 + 30, (code, seconds, out + err)
    assert lines == ["error: rank 0: no answer from the other ranks within 6 s in the all-reduce of "
                     "step 2's gradients: "
                     f"a rank died or hangs; stopping this one ({dist.TIMEOUT_ENV} sets the limit)"], err


@needs_mpi
def test_ranks_with_different_data_stop_with_one_line(tmp_path, stories_path, small_text):
    other = tmp_path / "other.txt"
    other.write_text(small_text.read_text().replace("the", "a"))
    out_path = tmp_path / "x.gguf"
    code, out, err, _ = mpirun(rank_argv("finetune", stories_path, small_text, "-o", out_path, *RUN),
                               rank_argv("finetune", stories_path, other, "-o", out_path, *RUN))
    assert code == dist.EXIT_CODE, out + err
    lines = error_lines(err)
    assert len(lines) == 1 and "rank 1 differs from rank 0 in the data file" in lines[0], err
    assert not out_path.exists()


@needs_mpi
def test_a_setup_error_on_one_rank_is_reported_by_rank_0(tmp_path, stories_path, small_text):
    missing = tmp_path / "missing.txt"
    code, out, err, _ = mpirun(rank_argv("finetune", stories_path, small_text, "-o", tmp_path / "x.gguf", *RUN),
                               rank_argv("finetune", stories_path, missing, "-o", tmp_path / "x.gguf", *RUN))
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and lines[0] == f"error: rank 1: {missing}: no such file", err


@pytest.mark.determinism
@needs_mpi
def test_perplexity_splits_its_passes_across_ranks(tmp_path, stories_path, small_text):
    args = [sys.executable, "-m", "llmtune", "perplexity", stories_path, small_text, "--ctx", "64", "--batch", "64",
            "--json", tmp_path / "two.json"]
    code, out, err, _ = mpirun(args, args)
    assert code == 0 and out.count("Final estimate") == 1, out + err

    one = perplexity(stories_path, small_text, ctx=64, batch=64)
    two = json.loads((tmp_path / "two.json").read_text())
    # the same passes, single-threaded where that changes the bits: the same numbers
    assert two["chunks"] == pytest.approx(one.chunks, rel=1e-12) and two["ppl"] == pytest.approx(one.ppl, rel=1e-12)


@pytest.mark.determinism
@needs_mpi
def test_eval_splits_its_passes_across_ranks(tmp_path, stories_path):
    """Shared-prefix passes split over two ranks: rank 0 alone prints, the same choices as one process."""
    mmlu = Path(__file__).parent / "data" / "benchmarks" / "mmlu-20.jsonl"
    args = [sys.executable, "-m", "llmtune", "eval", stories_path, mmlu, "--ctx", "256", "--batch", "256", "--summary",
            "--json", tmp_path / "two.json"]
    code, out, err, _ = mpirun(args, args)
    assert code == 0 and out.count("Final result") == 1, out + err

    one = evaluate(stories_path, mmlu, ctx=256, batch=256)
    two = json.loads((tmp_path / "two.json").read_text())
    assert [t["choice"] for t in two["tasks"]] == [t.choice for t in one.tasks]
    assert [t["scores"] for t in two["tasks"]] == [list(t.scores) for t in one.tasks]


# ------------------------------------------------------------------------------ no MPI: launcher and install
@pytest.mark.determinism
def test_a_resume_keeps_the_gradient_sum_of_its_checkpoint():
    """A checkpoint resumed on another number of ranks keeps its number of gradient buffers
    (workers x ranks) where the ranks divide it, and says the result may differ only where the
    sum's order may: another backend, or more than two buffers laid out otherwise (MPI's order)."""

    two_ranks = {"workers": 1, "ranks": 2, "backend": "cpu"}
    assert resume_workers(two_ranks, 1) == 2 and resume_workers(two_ranks, 2) == 1
    assert same_gradient_sum(two_ranks, "cpu", 2, 1) and same_gradient_sum(two_ranks, "cpu", 1, 2)
    assert not same_gradient_sum(two_ranks, "cuda", 2, 1) and not same_gradient_sum(two_ranks, "cpu", 1, 1)
    four = {"workers": 2, "ranks": 2, "backend": "cpu"}
    assert resume_workers(four, 1) == 4 and not same_gradient_sum(four, "cpu", 4, 1)
    assert same_gradient_sum(four, "cpu", 2, 2)
    assert resume_workers({"workers": 3, "ranks": 1, "backend": "cpu"}, 2) == 3  # 3 buffers do not split over 2 ranks
    assert resume_workers({"backend": "cpu"}, 1) == 1  # a checkpoint from before the layout was kept
    # the frozen matrices' products: their packed copies did or did not fit the memory
    assert not same_gradient_sum({**two_ranks, "base_products": "packed"}, "cpu", 2, 1, "blas")
    assert same_gradient_sum({**two_ranks, "base_products": "packed"}, "cpu", 2, 1, "packed")


def test_launcher_detection():
    assert launched({}) is None
    assert launched({"PMI_SIZE": "1", "PMI_RANK": "0"}) is None  # mpirun -n 1: a plain process
    assert launched({"PMI_SIZE": "4", "PMI_RANK": "2"}) == (4, 2, "PMI_SIZE")
    assert launched({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}) == (2, 1, "OMPI_COMM_WORLD_SIZE")
    assert launched({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "7"}) == (8, 7, "SLURM_STEP_NUM_TASKS")
    assert dist.collective_timeout({}) == dist.DEFAULT_TIMEOUT
    assert dist.collective_timeout({dist.TIMEOUT_ENV: "2.5"}) == 2.5
    with pytest.raises(DistributedError, match="positive number of seconds"):
        dist.collective_timeout({dist.TIMEOUT_ENV: "soon"})


@pytest.mark.parametrize("rank", [0, 1])
def test_a_launched_run_without_mpi4py_says_what_to_install(monkeypatch, capsys, stories_path, rank):

    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", str(rank))
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py fails
    monkeypatch.setattr(cli.out, "quiet", False)  # restored afterwards: rank 1 silences them
    monkeypatch.setattr(cli.err, "quiet", False)
    previous = dist.set_world(None)
    try:
        code, out, err = run_cli(monkeypatch, capsys, "info", stories_path)
    finally:
        dist.set_world(previous)
    assert code == dist.EXIT_CODE
    if rank == 0:
        assert err.count("\n") == 1 and "rank 0 of 2 (PMI_SIZE=2)" in err and 'pip install -e ".[mpi]"' in err, err
    else:
        assert err == "" and out == ""  # rank 0 speaks for the run


def test_single_process_collectives_return_their_input():
    c = Communicator()
    buf = np.arange(3.0)
    c.allreduce(buf)
    assert buf.tolist() == [0, 1, 2] and c.allgather("x") == ["x"] and c.bcast(5) == 5 and c.any(True)
    assert c.together(lambda a, b: a + b, 1, 2) == 3
    c.check_same({"the data file": "abc"})
    assert dist.world().size == 1  # no launcher here


# ------------------------------------------------------------------------------ no MPI: fakes
class FakeMPI:
    IN_PLACE, SUM, ERRORS_RETURN = object(), "sum", "errors-return"

    class Exception(Exception):  # noqa: N818 - mpi4py's name
        def Get_error_string(self):
            return str(self)


class FakeComm:
    """Rank `rank` of `size` ranks that all hold what this one holds (so a sum is size x it)."""

    def __init__(self, rank=1, size=2, root_value=None, host="node-a"):
        self.rank, self.size, self.root_value, self.host = rank, size, root_value, host
        self.calls = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Set_errhandler(self, handler):
        self.calls.append(("errhandler", handler))

    def allgather(self, obj):
        return [obj] * self.size

    def bcast(self, obj, root=0):
        return obj if self.rank == root else self.root_value

    def Allreduce(self, inplace, buf, op):
        assert inplace is FakeMPI.IN_PLACE and op == FakeMPI.SUM
        buf *= self.size

    def Barrier(self):
        pass


class Expired(list):
    def __call__(self, message):
        self.append(message)


def test_watchdog_ends_a_collective_that_outlives_its_deadline():
    expired = Expired()
    wd = Watchdog(expire=expired)
    with wd("fast", 5.0):
        pass
    hooks = []
    with wd("slow", 0.1, on_timeout=lambda: hooks.append("abort")):
        time.sleep(0.6)  # a blocking call that releases the GIL
    assert expired == ["slow"] and hooks == ["abort"]
    with wd("fast again", 5.0):
        pass
    assert expired == ["slow"]


def test_mpi_communicator_over_a_fake_comm():
    expired = Expired()
    c = MPICommunicator(FakeComm(rank=1, size=2), FakeMPI, timeout=1.0, watchdog=Watchdog(expire=expired))
    assert (c.rank, c.size, c.local_rank, c.local_size) == (1, 2, 1, 2) and not c.is_root
    assert c.sharing_my_cores() == 2  # both ranks on the same machine and the same cores: half each
    c.comm.allgather = lambda obj: [("node-a", [0]), obj] if c.rank == 1 else [obj, ("node-a", [1])]
    assert c.sharing_my_cores() == 1  # bound by the launcher to cores of its own
    del c.comm.allgather
    buf = np.ones(4, np.float32)
    c.allreduce(buf, "step 1")
    assert buf.tolist() == [2.0] * 4 and c.allreduce_calls == 1 and c.allreduce_bytes == 16
    assert c.any(False) is False and c.any(True) is True
    c.check_same({"the data file": "abc"})  # every rank the same
    c.comm.allgather = lambda obj: [obj, {"the data file": "0123456789abcdef0123"}]
    with pytest.raises(DistributedError,
                       match=r"rank 1 differs from rank 0 in the data file \(0123456789ab\.\.\. vs abc\)"):
        c.check_same({"the data file": "abc"})
    # an MPI error becomes one line naming the rank and the collective
    c.comm.Allreduce = lambda *a, **k: (_ for _ in ()).throw(FakeMPI.Exception("Other MPI error, peer gone"))
    c.allreduce(np.ones(2, np.float32), "the all-reduce of step 9's gradients")
    assert expired == ["rank 1: MPI error in the all-reduce of step 9's gradients: Other MPI error, peer gone"]


def test_together_raises_the_failing_ranks_error_on_every_rank():
    class Ranks(Communicator):
        def __init__(self, rank, outcomes):
            super().__init__()
            self.rank, self.size, self.outcomes = rank, 2, outcomes

        def allgather(self, obj, what=""):
            return [obj if r == self.rank else o for r, o in enumerate(self.outcomes)]


    # rank 1 failed: rank 0 reports it, naming the rank, with its exit status
    with pytest.raises(DistributedError, match=r"^rank 1: data.txt: no such file$") as info:
        Ranks(0, [None, ("data.txt: no such file", 2)]).together(lambda: "ok")
    assert info.value.exit_code == 2
    with pytest.raises(LlmtuneError, match="^data.txt: no such file$"):
        Ranks(1, [None, None]).together(lambda: (_ for _ in ()).throw(LlmtuneError("data.txt: no such file")))
    assert Ranks(0, [None, None]).together(lambda: "ok") == "ok"


def fake_cupy(n_devices=4, bus=lambda d: f"0000:{d:02x}:00.0", block: threading.Event | None = None):
    arrays, used = {}, []

    class Device:
        def __init__(self, d=None):
            self.id = used[-1] if d is None else d  # no argument: the current device
            self.pci_bus_id = bus(self.id)

        def use(self):
            used.append(self.id)

    class Stream:
        ptr = 777

        def synchronize(self):
            if block is not None:
                block.wait(10)

    cuda = types.SimpleNamespace(Device=Device, get_current_stream=lambda: Stream(),
                                 runtime=types.SimpleNamespace(getDeviceCount=lambda: n_devices))
    return types.SimpleNamespace(cuda=cuda, arrays=arrays, used=used)


class DeviceArray:
    """What NCCLCommunicator reads of a cupy array: data.ptr, size, dtype (backed by numpy here)."""

    def __init__(self, host: np.ndarray, registry: dict):
        self.host = host
        self.size, self.dtype, self.nbytes = host.size, host.dtype, host.nbytes
        self.data = types.SimpleNamespace(ptr=id(self))
        registry[id(self)] = self


class FakeNccl:
    NCCL_SUM, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 0, 6, 7, 8

    def __init__(self, cupy, on_abort=lambda: None):
        self.cupy, self.made, self.calls, self.aborted, self.on_abort = cupy, [], [], [], on_abort

    def get_unique_id(self):
        return (11, 22, 33)

    def NcclCommunicator(self, n, uid, rank):
        self.made.append((n, uid, rank))
        fake = self

        class Comm:
            def allReduce(self, send, recv, count, dtype, op, stream):
                fake.calls.append((send, recv, count, dtype, op, stream))
                fake.cupy.arrays[recv].host *= n  # every rank holds the same values

            def abort(self):  # the hung NCCL kernel ends (with an error) once its communicator is aborted
                fake.aborted.append(True)
                fake.on_abort()
        return Comm()


def test_nccl_bootstrap_and_allreduce_with_fakes(monkeypatch):
    cupy = fake_cupy()
    nccl = FakeNccl(cupy)
    expired = Expired()
    checked = []
    monkeypatch.setattr(dist, "check_own_gpus", lambda comm, cp: checked.append(comm.rank))
    # rank 1 of 2: NCCL's unique id comes from rank 0 over MPI, at the first device all-reduce
    host = MPICommunicator(FakeComm(rank=1, size=2, root_value=(11, 22, 33)), FakeMPI, timeout=1.0,
                           watchdog=Watchdog(expire=expired))
    c = NCCLCommunicator(host, nccl, cupy)
    assert nccl.made == [] and c.describe().startswith("NCCL over MPI")  # no collective while the ranks set up
    buf = DeviceArray(np.ones(5, np.float32), cupy.arrays)
    c.allreduce(buf, "step 1")
    assert nccl.made == [(2, (11, 22, 33), 1)] and checked == [1]
    assert nccl.calls == [(buf.data.ptr, buf.data.ptr, 5, FakeNccl.NCCL_FLOAT32, FakeNccl.NCCL_SUM, 777)]
    assert buf.host.tolist() == [2.0] * 5 and c.allreduce_calls == 1 and c.allreduce_bytes == 20
    host_buf = np.ones(2, np.float32)  # host arrays go over MPI
    c.allreduce(host_buf)
    assert host_buf.tolist() == [2.0, 2.0] and len(nccl.calls) == 1
    assert c.allgather("x") == ["x", "x"] and not expired
    with pytest.raises(DistributedError, match="no NCCL type"):
        c.allreduce(DeviceArray(np.ones(2, np.int64), cupy.arrays))


def test_nccl_allreduce_that_hangs_is_aborted_and_ends_the_rank(monkeypatch):
    monkeypatch.setattr(dist, "check_own_gpus", lambda comm, cp: None)
    block = threading.Event()
    cupy = fake_cupy(block=block)
    nccl = FakeNccl(cupy, on_abort=block.set)
    expired = Expired()
    host = MPICommunicator(FakeComm(rank=0, size=2), FakeMPI, timeout=0.2, watchdog=Watchdog(expire=expired))
    c = NCCLCommunicator(host, nccl, cupy)
    t0 = time.monotonic()
    c.allreduce(DeviceArray(np.ones(3, np.float32), cupy.arrays), "the all-reduce of step 4's gradients")
    assert nccl.made == [(2, (11, 22, 33), 0)]
    assert nccl.aborted == [True] and time.monotonic() - t0 < 5
    assert len(expired) == 1 and expired[0].startswith("rank 0: no answer from the other ranks within 0.2 s in the "
                                                       "all-reduce of step 4's gradients")


def test_each_rank_takes_its_own_gpu():
    assert [device_for_rank(r, 4, 8) for r in range(4)] == [0, 1, 2, 3]
    assert device_for_rank(3, 4, 1) == 0  # the launcher gave every rank its own device
    with pytest.raises(DistributedError, match="3 ranks on this machine but 2 CUDA devices"):
        device_for_rank(2, 3, 2)
    with pytest.raises(DistributedError, match="no CUDA device"):
        device_for_rank(0, 1, 0)

    class Local(Communicator):
        def __init__(self, rank, seen):
            super().__init__()
            self.rank, self.size, self.local_rank, self.local_size, self.seen = rank, 2, rank, 2, seen

        def allgather(self, obj, what=""):
            return [obj if r == self.rank else s for r, s in enumerate(self.seen)]


    host = socket.gethostname()
    cupy = fake_cupy(n_devices=2)
    assert use_local_device(Local(1, None), cupy) == 1 and cupy.used == [1]
    dist.check_own_gpus(Local(1, [(host, "0000:00:00.0"), None]), cupy)  # rank 0 has another GPU: fine
    dist.check_own_gpus(Local(1, [("node-b", "0000:01:00.0"), None]), cupy)  # the same bus on another machine
    with pytest.raises(DistributedError, match="ranks 0 and 1 share the GPU 0000:01:00.0 on " + host):
        dist.check_own_gpus(Local(1, [(host, "0000:01:00.0"), None]), cupy)  # two device numbers, one GPU
    assert use_local_device(Communicator(), cupy) is None  # one process: nothing chosen


def test_trainer_refuses_more_ranks_than_micro_batches(stories_path):

    class Four(Communicator):
        rank, size = 3, 4

    model = load_model(stories_path)
    with pytest.raises(DistributedError, match="2 micro-batch\\(es\\) per step for 4 ranks"):
        Trainer(model, get_backend("cpu"), n_ctx=32, n_batch=64, n_ubatch=32, trainable=["output.weight"], comm=Four())
    tr = Trainer(model, get_backend("cpu"), n_ctx=32, n_batch=256, n_ubatch=32, trainable=["output.weight"],
                 comm=Four())
    assert list(tr.my_ubatches) == [3, 7]  # rank 3 of 4 takes micro-batches 3 and 7 of 8


def test_evaluation_passes_are_split_across_ranks_and_merged_in_order():
    class Rank0Of2(Communicator):
        rank, size = 0, 2

        def allgather(self, obj, what=""):
            return [obj, (True, "theirs")]  # rank 1's result of the same round

    seen = []

    def score(state, item):
        seen.append(item)
        return item * 10

    out = list(dist.run_split(score, lambda: None, range(5), 1, Rank0Of2()))
    assert seen == [0, 2, 4] and out == [0, "theirs", 20, "theirs", 40]


    def bad(state, item):
        if item == 2:
            raise LlmtuneError("chunk 3: not finite")
        return item

    with pytest.raises(LlmtuneError, match="chunk 3: not finite"):
        list(dist.run_split(bad, lambda: None, range(5), 1, Rank0Of2()))


# ------------------------------------------------------------------------- on a GPU (bench/gpu_check.sh runs these)
def _cuda_nccl():
    try:
        import cupy  # noqa: PLC0415 - optional, probed where used
        from cupy.cuda import nccl  # noqa: PLC0415 - optional, probed where used

        return (cupy, nccl) if cupy.cuda.runtime.getDeviceCount() > 0 and getattr(nccl, "available", True) else None
    except Exception:  # noqa: BLE001
        return None


@pytest.mark.cuda
def test_nccl_communicator_on_a_real_gpu():
    """The real cupy.cuda.nccl calls (unique id, communicator, in-place all-reduce on the current
    stream) with one rank: the sum is the buffer itself."""
    found = _cuda_nccl()
    if found is None:
        pytest.skip("needs cupy with NCCL and a CUDA device")
    cupy, nccl = found
    host = MPICommunicator(FakeComm(rank=0, size=1), FakeMPI, timeout=60.0)
    c = NCCLCommunicator(host, nccl, cupy)
    for dtype in (np.float32, np.float64):
        buf = cupy.arange(1000, dtype=dtype)
        c.allreduce(buf, "a test all-reduce")
        assert cupy.asnumpy(buf).tolist() == list(range(1000))
    assert c.allreduce_calls == 2 and c.nccl_comm is not None


@pytest.mark.cuda
@needs_mpi
def test_two_ranks_on_gpus(tmp_path, stories_path, small_text):
    """mpirun -n 2 --backend cuda: with two GPUs, NCCL's sum equals one GPU's run; with one, both
    ranks would share it and stop with one line."""
    found = _cuda_nccl()
    if found is None:
        pytest.skip("needs cupy with NCCL and a CUDA device")
    cupy, _ = found
    args = [sys.executable, "-m", "llmtune", "finetune", stories_path, small_text, "-o", tmp_path / "two.gguf", *RUN,
            "--backend", "cuda"]
    code, out, err, _ = mpirun(args, args)
    if cupy.cuda.runtime.getDeviceCount() < 2:
        lines = error_lines(err)
        assert code != 0 and len(lines) == 1 and "ranks 0 and 1 share the GPU" in lines[0], out + err
        return
    assert code == 0, out + err
    single_process(stories_path, small_text, tmp_path / "one.gguf", backend="cuda")
    assert_same_weights(tmp_path / "one.gguf", tmp_path / "two.gguf", rtol=1e-5)  # GPU atomics: rounding varies
