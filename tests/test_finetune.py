"""finetune: llama.cpp's semantics (windows, first-step loss, ubatch invariance), determinism,
partial training, configs, bad input."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmtune
import llmtune.backends.cpu.backend as cpu
import llmtune.train.config as config
import llmtune.train.output as output
import llmtune.train.preflight as preflight
import llmtune.train.trainer as trainer
from cli_helpers import run_cli as run_cli_in_process
from llmtune.backends.base import Backend
from llmtune.backends.cpu import CPUBackend, threads
from llmtune.backends.cpu.threads import MAX_CPU_WORKERS, blas_threads
from llmtune.cli import _finetune_default
from llmtune.convert.init import init_model
from llmtune.errors import LlmtuneError
from llmtune.gguf.file import load_gguf
from llmtune.model.loaded import load_model
from llmtune.train.config import make_config
from llmtune.train.data import Holdout, WindowDataset
from llmtune.train.optim import LRSchedule
from llmtune.train.trainer import RunningStats, Trainer


@pytest.fixture(scope="module")
def small_text(tmp_path_factory, wiki100k_path):
    """About 12 KB of WikiText: enough windows at ctx 64 for a quick run."""
    path = tmp_path_factory.mktemp("ft") / "small.txt"
    text = wiki100k_path.read_text(encoding="utf-8")
    path.write_text(text[:12000], encoding="utf-8")
    return path


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "llmtune", *map(str, args)], capture_output=True, text=True)


def test_first_step_reports_reference_loss(stories_path, wiki100k_path, tmp_path):
    """First window of the WikiText ids is ids[0:257]: the first step's loss is 5.326544."""
    res = llmtune.finetune(stories_path, wiki100k_path, tmp_path / "o.gguf", ctx=256, epochs=1, shuffle=False,
                           lr=1e-5, val_split=0.9)
    assert abs(res.first_loss - 5.326544) < 1e-4


def test_windows_follow_llama_cpp_layout():
    tokens = np.arange(1000, dtype=np.int32)
    ds = WindowDataset.build(tokens, 64, 0.1)
    assert ds.stride == 32
    assert ds.n_train + ds.n_val == (1000 - 65) // 32 + 1
    x, y = ds.gather([0, 3])
    np.testing.assert_array_equal(x[1], tokens[96:160])
    np.testing.assert_array_equal(y[1], tokens[97:161])
    assert ds.val_indices()[0] == ds.n_train
    assert list(ds.train_order(0, 1, False)) == list(range(ds.n_train))
    assert sorted(ds.train_order(0, 1, True)) == list(range(ds.n_train))
    assert list(ds.train_order(0, 1, True)) != list(ds.train_order(1, 1, True))


def test_val_pick_random_draws_a_seeded_sample_apart_from_training():
    """--val-pick random: the same windows for the same --seed (what a resume and every MPI rank
    rebuild), none of them, nor a window overlapping one, trained on; `last` unchanged."""
    tokens = np.arange(3000, dtype=np.int32)
    n_windows = (3000 - 65) // 32 + 1
    last = WindowDataset.build(tokens, 64, Holdout(0.1, "last", 7))
    assert last.starts is None and (last.n_train, last.n_val) == (WindowDataset.build(tokens, 64, 0.1).n_train, 9)
    ds = WindowDataset.build(tokens, 64, Holdout(0.1, "random", 7))
    again = WindowDataset.build(tokens, 64, Holdout(0.1, "random", 7))
    other = WindowDataset.build(tokens, 64, Holdout(0.1, "random", 8))
    np.testing.assert_array_equal(ds.starts, again.starts)
    assert not np.array_equal(ds.starts, other.starts)
    val = ds.gather(ds.val_indices())[0][:, 0] // 32  # window index = first token / stride
    train = ds.gather(ds.train_order(0, 1, False))[0][:, 0] // 32
    assert ds.n_val == 9 and list(val) == sorted(val) and list(val) != list(range(n_windows - 9, n_windows))
    assert list(train) == sorted(train) and not set(train) & (set(val) | set(val - 1) | set(val + 1))
    assert ds.n_train + ds.n_val + ds.n_left_out == n_windows and 0 < ds.n_left_out <= 2 * ds.n_val
    # separate items (examples, pairs): nothing left out, each part in file order
    items, n_train, n_val = Holdout(0.25, "random", 7).arrange(list(range(40)), "data", "example(s)")
    assert (n_train, n_val) == (30, 10) and sorted(items) == list(range(40))
    assert items[:30] == sorted(items[:30]) and items[30:] == sorted(items[30:]) and items[30:] != list(range(30, 40))
    assert Holdout(0.25, "last").arrange(list(range(40)), "data", "example(s)") == (list(range(40)), 30, 10)
    with pytest.raises(LlmtuneError, match="too few for a random validation split"):
        WindowDataset.build(np.arange(100, dtype=np.int32), 64, Holdout(0.5, "random", 1))


