"""Seeing a run (train/observe.py): --plot's PNG, --tensorboard's event files read back by
TensorBoard's own reader, `llmtune plot`, and the summary's loss sparkline. The optional
libraries (matplotlib, tensorboardX, tensorboard) are skipped when absent."""

import json
import math
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

import llmtune
from cli_helpers import run_cli
from llmtune.errors import LlmtuneError
from llmtune.train import observe
from llmtune.ui.format import sparkline

SETTINGS = dict(ctx=32, batch=128, epochs=2, lr=1e-3)  # 2 x 8 steps


@pytest.fixture(scope="module")
def small_text(tmp_path_factory, wiki100k_path):
    path = tmp_path_factory.mktemp("obs") / "small.txt"
    path.write_text(wiki100k_path.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    return path


def _records(path, kind):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == kind]


# ------------------------------------------------------------------------------ sparkline
def test_sparkline_buckets_means_from_lowest_to_highest():
    falling = [10 - i / 100 for i in range(1000)]
    line = sparkline(falling)
    assert len(line) == 40 and line[0] == "█" and line[-1] == "▁"
    assert list(line) == sorted(line, reverse=True)  # a falling loss never rises in the line
    assert sparkline([1.0, 3.0, 2.0]) == "▁█▅"  # fewer values than the width: one block each
    # each block is the mean of its share: [0, 0, 4, 4] in 2 buckets -> lowest, highest
    assert sparkline([0, 0, 4, 4], width=2) == "▁█"
    assert sparkline([2.0, float("nan"), 2.0, None]) == "▄▄"  # not finite: left out; flat: mid blocks
    assert sparkline([]) == "" and sparkline([float("inf")]) == ""


def test_tensorboard_tags_every_number_of_a_record():
    step = {"type": "train_step", "epoch": 1, "step": 3, "steps": 9, "global_step": 3, "loss": 2.5, "running_loss": 2.6,
            "accuracy": 0.25, "lr": 1e-3, "tokens_per_s": 900.0, "grad_norm": None, "elapsed_s": 1.2}
    assert dict(observe.scalars(step)) == {"train/loss": 2.5, "train/running_loss": 2.6, "train/accuracy": 0.25,
                                           "train/lr": 1e-3, "train/tokens_per_s": 900.0}
    bench = {"type": "benchmark", "epoch": 0, "global_step": 0, "kind": "hellaswag", "accuracy": 0.3,
             "accuracy_err": 0.02, "n_tasks": 20}
    assert observe.scalars(bench) == [("benchmark/accuracy", 0.3)]
    assert observe.scalars({"type": "epoch", "epoch": 1, "train_loss": 2.0}) == []


