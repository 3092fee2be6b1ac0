"""Preference tuning (train/preference.py): TRL's DPO / ORPO / SimPO losses and gradients against a
plain float64 reference, the one-pass pair layout against separate passes, records, resume."""

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import lora_fixture
from cli_helpers import run_cli
from crash_hook import Crash, crash_hooks
from llmtune.arch.packing import pair_inputs
from llmtune.backends.cpu import CPUBackend
from llmtune.errors import LlmtuneError
from llmtune.graph import ops
from llmtune.graph.autodiff import grad
from llmtune.graph.planner import Program
from llmtune.model.adapter import load_adapter
from llmtune.model.loaded import load_model
from llmtune.train import checkpoint as ckpts, guard
from llmtune.train.finetune import finetune
from llmtune.train.preference import CHOSEN, PAD, REJECTED, TRUNK, Objective, Pair, PairDataset, SeqLogps
from llmtune.train.records import read_records

rng = np.random.default_rng(3)


# ------------------------------------------------------------------------------------ losses
def _logsigmoid(x):
    return -np.log1p(np.exp(-x))


def reference_loss(method: str, logits: np.ndarray, targets: np.ndarray, parts: np.ndarray, ref, beta, ls, gamma):
    """TRL's losses written out plainly from the logits (float64), for windows [n, T, V]."""
    lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tok = np.where(targets >= 0, np.take_along_axis(lsm, np.maximum(targets, 0)[..., None], -1)[..., 0], 0.0)
    pc, pr = (tok * (parts == CHOSEN)).sum(1), (tok * (parts == REJECTED)).sum(1)
    nc, nr = (parts == CHOSEN).sum(1), (parts == REJECTED).sum(1)
    if method == "dpo":
        z = beta * ((pc - ref[:, 0]) - (pr - ref[:, 1]))
        return float(np.mean(-(1 - ls) * _logsigmoid(z) - ls * _logsigmoid(-z)))
    if method == "simpo":
        z = beta * (pc / nc - pr / nr - gamma / beta)
        return float(np.mean(-(1 - ls) * _logsigmoid(z) - ls * _logsigmoid(-z)))
    ac, ar = pc / nc, pr / nr
    log_odds = (ac - ar) - (np.log(1 - np.exp(ac)) - np.log(1 - np.exp(ar)))
    nll_tokens = (targets >= 0) & ((parts == TRUNK) | (parts == CHOSEN))
    nll = -(tok * nll_tokens).sum() / nll_tokens.sum()
    return float(nll - beta * np.mean(_logsigmoid(log_odds)))


def toy_windows(n=3, T=9, V=7):
    parts = np.full((n, T), PAD, np.int32)
    targets = np.full((n, T), -1, np.int32)
    for r, (p, c, j) in enumerate([(2, 3, 2), (3, 2, 4), (1, 4, 3)][:n]):
        parts[r, :p], parts[r, p : p + c], parts[r, p + c : p + c + j] = TRUNK, CHOSEN, REJECTED
        targets[r, : p + c + j] = rng.integers(0, V, p + c + j)
    return 2 * rng.standard_normal((n, T, V)), targets, parts


