"""CPU parallelism: one single-threaded computation per core.

numpy runs elementwise kernels on one core, and OpenBLAS's own threads spin and stall whenever
the machine is busy; independent work items (forward passes, micro-batches) run one per core
with BLAS single-threaded keep every core on useful work.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import numpy as np

from llmtune.backends.cpu.native.build import cache_dir
from llmtune.errors import LlmtuneError
from llmtune.resources import write_atomically

MAX_CPU_WORKERS = 4  # each worker holds its own activations (and logits or a gradient buffer)


_CORE_SHARE: Optional[int] = None  # set by share_cores: this process's part of a machine shared by ranks


def n_cores() -> int:
    if _CORE_SHARE is not None:
        return _CORE_SHARE
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_cores(n_processes: int) -> None:
    """This process shares the cores it may run on with n_processes - 1 others (data-parallel ranks
    on one machine, backends/dist.py): it takes 1/n of them for its workers and for OpenBLAS's
    threads, so the ranks do not oversubscribe the machine."""
    global _CORE_SHARE
    if n_processes <= 1:
        return
    _CORE_SHARE = max(1, n_cores() // n_processes)
    funcs = blas_threads._load()
    if funcs:
        funcs[1](_CORE_SHARE)


def cpu_workers(requested: Optional[int], n_items: int) -> int:
    """How many work items (forward passes, micro-batches) run at once on the host's cores (the
    cpu backend's `workers`).

    With at least two items, and where OpenBLAS's thread count can be set (else its threads and
    ours would fight over the cores): `requested`, or one per core up to MAX_CPU_WORKERS, never
    more than there are items. Otherwise one. Workers run OpenBLAS single-threaded, and so does
    the caller's thread where its bits follow its thread count (blas_threads.reproducible), so
    which pass ran where never shows in the numbers.
    """
    if requested is not None and requested < 1:
        raise LlmtuneError(f"workers: must be positive (got {requested})")
    if n_items < 2 or not blas_threads.available():
        return 1
    n = requested or min(n_cores(), MAX_CPU_WORKERS)
    return max(1, min(n, n_items))


def run_in_order(fn, make_state, items, n_workers: int):
    """Yield fn(state, item) for each item in order, computed by n_workers threads.

    Each thread owns one `make_state()` (its compiled programs and their buffers); BLAS runs
    single-threaded meanwhile, so the threads do not compete for cores.
    """
    items = list(items)
    if n_workers <= 1:
        state = make_state()
        for item in items:
            with blas_threads.reproducible():  # as a worker runs it, where that changes the bits
                result = fn(state, item)
            yield result
        return
    states: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(n_workers):
        states.put(None)  # built lazily, in the worker, so compiles run in parallel too

    def task(item):
        state = states.get()
        try:
            if state is None:
                state = make_state()
            return fn(state, item)
        finally:
            states.put(state)

    pool = ThreadPoolExecutor(n_workers, thread_name_prefix="llmtune-ppl")
    try:
        with blas_threads(1, compiled=True):  # and the compiled kernels' pool (attention, products)
            futures = [pool.submit(task, item) for item in items]
            for fut in futures:
                yield fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_RANGE_POOL: list = []  # the shared pool of parallel_ranges, made on first use
PARALLEL_MIN = 1 << 20  # elements below which one thread does the whole range


def parallel_ranges(fn, n: int, align: int) -> None:
    """fn(start, stop) over 0..n split into one contiguous part per core (part boundaries on
    multiples of `align`), on a shared thread pool: for elementwise numpy work that releases the
    GIL. Small ranges (under PARALLEL_MIN) run whole on the calling thread."""
    parts = min(n_cores(), max(1, n // PARALLEL_MIN))
    if parts == 1:
        fn(0, n)
        return
    if not _RANGE_POOL:
        _RANGE_POOL.append(ThreadPoolExecutor(n_cores(), thread_name_prefix="llmtune-range"))
    step = -(-(-(-n // parts)) // align) * align
    bounds = [(s, min(s + step, n)) for s in range(0, n, step)]
    for fut in [_RANGE_POOL[0].submit(fn, s, e) for s, e in bounds]:
        fut.result()


class _BlasThreads:
    """Set OpenBLAS's thread count for a block (numpy's bundled OpenBLAS, found through ctypes)."""

    _SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                ("openblas_get_num_threads", "openblas_set_num_threads"))

    def __init__(self):
        self._funcs = None
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = 0
        self._followers: list = []
        self._compiled = False

    def follow(self, fn) -> None:
        """fn(n) is called where a block sets OpenBLAS's count with compiled=True (and when it
        restores it): the compiled packed products (native/kernels.py) take the same count."""
        if fn not in self._followers:
            self._followers.append(fn)

    def _set(self, n: int, compiled: bool) -> None:
        self._funcs[1](n)
        for fn in self._followers if compiled else ():
            fn(n)

    def _load(self):
        if self._funcs is None:
            self._funcs = ()
            for lib in _loaded_openblas():
                for get_name, set_name in self._SYMBOLS:
                    if hasattr(lib, get_name) and hasattr(lib, set_name):
                        self._funcs = (getattr(lib, get_name), getattr(lib, set_name))
                        return self._funcs
        return self._funcs

    def available(self) -> bool:
        return bool(self._load())

    def current(self) -> int:
        """OpenBLAS's thread count now (0 where it cannot be read)."""
        funcs = self._load()
        return int(funcs[0]()) if funcs else 0

    # products of a training step's shapes (stories260K's and SmolLM2's widths), checked once
    _PROBE_SHAPES = ((256, 64, 512), (256, 288, 768), (512, 288, 2048), (128, 576, 1536))
    _keeps_bits = None

    def keeps_bits(self) -> bool:
        """Whether this OpenBLAS gives the same bits with one thread as with all of them (BlasTuner's
        premise). It splits a product's rows and columns over its threads on some CPUs and a sum on
        others (the same 0.3.31 build, Intel AVX-512 and AMD AVX2 machines), so it is measured on a
        few products of training shapes: once per machine, library and thread count (the answer is
        kept in the cache folder, ProbeCache: the probe took ~70 ms of every command's start-up),
        and once per process where the cache cannot be read or written."""
        funcs = self._load()
        if self._keeps_bits is None or self._keeps_bits[0] is not funcs:
            n = max(2, n_cores()) if funcs else 1
            same = True
            if n > 1:
                cache = ProbeCache("blas-bits", _blas_identity(n))
                same = cache.get()
                if same is None:
                    same = self._probe_bits(n)
                    cache.put(same)
            self._keeps_bits = (funcs, same)  # per library handles (a test may fake them)
        return self._keeps_bits[1]

    def _probe_bits(self, n: int) -> bool:

        rng = np.random.default_rng(0)
        for m, k, c in self._PROBE_SHAPES:
            a = rng.standard_normal((m, k)).astype(np.float32)
            b = rng.standard_normal((c, k)).astype(np.float32)
            with self(1):
                one = a @ b.T
            with self(n):
                if (a @ b.T).tobytes() != one.tobytes():
                    return False
        return True

    def reproducible(self):
        """The block of a pass whose bits llmtune promises to reproduce (a training step, a
        validation, perplexity or eval pass, PiSSA's SVDs) on the caller's thread: where OpenBLAS's
        bits follow its thread count (not keeps_bits: its Haswell kernels at 1 and 2 threads), it
        runs single-threaded, the one count that every worker, rank and process shares (ranks
        sharing a machine run one thread each, share_cores); elsewhere its count is left as it is
        (any count gives the same bits, and BlasTuner picks the faster)."""
        return nullcontext() if self.keeps_bits() else self(1)

    @contextmanager
    def __call__(self, n: int, compiled: bool = False):
        """OpenBLAS's thread count n for the block; compiled: the compiled products' too (a worker
        per core), else they keep theirs (a step tuner's one-thread trials leave them the cores)."""
        funcs = self._load()
        if not funcs:
            yield
            return
        get = funcs[0]
        with self._lock:
            if self._depth == 0:
                self._saved, self._compiled = get(), compiled
                self._set(n, compiled)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._set(self._saved, self._compiled)