# ------------------------------------------------------------------------------ a run with both
@pytest.fixture(scope="module")
def observed(stories_path, small_text, tmp_path_factory):
    """One run with --metrics, --plot and --tensorboard (the libraries it can have)."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboardX")
    folder = tmp_path_factory.mktemp("observed")
    paths = {"out": folder / "o.gguf", "metrics": folder / "m.jsonl", "plot": folder / "curve.png", "tb": folder / "tb"}
    warnings = []
    llmtune.finetune(stories_path, small_text, paths["out"], metrics=str(paths["metrics"]), plot=str(paths["plot"]),
                     tensorboard=str(paths["tb"]),
                     callback=lambda e: e.kind == "warning" and warnings.append(e.message),
                     **SETTINGS)
    assert not warnings
    return paths


def _pixels(path):
    import matplotlib.image  # noqa: PLC0415 - optional, probed where used

    return matplotlib.image.imread(str(path))  # float RGBA in [0, 1]


def _share_of_colour(pixels, hex_colour: str) -> float:
    """The fraction of pixels within 0.06 (per channel) of a colour."""

    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return float((np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.06).mean())


def test_plot_is_a_png_of_the_curves(observed):
    pixels = _pixels(observed["plot"])
    assert pixels.shape[:2] == (450, 800)  # PLOT_SIZE at PLOT_DPI
    assert pixels[..., :3].std() > 0.05  # not blank
    # the train loss (matplotlib's C0 blue), validation loss (C1 orange) and lr (C2 green) are drawn
    assert _share_of_colour(pixels, "#1f77b4") > 0.002
    assert _share_of_colour(pixels, "#ff7f0e") > 0.0005
    assert _share_of_colour(pixels, "#2ca02c") > 0.0005
    assert not list(observed["plot"].parent.glob("*.tmp"))  # written atomically: no temp file left


def test_tensorboard_reader_reads_every_step(observed):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(observed["tb"]), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    steps, vals = _records(observed["metrics"], "train_step"), _records(observed["metrics"], "validation")
    assert {"train/loss", "train/accuracy", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss",
            "val/accuracy"} <= set(acc.Tags()["scalars"])
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["global_step"] for r in steps] == list(range(1, len(steps) + 1))
    assert all(math.isclose(e.value, r["loss"], rel_tol=1e-6) for e, r in zip(loss, steps))
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("val/loss")] == [(r["global_step"], round(r["loss"], 5))
                                                                             for r in vals]
    assert len(vals) == SETTINGS["epochs"]


def test_llmtune_plot_draws_a_metrics_file(observed, monkeypatch, capsys, tmp_path):
    png = tmp_path / "again.png"
    code, out, err = run_cli(monkeypatch, capsys, "plot", observed["metrics"], "-o", png)
    n = len(_records(observed["metrics"], "train_step"))
    assert code == 0, err
    assert f"{n} steps, 2 validation passes" in out
    assert f"(steps 1-{n})" in out and any(c in out for c in "▁▂▃▄▅▆▇█")
    assert _pixels(png).shape[:2] == (450, 800)


def test_the_loss_axis_says_what_each_method_s_loss_is(observed, stories_path, tmp_path, monkeypatch):
    """A preference loss is not per token: the y axis names the method's loss and its unit, from the
    --metrics records (each step's names its method), live and in `llmtune plot`."""
    matplotlib_axes = pytest.importorskip("matplotlib.axes")
    labels = []
    set_ylabel = matplotlib_axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib_axes.Axes, "set_ylabel", lambda ax, text, *a, **k: labels.append(text) or
                        set_ylabel(ax, text, *a, **k))
    observe.plot_metrics(observed["metrics"], tmp_path / "sft.png")
    assert labels == ["loss (nats per token)", "learning rate"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Once upon a time, {n} had a ball.", "chosen": f" {n} was happy.",
                                         "rejected": " The ball ball was sad sad."}) + "\n"
                             for n in ("Lily", "Tom", "Ben", "Sue")))
    for method, label in (("dpo", "DPO loss (nats per pair)"), ("simpo", "SimPO loss (nats per pair)")):
        labels.clear()
        llmtune.finetune(stories_path, pairs, tmp_path / f"{method}.gguf", method=method, lora_rank=2, ctx=64,
                         batch=128, epochs=1, val_split=0.0, metrics=str(tmp_path / f"{method}.jsonl"),
                         plot=str(tmp_path / f"{method}.png"))
        # the preference panel below (reward margin and accuracy) has its own axes
        assert labels and set(labels) == {label, "learning rate", "reward margin (chosen - rejected)",
                                          "reward accuracy"}, labels
        assert {r["method"] for r in _records(tmp_path / f"{method}.jsonl", "train_step")} == {method}
        labels.clear()
        observe.plot_metrics(tmp_path / f"{method}.jsonl", tmp_path / "again.png")
        assert labels == [label, "learning rate", "reward margin (chosen - rejected)", "reward accuracy"]


