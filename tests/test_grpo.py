"""GRPO (train/grpo.py, train/rewards.py): TRL's loss, gradient and advantages against a fixture
recorded from TRL (bench/check_grpo_trl.py --write-fixture), a finite-difference check of the
whole path on the bundled model, the rewards, and finetune --method grpo end to end."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run_cli
from crash_hook import Crash, crash_hooks
from llmtune.backends import cuda, get_backend
from llmtune.backends.cpu.native import kernels
from llmtune.errors import LlmtuneError
from llmtune.eval.generate import Generator, PolicySampler
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.model.adapter import attach, init_adapter
from llmtune.model.loaded import load_model
from llmtune.train import checkpoint as ckpts, observe
from llmtune.train.config import make_config
from llmtune.train.finetune import finetune as train_finetune
from llmtune.train.grpo import Generation, GRPOSettings, GRPOTrainer, PromptDataset, advantages, grpo_loss
from llmtune.train.preference import LOSS_LABELS
from llmtune.train.records import read_records
from llmtune.train.rewards import RewardError, Rewards, first_number, normalise, parse_reward
from llmtune.workflows import finetune

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).parent.parent
FIXTURE = json.loads((DATA / "grpo_trl.json").read_text())
PROMPTS = REPO / "data" / "grpo-stories.jsonl"


# ------------------------------------------------------------------------------------ TRL's loss
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['loss_type']}-b{c['beta']}-eh{c['epsilon_high']}"
                                                                 f"-{'old' if c['old'] else 'detached'}")
def test_loss_and_gradient_equal_trls(case):
    f = FIXTURE
    logp, mask = np.asarray(f["logp"]), np.asarray(f["mask"])
    old = np.asarray(f["old"]) if case["old"] else logp
    s = GRPOSettings(loss_type=case["loss_type"], beta=case["beta"], epsilon=case["epsilon"],
                     epsilon_high=case["epsilon_high"], max_completion_length=case["max_completion_length"])
    loss, grad, metrics = grpo_loss(logp, old, np.asarray(f["ref"]), mask, np.asarray(f["adv"]), s)
    want = np.asarray(case["grad"])
    assert loss == pytest.approx(case["loss"], rel=1e-6, abs=1e-7)
    scale = np.abs(want).max()
    assert np.abs(grad - want).max() <= 1e-6 * scale
    assert (grad[mask == 0] == 0).all()
    if case["old"]:
        assert metrics["clip_ratio/region_mean"] > 0  # the fixture's ratios leave the clipping range


@pytest.mark.parametrize("case", FIXTURE["advantage_cases"], ids=lambda c: c["scale_rewards"])
def test_advantages_equal_trls(case):
    rewards = np.asarray([[np.nan if v is None else v for v in row] for row in FIXTURE["rewards"]])
    adv, total, metrics = advantages(rewards, np.asarray(FIXTURE["weights"]), case["generations"],
                                     case["scale_rewards"])
    np.testing.assert_allclose(adv, case["advantages"], rtol=1e-6, atol=1e-6)
    assert np.isnan(total[4]) and adv[4] == 0  # every grader said None: no reward, no advantage


# ------------------------------------------------------------------------------------ the whole path
def _trainer(stories_path, settings, seed=5):
    model = load_model(stories_path)
    adapter = init_adapter(model, 2, 4.0, None, seed)
    rng = np.random.default_rng(seed)
    for pair in adapter.pairs.values():  # B != 0: the gradient reaches A too
        pair.b[...] = rng.normal(0.0, 0.05, pair.b.shape).astype(np.float32)
    n_ctx, n = 24, 4
    tr = GRPOTrainer(attach(model, [adapter]), get_backend("cpu"), settings=settings,
                     rewards=Rewards([], np.ones(1)), rollout=None, n_ctx=n_ctx, n_batch=n_ctx * n,
                     n_ubatch=n_ctx * n, trainable=list(adapter.tensors()), seed=seed)
    return tr, rng


def test_gradient_matches_finite_differences(stories_path):
    """d loss / d every trained value, as the seeded training pass computes it, against central
    differences of the loss along random directions (old and reference log-probabilities from
    other weights: ratios off 1, the KL term on)."""
    s = GRPOSettings(num_generations=2, max_completion_length=8, loss_type="grpo", beta=0.1, temperature=0.8,
                     epsilon=0.05)
    tr, rng = _trainer(stories_path, s)
    tok = tr.model.tokenizer
    prompts = [list(tok.encode(text, add_special=True)) for text in ("Once upon a time", "Tom") for _ in range(2)]
    completions = [list(rng.integers(3, 500, k)) for k in (5, 8, 3, 6)]
    x, y, parts = tr._windows(prompts, completions)
    w0 = np.array(tr.backend.to_numpy(tr.flat_w), dtype=np.float64)

    def at(w):
        tr.flat_w[...] = w.astype(np.float32)
        return tr.logps(x, y, parts)

    old = at(w0 + rng.normal(0, 0.02, w0.shape))
    tr.ref_weights = (w0 + rng.normal(0, 0.02, w0.shape)).astype(np.float32)
    logp = at(w0)
    ref = tr.reference_logps(x, y, parts)
    adv, _, _ = advantages(np.asarray([[1.0], [0.0], [0.5], [-1.0]]), np.ones(1), 2)
    gen = Generation(x, y, parts, old, ref, adv, np.zeros((4, 1)), np.asarray([5, 8, 3, 6]), np.zeros(4, bool))
    loss, _ = tr.gradient(gen, logp)
    g = np.array(tr.backend.to_numpy(tr.flat_g), dtype=np.float64)
    assert np.abs(g).max() > 0
    mask = gen.mask

    def loss_at(w):
        return grpo_loss(at(w), old, ref, mask, adv, s)[0]

    assert loss_at(w0) == pytest.approx(loss, rel=1e-12)
    for direction in (g / np.linalg.norm(g), rng.normal(0, 1, g.shape)):
        direction = direction / np.linalg.norm(direction)
        eps = 3e-4  # small: a ratio crossing a clipping bound within it would break the difference
        fd = (loss_at(w0 + eps * direction) - loss_at(w0 - eps * direction)) / (2 * eps)
        # float32 forward passes: within 1e-3 of the gradient's norm (along it: 2e-4 measured)
        assert fd == pytest.approx(float(g @ direction), rel=1e-3, abs=1e-3 * np.linalg.norm(g))


# ------------------------------------------------------------------------------------ rollouts
@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_batched_rollouts_are_each_completion_alone(stories_path, full, native_on, monkeypatch):
    """PolicySampler decodes prompts x G together (BatchGenerator, a prompt's k/v copied into its
    lanes): each completion is the one-sequence Generator's with its seed over the live weights
    (LoRA with B != 0, or every tensor trained), in chunks of whole groups, of split groups, or
    one; and a change of the trained values reaches the next call."""
    monkeypatch.setenv("LLMTUNE_NATIVE", native_on)
    kernels.reset()
    try:
        if full:
            model = load_model(stories_path)
            tr = GRPOTrainer(model, get_backend("cpu"), settings=GRPOSettings(), rewards=Rewards([], np.ones(1)),
                             rollout=None, n_ctx=64, n_batch=64 * 4, n_ubatch=64 * 4, trainable=model.select(None))
        else:
            tr, _ = _trainer(stories_path, GRPOSettings())
        tok = tr.model.tokenizer
        texts = ("Once upon a time", "Tom", "Lily went to the park and saw a big red ball. She was happy")
        prompts = [list(tok.encode(t, add_special=True)) for t in texts]
        assert len(prompts[2]) > PolicySampler.PREFILL_BATCH  # a prompt of several prefill passes
        seeds = [1000 + j for j in range(3 * 3)]
        alone = Generator(tr.model, tr.backend, n_ctx=64, n_batch=PolicySampler.PREFILL_BATCH, values=tr.values)

        def one_by_one(temp):
            alone.tokens = []  # (its cached prompt is of the weights it had)
            return [alone.generate(prompts[j // 3], min(40, 64 - len(prompts[j // 3])),
                                   Sampler(SamplerConfig(temp=temp, top_k=0, top_p=0.95, min_p=0.0, seed=seed))).tokens
                    for j, seed in enumerate(seeds)]

        want = one_by_one(1.0)
        assert len({tuple(c) for c in want}) > 3  # the seeds draw different completions
        for lanes in (16, 4, 2, 1):  # one chunk; whole groups; groups split; one lane
            assert PolicySampler(tr, 64, lanes=lanes)(prompts, 3, 40, 1.0, 0.95, seeds) == want, lanes
        # f32 products of 9 rows and of 1 round differently (logits ~4e-6 apart): a sampled token
        # may flip where two candidates tie that closely; greedy picks compare the weights' effect
        sampler = PolicySampler(tr, 64)
        before = sampler(prompts, 3, 40, 0.0, 0.95, seeds)
        assert before == one_by_one(0.0)
        tr.flat_w[...] += tr.backend.asarray(np.random.default_rng(0).normal(0, 0.05, tr.flat_w.shape)
                                             .astype(np.float32))
        after = sampler(prompts, 3, 40, 0.0, 0.95, seeds)
        assert after != before and after == one_by_one(0.0)
    finally:
        kernels.reset()


def test_memory_estimate_counts_the_rollout_cache(stories_path):
    """The run's estimate holds the batched generator's KV cache as it allocates it: 4 prompts'
    windows a step at G = 2, so 4 sequences of --ctx positions."""
    tr, _ = _trainer(stories_path, GRPOSettings(num_generations=2))
    tr.rollout_factory = PolicySampler
    estimate = tr.memory_bytes()["generation kv cache"]
    tok = tr.model.tokenizer
    tr.rollout()([list(tok.encode("Tom", add_special=True))] * 2, 2, 4, 1.0, 1.0, [1, 2, 3, 4])
    gen = tr.sampler.gen
    assert gen.n_seq == 4 and estimate == sum(buf.nbytes for buf in gen.cache.values()) > 0


# ------------------------------------------------------------------------------------ rewards
def test_builtin_rewards():
    assert normalise("  The   Cat\n") == "the cat" and normalise(42) == "42"
    assert normalise("Positive.") == normalise("**positive**") == normalise(" \u201cPositive!\u201d\n") == "positive"
    assert normalise("3.5.") == "3.5" and normalise("-1") == "-1" and normalise(".5") == ".5"  # signs stay
    assert first_number("it is 1,234.5 apples") == 1234.5 and first_number("none") is None
    cols = {"answer": [" the  CAT ", "dog", 7, "7"]}
    comps = ["The cat", "a dog", "I think 7.0", "no"]
    ids = [[1] * 4, [1] * 8, [1] * 2, [1] * 12]
    score = lambda spec: parse_reward(spec).score(["p"] * 4, comps, ids, cols, ["f:1"] * 4).tolist()  # noqa: E731
    assert score("exact:answer") == [1.0, 0.0, 0.0, 0.0]
    assert score("number:answer") == [0.0, 0.0, 1.0, 0.0]
    assert score(r"regex:\bdog\b") == [0.0, 1.0, 0.0, 0.0]
    assert score("length:8") == [-0.5, 0.0, -0.75, -0.5]
    conversational = [[{"role": "assistant", "content": c}] for c in comps]
    assert parse_reward("exact:answer").score(["p"] * 4, conversational, ids, cols, ["f:1"] * 4)[0] == 1.0


def test_user_reward_function(tmp_path):
    f = tmp_path / "graders.py"
    f.write_text("def has_cat(prompts, completions, thing, **kw):\n"
                 "    return [None if t is None else float(t in c) for c, t in zip(completions, thing)]\n"
                 "def short(prompts, completions, **kw):\n    return [1.0]\n"
                 "def words(prompts, completions, **kw):\n    return ['yes' for c in completions]\n"
                 "def crash(prompts, completions, **kw):\n    raise ValueError('bad grader')\n")
    rewards = Rewards.of([f"{f}:has_cat", "regex:a"], [1.0, 0.5])
    r = rewards.score(["p", "p"], ["a cat", "a dog"], [[1], [1]], {"thing": ["cat", None]}, ["x:1", "x:2"])
    assert r[0].tolist() == [1.0, 1.0] and np.isnan(r[1, 0]) and rewards.names == ["has_cat", "regex:a"]
    for name, message in (("short", "returned 1 rewards for 2 completions"), ("words", "reward 1 is str 'yes'"),
                          ("crash", "ValueError: bad grader in")):
        with pytest.raises(RewardError, match=message) as exc:
            parse_reward(f"{f}:{name}").score(["p", "p"], ["a", "b"], [[1], [1]], {}, ["x:1", "x:2"])
        assert str(f) in str(exc.value) and "x:1" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(LlmtuneError, match="defines no 'nothing'"):
        parse_reward(f"{f}:nothing")
    with pytest.raises(LlmtuneError, match="no such file"):
        parse_reward(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(LlmtuneError, match="unknown reward kind 'bleu'"):
        parse_reward("bleu:answer")


# ------------------------------------------------------------------------------------ end to end
RUN = dict(method="grpo", reward=[r"regex:\b(happy|played)\b", "length:10"], num_generations=4,
           max_completion_length=12, ctx=32, lora_rank=2, lr=2e-3, val_split=0.0, seed=3)


def _run(stories_path, out, crash_at=None, **kw):
    # the workflow's sampler, with a test hook
    return train_finetune(stories_path, PROMPTS, out, hooks=crash_hooks(crash_at), rollout=PolicySampler,
                          **{**RUN, **kw})


def test_two_steps_write_adapter_metrics_and_completions(stories_path, tmp_path):
    out, metrics = tmp_path / "a.gguf", tmp_path / "m.jsonl"
    res = finetune(stories_path, PROMPTS, out, epochs=1, checkpoint_every=1, metrics=str(metrics),
                   **{**RUN, "batch": 32 * 16})  # 4 prompts a step: 8 prompts, 2 steps
    assert out.exists() and res.epochs[0].train_loss == res.epochs[0].train_loss  # finite
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"train_step"' in line]
    assert len(steps) == 2
    for key in ("reward", "reward_std", r"rewards/regex:\b(happy|played)\b/mean", "rewards/length:10/mean",
                "completions/mean_length", "clip_ratio/region_mean", "frac_reward_zero_std"):
        assert key in steps[0], key
    log = tmp_path / "m.completions.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2 * 16 and {r["step"] for r in lines} == {1, 2}
    assert set(lines[0]) >= {"prompt", "completion", "rewards", "reward", "advantage"}
    assert all(r["tokens"] <= 12 for r in lines)


@pytest.mark.cuda
def test_two_steps_on_a_real_gpu_equal_the_cpus(stories_path, tmp_path):
    """bench/gpu_check.sh's GRPO step: two steps with --backend cuda sample the CPU run's
    completions (same seed: f32 logits a few ulps apart do not move a draw) and reach its losses."""
    if not cuda.available():
        pytest.skip(f"no CUDA device: {cuda.unavailable_reason()}")
    runs = {}
    for backend in ("cpu", "cuda"):
        metrics = tmp_path / f"{backend}.jsonl"
        finetune(stories_path, PROMPTS, tmp_path / f"{backend}.gguf", epochs=1, metrics=str(metrics), backend=backend,
                 **{**RUN, "batch": 32 * 16})  # 4 prompts a step: 8 prompts, 2 steps
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"train_step"' in line]
        completions = [json.loads(line)["completion"]
                       for line in (tmp_path / f"{backend}.completions.jsonl").read_text().splitlines()]
        runs[backend] = ([s["loss"] for s in steps], completions)
    (cpu_loss, cpu_text), (gpu_loss, gpu_text) = runs["cpu"], runs["cuda"]
    assert len(cpu_loss) == 2 and gpu_text == cpu_text
    np.testing.assert_allclose(gpu_loss, cpu_loss, rtol=1e-4, atol=1e-6)


@pytest.mark.determinism
def test_resume_is_byte_identical(stories_path, tmp_path):
    """Stopped after its step-2 checkpoint mid-way through a generation batch's iterations
    (num_iterations 2, beta > 0: the batch in flight and the reference weights come from the
    checkpoint), resumed: the uninterrupted run's adapter and completions."""
    kw = dict(epochs=1, checkpoint_every=1, num_iterations=2, beta=0.05, batch=32 * 8, keep_checkpoints=3)
    ref = tmp_path / "ref.gguf"
    _run(stories_path, ref, completions_log=str(tmp_path / "ref.log"), **kw)
    out = tmp_path / "out.gguf"
    with pytest.raises(Crash):
        _run(stories_path, out, crash_at=4, completions_log=str(tmp_path / "out.log"), **kw)
    found = dict(ckpts.checkpoints_of(out))
    assert "grpo_inputs" in ckpts.read_checkpoint(found[3]).arrays  # step 3: the first of a batch's 2 steps
    finetune(stories_path, PROMPTS, out, resume=found[3])
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(out) == digest(ref)
    assert (tmp_path / "out.log").read_text() == (tmp_path / "ref.log").read_text()