@pytest.mark.parametrize("method,ls", [("dpo", 0.0), ("dpo", 0.2), ("orpo", 0.0), ("simpo", 0.0), ("simpo", 0.1)])
def test_losses_and_logit_gradients_match_a_float64_reference(method, ls):
    """Objective.loss on ops.token_nll's NLL, and the gradient its token weights give through
    token_nll's backward, against TRL's formulas written out (loss to 1e-12, gradient against
    central differences of the written-out loss)."""
    logits, targets, parts = toy_windows()
    n, T, V = logits.shape
    ref = rng.standard_normal((n, 2)) - 8.0
    beta, gamma = (0.1 if method != "simpo" else 2.0), 0.5
    obj = Objective(method, beta, ls, gamma)
    x = ops.param((n * T, V), name="logits")
    t = ops.input((n * T,), "i32", name="t")
    w = ops.input((n * T,), name="w")
    nll = ops.token_nll(x, t)
    g = grad(nll, [x], seed=w)[x]
    be = CPUBackend(np.float64)
    leaves = {x: be.asarray(logits.reshape(n * T, V).copy())}
    nll_v = Program([nll], be, params=leaves).run(t=targets.reshape(-1))[0].reshape(n, T)
    lp = SeqLogps.of(nll_v, targets, parts)
    loss, d_c, d_r, nll_w, metrics = obj.loss(lp, ref)
    weights = obj.token_weights(lp, d_c, d_r, nll_w, targets, parts)
    leaves = {x: be.asarray(logits.reshape(n * T, V).copy())}
    ours = Program([g], be, params=leaves).run(t=targets.reshape(-1), w=weights.reshape(-1))[0].reshape(n, T, V)

    want = reference_loss(method, logits, targets, parts, ref, beta, ls, gamma)
    assert abs(loss - want) < 1e-12 * max(1.0, abs(want))
    num, eps = np.zeros_like(logits), 1e-6
    for idx in np.ndindex(logits.shape):
        hi, lo = logits.copy(), logits.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (reference_loss(method, hi, targets, parts, ref, beta, ls, gamma)
                    - reference_loss(method, lo, targets, parts, ref, beta, ls, gamma)) / (2 * eps)
    assert np.abs(ours - num).max() < 1e-7 * max(np.abs(num).max(), 1e-3)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(metrics)
    if method == "orpo":
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(metrics)


def test_dpo_metrics_are_trls():
    """rewards = beta * (policy - reference) per completion; accuracy counts chosen > rejected."""
    lp = SeqLogps(np.array([-10.0, -20.0]), np.array([-30.0, -5.0]), np.array([3, 4]), np.array([2, 2]), 0.0, 0)
    ref = np.array([[-12.0, -29.0], [-20.0, -6.0]])
    _, _, _, _, m = Objective("dpo", 0.5).loss(lp, ref)
    assert m["rewards/chosen"] == pytest.approx(np.mean([1.0, 0.0]))
    assert m["rewards/rejected"] == pytest.approx(np.mean([-0.5, 0.5]))
    assert m["rewards/accuracies"] == 0.5 and m["rewards/margins"] == pytest.approx(np.mean([1.5, -0.5]))
    assert m["logps/chosen"] == -15.0 and m["logps/rejected"] == -17.5


@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo"])
def test_pair_shares_average_to_the_loss(method):
    """Objective.terms: each pair's share of the loss, whose mean is the loss (the units of the
    validation loss's standard error; ORPO's token-weighted NLL included)."""
    logits, targets, parts = toy_windows()
    lsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(lsm, np.maximum(targets, 0)[..., None], -1)[..., 0]
    lp = SeqLogps.of(nll, targets, parts)
    obj, ref = Objective(method, 0.3, 0.0, 0.5), rng.standard_normal((3, 2)) - 8.0
    shares = obj.terms(lp, ref)[0]
    assert shares.shape == (3,) and len(set(np.round(shares, 9))) == 3
    assert shares.mean() == pytest.approx(reference_loss(method, logits, targets, parts, ref, 0.3, 0.0, 0.5), abs=1e-12)


# ------------------------------------------------------------------------------------ the divergence guard
class _GuardedTrainer:
    """What train/guard.py reads of a trainer: its limits, step count and trained buffer."""

    def __init__(self, weights, n_vocab=512):
        self.backend, self.steps_done, self.trainable = CPUBackend(), 0, ["w"]
        self.flat_w = np.asarray(weights, np.float32)
        self.n_trainable, self.tensors = self.flat_w.size, {"w": self.flat_w}
        self.model = SimpleNamespace(hp=SimpleNamespace(n_vocab=n_vocab))
        self.limits = guard.Limits.of(self)

    def _flat_views(self, flat):
        return {"w": flat}