def test_val_pick_random_resumes_to_the_same_bytes(stories_path, small_text, tmp_path):
    """A --val-pick random run resumed from its first epoch's checkpoint writes the uninterrupted
    run's model: the resume draws the same validation windows (and trains on the same others)."""
    out = tmp_path / "o.gguf"
    kw = dict(ctx=64, batch=128, epochs=2, lr=1e-3, val_split=0.2, val_pick="random", seed=3)
    res = llmtune.finetune(stories_path, small_text, out, keep_checkpoints=2, **kw)
    assert res.config.val_pick == "random" and res.n_val_windows > 0
    first = sorted(tmp_path.glob("o.gguf.ckpt-*.npz"))[0]
    whole = out.read_bytes()
    llmtune.finetune(stories_path, small_text, out, resume=first)
    assert out.read_bytes() == whole
    with pytest.raises(LlmtuneError, match=r"^--val-pick: 'last' differs from the 'random' checkpoint"):
        llmtune.finetune(stories_path, small_text, out, resume=first, val_pick="last")


def test_val_pick_flag_mistakes_are_one_line(stories_path, small_text, tmp_path):
    r = run_cli("finetune", stories_path, small_text, "-o", tmp_path / "o.gguf", "--val-pick", "middle")
    assert r.returncode == 2 and "--val-pick: unknown choice 'middle' (choose last, random)" in r.stderr
    r = run_cli("finetune", stories_path, small_text, "-o", tmp_path / "o.gguf", "--val-pick", "random",
                "--val-split", "0")
    assert r.returncode == 2 and "--val-pick random: needs --val-split above 0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.gguf").exists()


def test_ubatch_does_not_change_the_result(stories_path, wikitext_ids):
    """Weights after 3 steps with ubatch = ctx and ubatch = batch agree within 1e-5 relative."""
    model = load_model(stories_path)
    ctx, batch = 64, 256
    results = []
    for ubatch in (ctx, batch):
        tr = Trainer(model, CPUBackend(), n_ctx=ctx, n_batch=batch, n_ubatch=ubatch, trainable=list(model.weights))
        stats = RunningStats()
        for step in range(3):
            starts = [(step * 4 + i) * 32 for i in range(4)]
            x = np.stack([wikitext_ids[s : s + ctx] for s in starts])
            y = np.stack([wikitext_ids[s + 1 : s + ctx + 1] for s in starts])
            tr.train_step(x, y, 1e-3, stats)
        results.append(tr.flat_w.copy())
    base = load_model(stories_path)
    moved = np.concatenate([(results[0] - np.concatenate([w.ravel() for w in base.weights.values()]))])
    assert np.abs(moved).max() > 1e-4  # training did change the weights
    rel = np.abs(results[0] - results[1]).max() / np.abs(results[1]).max()
    # float32 summation order only: parallel micro-batches run OpenBLAS single-threaded, and where it
    # splits sums over its threads (threads.blas_threads.keeps_bits: 1.5e-5 on an AMD AVX2 machine)
    # the sequential run's products sum in another order too
    assert rel < 5e-5, rel