def test_runaway_lr_exits_3_without_model(stories_path, tmp_path, monkeypatch, capsys):
    out = tmp_path / "a.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "finetune", stories_path, PROMPTS, "-o", out, "--method", "grpo",
                           "--reward", r"regex:\bthe\b", "--reward", r"regex:\.", "--num-generations", "4",
                           "--max-completion-length", "12",
                           "--ctx", "32", "--lora-rank", "2", "--lr", "1e3", "--val-split", "0", "--epochs", "1")
    assert code == 3, err
    assert "diverged" in err and not out.exists()


def _cli(monkeypatch, capsys, tmp_path, *extra, data=PROMPTS):
    return run_cli(monkeypatch, capsys, "finetune", "tests/data/stories260K.gguf", data, "-o", tmp_path / "a.gguf",
                   "--method", "grpo", "--num-generations", "2", "--max-completion-length", "4", "--ctx", "32",
                   "--lora-rank", "2", "--val-split", "0", "--epochs", "1", *extra)


@pytest.mark.parametrize("extra,message", [
    (("--reward", "exact:answer"), r'grpo-stories.jsonl:1: prompt record has no "answer" column '
                                   r"\(--reward exact:answer reads it\)"),
    (("--reward", "bleu:x"), "--reward bleu:x: unknown reward kind 'bleu'"),
    (("--reward", "nothere.py:f"), "--reward nothere.py:f: nothere.py: no such file"),
    (("--reward", "regex:a", "--num-generations", "1"), "--num-generations: must be at least 2"),
    ((), "--method grpo: needs --reward"),
    (("--reward", "regex:a", "--reward-weights", "1,2"), "--reward-weights: 2 weight"),
])
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, tmp_path, extra, message):
    code, _, err = _cli(monkeypatch, capsys, tmp_path, *extra)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and __import__("re").search(message, lines[0]), err