def test_guard_stops_non_finite_or_collapsed_log_probabilities_and_exploding_weights():
    tr = _GuardedTrainer(np.full(100, 0.05))
    assert tr.limits.max_preferred_nll == pytest.approx(2 * np.log(512))  # 2 x uniform guessing
    assert tr.limits.max_loss == pytest.approx(10 * np.log(512)) and tr.limits.max_weight_rms == pytest.approx(5.0)
    counts = np.array([10, 10])
    ok = {"chosen": (np.array([-30.0, -40.0]), counts), "rejected": (np.array([-600.0, -900.0]), counts)}
    guard.check_logps(tr, ok, "chosen")  # the rejected completions may go as low as the loss pushes them
    guard.check_weights(tr)
    with pytest.raises(guard.Diverged, match=r"^step 1: the log-probabilities of 1 of the batch's 2 rejected "):
        guard.check_logps(tr, {**ok, "rejected": (np.array([-5.0, -np.inf]), counts)}, "chosen")
    collapsed = {**ok, "chosen": (np.array([-100.0, -200.0]), counts)}  # 15 nats per token > 2 ln 512 = 12.5
    with pytest.raises(guard.Diverged, match=r"the chosen completions collapsed: their mean NLL is 15 per token, "
                                             r"above 2 x uniform guessing's 6.238"):
        guard.check_logps(tr, collapsed, "chosen")
    tr.steps_done, tr.flat_w[:] = 1, 6.0
    with pytest.raises(guard.Diverged, match=r"^step 1: its update made the trained weights explode: their RMS is 6, "
                                             r"above the limit 5 \(it was 0.05 at the start\)"):
        guard.check_weights(tr)
    tr.flat_w[3] = np.nan
    with pytest.raises(guard.Diverged, match="the weights of w are no longer finite"):
        guard.check_weights(tr)
    assert guard.Limits().max_weight_rms == np.inf  # a trainer outside a finetune run: non-finite values only


