"""eval MODEL TASK.jsonl --reward (eval/graded.py, ui/graded.py): batched greedy and sampled
completions equal one-at-a-time generation, the graders' and weights' arithmetic, base and adapter
side by side, the confusion table, pass@k, the JSON, and bad input as one line with exit 2."""

import itertools
import json
import math

import numpy as np
import pytest

from cli_helpers import run_cli
from llmtune.errors import Interrupted
from llmtune.eval.generate import Generator
from llmtune.eval.graded import GradedSettings, evaluate_graded, pass_at, sample_seed
from llmtune.eval.sampling import Sampler, SamplerConfig
from llmtune.model.adapter import attach
from llmtune.model.loaded import load_model
from llmtune.train.chat import prompt_ids
from llmtune.train.rewards import normalise
from lora_fixture import write_fixture_adapter

PROMPTS = ["Once upon a time", "Lily went to the", "The cat", "Tom had a big", "One day"]
N = 6


def _greedy(model, prompts, n=N):
    gen = Generator(model, "cpu", n_ctx=64)
    return [gen.generate(prompt_ids(model.tokenizer, p), n, Sampler(SamplerConfig(temp=0.0, seed=0)))
            for p in prompts]


@pytest.fixture(scope="module")
def base_runs(stories_path):
    return _greedy(load_model(stories_path), PROMPTS)


@pytest.fixture
def task(base_runs, tmp_path):
    """Prompts whose label is the model's own greedy answer for the first two, "no" or "yes" for
    the rest (the exact: grader must find both kinds), and a number column."""
    path = tmp_path / "task.jsonl"
    labels = [base_runs[0].text, base_runs[1].text, "no", "yes", "no"]
    with open(path, "w") as fh:
        for i, (p, lab) in enumerate(zip(PROMPTS, labels)):
            fh.write(json.dumps({"prompt": p, "label": lab, "n": i}) + "\n")
    return path


def _settings(**kw):
    return GradedSettings(max_completion_length=N, ctx=64, **kw)


def test_greedy_completions_and_grades(stories_path, task, base_runs):
    """Batched greedy (2 lanes: a padded last batch) = Generator one prompt at a time; each grader's
    value, the weighted sum and the means as defined."""
    res = evaluate_graded(stories_path, task, ["exact:label", "regex:was", "length:4"], [1.0, 0.5, 0.25],
                          settings=_settings(n_seq=2))
    m = res.model
    assert res.base is None and len(m.prompts) == 5 and not m.partial
    for p, want in zip(m.prompts, base_runs):
        assert p.texts == [want.text] and p.n_tokens == [len(want.tokens)]
    exact = [1.0, 1.0, 0.0, 0.0, 0.0]
    regex = [float("was" in r.text) for r in base_runs]
    length = [-abs(len(r.tokens) - 4) / 4 for r in base_runs]
    for i, p in enumerate(m.prompts):
        assert p.scores[0] == [exact[i], regex[i], length[i]]
        assert p.rewards[0] == pytest.approx(exact[i] + 0.5 * regex[i] + 0.25 * length[i])
    assert m.rewards == pytest.approx({"exact:label": 0.4, "regex:was": np.mean(regex), "length:4": np.mean(length)})
    assert m.reward == pytest.approx(np.mean([p.rewards[0] for p in m.prompts]))
    # the pass threshold: every grader's best, 1 + 0.5 + 0 (length's best is 0)
    assert m.threshold == 1.5
    want_pass = np.mean([r >= 1.5 for r in (p.rewards[0] for p in m.prompts)])
    assert m.pass_at() == {1: pytest.approx(want_pass)}


def test_confusion_table_of_label_answers(stories_path, task, base_runs):
    m = evaluate_graded(stories_path, task, ["exact:label"], settings=_settings()).model
    conf = m.confusion()["exact:label"]
    a, b = sorted([normalise(base_runs[0].text), normalise(base_runs[1].text)])
    assert conf["gold"] == sorted([a, b, "no", "yes"]) and conf["predicted"] == conf["gold"] + ["other"]
    counts = np.asarray(conf["counts"])
    gold = {g: i for i, g in enumerate(conf["gold"])}
    assert counts[gold[a], gold[a]] == 1 and counts[gold[b], gold[b]] == 1  # right
    assert counts[gold["no"], -1] == 2 and counts[gold["yes"], -1] == 1  # story text: "other"
    assert counts.sum() == 5
    # a column of many distinct values is no label: no table
    assert evaluate_graded(stories_path, task, ["exact:n"], settings=_settings()).model.confusion() == {}


def test_side_by_side_with_a_lora(stories_path, task, tmp_path, base_runs):
    adapter = write_fixture_adapter(stories_path, tmp_path / "a.gguf")
    res = evaluate_graded(stories_path, task, ["exact:label", "regex:the"], settings=_settings(), lora=[adapter])
    tuned = _greedy(attach(load_model(stories_path), [adapter]), PROMPTS)
    assert [p.texts[0] for p in res.base.prompts] == [r.text for r in base_runs]
    assert [p.texts[0] for p in res.model.prompts] == [r.text for r in tuned]
    assert any(a.text != b.text for a, b in zip(tuned, base_runs))  # the adapter changes answers
    d = res.to_dict()
    assert d["base"]["rewards"] == res.base.rewards and d["rewards"] == res.model.rewards
    for name in ("exact:label", "regex:the"):
        assert d["difference"]["rewards"][name] == pytest.approx(res.model.rewards[name] - res.base.rewards[name])
    assert d["difference"]["reward"] == pytest.approx(res.model.reward - res.base.reward)