class BlasTuner:
    """OpenBLAS's thread count for one repeated piece of work (a training step), chosen by timing.

    Its threads pay off on a quiet machine and stall on a busy one (a spinning thread waits for a
    descheduled sibling at every product: a stories260K step ran 6x slower with 2 threads than with
    1 at load 5 on 2 cores), so neither choice is right everywhere. Each run is timed: the first
    runs alternate between one thread and all of them, then the faster one runs, and the other is
    probed after `interval` runs (doubled each time it loses, so slow probes cost little; it takes
    over after two wins in a row, so one lucky run does not); a warm-up run of SETTLE_SECONDS or more
    settles on all threads without trials. It tunes only where OpenBLAS splits a
    product's rows and columns over its threads, never a sum (_BlasThreads.keeps_bits: products at
    1 and all threads compare equal), so the choice never changes a bit of the result; elsewhere
    every run is single-threaded (_BlasThreads.reproducible), as every rank and worker runs it.
    """

    FIRST_INTERVAL, MAX_INTERVAL, WINDOW = 8, 128, 3
    TRIAL_RUNS = 1 + 2 * 2  # a warm-up run (it also pays for first touches), then each count twice
    # a warm-up run this long is made of big products: there every thread pays, a busy machine's
    # stalls are short beside each product, and a trial at one thread costs a whole slow step (a
    # 7B-class QLoRA step at ctx 512: ~100 s on two threads, ~190 s on one): all threads, no trials
    SETTLE_SECONDS = 20.0

    def __init__(self, enabled: bool = True):
        funcs = blas_threads._load() if enabled else ()
        n = funcs[0]() if funcs else 1
        # counts to choose from: none where one is all there is, or where the count changes the bits
        self.candidates = (n, 1) if n > 1 and blas_threads.keeps_bits() else ()
        self.times: dict[int, list[float]] = {c: [] for c in self.candidates}
        self.best = n
        self.interval = self.FIRST_INTERVAL
        self.countdown = 0
        self.runs = 0
        self.probe: list[float] = []  # this probe round's times of the other count
        self.settled = False  # a long warm-up run: all threads from then on (SETTLE_SECONDS)

    def _typical(self, n: int) -> float:
        recent = sorted(self.times[n][-self.WINDOW:])
        return recent[len(recent) // 2]

    def _pick(self) -> int:
        if self.settled:
            return self.candidates[0]
        if self.runs < self.TRIAL_RUNS:
            return self.candidates[self.runs % 2]
        if self.countdown <= 0:  # time for a probe of the other count
            return self.candidates[1] if self.best == self.candidates[0] else self.candidates[0]
        return self.best

    def _record(self, n: int, seconds: float) -> None:
        self.runs += 1
        if self.runs == 1:
            self.settled = seconds >= self.SETTLE_SECONDS
            return
        if self.settled:
            return
        if self.runs <= self.TRIAL_RUNS:
            self.times[n].append(seconds)
            if self.runs == self.TRIAL_RUNS:
                self.best = min(self.candidates, key=self._typical)
                self.countdown = self.interval
        elif n == self.best:
            self.times[n].append(seconds)
            self.countdown -= 1
        else:  # a probe, against the best count's recent runs
            self.probe.append(seconds)
            if seconds >= self._typical(self.best):  # lost: probe again later, and less often
                self.probe = []
                self.interval = min(2 * self.interval, self.MAX_INTERVAL)
                self.countdown = self.interval
            elif len(self.probe) == 2:  # won twice in a row (once could be noise): switch
                self.best, self.times[n], self.probe = n, self.probe, []
                self.interval = self.countdown = self.FIRST_INTERVAL
            # won once: probe again on the next run (the countdown stays at 0)

    @contextmanager
    def __call__(self):
        if not self.candidates:
            with blas_threads.reproducible():
                yield
            return
        n = self._pick()
        start = time.perf_counter()
        with blas_threads(n):
            yield
        self._record(n, time.perf_counter() - start)


class ProbeCache:
    """One measured fact about this machine (a bool, or a float: a rate), kept in the cache folder (native/build.py's
    cache_dir: $LLMTUNE_CACHE_DIR, else ~/.cache/llmtune) as `<name>.json`, under a key that hashes
    everything the fact depends on. A cache that cannot be read or written (a read-only home, a
    damaged file) only means measuring again: get() says None, put() does nothing."""

    def __init__(self, name: str, identity: str, kind: type = bool):
        self.kind = kind  # bool (a bit-probe's verdict) or float (a measured rate)
        self.path = cache_dir() / f"{name}.json"
        self.key = hashlib.sha256(identity.encode()).hexdigest()[:16]

    def _read(self) -> dict:

        try:
            facts = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return facts if isinstance(facts, dict) else {}

    def get(self):
        value = self._read().get(self.key)
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        return value if isinstance(value, self.kind) and (self.kind is bool or not isinstance(value, bool)) else None

    def put(self, value) -> None:
        facts = self._read()
        facts[self.key] = self.kind(value)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # whole or not at all, as concurrent processes may write it
            write_atomically(self.path, lambda fh: fh.write(json.dumps(facts).encode()))
        except (OSError, LlmtuneError):
            pass


def blas_kernel() -> str:
    """The OpenBLAS numpy runs and the kernel it picked for this CPU ("OpenBLAS 0.3.31 Haswell";
    threadpoolctl's `architecture`): benchmarks print it beside their figures, since
    OPENBLAS_CORETYPE can make a current OpenBLAS run older, slower kernels. "" where none is loaded
    (numpy, imported above, has loaded its own)."""
    for lib in _loaded_openblas():
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                core = getattr(lib, f"{prefix}_get_corename{suffix}", None)
                config = getattr(lib, f"{prefix}_get_config{suffix}", None)
                if core is None or config is None:
                    continue
                core.restype = config.restype = ctypes.c_char_p
                version = next((w for w in (config() or b"").decode(errors="replace").split() if w[:1].isdigit()), "")
                return f"OpenBLAS {version} {(core() or b'?').decode(errors='replace')}".replace("  ", " ")
    return ""


def _blas_identity(n_threads: int) -> str:
    """What OpenBLAS's threaded summation order depends on: the library files numpy loaded (path,
    size, modification time), the kernel it picked (its config and OPENBLAS_CORETYPE), the CPU
    (model and flags) and the thread count."""

    parts = [f"threads {n_threads}", f"coretype {os.environ.get('OPENBLAS_CORETYPE', '')}"]
    for lib in _loaded_openblas():
        path = Path(lib._name)
        try:
            st = path.stat()
            parts.append(f"{path} {st.st_size} {st.st_mtime_ns}")
        except OSError:
            parts.append(str(path))
        for name in ("scipy_openblas_get_config64_", "scipy_openblas_get_config", "openblas_get_config64_",
                     "openblas_get_config"):
            if hasattr(lib, name):
                getter = getattr(lib, name)
                getter.restype = ctypes.c_char_p
                parts.append((getter() or b"").decode(errors="replace"))
                break
    try:
        cpu = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("model name", "flags"))]
        parts.extend(sorted(set(cpu)))
    except OSError:

        parts.append(platform.processor())
    return "\n".join(parts)


def _loaded_openblas() -> list:
    """ctypes handles of the OpenBLAS libraries numpy has loaded (Linux: from /proc/self/maps)."""

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower() and ".so" in line})
    libs = []
    for path in paths:
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


blas_threads = _BlasThreads()
