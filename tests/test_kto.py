"""KTO (train/kto.py): TRL's KTOTrainer loss and gradients (tests/data/kto_trl.json, recorded from
TRL by bench/check_trl.py --kto-fixture), the full path's gradient against finite differences, the
KL pairs (TRL's rotation within each step's batch), unpaired records, runs, resume and the guard."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run_cli
from crash_hook import Crash, crash_hooks
from llmtune.backends.cpu import CPUBackend
from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import Program
from llmtune.train import checkpoint as ckpts
from llmtune.train.finetune import finetune
from llmtune.train.kto import KTODataset, KTOObjective
from llmtune.train.preference import CHOSEN, PAD, REJECTED, TRUNK, SeqLogps
from llmtune.train.records import read_records

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).parent.parent
rng = np.random.default_rng(5)


# ------------------------------------------------------------------------------------ the loss
def _case_logps(case) -> tuple[SeqLogps, np.ndarray]:
    n = len(case["labels"])
    lp = SeqLogps(np.array(case["logps"]), np.array(case["kl_logps"]), np.ones(n, int), np.ones(n, int), 0.0, 0,
                  labels=np.array(case["labels"]))
    return lp, np.stack([case["ref_logps"], case["ref_kl_logps"]], axis=1)


@pytest.mark.parametrize("i", range(5))
def test_loss_gradients_and_metrics_are_trls(i):
    """Per-sequence log-probabilities in, TRL's loss, d loss / d each completion's sum and metrics
    out, to 1e-9 (both float64): beta, both weights, a clamped KL, one label only, apo_zero_unpaired."""
    case = json.loads((DATA / "kto_trl.json").read_text())["cases"][i]
    lp, ref = _case_logps(case)
    obj = KTOObjective(beta=case["beta"], desirable_weight=case["desirable_weight"],
                       undesirable_weight=case["undesirable_weight"], loss_type=case["loss_type"])
    loss, d_c, d_r, nll_w, metrics = obj.loss(lp, ref)
    assert loss == pytest.approx(case["loss"], rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(d_c, case["grad"], rtol=1e-9, atol=1e-14)
    assert not d_r.any() and nll_w == 0.0  # the KL completions are detached
    for key, want in case["metrics"].items():
        assert metrics[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key
    # what TRL leaves out with one label only is left out too
    assert {k for k in metrics if k != "rewards/accuracies"} == set(case["metrics"])


def _windows(n=4, T=10, V=6):
    """Toy KTO windows: trunk, completion (CHOSEN), KL completion (REJECTED)."""
    parts = np.full((n, T), PAD, np.int32)
    targets = np.full((n, T), -1, np.int32)
    for r, (p, c, k) in enumerate([(2, 3, 2), (3, 2, 4), (1, 4, 3), (2, 2, 2)][:n]):
        parts[r, :p], parts[r, p : p + c], parts[r, p + c : p + c + k] = TRUNK, CHOSEN, REJECTED
        targets[r, : p + c + k] = rng.integers(0, V, p + c + k)
    return 2 * rng.standard_normal((n, T, V)), targets, parts


def _kto_reference(logits, targets, parts, ref, labels, beta, dw, uw, kl_logits):
    """TRL's KTO loss written out from the logits (float64); the KL estimate from kl_logits (it is
    detached: a finite difference must not move it)."""
    def sums(lg, part):
        lsm = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        tok = np.where(targets >= 0, np.take_along_axis(lsm, np.maximum(targets, 0)[..., None], -1)[..., 0], 0.0)
        return (tok * (parts == part)).sum(1)

    kl = max(np.mean(sums(kl_logits, REJECTED) - ref[:, 1]), 0.0)
    lr = sums(logits, CHOSEN) - ref[:, 0]
    losses = np.where(labels, dw * (1 - 1 / (1 + np.exp(-beta * (lr - kl)))),
                      uw * (1 - 1 / (1 + np.exp(-beta * (kl - lr)))))
    return float(losses.mean())


def test_token_weights_give_the_loss_gradient():
    """Objective.token_weights on KTO's gradients, through ops.token_nll's backward (the path a
    training step takes), against central differences of the written-out loss."""
    logits, targets, parts = _windows()
    n, T, V = logits.shape
    labels = np.array([True, False, False, True])
    lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tok = np.take_along_axis(lsm, np.maximum(targets, 0)[..., None], -1)[..., 0]
    # references near the policy, the KL ones below it: a positive KL estimate, not clamped
    ref = np.stack([(tok * (parts == CHOSEN)).sum(1) + rng.normal(0, 1, n),
                    (tok * (parts == REJECTED)).sum(1) - 1.0], axis=1)
    beta, dw, uw = 0.7, 1.2, 0.8
    obj = KTOObjective(beta=beta, desirable_weight=dw, undesirable_weight=uw)
    x = ops.param((n * T, V), name="logits")
    t = ops.input((n * T,), "i32", name="t")
    w = ops.input((n * T,), name="w")
    nll = ops.token_nll(x, t)
    g = grad(nll, [x], seed=w)[x]
    be = CPUBackend(np.float64)
    nll_v = Program([nll], be, params={x: be.asarray(logits.reshape(n * T, V).copy())}).run(
        t=targets.reshape(-1))[0].reshape(n, T)
    lp = SeqLogps.of(nll_v, targets, parts, labels)
    loss, d_c, d_r, nll_w, metrics = obj.loss(lp, ref)
    assert metrics["kl"] > 0
    weights = obj.token_weights(lp, d_c, d_r, nll_w, targets, parts)
    ours = Program([g], be, params={x: be.asarray(logits.reshape(n * T, V).copy())}).run(
        t=targets.reshape(-1), w=weights.reshape(-1))[0].reshape(n, T, V)
    want = _kto_reference(logits, targets, parts, ref, labels, beta, dw, uw, logits)
    assert abs(loss - want) < 1e-12
    num, eps = np.zeros_like(logits), 1e-6
    for idx in np.ndindex(logits.shape):
        hi, lo = logits.copy(), logits.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (_kto_reference(hi, targets, parts, ref, labels, beta, dw, uw, logits)
                    - _kto_reference(lo, targets, parts, ref, labels, beta, dw, uw, logits)) / (2 * eps)
    assert np.abs(ours - num).max() < 1e-7 * max(np.abs(num).max(), 1e-3)
    assert not ours[parts == REJECTED].any()  # no gradient through the KL completions


# ------------------------------------------------------------------------------------ data
def test_kl_completions_rotate_within_each_steps_batch_as_trls():
    """TRL's _prepare_dataset: (x_1, y_n), (x_2, y_1), ..., per run of the batch size, training
    examples and validation ones apart; a KL completion longer than its window's room is cut."""
    ids = lambda *v: np.array(v, dtype=np.int32)  # noqa: E731
    examples = [(ids(1, 10 + i), ids(100 + i, 200 + i), i % 2 == 0) for i in range(7)]
    examples[2] = (ids(1, 12), ids(*range(300, 309)), True)
    ds = KTODataset.of_examples(examples, 11, 2 / 7, 0, per_step=3)
    assert (ds.n_train, ds.n_val) == (5, 2)
    first = lambda a: int(a[0])  # noqa: E731
    assert [first(p.chosen) for p in ds.pairs] == [100, 101, 300, 103, 104, 105, 106]
    assert [first(p.rejected) for p in ds.pairs] == [300, 100, 101, 104, 103, 106, 105]
    assert ds.labels.tolist() == [True, False, True, False, True, False, True]
    # example 2's 9 completion tokens fill its window but 1 slot: its KL completion (example 1's) is cut to 1
    # token, and as example 0's KL completion they are cut to the 8 slots left there
    assert [len(ds.pairs[i].rejected) for i in (0, 1, 2)] == [8, 2, 1] and ds.n_truncated == 2
    x, y, layout = ds.gather([1, 0])
    assert layout.labels.tolist() == [False, True] and (layout.parts[1] == REJECTED).sum() == 8