def test_pass_at_is_chen_et_al_unbiased_estimator():
    """pass@j = the chance that j of the n samples, drawn without replacement, hold a correct one."""
    for n, c in itertools.product(range(1, 7), range(0, 7)):
        if c > n:
            continue
        for j in range(1, n + 1):
            subsets = list(itertools.combinations([True] * c + [False] * (n - c), j))
            assert pass_at(n, c, j) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_samples_are_seeded_and_pass_at_k(stories_path, task):
    """--samples 3: sample j of prompt p is Generator's with seed SeedSequence([seed, p, j]), the
    same whatever the batching; pass@j from the samples' rewards."""
    specs = ["regex:the"]
    res = evaluate_graded(stories_path, task, specs, settings=_settings(samples=3, temp=1.0, seed=7, n_seq=4)).model
    again = evaluate_graded(stories_path, task, specs, settings=_settings(samples=3, temp=1.0, seed=7, n_seq=8)).model
    assert [p.texts for p in res.prompts] == [p.texts for p in again.prompts]
    model = load_model(stories_path)
    gen = Generator(model, "cpu", n_ctx=64)
    for i, p in enumerate(res.prompts):
        for j in range(3):
            want = gen.generate(prompt_ids(model.tokenizer, PROMPTS[i]), N,
                                Sampler(SamplerConfig(temp=1.0, seed=sample_seed(7, i, j))))
            assert p.texts[j] == want.text
    assert len({t for p in res.prompts for t in p.texts}) > 5  # sampling, not greedy
    got = res.pass_at()
    for j in (1, 2, 3):
        want = np.mean([pass_at(3, sum(r >= 1.0 for r in p.rewards), j) for p in res.prompts])
        assert got[j] == pytest.approx(want)
    assert got[1] <= got[2] <= got[3]


def test_cli_tables_and_json(stories_path, task, tmp_path, monkeypatch, capsys):
    adapter = write_fixture_adapter(stories_path, tmp_path / "a.gguf")
    out = tmp_path / "out.json"
    code, stdout, stderr = run_cli(monkeypatch, capsys, "eval", stories_path, task, "--reward", "exact:label",
                                   "--reward", "regex:the", "--reward-weights", "1,0.5", "--lora", adapter,
                                   "--max-completion-length", N, "--ctx", 64, "--json", out)
    assert code == 0, stderr
    assert "base" in stdout and "adapter" in stdout and "difference" in stdout and "gold" in stdout
    d = json.loads(out.read_text())
    for section in (d, d["base"]):
        assert set(section["rewards"]) == {"exact:label", "regex:the"}
        assert section["reward"] == pytest.approx(section["rewards"]["exact:label"]
                                                  + 0.5 * section["rewards"]["regex:the"])
        assert len(section["prompts"]) == 5 and section["pass_at"].keys() == {"1"}
        assert "exact:label" in section["confusion"]
    assert d["graders"] == [{"name": "exact:label", "spec": "exact:label", "weight": 1.0},
                            {"name": "regex:the", "spec": "regex:the", "weight": 0.5}]
    assert math.isclose(d["difference"]["reward"], d["reward"] - d["base"]["reward"], abs_tol=1e-12)


BAD_REWARDS = '''
def short(prompts, completions, **kw):
    return [1.0] * (len(completions) - 1)

def word(prompts, completions, **kw):
    return ["good" for _ in completions]
'''


@pytest.mark.parametrize("args, words", [
    (["--reward", "exact:missing"], ['no "missing" column', "--reward exact:missing"]),
    (["--reward", "{py}:short"], ["--reward", "short", "rewards for", "completions"]),
    (["--reward", "{py}:word"], ["--reward", "word", "not a number"]),
    (["--reward", "{dir}/nothere.py:f"], ["nothere.py", "no such file"]),
    (["--reward", "{py}:absent"], ["defines no 'absent'"]),
    (["--reward", "bogus:x"], ["unknown reward kind"]),
    (["--reward", "regex:a", "--reward-weights", "1,2"], ["--reward-weights", "2 weight(s) for 1"]),
    (["--reward", "regex:a", "--samples", "0"], ["--samples"]),
    (["--reward", "regex:a", "--json", "{task}"], ["--json", "refusing to overwrite the input"]),
    (["--reward", "regex:a", "--json", "{dir}"], ["--json", "is a directory"]),
    (["--reward", "regex:a", "--hellaswag"], ["--reward", "--hellaswag"]),
    (["--reward", "regex:a", "--max-completion-length", "64"], ["--max-completion-length"]),
])
def test_bad_input_is_one_line_exit_2(stories_path, task, tmp_path, monkeypatch, capsys, args, words):
    py = tmp_path / "rewards.py"
    py.write_text(BAD_REWARDS)
    before = task.read_bytes()
    args = [a.format(py=py, dir=tmp_path, task=task) for a in args]
    code, stdout, stderr = run_cli(monkeypatch, capsys, "eval", stories_path, task, "--max-completion-length", N,
                                   "--ctx", 64, *args)
    assert code == 2, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    for w in words:
        assert w in stderr, stderr
    assert task.read_bytes() == before


def test_ctrl_c_keeps_the_prompts_done(stories_path, task, tmp_path):
    """Interrupted after the adapter's first batch: the comparison over its 2 prompts, base cut to them."""
    adapter = write_fixture_adapter(stories_path, tmp_path / "a.gguf")

    def progress(p):
        if p.stage == "adapter":
            raise Interrupted(2)

    with pytest.raises(Interrupted) as info:
        evaluate_graded(stories_path, task, ["regex:the"], settings=_settings(n_seq=2), lora=[adapter],
                        progress=progress)
    part = info.value.partial
    assert part.partial and len(part.model.prompts) == 2 and len(part.base.prompts) == 2
    assert part.to_dict()["prompts_done"] == 2 and part.to_dict()["prompts_planned"] == 5