def test_llmtune_plot_refuses_a_bad_file_in_one_line(monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    not_json, no_steps = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl"
    not_json.write_text('{"type": "train_step", "global_step": 1, "loss": 2.0}\nnot json\n')
    no_steps.write_text('{"type": "validation", "global_step": 1, "loss": 2.0}\n')
    no_position = tmp_path / "no-step.jsonl"
    no_position.write_text('{"type": "train_step", "loss": 2.0}\n')
    for path, message in ((not_json, f"{not_json}:2: not a JSON record"), (no_steps, "no train_step record"),
                          (no_position, f"{no_position}:1: a train_step record without an integer \"global_step\""),
                          (tmp_path / "missing.jsonl", "cannot read")):
        code, out, err = run_cli(monkeypatch, capsys, "plot", path, "-o", tmp_path / "x.png")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x.png").exists()
    code, _, err = run_cli(monkeypatch, capsys, "plot", not_json, "-o", not_json)
    assert code == 2 and "refusing to overwrite the input file" in err


@pytest.mark.parametrize("name, magic", [("a.jpg", b"\xff\xd8\xff"), ("a.JPEG", b"\xff\xd8\xff"),
                                         ("a.svg", b"<?xml"), ("a.pdf", b"%PDF"), ("a.png", b"\x89PNG"),
                                         ("a", b"\x89PNG")])
def test_llmtune_plot_writes_the_format_its_name_says(observed, monkeypatch, capsys, tmp_path, name, magic):
    """A .jpg holds JPEG bytes (never PNG under a .jpg name); a name without an extension gets PNG."""
    code, _, err = run_cli(monkeypatch, capsys, "plot", observed["metrics"], "-o", tmp_path / name)
    assert code == 0 and (tmp_path / name).read_bytes().startswith(magic), err


def test_a_picture_format_matplotlib_cannot_write_is_refused_before_the_run(observed, stories_path, small_text,
                                                                           monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "plot", observed["metrics"], "-o", tmp_path / "a.doc")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: -o {tmp_path / 'a.doc'}: matplotlib cannot write .doc pictures (name it .png"), err
    steps = []
    with pytest.raises(LlmtuneError, match=r"^--plot .*a.doc: matplotlib cannot write .doc pictures"):
        llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", plot=str(tmp_path / "a.doc"),
                         callback=lambda e: e.kind == "step" and steps.append(e), **SETTINGS)
    assert not steps and sorted(p.name for p in tmp_path.iterdir()) == []


def test_llmtune_plot_replaces_a_picture_but_never_a_data_file_without_force(observed, monkeypatch, capsys,
                                                                            tmp_path):
    notes = tmp_path / "notes"  # no extension: PNG
    notes.write_text("my only copy\n")
    code, _, err = run_cli(monkeypatch, capsys, "plot", observed["metrics"], "-o", notes)
    assert code == 2 and err.strip() == (f"error: {notes}: exists and is not a .png picture; refusing to overwrite it "
                                         "(choose another -o path, or add --force to replace it)"), err
    assert notes.read_text() == "my only copy\n"
    code, _, err = run_cli(monkeypatch, capsys, "plot", observed["metrics"], "-o", notes, "--force")
    assert code == 0 and notes.read_bytes()[:4] == b"\x89PNG", err
    assert run_cli(monkeypatch, capsys, "plot", observed["metrics"], "-o", notes)[0] == 0  # a PNG: replaced


def test_llmtune_plot_reads_a_running_finetunes_file(observed, monkeypatch, capsys, tmp_path):
    """The record being written (its last line without its newline yet) is left out."""
    lines = observed["metrics"].read_text().splitlines(keepends=True)
    running = tmp_path / "running.jsonl"
    running.write_text("".join(lines[:5]) + lines[5][:20])
    code, out, err = run_cli(monkeypatch, capsys, "plot", running, "-o", tmp_path / "r.png")
    assert code == 0 and "wrote" in out and "5 steps" in out, err


def test_a_resumed_run_continues_its_curves(stories_path, small_text, tmp_path, monkeypatch):
    """Resumed from the first epoch's checkpoint: TensorBoard purges the steps the first process
    wrote after it (each step once), and --plot starts from the --metrics file's records."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("matplotlib")
    event_file_writer = pytest.importorskip("tensorboardX.event_file_writer")
    # both writers start in the same second (the file name's own time): the second must not
    # overwrite the first's file
    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1.7e9))
    out, metrics, tb = tmp_path / "o.gguf", tmp_path / "m.jsonl", tmp_path / "tb"
    llmtune.finetune(stories_path, small_text, out, metrics=str(metrics), tensorboard=str(tb), keep_checkpoints=2,
                     **SETTINGS)
    n = len(_records(metrics, "train_step"))
    first = sorted(tmp_path.glob("o.gguf.ckpt-*.npz"))[0]
    drawn = []
    draw = observe.draw_curves
    monkeypatch.setattr(observe, "draw_curves", lambda curves, *a, **k: (drawn.append(list(curves.steps)),
                                                                           draw(curves, *a, **k)))
    llmtune.finetune(stories_path, small_text, out, resume=first, metrics=str(metrics), tensorboard=str(tb),
                     plot=str(tmp_path / "p.png"))
    assert drawn[-1] == list(range(1, n + 1))
    acc = accumulator.EventAccumulator(str(tb), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, n + 1))


def test_missing_library_and_bad_folder_are_one_line(stories_path, small_text, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.delitem(sys.modules, "matplotlib.backends.backend_agg", raising=False)
    with pytest.raises(LlmtuneError,
                       match=r"^--plot: needs matplotlib, which is not installed \(pip install matplotlib"):
        llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", plot=str(tmp_path / "p.png"), **SETTINGS)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(LlmtuneError, match="^--tensorboard .*file: is a file, not a folder"):
        llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", tensorboard=str(a_file), **SETTINGS)
    with pytest.raises(LlmtuneError, match="^--plot .*o.gguf: is the -o file too"):
        llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", plot=str(tmp_path / "o.gguf"), **SETTINGS)


def test_finetune_summary_ends_with_the_loss_sparkline(stories_path, small_text, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "finetune", stories_path, small_text, "-o", tmp_path / "o.gguf",
                             "--ctx", "32", "--batch", "128", "--epochs", "1", "--lr", "1e-3")
    assert code == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("loss ") and "(steps 1-" in last
    assert 1 <= sum(c in "▁▂▃▄▅▆▇█" for c in last) <= 40


def _fake_run(warnings, tmp_path):
    """What PlotHook reads of a run: rank, --metrics file, output name, warn."""

    return SimpleNamespace(trainer=SimpleNamespace(comm=SimpleNamespace(is_root=True)),
                           log=SimpleNamespace(fh=None, path=None), result=SimpleNamespace(output=tmp_path / "o.gguf"),
                           warn=warnings.append)


def test_plot_is_redrawn_at_validation_and_every_minute_and_a_failure_only_warns(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    warnings, png = [], tmp_path / "p.png"
    run, hook = _fake_run(warnings, tmp_path), observe.PlotHook(png)
    step = lambda i: {"type": "train_step", "epoch": 1, "global_step": i, "loss": 3.0 - i / 10, "lr": 1e-3}  # noqa: E731
    for i in range(1, 4):
        hook.on_record(run, step(i))
    assert not png.exists()  # steps alone: not before a minute has passed
    hook.on_record(run, {"type": "validation", "epoch": 1, "global_step": 3, "loss": 2.9})
    first = png.stat().st_mtime_ns
    monkeypatch.setattr(observe.time, "perf_counter", lambda: hook.last_draw + observe.REDRAW_S + 1)
    hook.on_record(run, step(4))  # a minute later: redrawn with step 4
    assert png.stat().st_mtime_ns >= first and hook.drawn == 5
    png.unlink()
    png.mkdir()  # the picture can no longer be written: one warning, then the hook is quiet
    hook.on_record(run, {"type": "validation", "epoch": 1, "global_step": 4, "loss": 2.8})
    hook.on_stop(run, "done")
    assert len(warnings) == 1 and warnings[0].startswith(f"--plot {png}: cannot write") and "goes on" in warnings[0]


# ------------------------------------------------------------------------------ marks and preference runs
RED, PURPLE, BROWN, PINK = "#d62728", "#9467bd", "#8c564b", "#e377c2"  # C3 best, C4 early stop; C5, C6 rewards


def test_plot_marks_the_best_pass_and_the_early_stop(stories_path, small_text, tmp_path, monkeypatch, capsys):
    """--min-delta 100: the first pass (step 2) stays the best and the next one (step 4) stops the
    run; the live --plot and `llmtune plot` of its --metrics file mark both."""
    pytest.importorskip("matplotlib")
    png, metrics = tmp_path / "live.png", tmp_path / "m.jsonl"
    result = llmtune.finetune(stories_path, small_text, tmp_path / "o.gguf", metrics=str(metrics), plot=str(png),
                              eval_every=2, early_stop=1, min_delta=100.0, **SETTINGS)
    assert (result.best_step, result.stopped_at) == (2, 4)
    curves = observe.Curves.of(map(json.loads, metrics.read_text().splitlines()))
    assert (curves.best_step, curves.stopped_at, curves.preference) == (2, 4, False)
    again = tmp_path / "again.png"
    code, out, err = run_cli(monkeypatch, capsys, "plot", metrics, "-o", again)
    assert code == 0 and "4 steps, 2 validation passes, best: step 2, stopped early at step 4" in out, err
    for path in (png, again):
        pixels = _pixels(path)
        assert pixels.shape[:2] == (450, 800)
        assert _share_of_colour(pixels, RED) > 0.0005 and _share_of_colour(pixels, PURPLE) > 0.0005


def test_without_a_selection_the_lowest_validation_loss_is_marked_and_no_stop(tmp_path):
    pytest.importorskip("matplotlib")
    records = [{"type": "train_step", "epoch": 1, "global_step": i, "loss": 3.0 - i / 10, "lr": 1e-3}
               for i in range(1, 9)]
    records += [{"type": "validation", "epoch": 1, "global_step": s, "loss": v} for s, v in ((4, 2.5), (8, 2.6))]
    curves = observe.Curves.of(records)
    assert (curves.best_step, curves.stopped_at) == (4, 0)
    pixels = _pixels(observe.draw_curves(curves, tmp_path / "p.png"))
    assert _share_of_colour(pixels, RED) > 0.0005 and _share_of_colour(pixels, PURPLE) == 0
    assert observe.Curves.of(records[:8]).best_step == 0  # no validation pass: nothing to mark


PAIRS = [{"prompt": f"Once upon a time, {n} had a {t}.", "chosen": f" {n} was happy and played with the {t}.",
          "rejected": f" The {t} {t} was sad sad."}
         for n, t in zip(["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia"],
                         ["ball", "cat", "dog", "tree", "cake", "boat", "kite", "toy"])]


def test_a_preference_run_plots_its_reward_margin_and_accuracy(stories_path, tmp_path):
    """DPO's records carry TRL's rewards/margins and rewards/accuracies (train/preference.py): a
    panel below the loss draws them, per step and per validation pass."""
    pytest.importorskip("matplotlib")
    data, png, metrics = tmp_path / "pairs.jsonl", tmp_path / "dpo.png", tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    llmtune.finetune(stories_path, data, tmp_path / "o.gguf", method="dpo", lora_rank=2, ctx=64, batch=128, epochs=2,
                     lr=5e-3, val_split=0.25, metrics=str(metrics), plot=str(png))
    curves = observe.Curves.of(map(json.loads, metrics.read_text().splitlines()))
    assert curves.preference and len(curves.margin) == len(curves.steps) and len(curves.val_margin) == 2
    assert all(math.isfinite(v) for v in curves.margin + curves.reward_accuracy + curves.val_reward_accuracy)
    pixels = _pixels(png)
    assert pixels.shape[:2] == (750, 800)  # PREFERENCE_PLOT_SIZE
    assert _share_of_colour(pixels, BROWN) > 0.0005 and _share_of_colour(pixels, PINK) > 0.0005
    assert _share_of_colour(pixels, "#1f77b4") > 0.001  # the loss panel is still there