# ------------------------------------------------------------------------------------ records
def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_unpaired_records_in_both_trl_forms(tmp_path):
    plain = read_records(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "completion": "b", "label": False}]))
    assert plain.format == "unpaired" and plain.items == [("a", "b", False)]
    conv = read_records(write_jsonl(tmp_path / "c.jsonl", [{
        "prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}],
        "label": True}]))
    prompt, completion, label = conv.items[0]
    assert conv.format == "unpaired" and prompt[0]["role"] == "user" and completion[0]["content"] == "hello" and label
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,completion,label\na,b,true\nc,d,False\n")
    assert read_records(csv).items == [("a", "b", True), ("c", "d", False)]


@pytest.mark.parametrize("record,message", [
    ({"prompt": "a", "label": True}, 'unpaired preference record has no "completion" field'),
    ({"prompt": "a", "completion": "b", "label": "yes"}, '"label" must be true (desirable) or false (undesirable), '
                                                         'got "yes"'),
    ({"prompt": "a", "completion": "b", "label": 1}, '"label" must be true (desirable) or false (undesirable), got 1'),
    ({"prompt": "a", "completion": "b"}, 'unpaired preference record has no "label" field'),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": "b", "label": True},
     '"completion" must be a list of assistant messages when the prompt is one'),
])
def test_bad_unpaired_records_are_one_line_naming_file_and_record(tmp_path, record, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "completion": "y", "label": True}, record])
    with pytest.raises(LlmtuneError) as exc:
        read_records(data)
    assert str(exc.value).startswith(f"{data}:2: {message}"), str(exc.value)


