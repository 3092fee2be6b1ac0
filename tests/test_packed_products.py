"""The compiled packed float32 product (native/qdot.c lt_sgemm_packed) against numpy, and a
training run's frozen base multiplied through it (FloatCopies.packed): the same losses and
gradients as numpy's BLAS, within float32 summation order. Skips where this build has no packed
product (no compiler, no AVX-512)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import llmtune
import llmtune.train.memory as memory_module
from llmtune.backends.cpu import CPUBackend, products as qmatmul
from llmtune.backends.cpu.native import kernels
from llmtune.backends.cpu.products import FloatCopies
from llmtune.backends.cpu.threads import BlasTuner, blas_threads
from llmtune.gguf.file import GGUFFile
from llmtune.model.adapter import attach, init_adapter
from llmtune.model.loaded import load_model
from llmtune.train.trainer import RunningStats, Trainer

needs_packed = pytest.mark.skipif(not kernels.pack_wt_available(),
                                  reason=f"no packed product in this build: {kernels.reason() or 'no AVX-512'}")


def _relative_error(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """|out - a @ b| over the products' magnitudes |a| @ |b| (float64)."""
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    return float((np.abs(out - exact) / scale).max())


# (rows, n, k): a training pass's shapes, row and column tails, a one-row and a K=1 product
SHAPES = [(128, 576, 576), (72, 1536, 576), (9, 50, 33), (65, 97, 129), (1, 48, 16), (300, 1000, 7), (3, 5, 1),
          (9, 50, 4100)]  # the last: a sum in blocks of GEMM_KC (2048), the later ones added to C


@needs_packed
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_products_match_numpy(m, n, k):
    rng = np.random.default_rng(m * 1000 + n)
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    out = np.full((m, n), np.nan, np.float32)
    assert kernels.sgemm_packed(out, x, kernels.pack_wt(w), n, k)
    assert _relative_error(out, x, w.T) < 1e-6
    g = rng.standard_normal((m, n), dtype=np.float32)  # the input gradient g @ W, through W^T packed
    dx = np.full((m, k), np.nan, np.float32)
    assert kernels.sgemm_packed(dx, g, kernels.pack_wt(w, transposed=True), k, n)
    assert _relative_error(dx, g, w) < 1e-6


@needs_packed
def test_strided_operands_and_output():
    """Rows of x and of the output with strides of their own (views of wider arrays)."""
    rng = np.random.default_rng(1)
    wide_x, w = rng.standard_normal((40, 100), dtype=np.float32), rng.standard_normal((60, 64), dtype=np.float32)
    wide_out = np.zeros((40, 90), np.float32)
    x, out = wide_x[:, 10:74], wide_out[:, 5:65]
    assert kernels.sgemm_packed(out, x, kernels.pack_wt(w), 60, 64)
    assert _relative_error(out, x, w.T) < 1e-6
    assert not wide_out[:, :5].any() and not wide_out[:, 65:].any()  # nothing written beside it


@needs_packed
def test_declines_what_it_does_not_take():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 32), dtype=np.float32)
    packed = kernels.pack_wt(w)
    out = np.zeros((4, 64), np.float32)
    assert not kernels.sgemm_packed(out, rng.standard_normal((4, 32)), packed, 64, 32)  # float64 rows
    assert not kernels.sgemm_packed(out, np.zeros((4, 31), np.float32), packed, 64, 31)  # another shape
    assert not kernels.sgemm_packed(np.zeros((4, 64), np.float32), np.zeros((4, 32), np.float32)[:, ::-1],
                                    packed, 64, 32)
    assert kernels.pack_wt(w.astype(np.float64)) is None