@pytest.mark.determinism
def test_training_and_validation_loss_fall_and_output_is_deterministic(stories_path, small_text, tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"ft{i}.gguf"
        res = llmtune.finetune(stories_path, small_text, out, ctx=64, epochs=2, lr=1e-4, seed=7, val_split=0.1,
                               metrics=str(tmp_path / f"m{i}.jsonl"))
        outs.append(out.read_bytes())
    e1, e2 = res.epochs
    assert e2.train_loss < e1.train_loss < res.first_loss
    assert e2.val_loss < e1.val_loss
    assert 0 < e1.train_accuracy < 1 and e1.val_loss_err > 0
    assert outs[0] == outs[1]  # same seed -> byte-identical file
    records = [json.loads(line) for line in (tmp_path / "m0.jsonl").read_text().splitlines()]
    kinds = {r["type"] for r in records}
    assert kinds == {"train_step", "validation", "epoch"}
    assert sum(r["type"] == "train_step" for r in records) == 2 * (res.n_train_windows)


def test_output_keeps_metadata_and_loads_back(stories_path, small_text, tmp_path):
    out = tmp_path / "ft.gguf"
    llmtune.finetune(stories_path, small_text, out, ctx=64, epochs=1, lr=1e-3)
    src, dst = load_gguf(stories_path), load_gguf(out)
    assert src.meta == dst.meta
    assert list(src.tensors) == list(dst.tensors)
    assert all(src.tensors[n].type == dst.tensors[n].type for n in src.tensors)
    changed = [n for n in src.tensors if not np.array_equal(src.tensor(n), dst.tensor(n))]
    assert len(changed) == len(src.tensors)
    load_model(out)


def test_params_regex_freezes_the_rest(stories_path, small_text, tmp_path):
    out = tmp_path / "ft.gguf"
    llmtune.finetune(stories_path, small_text, out, ctx=64, epochs=1, lr=1e-3, params=r"attn_(q|v)\.weight$",
                     optimizer="sgd")
    src, dst = load_gguf(stories_path), load_gguf(out)
    for name in src.tensors:
        same = np.array_equal(src.tensor(name), dst.tensor(name))
        trained = name.endswith(("attn_q.weight", "attn_v.weight"))
        assert same != trained, name


def test_frozen_tensors_carry_no_gradient_memory(stories_path):
    model = load_model(stories_path)
    names = model.select("output")
    tr = Trainer(model, CPUBackend(), n_ctx=32, n_batch=32, n_ubatch=32, trainable=names)
    assert tr.n_trainable == sum(model.weights[n].size for n in names)
    assert tr.memory_bytes()["gradients"] == tr.n_trainable * 4


def test_config_file_and_flag_precedence(stories_path, small_text, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[finetune]\nctx = 64\nepochs = 1\nlr = 0.002\nno-shuffle = true\nval-split = 0.2\n')
    res = llmtune.finetune(stories_path, small_text, tmp_path / "a.gguf", config_file=cfg, lr=0.001)
    assert res.config.ctx == 64 and res.config.lr == 0.001 and res.config.shuffle is False
    assert res.config.val_split == 0.2
    bad = tmp_path / "bad.toml"
    bad.write_text("learning_rate = 1\n")
    with pytest.raises(LlmtuneError, match="unknown setting"):
        llmtune.finetune(stories_path, small_text, tmp_path / "b.gguf", config_file=bad)


def test_config_file_errors_name_the_file(tmp_path):

    (tmp_path / "broken.toml").write_text("ctx = [\n")
    for path, problem in ((tmp_path / "nope.toml", "no such file"), (tmp_path, "is a directory"),
                          (tmp_path / "broken.toml", "invalid TOML")):
        with pytest.raises(LlmtuneError, match="^" + re.escape(f"{path}: {problem}")):
            make_config(path)


def test_help_shows_the_config_defaults(monkeypatch):
    """--help's defaults are read from FinetuneConfig, so they follow a changed default."""

    assert [_finetune_default(n) for n in ("ctx", "lr", "wd", "val_split", "optimizer")] == [
        " \\[default: 512]", " \\[default: 1e-5]", " \\[default: 0]", " \\[default: 0.05]", " \\[default: adamw]"]
    assert _finetune_default("batch", unset="ctx") == " \\[default: ctx]"
    monkeypatch.setitem(config.FIELDS, "lr_min", type("F", (), {"default": 2.5e-6, "metadata": {"unset": "off"}})())
    assert _finetune_default("lr_min", unset="off") == " \\[default: 2.5e-6]"


def test_cpu_workers_rule(monkeypatch):
    """One worker off the cpu, for a single item, or without OpenBLAS thread control; else one per
    core up to 4, whether or not OpenBLAS's bits follow its thread count."""

    cpu = CPUBackend()
    for be in (cpu, Backend()):
        with pytest.raises(LlmtuneError, match="workers: must be positive"):
            be.workers(0, 8)
    monkeypatch.setattr(threads.blas_threads, "available", lambda: True)
    monkeypatch.setattr(threads, "n_cores", lambda: 16)
    for keeps_bits in (False, True):  # passes run OpenBLAS single-threaded where its bits follow its count
        monkeypatch.setattr(threads.blas_threads, "keeps_bits", lambda: keeps_bits)
        assert cpu.workers(None, 8) == threads.MAX_CPU_WORKERS and cpu.workers(3, 8) == 3
    assert Backend().workers(None, 8) == 1  # a backend that queues its own work (cuda)
    assert cpu.workers(None, 1) == 1
    assert cpu.workers(None, 8) == threads.MAX_CPU_WORKERS
    assert cpu.workers(6, 8) == 6 and cpu.workers(6, 3) == 3
    monkeypatch.setattr(threads.blas_threads, "available", lambda: False)
    assert cpu.workers(6, 8) == 1


def test_lr_schedule_matches_llama_cpp():
    s = LRSchedule(1e-3, 1e-5, 0, 4)  # decay over all 4 epochs: halves log2(100)/4 times per epoch
    assert s.lr(0, 10) == pytest.approx(1e-3)
    assert s.lr(2, 10) == pytest.approx(1e-4)
    assert s.lr(4, 10) == pytest.approx(1e-5)
    assert LRSchedule(1e-3).lr(3.5, 99) == 1e-3
    warm = LRSchedule(1e-3, warmup=4)
    assert [warm.lr(0, i) for i in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_jsonl_documents(stories_path, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Once upon a time there was a cat number {i}."}) for i in range(60)))
    res = llmtune.finetune(stories_path, data, tmp_path / "j.gguf", ctx=32, epochs=1, lr=1e-3)
    assert res.n_tokens > 60 * 10


def test_memory_refusal(stories_path, small_text, tmp_path, monkeypatch):

    monkeypatch.setattr(preflight, "available_memory", lambda backend: 1000)
    with pytest.raises(LlmtuneError, match="MiB is available"):
        llmtune.finetune(stories_path, small_text, tmp_path / "m.gguf", ctx=64, epochs=1)
    assert not (tmp_path / "m.gguf").exists()


def test_activations_that_do_not_fit_are_refused_before_allocating(stories_path, small_text, tmp_path, monkeypatch,
                                                                    capsys):
    """The activations' arena is planned, then checked against the memory left, then allocated:
    a run whose pass does not fit ends in one line (exit 2) and no arena is ever asked for."""

    monkeypatch.setattr(trainer, "available_memory", lambda backend: 3 * 2**20)
    asked = []
    real_arena = cpu.CPUBackend.arena
    monkeypatch.setattr(cpu.CPUBackend, "arena", lambda self, n: asked.append(n) or real_arena(self, n))
    code, out, err = run_cli_in_process(monkeypatch, capsys, "finetune", stories_path, small_text, "-o",
                                        tmp_path / "m.gguf", "--ctx", 256, "--batch", 1024, "--epochs", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the run does not fit in memory: it needs" in err
    assert "MiB of activations for one pass of 1,024 tokens" in err
    assert "3 MiB is available" in err and "--ubatch" in err and "--grad-checkpoint" in err
    assert asked == [] and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", "empty"),
        (b"tiny text", "shorter than one training window"),
        (b"caf\xe9 au lait\n" * 50, "not valid UTF-8"),
    ],
)
def test_bad_text_data(stories_path, tmp_path, content, needle):
    data = tmp_path / "bad.txt"
    data.write_bytes(content)
    r = run_cli("finetune", stories_path, data, "-o", tmp_path / "o.gguf", "--ctx", "64")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert needle in r.stderr and "bad.txt" in r.stderr


def test_bad_jsonl_names_the_line(stories_path, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    r = run_cli("finetune", stories_path, data, "-o", tmp_path / "o.gguf", "--ctx", "8")
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "text" in r.stderr


def test_refuses_to_overwrite_input(stories_path, small_text, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(stories_path.read_bytes())
    before = model.read_bytes()
    r = run_cli("finetune", model, small_text, "-o", model, "--ctx", "64")
    assert r.returncode == 2 and "overwrite" in r.stderr
    assert model.read_bytes() == before


def test_bad_flags(stories_path, small_text, tmp_path):
    r = run_cli("finetune", stories_path, small_text, "-o", tmp_path / "o.gguf", "--ctx", "64", "--batch", "100")
    assert r.returncode == 2 and "--batch" in r.stderr
    r = run_cli("finetune", stories_path, small_text, "-o", tmp_path / "o.gguf", "--optimizer", "lion", "--ctx", "64")
    assert r.returncode == 2 and "--optimizer" in r.stderr
    r = run_cli("finetune", stories_path, small_text, "-o", tmp_path / "o.gguf", "--params", "nomatch", "--ctx", "64")
    assert r.returncode == 2 and "matches no tensor" in r.stderr


def test_validation_with_more_workers_than_the_default_cap(stories_path, wikitext_ids):
    """workers above MAX_CPU_WORKERS: each evaluation worker still gets its own program cache."""

    if not blas_threads.available():
        pytest.skip("OpenBLAS thread control unavailable: workers fall back to 1")
    model = load_model(stories_path)
    n = MAX_CPU_WORKERS + 2
    tr = Trainer(model, CPUBackend(), n_ctx=16, n_batch=16, n_ubatch=16, trainable=[], workers=n)
    x = np.stack([wikitext_ids[s : s + 16] for s in range(0, 16 * n, 16)])
    y = np.stack([wikitext_ids[s + 1 : s + 17] for s in range(0, 16 * n, 16)])
    stats = RunningStats()
    tr.evaluate(x, y, stats)
    assert stats.tokens == 16 * n and len(tr.programs.eval_caches) == n


def test_parallel_micro_batches_match_sequential(stories_path, wikitext_ids):
    """Micro-batches computed one per core give the sequential result (float rounding aside)."""

    if not blas_threads.available():
        pytest.skip("OpenBLAS thread control unavailable: workers fall back to 1")
    model = load_model(stories_path)
    flat = []
    for workers in (1, 2):
        tr = Trainer(model, CPUBackend(), n_ctx=32, n_batch=128, n_ubatch=32, trainable=list(model.weights),
                     workers=workers)
        assert tr.n_workers == workers
        stats = RunningStats()
        for step in range(2):
            x = np.stack([wikitext_ids[s : s + 32] for s in range(step * 200, step * 200 + 128, 32)])
            y = np.stack([wikitext_ids[s + 1 : s + 33] for s in range(step * 200, step * 200 + 128, 32)])
            tr.train_step(x, y, 1e-3, stats)
        val = RunningStats()
        tr.evaluate(x, y, val)
        flat.append((tr.flat_w.copy(), stats.losses, val.loss, val.correct))
    rel = np.abs(flat[0][0] - flat[1][0]).max() / np.abs(flat[1][0]).max()
    assert rel < 5e-5, rel  # summation order: 1.5e-5 where OpenBLAS splits sums over threads (keeps_bits)
    np.testing.assert_allclose(flat[0][1], flat[1][1], rtol=1e-5)
    assert flat[0][2] == pytest.approx(flat[1][2], rel=1e-5) and flat[0][3] == flat[1][3]


def test_quantized_model_keeps_its_training(stories_path, small_text, tmp_path):
    """A full finetune of a q8_0 file (with llama.cpp's F16 fallback for rows that do not split
    into blocks) writes its trained tensors as F32, exactly the trained weights, and every other
    tensor byte for byte: the training is never rounded away on write."""
    quantized = tmp_path / "q8.gguf"
    llmtune.export(stories_path, quantized, "q8_0")
    out = tmp_path / "q8-ft.gguf"
    events = []
    res = llmtune.finetune(quantized, small_text, out, ctx=64, epochs=1, lr=1e-3, params=r"attn_q\.weight$",
                           callback=events.append)
    src, dst = load_gguf(quantized), load_gguf(out)
    assert {t.type.name for t in src.tensors.values()} >= {"Q8_0", "F32"}
    trained = [n for n in src.tensors if n.endswith("attn_q.weight")]
    assert trained and all(dst.tensors[n].type.name == "F32" for n in trained)
    assert all(np.array_equal(np.asarray(src.tensors[n].raw), np.asarray(dst.tensors[n].raw))
               and src.tensors[n].type == dst.tensors[n].type for n in src.tensors if n not in trained)
    assert src.meta == dst.meta
    assert not np.array_equal(src.tensor(trained[0]), dst.tensor(trained[0]))
    check = [e for e in events if e.kind == "output_checked"]
    assert len(check) == 1 and not check[0].rescored and check[0].types == {"F32": len(trained)}
    assert res.val_loss_written == res.epochs[-1].val_loss


def test_out_type_rewrites_the_model_and_scores_it_as_written(stories_path, small_text, tmp_path, monkeypatch):
    """--out-type q8_0: the trained model stored as `export --type q8_0` would store it, the
    validation windows scored again from the written file (close to the in-memory loss); a
    coarse type that loses more than the margin warns in one line with both numbers (q4_0 costs
    this tiny model ~0.6 %: the margin is lowered below that)."""

    out = tmp_path / "q8.gguf"
    events = []
    res = llmtune.finetune(stories_path, small_text, out, ctx=64, epochs=1, lr=1e-3, out_type="q8_0",
                           callback=events.append)
    exported = tmp_path / "exported.gguf"
    llmtune.export(stories_path, exported, "q8_0")
    ref, dst = load_gguf(exported), load_gguf(out)
    assert {n: t.type for n, t in dst.tensors.items()} == {n: t.type for n, t in ref.tensors.items()}
    assert dst.get("general.file_type") == ref.get("general.file_type")
    check = next(e for e in events if e.kind == "output_checked")
    assert check.rescored and check.val_loss == res.epochs[-1].val_loss
    assert check.val_loss_written == res.val_loss_written and check.val_loss_written != check.val_loss
    assert abs(check.val_loss_written / check.val_loss - 1) < 0.02
    warnings = []
    monkeypatch.setattr(output, "WRITTEN_LOSS_MARGIN", 0.002)
    llmtune.finetune(stories_path, small_text, tmp_path / "q4.gguf", ctx=64, epochs=1, lr=1e-3, out_type="q4_0",
                     callback=lambda e: warnings.append(e.message) if e.kind == "warning" else None)
    assert len(warnings) == 1, warnings
    assert "as written vs" in warnings[0] and "lost part of the training" in warnings[0], warnings


def test_out_type_mistakes_are_one_line(stories_path, small_text, tmp_path):
    with pytest.raises(LlmtuneError, match="^--out-type: unknown type 'q3'"):
        llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", ctx=64, epochs=1, out_type="q3")
    with pytest.raises(LlmtuneError, match="^--out-type: a LoRA adapter is written in F32; to merge"):
        llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", ctx=64, epochs=1, out_type="q8_0", lora_rank=2)
    assert not (tmp_path / "o.gguf").exists()


# ------------------------------------------------------------------------------ the memory estimate
# Peak RSS is VmHWM, this process's own high-water mark (resources.peak_rss: ru_maxrss also holds
# the parent's, which inside a large pytest process is the larger)
_PEAK_RSS_RUN = """
import json, sys
import llmtune
from llmtune.resources import peak_rss
settings = json.loads(sys.argv[4])
res = llmtune.finetune(sys.argv[1], sys.argv[2], sys.argv[3], epochs=1, lr=1e-5, val_split=0.0, **settings)
print(json.dumps({"estimate": sum(res.memory.values()), "memory": res.memory, "peak_rss": peak_rss()}))
"""


@pytest.fixture(scope="module")
def model_15m(tmp_path_factory):
    """The 15M shape (configs/llama-15m.toml, 32000-token vocabulary): 93 MiB of weights, so a full
    finetune's buffers are ~400 MiB against ~50 MiB of interpreter and libraries."""

    root = Path(__file__).resolve().parents[1]
    path = tmp_path_factory.mktemp("m15") / "llama-15m.gguf"
    init_model(root / "configs" / "llama-15m.toml", root / "tests" / "data" / "vocab" / "ggml-vocab-llama-spm.gguf",
               path, seed=0)
    return path


@pytest.mark.parametrize("settings", [{}, {"lora_rank": 8}, {"grad_checkpoint": True}],
                         ids=["full", "lora", "checkpoint"])
def test_memory_estimate_holds(model_15m, wiki100k_path, tmp_path, settings):
    """The printed memory total is within 15 % of the run's measured peak RSS (a fresh process:
    its VmHWM), for a full finetune, a LoRA one and one with --grad-checkpoint."""
    text = tmp_path / "t.txt"
    text.write_text(wiki100k_path.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    run = subprocess.run([sys.executable, "-c", _PEAK_RSS_RUN, str(model_15m), str(text), str(tmp_path / "o.gguf"),
                          json.dumps({"ctx": 256, **settings})], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert abs(got["estimate"] / got["peak_rss"] - 1) < 0.15, json.dumps(got)


# ------------------------------------------------------------------------------ --grad-clip
def _torch_clip(g: np.ndarray, max_norm: float) -> tuple[float, np.ndarray]:
    """torch.nn.utils.clip_grad_norm_ on one tensor, written out (float64): the total L2 norm, and
    the gradient times min(1, max_norm / (norm + 1e-6))."""
    norm = float(np.sqrt(np.sum(np.asarray(g, np.float64) ** 2)))
    return norm, g * min(1.0, max_norm / (norm + 1e-6))


def test_grad_clip_scales_as_torch(stories_path):

    model = load_model(stories_path)
    tr = Trainer(model, CPUBackend(), n_ctx=16, n_batch=16, n_ubatch=16, trainable=model.select(None), grad_clip=0.5)
    g = np.random.default_rng(3).standard_normal(tr.n_trainable).astype(np.float32) * 1e-3
    for max_norm in (0.5, 1e9):  # clipped, and a norm under the limit (untouched)
        tr.grad_clip = max_norm
        tr.flat_g[...] = g
        norm = tr.clip_gradients()
        want_norm, want = _torch_clip(g, max_norm)
        assert norm == pytest.approx(want_norm, rel=1e-6)
        np.testing.assert_allclose(tr.flat_g, want, rtol=1e-6, atol=0)
    assert np.array_equal(tr.flat_g, g)  # under the limit: the very same bits


def test_grad_clip_in_a_run_logs_the_norm_and_changes_only_clipped_steps(stories_path, small_text, tmp_path):
    """Every step's norm (before clipping) is in --metrics; a limit above every norm gives the
    unclipped run's bytes, a low one another model."""
    runs = {}
    for name, clip in (("off", None), ("high", 1e9), ("low", 0.05)):
        out, metrics = tmp_path / f"{name}.gguf", tmp_path / f"{name}.jsonl"
        llmtune.finetune(stories_path, small_text, out, ctx=64, epochs=1, lr=1e-3, metrics=str(metrics), grad_clip=clip)
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["type"] == "train_step"]
        runs[name] = (out.read_bytes(), [r["grad_norm"] for r in steps])
    assert all(n > 0 for n in runs["off"][1]) and runs["off"] == runs["high"]
    assert runs["low"][0] != runs["off"][0] and runs["low"][1][0] == runs["off"][1][0] > 0.05
    with pytest.raises(LlmtuneError, match="^--grad-clip: must be >= 0"):
        llmtune.finetune(stories_path, small_text, tmp_path / "x.gguf", ctx=64, epochs=1, grad_clip=-1.0)


def test_memory_check_counts_the_trained_values_once(stories_path, small_text, tmp_path, monkeypatch):
    """Setup has written the trained values before the check, so the host's free memory no longer
    counts them while the estimate does: the run is refused only when what it still needs is more
    than is free (and a full AdamW run is told about --optimizer adamw8bit)."""

    kw = dict(ctx=64, epochs=1)
    res = llmtune.finetune(stories_path, small_text, tmp_path / "a.gguf", **kw)
    need = sum(v for k, v in res.memory.items() if k != "runtime")
    monkeypatch.setattr(preflight, "available_memory", lambda backend: 1000)
    with pytest.raises(LlmtuneError,
                       match=r"held already, but only 0 MiB is available besides \(--optimizer adamw8bit"):
        llmtune.finetune(stories_path, small_text, tmp_path / "b.gguf", **kw)
    trained = res.memory["base"]  # a full finetune trains every tensor: all of "base" is written at setup
    monkeypatch.setattr(preflight, "available_memory", lambda backend: need - trained + 2**16)
    llmtune.finetune(stories_path, small_text, tmp_path / "c.gguf", **kw)  # fits: the trained values are held
    monkeypatch.setattr(preflight, "available_memory", lambda backend: need - trained - 2**16)
    with pytest.raises(LlmtuneError, match="MiB is available besides"):
        llmtune.finetune(stories_path, small_text, tmp_path / "d.gguf", **kw)