@pytest.mark.parametrize("rows,args,message", [
    ([{"prompt": "a", "completion": "b"}] * 8, [], 'holds completion data (no "label"); KTO reads'),
    ([{"prompt": "a", "completion": "b", "label": "no"}] * 8, [], '"label" must be true (desirable) or false'),
    (None, ["--batch", "64"], "--batch 64: --method kto needs at least 2 examples a step"),
    (None, ["--desirable-weight", "0"], "--desirable-weight: must be > 0, got 0.0"),
    (None, ["--method", "dpo", "--undesirable-weight", "2"], "--undesirable-weight: only --method kto uses it"),
    (None, ["--label-smoothing", "0.1"], "--label-smoothing: only --method dpo or simpo uses it"),
    (None, ["--kto-loss", "ipo"], "--kto-loss: unknown loss 'ipo' (choose kto, apo_zero_unpaired)"),
    (None, ["--method", "simpo", "--kto-loss", "apo_zero_unpaired"], "--kto-loss: only --method kto uses it"),
])
def test_bad_kto_input_is_one_line_exit_2(tmp_path, stories_path, monkeypatch, capsys, rows, args, message):
    data = write_jsonl(tmp_path / "d.jsonl", rows or [{"prompt": "a", "completion": "b", "label": True}] * 8)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                           "--method", "kto", "--ctx", 64, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


# ------------------------------------------------------------------------------------ runs
RUN = dict(ctx=64, batch=256, epochs=3, lr=1e-2, val_split=0.25, checkpoint_every=2, lora_rank=4)


def _run(stories_path, out, crash_at=None, **kw):
    return finetune(stories_path, REPO / "data" / "kto-stories.jsonl", out, method="kto",
                    hooks=crash_hooks(crash_at), **{**RUN, **kw})