def test_reward_file_problems_exit_2(monkeypatch, capsys, tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def ok(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
                 "def few(prompts, completions, **kw):\n    return [1.0]\n"
                 "calls = []\n"
                 "def boom(prompts, completions, **kw):\n    calls.append(1)\n"
                 "    if len(calls) > 1:\n        raise KeyError('answer')\n    return [0.0] * len(completions)\n")
    code, _, err = _cli(monkeypatch, capsys, tmp_path, "--reward", f"{f}:missing")
    assert code == 2 and f"{f} defines no 'missing'" in err
    code, _, err = _cli(monkeypatch, capsys, tmp_path, "--reward", f"{f}:few")
    assert code == 2 and "returned 1 rewards for 2 completions" in err and "grpo-stories.jsonl:" in err
    # a crash mid-run: one line naming the file and the prompt, the last checkpoint kept
    code, _, err = _cli(monkeypatch, capsys, tmp_path, "--reward", f"{f}:boom", "--checkpoint-every", "1")
    assert code == 2, err
    line = [w for w in err.splitlines() if "boom" in w][0]
    assert "KeyError" in line and str(f) in line and "grpo-stories.jsonl:" in line
    assert f"the last checkpoint is {tmp_path / 'a.gguf'}.ckpt-000001.npz" in line
    assert not (tmp_path / "a.gguf").exists() and (tmp_path / "a.gguf.ckpt-000001.npz").exists()


# ------------------------------------------------------------------------------------ data
def test_prompt_records(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hi", "answer": 4}\n{"prompt": [{"role": "user", "content": "Yo"}], "x": [1]}\n')
    records = read_records(f, "prompt")
    assert records.items == [("Hi", {"answer": 4}), ([{"role": "user", "content": "Yo"}], {"x": [1]})]
    f.write_text('{"question": "Hi"}\n')
    with pytest.raises(LlmtuneError, match=r'p.jsonl:1: prompt record has no "prompt" field'):
        read_records(f, "prompt")


def test_steps_take_a_prompt_batch_per_iteration():
    """The loop's order: batches of prompts_per_step prompts, each batch's G windows per prompt
    repeated for its iterations, so consecutive steps train one generation batch."""
    ds = PromptDataset([np.arange(2)] * 5, ["p"] * 5, [{}] * 5, ["w"] * 5, 16, generations=2, iterations=2,
                       prompts_per_step=2, n_train=4 * 2 * 2, n_val=1 * 2)
    order = ds.train_order(0, 1, shuffle=False)
    assert sorted(order.tolist()) == list(range(ds.n_train))
    steps = order.reshape(-1, 4)  # 4 completions (2 prompts x G) a step
    batches = [ds.gather(s)[2] for s in steps]
    assert [b.iteration for b in batches] == [0, 1, 0, 1]
    assert [len(b.ids) for b in batches] == [2, 2, 2, 2]
    assert ds.decode(ds.val_indices()[0]) == (4, 0)
    odd = PromptDataset([np.arange(2)] * 5, ["p"] * 5, [{}] * 5, ["w"] * 5, 16, generations=2, iterations=2,
                        prompts_per_step=2, n_train=5 * 2 * 2, n_val=0)
    order = odd.train_order(3, 1, shuffle=True)
    assert odd.steps_per_epoch() == 4 and sorted(order.tolist()) == list(range(odd.n_train))
    steps = [odd.gather(order[s * 4 : (s + 1) * 4])[2] for s in range(odd.steps_per_epoch())]
    assert [b.iteration for b in steps] == [0, 1, 0, 1] and steps[0].ids is not None


def test_conversational_full_finetune_with_validation(stories_path, tmp_path):
    """Message-list prompts through a chat template, a full finetune of one tensor, a validation
    pass (its loss: minus the held-out completions' mean reward) and its completions logged."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Tell me about a {t}."}],
                                        "thing": t}) + "\n" for t in ("cat", "dog", "ball", "tree")))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    log = tmp_path / "c.jsonl"
    res = finetune(stories_path, data, tmp_path / "full.gguf", method="grpo", reward=["exact:thing", "regex:a"],
                   num_generations=2, max_completion_length=6, ctx=40, params="attn_q", lr=1e-4, epochs=1,
                   val_split=0.25, chat_template=str(template), completions_log=str(log), seed=1)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"]
    val = [r for r in lines if r["split"] == "validation"]
    assert len(train) == 3 * 2 and len(val) == 2 and isinstance(train[0]["prompt"], list)
    assert res.epochs[0].val_loss == pytest.approx(-np.mean([r["reward"] for r in val]))


def test_toml_settings_and_a_reward_that_is_not_a_number(monkeypatch, capsys, tmp_path):
    cfg = tmp_path / "grpo.toml"
    cfg.write_text('method = "grpo"\nreward = ["regex:a", "length:4"]\nreward-weights = "1,0.5"\nloss-type = "grpo"\n'
                   "num-generations = 2\n")
    c = make_config(cfg)
    assert c.reward == ["regex:a", "length:4"] and c.loss_type == "grpo" and c.beta == 0.0 and c.batch == 2 * c.ctx
    cfg.write_text('method = "grpo"\nreward = "regex:a"\n')
    with pytest.raises(LlmtuneError, match="reward = 'regex:a' should be a list of strings"):
        make_config(cfg)
    with pytest.raises(LlmtuneError, match="--loss-type: only --method grpo uses it"):
        make_config(loss_type="grpo")
    f = tmp_path / "r.py"
    f.write_text("def words(prompts, completions, **kw):\n    return ['yes'] * len(completions)\n")
    code, _, err = _cli(monkeypatch, capsys, tmp_path, "--reward", f"{f}:words")
    assert code == 2 and "reward 1 is str 'yes', not a number or None" in err and "grpo-stories.jsonl:" in err


def test_plot_draws_the_reward(tmp_path, monkeypatch):
    """--plot / llmtune plot of a GRPO run: the loss above, the mean reward and completion length below."""
    matplotlib_axes = pytest.importorskip("matplotlib.axes")
    labels = []
    set_ylabel = matplotlib_axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib_axes.Axes, "set_ylabel", lambda ax, text, *a, **k: labels.append(text) or
                        set_ylabel(ax, text, *a, **k))
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"type": "train_step", "global_step": s, "epoch": 1, "loss": 0.0, "lr": 1e-3,
                                           "method": "grpo", "reward": s / 10, "completions/mean_length": 12.0}) + "\n"
                               for s in range(1, 11)))
    observe.plot_metrics(metrics, tmp_path / "p.png")
    assert labels == [LOSS_LABELS["grpo"], "learning rate", "reward (mean over completions)",
                      "completion length (tokens)"]
