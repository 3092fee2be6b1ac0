"""--pack: several examples per window (train/chat.py PackedDataset, arch/packing.py). A packed step
equals the one-example-per-window step in loss and gradients (llama with rope, gemma2 with its
sliding-window layers and softcaps, gpt2 with learned positions), the packing fills windows as
best-fit decreasing says, and the start report counts windows, examples per window and padding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import cuda_emu
import llmtune
from cli_helpers import run_cli
from family_check import REPO
from llmtune.arch.packing import packing_inputs, segment_positions
from llmtune.backends import get_backend
from llmtune.backends.cpu.threads import blas_threads
from llmtune.backends.cuda import CUDABackend
from llmtune.convert.init import init_model
from llmtune.errors import LlmtuneError
from llmtune.model.adapter import attach, init_adapter
from llmtune.model.loaded import load_model
from llmtune.train.chat import ExampleDataset, PackedDataset, build_dataset, pack_lengths
from llmtune.train.trainer import RunningStats, Trainer

WORDS = "the cat sat on a mat and then it ran to see the big red ball in the park".split()


def completion_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS, rng.integers(2, 9)))
        rows.append({"prompt": f"Q{i}: {prompt}?\nA:",
                     "completion": " " + " ".join(rng.choice(WORDS, rng.integers(1, 7)))})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def step(model, ds, packed: bool, ctx: int, backend=None):
    """(loss, gradient, loss tokens) of one optimizer step (lr 0) over every training window of `ds`."""
    n = ds.n_train
    trainable = model.select(None)
    trainer = Trainer(model, backend or get_backend("cpu"), n_ctx=ctx, n_batch=n * ctx,
                      n_ubatch=ctx if packed else 2 * ctx, trainable=trainable, workers=1, packed=packed)
    batch = ds.gather(range(n))
    stats = RunningStats()
    loss = trainer.train_step(batch[0], batch[1], 0.0, stats, *batch[2:])
    return loss, np.array(trainer.backend.to_numpy(trainer.flat_g)), stats.tokens


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):

    tmp = tmp_path_factory.mktemp("families")
    vocab = REPO / "tests" / "data" / "stories260K.gguf"
    return {name: init_model(REPO / "configs" / f"{name}-tiny.toml", vocab, tmp / f"{name}.gguf", 0)
            for name in ("gemma2", "gpt2")}


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_packed_step_equals_one_example_per_window(tmp_path, stories_path, family_models, family):
    path = stories_path if family == "llama" else family_models[family]
    model = load_model(path)
    ctx = 64 if family != "gemma2" else 96  # gemma2-tiny's window is 32: packed examples cross it
    rows = completion_rows(10)
    if family == "gemma2":  # examples longer than the sliding window
        rows = [{"prompt": r["prompt"] * 3, "completion": r["completion"]} for r in rows]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    plain, _ = build_dataset(model, data, ctx, 0.0)
    packed, _ = build_dataset(model, data, ctx, 0.0, pack=True)
    assert isinstance(plain, ExampleDataset) and isinstance(packed, PackedDataset)
    assert packed.n_train < plain.n_train  # it packs
    assert sorted(packed.examples_of(range(packed.n_train))) == list(range(plain.n_train))
    with blas_threads(1):
        loss_a, grad_a, tokens_a = step(model, plain, False, ctx)
        loss_b, grad_b, tokens_b = step(model, packed, True, ctx)
    assert tokens_a == tokens_b == plain.loss_tokens(range(plain.n_train))
    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_a), (loss_a, loss_b)
    scale = np.abs(grad_a).max()
    assert scale > 0 and np.abs(grad_a - grad_b).max() <= 1e-5 * scale, np.abs(grad_a - grad_b).max() / scale


def test_packed_step_on_the_cuda_backend_matches_cpu(tmp_path, stories_path):
    """The CUDA backend's kernels (tests/cuda_emu.py's emulator) on packed windows: the cpu's
    loss and gradients (the masks, per-sequence positions and rope of the flattened batch)."""

    if not cuda_emu.available():
        pytest.skip("no C++ compiler for the CUDA kernel emulator")
    model = load_model(stories_path)
    ds, _ = build_dataset(model, write_jsonl(tmp_path / "d.jsonl", completion_rows(6)), 48, 0.0, pack=True)
    loss_a, grad_a, _ = step(model, ds, True, 48)
    loss_b, grad_b, _ = step(model, ds, True, 48, CUDABackend(np.float32, runtime=cuda_emu.EmuRuntime()))
    assert abs(loss_a - loss_b) <= 1e-5 * loss_a and np.abs(grad_a - grad_b).max() <= 1e-5 * np.abs(grad_a).max()


def test_packed_lora_step_and_evaluation_equal_unpacked(tmp_path, stories_path):
    """The same with a LoRA adapter training, and validation passes (the eval programs)."""

    base = load_model(stories_path)
    adapter = init_adapter(base, 4, None, None, 0)
    adapter = adapter.with_tensors({k: v + 0.01 for k, v in adapter.tensors().items()})  # B != 0: a live adapter
    model = attach(base, [adapter])
    data = write_jsonl(tmp_path / "d.jsonl", completion_rows(12, seed=1))
    ctx = 64
    results = []
    for pack in (False, True):
        ds, _ = build_dataset(model, data, ctx, 0.5, pack=pack)
        trainer = Trainer(model, get_backend("cpu"), n_ctx=ctx, n_batch=ds.n_train * ctx, n_ubatch=ctx,
                          trainable=list(adapter.tensors()), workers=1, packed=pack)
        batch = ds.gather(range(ds.n_train))
        loss = trainer.train_step(batch[0], batch[1], 0.0, RunningStats(), *batch[2:])
        val = ds.gather(ds.val_indices())
        stats = RunningStats()
        trainer.evaluate(val[0], val[1], stats, *val[2:])
        mean = sum(stats.losses[i] * t for i, t in enumerate(_pass_tokens(val[1], trainer))) / stats.tokens
        results.append((loss, np.array(trainer.flat_g), mean, stats.tokens, stats.correct))
    (la, ga, va, ta, ca), (lb, gb, vb, tb, cb) = results
    assert abs(la - lb) <= 1e-5 * la and np.abs(ga - gb).max() <= 1e-5 * np.abs(ga).max()
    assert ta == tb and ca == cb and abs(va - vb) <= 1e-5 * va


def _pass_tokens(targets, trainer) -> list[int]:
    k = trainer.seqs_per_ubatch
    return [int((targets[s : s + k] >= 0).sum()) for s in range(0, len(targets), k)]


def test_segments_give_positions_and_block_diagonal_masks():
    seg = np.array([[0, 0, 0, 1, 1, 2, 2]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1]]

    class HP:
        has_swa, sliding_window = True, 2

    feed = packing_inputs(HP, seg)
    visible = (feed["pack_mask"][0] == 0).astype(int)
    assert visible.tolist() == [[1, 0, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0, 0],
                                [1, 1, 1, 0, 0, 0, 0],
                                [0, 0, 0, 1, 0, 0, 0],
                                [0, 0, 0, 1, 1, 0, 0],
                                [0, 0, 0, 0, 0, 1, 0],
                                [0, 0, 0, 0, 0, 1, 1]]
    swa = (feed["pack_mask_swa"][0] == 0).astype(int)
    assert swa[2].tolist() == [0, 1, 1, 0, 0, 0, 0]  # position 2 sees positions 1 and 2 (window 2)


def test_best_fit_decreasing():
    assert pack_lengths([5, 3, 7, 2, 6, 1], 8) == [[0, 1], [2, 5], [3, 4]]
    assert pack_lengths([8, 8], 8) == [[0], [1]]
    bins = pack_lengths(list(np.random.default_rng(0).integers(1, 60, 200)), 128)
    assert sorted(i for b in bins for i in b) == list(range(200))


def test_pack_report_and_refusals(tmp_path, stories_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", completion_rows(16))
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                             "--ctx", "64", "--epochs", "1", "--val-split", "0.25", "--pack")
    assert code == 0, err
    ds, _ = build_dataset(load_model(stories_path), data, 64, 0.25, pack=True)
    pad, windows = ds.padding(range(ds.n_train)), ds.n_train + ds.n_val
    assert ds.n_val and (f"16 completion examples, packed into {windows} windows ({16 / windows:.1f} examples per "
                         f"window, {pad:.0%} of the training windows padding)") in err, err

    res = llmtune.finetune(stories_path, data, tmp_path / "o1.gguf", ctx=64, epochs=1, val_split=0.25, pack=True)
    assert np.isfinite(res.epochs[0].val_loss) and res.n_val_windows == ds.n_val
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, REPO / "data" / "wikitext-100k.txt",
                             "-o", tmp_path / "o2.gguf", "--pack")
    assert code == 2 and "--pack: " in err and "cut into full windows already" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o2.gguf").exists()
    with pytest.raises(LlmtuneError, match="--pack"):
        build_dataset(load_model(stories_path), REPO / "data" / "wikitext-100k.txt", 64, 0.0, pack=True)


def test_packed_validation_has_a_standard_error(tmp_path, stories_path, monkeypatch, capsys):
    """Packing leaves a validation set of few windows (here 4, one pass of --batch 512): it runs in
    at least two passes, so its loss has the ± (the spread of its passes) every other line shows."""
    data = write_jsonl(tmp_path / "d.jsonl", completion_rows(40))
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf", "--ctx", 64,
                           "--batch", 512, "--epochs", 1, "--val-split", 0.25, "--pack")
    assert code == 0, err
    assert "/ 4 validation windows" in err and re.search(r"\| val loss \d+\.\d+ ± \d+\.\d+, acc", err), err
