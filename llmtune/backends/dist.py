"""Data-parallel processes: MPI (mpi4py) between processes and machines, NCCL (cupy.cuda.nccl)
between GPUs, behind one `Communicator`.

`world()` is the communicator of this process: a single-process one whose collectives return
their input, unless an MPI launcher (mpirun / mpiexec / srun) started it as one of several
ranks; then it is an `MPICommunicator` over MPI_COMM_WORLD (and `for_backend` gives the CUDA
backend an `NCCLCommunicator` bootstrapped over it). Library code calls the same collectives
either way, so training and evaluation have one code path.

Every collective runs under a deadline (LLMTUNE_DIST_TIMEOUT seconds, default 600): a rank that
died or hangs, or an MPI error, ends this rank with one line on stderr and exit status 4, never
a hang. (Launchers such as MPICH's and Open MPI's mpirun already end the whole job when a rank
dies; the deadline covers what they cannot see: a hung rank, a lost machine, srun's
--kill-on-bad-exit=0.)

Nothing here imports mpi4py or cupy unless this process is one of several ranks.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Optional

import numpy as np

from llmtune.backends.cpu.threads import run_in_order, share_cores
from llmtune.errors import LlmtuneError, LlmtuneWarning

TIMEOUT_ENV = "LLMTUNE_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 600.0  # seconds a rank waits in one collective for the others
EXIT_CODE = 4  # a distributed run that lost a rank, or whose ranks disagree
INSTALL_HINT = ('pip install -e ".[mpi]" (mpi4py and MPICH from PyPI), '
                "or pip install mpi4py built for your cluster's MPI")

# (world size, rank) variables of the launchers, checked in this order
LAUNCHER_ENV = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),  # Open MPI's mpirun / prterun
    ("PMI_SIZE", "PMI_RANK"),  # MPICH's and Intel MPI's mpiexec (hydra), srun --mpi=pmi2
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),  # MVAPICH
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),  # srun
)


class DistributedError(LlmtuneError):
    """The ranks of a data-parallel run disagree (files, settings, versions) or cannot run together."""

    exit_code = EXIT_CODE


def launched(environ=None) -> Optional[tuple[int, int, str]]:
    """(world size, rank, the variable that said so) when an MPI launcher started this process as
    one of several ranks; None for a plain process (or a launch of one)."""
    env = os.environ if environ is None else environ
    for size_var, rank_var in LAUNCHER_ENV:
        try:
            size, rank = int(env[size_var]), int(env.get(rank_var, 0))
        except (KeyError, ValueError):
            continue
        return (size, rank, size_var) if size > 1 else None
    return None


def collective_timeout(environ=None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw}: should be a positive number of seconds")
    return value


# ------------------------------------------------------------------------------------ single process
class Communicator:
    """One process: every collective returns its input. The interface of every communicator.

    Collectives are called by every rank in the same order; `what` words the collective for the
    one-line message that ends a rank when the others do not answer."""

    rank, size, local_rank, local_size = 0, 1, 0, 1
    timeout = DEFAULT_TIMEOUT
    kind = "single process"

    def __init__(self):
        self.allreduce_seconds = 0.0  # time spent in allreduce (waiting for the others included)
        self.allreduce_calls = 0
        self.allreduce_bytes = 0

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def allreduce(self, buf, what: str = "an all-reduce") -> None:
        """Sum `buf` (a backend array: numpy, or cupy with NCCL) in place over the ranks."""

    def allreduce_host(self, values: np.ndarray, what: str = "an all-reduce") -> np.ndarray:
        """The elementwise sum over the ranks of a small host array (a new float64 array)."""
        return np.array(values, dtype=np.float64)

    def allgather(self, obj: Any, what: str = "an all-gather") -> list:
        """Every rank's `obj` (picklable), in rank order."""
        return [obj]

    def bcast(self, obj: Any, what: str = "a broadcast") -> Any:
        """Rank 0's `obj` on every rank."""
        return obj

    def barrier(self, what: str = "a barrier") -> None:
        pass

    def any(self, flag: bool, what: str = "a vote") -> bool:
        """True on every rank when `flag` is true on any (e.g. a stop request seen by one rank)."""
        return bool(self.allreduce_host(np.array([1.0 if flag else 0.0]), what)[0] > 0)

    def together(self, fn: Callable, *args, what: str = "the setup", **kwargs):
        """fn(*args, **kwargs) on every rank. When it raises a LlmtuneError on some rank, every rank
        raises one: that rank its own, the others the same message prefixed with the rank (the
        lowest failing one), with its exit status; so rank 0 reports it and all stop alike."""
        if self.size == 1:
            return fn(*args, **kwargs)
        failure, result = None, None
        try:
            result = fn(*args, **kwargs)
        except LlmtuneError as exc:
            failure = exc
        outcome = None if failure is None else (str(failure), getattr(failure, "exit_code", 2))
        outcomes = self.allgather(outcome, what)
        bad = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not bad:
            return result
        if failure is not None:  # this rank's own error (rank 0's is the one printed)
            raise failure
        r, (message, code) = bad[0]
        err = DistributedError(f"rank {r}: {message}" if r != 0 else message)
        err.exit_code = code
        raise err

    def check_same(self, facts: dict[str, str], what: str = "the ranks' inputs") -> None:
        """Every rank must hold the same `facts` (name -> value: file hashes, settings, versions);
        otherwise every rank raises the same DistributedError naming the first difference."""
        if self.size == 1:
            return
        every = self.allgather(facts, what)
        for r, theirs in enumerate(every[1:], 1):
            for key, mine in every[0].items():
                if theirs.get(key) != mine:
                    raise DistributedError(
                        f"rank {r} differs from rank 0 in {key} ({_short(theirs.get(key))} vs {_short(mine)}): "
                        f"every rank must run the same llmtune on the same files with the same settings")

    def for_backend(self, backend) -> "Communicator":
        """The communicator for `backend`'s arrays (NCCL for cuda arrays when there are several ranks)."""
        return self

    def describe(self) -> str:
        return self.kind