@needs_packed
def test_threads_change_no_bit():
    """Every output is one sum in k order whatever the chunks: 1, 2 or 3 threads, the same bits."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((300, 576), dtype=np.float32), rng.standard_normal((1000, 576), dtype=np.float32)
    packed, results = kernels.pack_wt(w), []
    lib = kernels.library()
    for threads in (1, 2, 3):
        out = np.empty((300, 1000), np.float32)
        assert lib.lt_sgemm_packed(kernels._addr(x), 576, 300, kernels._addr(packed), 1000, 576,
                                   kernels._addr(out), 1000, threads) == 0
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


@needs_packed
def test_a_worker_per_core_sets_the_products_threads():
    """blas_threads(1, compiled=True) (a trainer's worker per core) takes the packed products to
    one thread and gives the cores back after; a plain blas_threads(1) leaves them."""
    seen = []
    blas_threads.follow(seen.append)
    try:
        if not blas_threads.available():
            pytest.skip("no OpenBLAS found to set")
        with blas_threads(1):
            pass
        assert seen == []
        with blas_threads(1, compiled=True):
            assert seen == [1]
        assert len(seen) == 2 and seen[1] >= 1
    finally:
        blas_threads._followers.remove(seen.append)


@pytest.fixture(scope="module")
def stories_q8_path(stories_path, tmp_path_factory):
    return llmtune.export(stories_path, tmp_path_factory.mktemp("q8") / "stories-q8_0.gguf", "q8_0").out_path


def _lora_trainer(path, pack: bool | None, budget: int | None = None):
    model = load_model(path)
    adapter = init_adapter(model, 4, alpha=8, seed=0)
    tr = Trainer(attach(model, [adapter]), CPUBackend(), n_ctx=32, n_batch=64, n_ubatch=32,
                 trainable=list(adapter.tensors()))
    if pack is not None:  # (None: as the trainer chose)
        tr.float_copies.pack = pack
    if budget is not None:
        tr.float_copies.budget = budget
    return tr


def _steps(tr, n: int = 3) -> tuple[list[float], np.ndarray]:
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(n):
        x = rng.integers(0, 200, (2, 32), dtype=np.int32)
        stats = RunningStats()
        tr.train_step(x, np.roll(x, -1, axis=1), 1e-3, stats)
        losses.append(stats.loss)
    return losses, tr.flat_w.copy()


@needs_packed
@pytest.mark.parametrize("fixture", ["stories_path", "stories_q8_path"])
def test_a_training_run_through_packed_copies_is_numpy_s(fixture, request):
    """LoRA on a float32 file and QLoRA on a quantized one: the frozen base's forward products go
    through packed copies (every multiplied weight), and its input gradients (those the adapters
    need; the first layer's attention inputs need none) through packed transposes, and
    three steps give numpy's losses and adapter weights within float32 summation order."""
    path = request.getfixturevalue(fixture)
    packed_run, numpy_run = _lora_trainer(path, True), _lora_trainer(path, False)
    (losses_p, w_p), (losses_n, w_n) = _steps(packed_run), _steps(numpy_run)
    assert numpy_run.float_copies.packs == {}
    multiplied = {n.inputs[1].name for n in packed_run.programs.train[0].order if n.op in ("matmul", "qlinear")}
    frozen = [n for n in multiplied if n in packed_run.frozen]
    directions = [key[-1] for key in packed_run.float_copies.packs]  # transposed: an input gradient's
    assert frozen and directions.count(False) == len(frozen) and directions.count(True) > len(frozen) // 2
    np.testing.assert_allclose(losses_p, losses_n, rtol=1e-5)
    np.testing.assert_allclose(w_p, w_n, rtol=1e-4, atol=2e-5)  # AdamW moves each by ~lr: 3e-3 in all
    assert packed_run.float_copies.used <= packed_run.float_copies.budget
    assert packed_run.float_copies.arrays == {}  # QLoRA: the packed forms replace the float copies


@needs_packed
@pytest.mark.parametrize("fixture", ["stories_path", "stories_q8_path"])
def test_packed_matrices_give_their_file_pages_back(fixture, request, monkeypatch):
    """Once a frozen matrix has both packed forms, the file pages under it are released (one
    drop_pages per packed matrix, its own view of the mapping), and what the run reads from the
    file afterwards (a token table's rows) faults back in intact: the same losses."""

    path = request.getfixturevalue(fixture)
    released, real_drop = [], GGUFFile.drop_pages
    monkeypatch.setattr(GGUFFile, "drop_pages", lambda self, part=None: released.append(part) or real_drop(self, part))
    tr = _lora_trainer(path, True)
    losses, _ = _steps(tr)
    parts = [p for p in released if p is not None]
    assert len(parts) == len(tr.float_copies.packs) // 2 > 0
    assert all(np.shares_memory(p, tr.model.gguf._mm) for p in parts)
    monkeypatch.undo()
    assert losses == _steps(_lora_trainer(path, True))[0]


def test_dropping_pages_touches_only_the_file_s_own(stories_path):
    """drop_pages(part) hands back the whole pages under a view of the file's mapping (read back
    from the file on the next access) and leaves memory of its own alone: MADV_DONTNEED would
    zero that."""

    f = GGUFFile(stories_path)
    info = max(f.tensors.values(), key=lambda t: t.raw.nbytes)
    before = np.array(info.raw)
    own = before.copy()
    for part in (info.raw, own, np.ones(1 << 16, np.float32)):
        f.drop_pages(part)
    assert np.array_equal(np.asarray(info.raw), before) and np.array_equal(own, before)


@needs_packed
def test_a_pack_another_worker_makes_meanwhile_is_found_not_refused():
    """Two workers reach a frozen matrix's first product together, the budget's last: the one that
    finds no pack waits for the other's and multiplies through it. (It used to read the budget as
    full once the other had packed, and ran that product on numpy's BLAS: other bits, in about one
    two-worker LoRA run in ten.)"""


    w = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    copies = FloatCopies(FloatCopies.packed_bytes(w.shape), pack=True)
    other_packed = threading.Event()

    class Packs(dict):  # the first look-up of worker "late" returns before the other worker packs
        def get(self, key, default=None):
            found = super().get(key, default)
            if found is None and threading.current_thread().name == "late":
                other_packed.wait(10)
            return found

    copies.packs = Packs()
    got = {}
    late = threading.Thread(target=lambda: got.update(late=copies.packed(w)), name="late")
    late.start()
    got["first"] = copies.packed(w)
    other_packed.set()
    late.join(10)
    assert got["first"] is not None and got["late"] is got["first"]


@needs_packed
def test_no_budget_no_packed_copies(stories_path):
    tr = _lora_trainer(stories_path, True, budget=0)
    _steps(tr, 1)
    assert tr.float_copies.packs == {} and tr.float_copies.used == 0


def test_a_freed_array_is_no_longer_frozen():
    """The registry holds its arrays weakly: one that is gone never matches a new one at its id."""
    copies = qmatmul.FloatCopies(0, pack=True)
    w = np.zeros((4, 4), np.float32)
    qmatmul.register_frozen(w, copies)
    assert qmatmul.frozen_copies(w) is copies
    assert qmatmul.frozen_copies(w.copy()) is None
    key = id(w)
    del w
    assert key not in qmatmul._FROZEN


@needs_packed
def test_packed_copies_all_or_none(stories_path, monkeypatch):
    """A budget that holds only some of the packed copies keeps none of them (a step with some
    products packed would run the rest on a single-threaded OpenBLAS), and OpenBLAS's thread
    count is tuned by timing again."""

    monkeypatch.setattr(memory_module, "training_budget",
                        lambda quantized, need, available, packed=0, share=2: packed // 2)
    tr = _lora_trainer(stories_path, None)
    assert not tr.float_copies.pack and not tr.packed_products and isinstance(tr.blas_tuner, BlasTuner)
    _steps(tr, 1)
    assert tr.float_copies.packs == {}
    monkeypatch.undo()
    tr = _lora_trainer(stories_path, None)  # two micro-batches: a worker per core (single-threaded) on 2+ cores
    assert tr.float_copies.pack and tr.packed_products == (tr.n_workers == 1)
    _steps(tr, 1)
    assert tr.float_copies.packs


@needs_packed
def test_turned_off_by_the_environment(stories_path, monkeypatch):
    monkeypatch.setenv("LLMTUNE_PACKED", "0")
    assert not kernels.pack_wt_available() and kernels.pack_wt(np.zeros((4, 4), np.float32)) is None
    tr = _lora_trainer(stories_path, None)
    assert not tr.packed_products and not {"float copies", "packed copies"} & set(tr.memory_bytes())