@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo"])
def test_lr_1e3_stops_a_preference_run_with_exit_3_and_no_model(tmp_path, stories_path, monkeypatch, capsys, method):
    """As a supervised run does: a preference loss falls while the model explodes (DPO's to 0), so
    the guard reads the weights and log-probabilities too."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "o.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", out, "--method", method,
                           "--lora-rank", 2, "--ctx", 64, "--batch", 128, "--epochs", 2, "--val-split", 0.25,
                           "--lr", "1e3")
    line = err.strip().splitlines()[-1]
    assert code == 3 and line.startswith("error: training diverged at step 1: its update made the trained weights "
                                         "explode: their RMS is "), err
    assert "no model written (lower --lr?)" in line and not out.exists()


# ------------------------------------------------------------------------------------ one pass per pair
def _nll_program(model, n_seq, n_tok, packed):
    _, nodes, logits = model.build(n_seq, n_tok, packed=packed)
    out = ops.token_nll(logits, ops.input((n_seq * n_tok,), "i32", name="targets"))
    be = CPUBackend(np.float64)
    return Program([out], be, params={nodes[n]: np.asarray(w, np.float64) for n, w in model.weights.items()})


def test_one_pass_pair_scoring_equals_two_separate_passes(stories_path):
    """Prompt + chosen + rejected in one window (the prompt computed once, each completion seeing
    it) gives each completion's and the prompt's log-probabilities of a pass of its own."""

    model = load_model(stories_path)
    ids = lambda k: rng.integers(3, model.hp.n_vocab, k).astype(np.int32)  # noqa: E731
    pairs = [Pair(np.r_[1, ids(6)].astype(np.int32), ids(5), ids(8)),
             Pair(np.r_[1, ids(2)].astype(np.int32), ids(7), ids(3))]
    ds = PairDataset.build(pairs, 24, 0.0, 0)
    x, y, layout = ds.gather([0, 1])
    nll = _nll_program(model, 2, 24, True).run(tokens=x, targets=y.reshape(-1),
                                               **pair_inputs(model.hp, layout.parts))[0]
    lp = SeqLogps.of(nll.reshape(2, -1), y, layout.parts)
    for r, p in enumerate(pairs):
        for completion, got in ((p.chosen, lp.chosen[r]), (p.rejected, lp.rejected[r])):
            alone = _alone(model, np.r_[p.prompt, completion].astype(np.int32))
            assert abs(got + alone[len(p.prompt) - 1 :].sum()) < 1e-10
    # the trunks' NLL (ORPO's prompt tokens) is the prompts' own
    assert abs(lp.trunk_nll - sum(_alone(model, p.prompt).sum() for p in pairs)) < 1e-10


def _alone(model, seq):
    """Per-token NLL of a sequence in a plain pass of its own."""
    T = len(seq) - 1
    return _nll_program(model, 1, T, False).run(tokens=seq[None, :-1], pos=np.arange(T, dtype=np.int32),
                                                targets=seq[1:])[0]


# ------------------------------------------------------------------------------------ records
def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_preference_records_in_both_trl_forms(tmp_path):
    plain = read_records(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    assert plain.format == "preference" and plain.items == [("a", "b", "c")]
    conv = read_records(write_jsonl(tmp_path / "c.jsonl", [{
        "prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "assistant", "content": "go away"}]}]))
    prompt, chosen, rejected = conv.items[0]
    assert conv.format == "preference" and prompt[0]["role"] == "user" and rejected[0]["content"] == "go away"


@pytest.mark.parametrize("record,message", [
    ({"prompt": "a", "chosen": "b"}, 'preference record has no "rejected" field'),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, 'preference "chosen" must be a string'),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": []},
     '"chosen" must be a list of assistant messages when the prompt is one'),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, '"chosen" must hold assistant messages only'),
    ({"prompt": 5, "chosen": "b", "rejected": "c"}, '"prompt" must be a string or a list of messages'),
])
def test_bad_preference_records_are_one_line_naming_file_and_record(tmp_path, record, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "chosen": "y", "rejected": "z"}, record])
    with pytest.raises(LlmtuneError) as exc:
        read_records(data)
    assert str(exc.value).startswith(f"{data}:2: {message}"), str(exc.value)


@pytest.mark.parametrize("args,message", [
    (["--method", "dpo"], "holds completion data; preference tuning reads"),
    (["--method", "dpo", "--gamma", "1"], "--gamma: only --method simpo uses it"),
    (["--method", "orpo", "--label-smoothing", "0.1"], "--label-smoothing: only --method dpo or simpo uses it"),
    (["--method", "ipo"], "--method: unknown method 'ipo' (choose sft, dpo, orpo, simpo, kto, grpo)"),
    (["--method", "simpo", "--pack"], "--pack: not with --method simpo (one pair per window)"),
    (["--method", "dpo", "--train-on-prompt"], "--train-on-prompt: not with --method dpo (DPO compares the chosen and "
     "rejected answers given the prompt, which both share)"),
    (["--method", "orpo", "--train-on-prompt"], "--train-on-prompt: not with --method orpo (ORPO's NLL term counts "
     "the prompt's tokens already"),
])
def test_bad_method_settings_are_one_line_exit_2(tmp_path, stories_path, monkeypatch, capsys, args, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}] * 4)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_bad_pair_stops_finetune_with_one_line(tmp_path, stories_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a"}])
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, data, "-o", tmp_path / "o.gguf",
                           "--method", "dpo")
    assert code == 2 and err.strip() == f'error: {data}:2: preference record has no "chosen" field (TRL\'s implicit ' \
                                         f'prompt is not read: give the prompt apart)', err
    good = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 3)
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, good, "-o", tmp_path / "o.gguf")
    assert code == 2 and "train them with --method dpo, orpo or simpo" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ runs
PAIRS = [{"prompt": f"Once upon a time, {n} had a {t}.", "chosen": f" {n} was happy and played with the {t}.",
          "rejected": f" The {t} {t} was sad sad."}
         for n, t in zip(["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Mia"],
                         ["ball", "cat", "dog", "tree", "cake", "boat", "kite", "toy"])]
RUN = dict(ctx=64, batch=128, epochs=2, lr=5e-3, val_split=0.25, checkpoint_every=2)


def _run(stories_path, data, out, crash_at=None, **kw):
    return finetune(stories_path, data, out, hooks=crash_hooks(crash_at), **RUN, **kw)


@pytest.mark.determinism
@pytest.mark.parametrize("method,kind", [("dpo", "lora"), ("dpo", "full")])
def test_resume_is_byte_identical(stories_path, tmp_path, method, kind):
    """A run stopped after its step-2 checkpoint and resumed from it writes the uninterrupted
    run's bytes (a full DPO finetune: the reference log-probabilities come from the checkpoint,
    since the weights they were computed from are gone)."""

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    extra = {"lora_rank": 2} if kind == "lora" else {"params": "attn_q"}
    ref = _run(stories_path, data, tmp_path / "ref.gguf", method=method, metrics=str(tmp_path / "ref.jsonl"), **extra)
    assert ref.first_loss == pytest.approx(np.log(2), abs=1e-6)  # policy == reference at the first step
    assert ref.epochs[-1].val_metrics["rewards/margins"] > 0  # the held-out pairs separate
    out = tmp_path / "out.gguf"
    with pytest.raises(Crash):
        _run(stories_path, data, out, crash_at=3, method=method, metrics=str(tmp_path / "out.jsonl"), **extra)
    found = ckpts.checkpoints_of(out)
    assert [s for s, _ in found] == [2]
    if method == "dpo":
        assert "ref_logps" in ckpts.read_checkpoint(found[0][1]).arrays
    finetune(stories_path, data, out, resume=found[0][1])
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(out) == digest(tmp_path / "ref.gguf")
    timing = ("elapsed_s", "tokens_per_s", "seconds", "mfu")
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if k not in timing}  # noqa: E731
                       for line in p.read_text().splitlines()]
    assert strip(tmp_path / "out.jsonl") == strip(tmp_path / "ref.jsonl")
    records = strip(tmp_path / "ref.jsonl")
    step = next(r for r in records if r["type"] == "train_step")
    val = next(r for r in records if r["type"] == "validation")
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected") + (("nll_loss", "log_odds_ratio") if method == "orpo" else ()):
        assert key in step and key in val


def test_preference_validation_has_a_standard_error(stories_path, tmp_path):
    """The held-out pairs' loss has a ± as every validation loss: the standard error of the mean
    over the pairs' shares of the loss (Objective.terms)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    for method in ("dpo", "orpo"):
        res = _run(stories_path, data, tmp_path / f"{method}.gguf", method=method, lora_rank=2)
        epoch = res.epochs[-1]
        assert np.isfinite(epoch.val_loss_err) and epoch.val_loss_err > 0, (method, epoch)


def test_dpo_continues_an_sft_adapter_whose_model_is_the_reference(stories_path, tmp_path):
    """--lora-init: DPO trains the given adapter on, and its reference is the model with that
    adapter (the SFT policy), so the first step's loss is ln 2 although B != 0."""

    init = lora_fixture.write_fixture_adapter(stories_path, tmp_path / "sft.gguf")
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    res = _run(stories_path, data, tmp_path / "dpo.gguf", method="dpo", lora_init=str(init))
    assert res.first_loss == pytest.approx(np.log(2), abs=1e-6)
    model = load_model(stories_path)
    before, after = load_adapter(init, model), load_adapter(tmp_path / "dpo.gguf", model)
    assert before.pairs.keys() == after.pairs.keys()
    assert any(not np.array_equal(before.pairs[n].b, after.pairs[n].b) for n in before.pairs)