@pytest.mark.determinism
def test_kto_learns_and_resumes_byte_identical(stories_path, tmp_path):
    """The bundled records: the loss falls from 0.5 (policy = reference: 1 - sigmoid(0)), the
    held-out examples' rewards separate, the metrics are TRL's names; a run stopped after its step-4
    checkpoint (the reference and KL reference log-probabilities in it) writes the same bytes."""
    ref = _run(stories_path, tmp_path / "ref.gguf", metrics=str(tmp_path / "ref.jsonl"))
    assert ref.first_loss == pytest.approx(0.5, abs=1e-6)
    assert ref.epochs[-1].train_loss < 0.2 and ref.epochs[-1].val_loss < 0.2
    val = ref.epochs[-1].val_metrics
    assert val["rewards/chosen"] > 0 > val["rewards/rejected"] and val["rewards/margins"] > 0
    out = tmp_path / "out.gguf"
    with pytest.raises(Crash):
        _run(stories_path, out, crash_at=5, metrics=str(tmp_path / "out.jsonl"))
    found = ckpts.checkpoints_of(out)
    assert [s for s, _ in found] == [4]
    assert ckpts.read_checkpoint(found[0][1]).arrays["ref_logps"].shape == (16, 2)
    finetune(stories_path, REPO / "data" / "kto-stories.jsonl", out, resume=found[0][1])
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(out) == digest(tmp_path / "ref.gguf")
    timing = ("elapsed_s", "tokens_per_s", "seconds", "mfu")
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if k not in timing}  # noqa: E731
                       for line in p.read_text().splitlines()]
    assert strip(tmp_path / "out.jsonl") == strip(tmp_path / "ref.jsonl")
    step = next(r for r in strip(tmp_path / "ref.jsonl") if r["type"] == "train_step")
    assert {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(step)


def test_kto_progress_line_and_one_label_only(tmp_path, stories_path, monkeypatch, capsys):
    """The progress line words TRL's metrics (kl among them); data of one label trains, as TRL's
    KTOTrainer allows (with its warning that the weights do not balance the classes)."""
    rows = [json.loads(line) for line in (REPO / "data" / "kto-stories.jsonl").read_text().splitlines()]
    data = write_jsonl(tmp_path / "d.jsonl", [r for r in rows if r["label"]])
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                           "--method", "kto", "--lora-rank", 2, "--ctx", 64, "--batch", 128, "--epochs", 1,
                           "--lr", "1e-2", "--val-split", 0)
    assert code == 0, err
    assert "8 desirable, 0 undesirable" in err and "--desirable-weight in [" in err
    line = next(x for x in err.splitlines() if x.startswith("epoch 1 step 1/4"))
    assert "chosen 0.000, kl 0.000" in line and "rejected" not in line and "margin" not in line


def test_apo_zero_unpaired_has_no_kl_completions_and_learns(stories_path, tmp_path):
    """--kto-loss apo_zero_unpaired (TRL's calculate_KL False): no KL branch in the windows, a
    step of one example allowed, kl logged as 0, the loss falls."""
    res = _run(stories_path, tmp_path / "apo.gguf", kto_loss="apo_zero_unpaired", batch=64, epochs=1,
               checkpoint_every=0, metrics=str(tmp_path / "apo.jsonl"))
    assert res.first_loss == pytest.approx(0.5, abs=1e-6) and res.epochs[-1].val_loss < 0.1
    steps = [json.loads(line) for line in (tmp_path / "apo.jsonl").read_text().splitlines()]
    assert all(r["kl"] == 0 for r in steps if r["type"] == "train_step")
    ds = KTODataset.of_examples([(np.array([1, 2], np.int32), np.array([3, 4], np.int32), True)] * 2, 3, 0.0, 0,
                                per_step=2, kl=False)  # prompt + completion fill the window: no slot for KL
    assert [len(p.rejected) for p in ds.pairs] == [0, 0] and ds.n_truncated == 0
    x, y, layout = ds.gather([0, 1])
    assert not (layout.parts == REJECTED).any() and y[0].tolist() == [2, 3, 4]


def test_lr_1e3_stops_a_kto_run_with_exit_3_and_no_model(tmp_path, stories_path, monkeypatch, capsys):
    out = tmp_path / "o.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, REPO / "data" / "kto-stories.jsonl", "-o",
                           out, "--method", "kto", "--lora-rank", 2, "--ctx", 64, "--batch", 256, "--epochs", 2,
                           "--val-split", 0.25, "--lr", "1e3")
    line = err.strip().splitlines()[-1]
    assert code == 3 and line.startswith("error: training diverged at step 1: its update made the trained weights "
                                         "explode: their RMS is "), err
    assert "no model written (lower --lr?)" in line and not out.exists()