def _short(value) -> str:
    text = str(value)
    return text[:12] + "..." if len(text) > 16 else text


# ------------------------------------------------------------------------------------ deadlines
def _die(message: str) -> None:
    """One line on stderr, then end this process at once (MPI cannot be left cleanly: a peer is gone)."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a closed stdout must not stop the message
        pass
    try:
        os.write(2, f"error: {message}\n".encode())
    finally:
        os._exit(EXIT_CODE)


class Watchdog:
    """Deadlines for blocking collectives: a thread that, when an armed deadline passes, runs the
    `on_timeout` hooks and then `expire(message)` (which ends the process). The blocking call
    itself (MPI, a CUDA stream sync) releases the GIL, so the thread runs meanwhile."""

    def __init__(self, expire: Callable[[str], None] = _die):
        self.expire = expire
        self._cond = threading.Condition()
        self._armed: Optional[tuple] = None
        self._thread: Optional[threading.Thread] = None

    @contextmanager
    def __call__(self, message: str, timeout: float, on_timeout: Optional[Callable[[], None]] = None):
        with self._cond:
            self._armed = (time.monotonic() + timeout, message, on_timeout)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmtune-dist-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._armed is None:
                    self._cond.wait()
                    continue
                deadline, message, on_timeout = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._armed = None
                if on_timeout is not None:
                    try:
                        on_timeout()
                    except Exception:  # noqa: BLE001 - best effort (e.g. NCCL's abort) before the exit
                        pass
                self.expire(message)


# ------------------------------------------------------------------------------------ MPI
class MPICommunicator(Communicator):
    """Collectives over an mpi4py communicator, each under the deadline (see the module docstring)."""

    kind = "MPI"

    def __init__(self, comm, MPI, timeout: float = DEFAULT_TIMEOUT, watchdog: Optional[Watchdog] = None):
        super().__init__()
        self.comm, self.MPI, self.timeout = comm, MPI, float(timeout)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.watchdog = watchdog or Watchdog()
        try:  # errors come back as exceptions (then one line), not MPI's own abort
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        except Exception:  # noqa: BLE001 - fakes and old MPIs
            pass
        hosts = self.allgather(socket.gethostname(), "finding the ranks on each machine")
        self.hosts = hosts
        self.local_rank = sum(1 for h in hosts[: self.rank] if h == hosts[self.rank])
        self.local_size = hosts.count(hosts[self.rank])
        self._for_cuda: Optional[Communicator] = None

    def sharing_my_cores(self) -> int:
        """How many ranks (this one included) may run on exactly this rank's cores: those of its
        machine, unless the launcher bound each rank to cores of its own."""
        try:
            mine = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux: no binding to see
            mine = []
        every = self.allgather((self.hosts[self.rank], mine), "comparing the ranks' cores")
        return every.count(every[self.rank])

    def describe(self) -> str:
        machines = len(set(self.hosts))
        return f"MPI, {self.size} ranks on {machines} machine{'s' if machines != 1 else ''}"

    @contextmanager
    def _collective(self, what: str, on_timeout=None, timeout: Optional[float] = None):
        limit = self.timeout if timeout is None else timeout
        message = (f"rank {self.rank}: no answer from the other ranks within {limit:g} s in {what}: a rank died or "
                   f"hangs; stopping this one ({TIMEOUT_ENV} sets the limit)")
        with self.watchdog(message, limit, on_timeout):
            try:
                yield
            except self.MPI.Exception as exc:
                self.fail(f"MPI error in {what}: {_mpi_error_string(exc)}")

    def fail(self, message: str) -> None:
        self.watchdog.expire(f"rank {self.rank}: {message}")

    def allreduce(self, buf, what: str = "an all-reduce") -> None:
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"MPICommunicator.allreduce: a host (numpy) buffer, got {type(buf).__name__}; "
                            f"use for_backend(backend) for device arrays")
        t0 = time.perf_counter()
        with self._collective(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        self.allreduce_seconds += time.perf_counter() - t0
        self.allreduce_calls += 1
        self.allreduce_bytes += buf.nbytes

    def allreduce_host(self, values: np.ndarray, what: str = "an all-reduce") -> np.ndarray:
        out = np.array(values, dtype=np.float64)
        with self._collective(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, out, op=self.MPI.SUM)
        return out

    def allgather(self, obj: Any, what: str = "an all-gather") -> list:
        with self._collective(what):
            return self.comm.allgather(obj)

    def bcast(self, obj: Any, what: str = "a broadcast") -> Any:
        with self._collective(what):
            return self.comm.bcast(obj, root=0)

    def barrier(self, what: str = "a barrier") -> None:
        with self._collective(what):
            self.comm.Barrier()

    def for_backend(self, backend) -> Communicator:
        if getattr(backend, "name", "cpu") != "cuda":
            return self
        if self._for_cuda is None:
            nccl = _import_nccl()
            if nccl is None:
                warnings.warn("--backend cuda with several ranks: cupy has no NCCL here (pip install "
                              "nvidia-nccl-cu12); "
                              "gradients go through host memory and MPI instead (slower)", LlmtuneWarning, stacklevel=2)
                self._for_cuda = HostStagedCommunicator(self, backend)
            else:
                import cupy  # noqa: PLC0415 - optional ([cuda] extra), loaded where used

                self._for_cuda = NCCLCommunicator(self, nccl, cupy)
        return self._for_cuda


def _mpi_error_string(exc) -> str:
    try:
        return exc.Get_error_string().strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class _Delegating(Communicator):
    """A communicator for device arrays that runs every host collective on `host` (an MPICommunicator)."""

    def __init__(self, host: MPICommunicator):
        super().__init__()
        self.host = host
        self.rank, self.size, self.timeout = host.rank, host.size, host.timeout
        self.local_rank, self.local_size = host.local_rank, host.local_size

    def allreduce_host(self, values, what="an all-reduce"):
        return self.host.allreduce_host(values, what)

    def allgather(self, obj, what="an all-gather"):
        return self.host.allgather(obj, what)

    def bcast(self, obj, what="a broadcast"):
        return self.host.bcast(obj, what)

    def barrier(self, what="a barrier"):
        self.host.barrier(what)

    def for_backend(self, backend) -> Communicator:
        return self

    def describe(self) -> str:
        return f"{self.kind} over {self.host.describe()}"


class HostStagedCommunicator(_Delegating):
    """Device arrays summed through host memory and MPI (CUDA without NCCL)."""

    kind = "host-staged MPI"

    def __init__(self, host: MPICommunicator, backend):
        super().__init__(host)
        self.backend = backend

    def allreduce(self, buf, what="an all-reduce") -> None:
        t0 = time.perf_counter()
        staged = np.array(self.backend.to_numpy(buf), copy=True)
        self.host.allreduce(staged, what)
        buf[...] = self.backend.asarray(staged)
        self.allreduce_seconds += time.perf_counter() - t0
        self.allreduce_calls += 1
        self.allreduce_bytes += staged.nbytes


# ------------------------------------------------------------------------------------ NCCL
def _import_nccl():
    try:
        from cupy.cuda import nccl  # noqa: PLC0415 - optional ([cuda] extra), loaded where used
    except Exception:  # noqa: BLE001 - no cupy, or cupy without NCCL
        return None
    return nccl if getattr(nccl, "available", True) else None


def nccl_dtype(nccl, dtype) -> int:
    dtype = np.dtype(dtype)
    table = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float64): "NCCL_FLOAT64",
             np.dtype(np.float16): "NCCL_FLOAT16"}
    if dtype not in table:
        raise DistributedError(f"NCCL all-reduce: no NCCL type for {dtype}")
    return getattr(nccl, table[dtype])


class NCCLCommunicator(_Delegating):
    """Device arrays summed by NCCL (one GPU per rank, selected by `use_local_device`); host
    collectives stay on MPI. NCCL starts at the first device all-reduce (so the setup, which every
    rank runs under `together`, holds no collective): the ranks check that no two share a GPU, and
    NCCL's unique id travels from rank 0 over MPI. A timeout aborts the NCCL communicator before
    the rank ends."""

    kind = "NCCL"

    def __init__(self, host: MPICommunicator, nccl, cupy):
        super().__init__(host)
        self.nccl, self.cupy = nccl, cupy
        self.nccl_comm = None

    def _start(self) -> None:
        check_own_gpus(self.host, self.cupy)
        uid = self.nccl.get_unique_id() if self.host.rank == 0 else None
        uid = self.host.bcast(uid, "sending NCCL's unique id")
        with self.host._collective("creating the NCCL communicator"):
            self.nccl_comm = self.nccl.NcclCommunicator(self.host.size, uid, self.host.rank)

    def allreduce(self, buf, what="an all-reduce") -> None:
        if isinstance(buf, np.ndarray):
            self.host.allreduce(buf, what)
            return
        if self.nccl_comm is None:
            self._start()
        t0 = time.perf_counter()
        stream = self.cupy.cuda.get_current_stream()
        with self.host._collective(what, on_timeout=self.nccl_comm.abort):
            self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl_dtype(self.nccl, buf.dtype),
                                     self.nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()
        self.allreduce_seconds += time.perf_counter() - t0
        self.allreduce_calls += 1
        self.allreduce_bytes += buf.nbytes


def device_for_rank(local_rank: int, local_size: int, n_devices: int) -> int:
    """The CUDA device of a rank: the local_rank-th of those this process sees; a launcher that
    gives every rank its own device (CUDA_VISIBLE_DEVICES per rank) shows one, device 0."""
    if n_devices < 1:
        raise DistributedError("--backend cuda: this rank sees no CUDA device")
    if n_devices == 1:
        return 0
    if local_size > n_devices:
        raise DistributedError(f"--backend cuda: {local_size} ranks on this machine but {n_devices} CUDA devices: "
                               f"start at most {n_devices} ranks per machine (one GPU each)")
    return local_rank


def use_local_device(comm: Optional[Communicator] = None, cupy=None) -> Optional[int]:
    """Make this rank's GPU cupy's current device, before the CUDA backend allocates anything (no
    collective: the rank's place on its machine is known). None with a single process."""
    comm = world() if comm is None else comm
    if comm.size == 1:
        return None
    if cupy is None:
        import cupy  # noqa: PLC0415 - optional ([cuda] extra), loaded where used
    device = device_for_rank(comm.local_rank, comm.local_size, cupy.cuda.runtime.getDeviceCount())
    cupy.cuda.Device(device).use()
    return device


def check_own_gpus(comm: Communicator, cupy) -> None:
    """Every rank must have a GPU of its own (NCCL refuses two ranks on one): one line naming two
    ranks that share one, the same on every rank."""
    device = cupy.cuda.Device()
    try:
        bus = device.pci_bus_id
    except Exception:  # noqa: BLE001 - no PCI id (fakes): the device number must do
        bus = f"device {device.id}"
    seen = comm.allgather((socket.gethostname(), bus), "comparing the ranks' GPUs")
    for r, mine in enumerate(seen):
        twin = seen.index(mine)
        if twin != r:
            raise DistributedError(f"--backend cuda: ranks {twin} and {r} share the GPU {mine[1]} "
                                   f"on {mine[0]}: give every rank its own GPU")


# ------------------------------------------------------------------------------------ work split
def run_split(fn, make_state, items: Iterable, n_workers: int, comm: Optional[Communicator] = None):
    """run_in_order across ranks: rank r computes items r, r + size, ... (with n_workers threads),
    and every rank yields every result in item order. Called by every rank with the same items.
    When fn raises a LlmtuneError for some item, every rank raises it (the first in item order)."""
    comm = world() if comm is None else comm
    items = list(items)
    if comm.size == 1:
        yield from run_in_order(fn, make_state, items, n_workers)
        return

    def guarded(state, item):
        try:
            return True, fn(state, item)
        except LlmtuneError as exc:
            return False, exc

    mine = run_in_order(guarded, make_state, items[comm.rank :: comm.size], n_workers)
    for first in range(0, len(items), comm.size):
        local = next(mine) if first + comm.rank < len(items) else (True, None)
        if not local[0]:
            exc = local[1]
            local = (False, (str(exc), getattr(exc, "exit_code", 2)))
        results = comm.allgather(local, "an evaluation pass")
        for r, (ok, value) in enumerate(results[: len(items) - first]):
            if not ok:
                err = LlmtuneError(value[0])
                err.exit_code = value[1]
                raise err
            yield value


# ------------------------------------------------------------------------------------ this process
_WORLD: Optional[Communicator] = None


def world() -> Communicator:
    """This process's communicator (created on first use from the launcher's environment)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = _from_launcher()
    return _WORLD


def set_world(comm: Optional[Communicator]) -> Optional[Communicator]:
    """Replace this process's communicator (tests); returns the previous one. None: detect again."""
    global _WORLD
    previous, _WORLD = _WORLD, comm
    return previous


def _from_launcher() -> Communicator:
    launch = launched()
    if launch is None:
        return Communicator()
    size, rank, var = launch
    timeout = collective_timeout()
    try:
        from mpi4py import MPI  # noqa: PLC0415 - optional ([mpi] extra), loaded where used
    except ImportError:
        raise DistributedError(f"an MPI launcher started this process as rank {rank} of {size} ({var}={size}), "
                               f"but mpi4py is not installed: {INSTALL_HINT}") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != size:
        raise DistributedError(
            f"the launcher started {size} ranks ({var}={size}) but mpi4py's MPI ({_mpi_name(MPI)}) sees "
            f"{comm.Get_size()}: this mpirun belongs to another MPI; start llmtune with the mpirun or mpiexec of "
            f"mpi4py's MPI (python -m mpi4py --mpi-lib-version names it)")
    c = MPICommunicator(comm, MPI, timeout=timeout)
    share_cores(c.sharing_my_cores())
    return c


def _mpi_name(MPI) -> str:
    try:
        return MPI.Get_library_version().strip().splitlines()[0].strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def quiet_other_ranks(*consoles) -> None:
    """The CLI under a launcher: rank 0 alone prints (progress, results, errors); the consoles of
    the other ranks go quiet. Failures that end a rank on its own bypass them (one line each)."""
    launch = launched()
    if launch is not None and launch[1] != 0:
        for console in consoles:
            console.quiet = True


def digest(*parts) -> str:
    """A short sha256 of `parts` (for check_same facts)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(pickle.dumps(part))
    return h.hexdigest()
