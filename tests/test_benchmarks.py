"""llmtune eval: HellaSwag, Winogrande and multiple choice task by task as llama-perplexity scores
them (choices recorded from llama.cpp in tests/data/benchmarks/llamacpp-choices.json by
`bench/check_benchmarks.py fixtures`), its random task selection, batching, JSON and input errors."""

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest

import cuda_emu
import family_check
import llmtune
from cli_helpers import run_cli
from llmtune.backends import cuda, get_backend
from llmtune.backends.cpu.threads import blas_threads
from llmtune.errors import LlmtuneError
from llmtune.eval.benchmarks import evaluate, prepare_benchmark, score_benchmark, wilson_interval
from llmtune.eval.continuations import Row, score_rows
from llmtune.eval.tasks import (
    MT19937,
    detect_kind,
    float_scale_selection,
    hellaswag_selection,
    multiple_choice_bytes,
    read_hellaswag,
    read_multiple_choice,
    read_winogrande,
    uniform_below,
)
from llmtune.model.loaded import load_model

DATA = Path(__file__).parent / "data"
STORIES = DATA / "stories260K.gguf"
BENCH = DATA / "benchmarks"
HELLASWAG = BENCH / "hellaswag-20.txt"  # the first 20 tasks of HellaSwag's validation set
MMLU_BIN = BENCH / "mmlu-20.bin"  # 20 MMLU test questions (20 topics), llama.cpp's binary format
MMLU_JSONL = BENCH / "mmlu-20.jsonl"  # the same questions as JSONL
WINOGRANDE = BENCH / "winogrande-10.csv"
LLAMACPP = json.loads((BENCH / "llamacpp-choices.json").read_text())


@pytest.fixture(scope="module")
def stories():
    return load_model(STORIES)


@pytest.fixture(scope="module")
def hellaswag(stories):
    return evaluate(stories, HELLASWAG, tasks=20, ctx=128)


@pytest.fixture(scope="module")
def mmlu(stories):
    return evaluate(stories, MMLU_BIN, ctx=256)


# --- llama.cpp's random selection ----------------------------------------------------------------


def test_mt19937_matches_std():
    rng = MT19937(5489)  # the C++ standard: the 10000th output of a default-seeded mt19937
    for _ in range(9999):
        rng()
    assert rng() == 4123659995
    rng = MT19937(1)
    assert [rng() for _ in range(3)] == [1791095845, 4282876139, 3093770124]


def test_selection_matches_llamacpp():
    # printed by a C++ program built with the GCC 12 that built llama-perplexity (libstdc++'s
    # uniform_int_distribution<size_t> over the tasks left; the float-scaled draw of winogrande/mc)
    assert hellaswag_selection(500, 400)[:12] == [208, 498, 359, 465, 0, 64, 151, 499, 74, 118, 46, 199]
    assert hellaswag_selection(10042, 8) == [4187, 10013, 7233, 9363, 1, 1286, 3036, 10032]
    assert float_scale_selection(14042, 10) == [5855, 14001, 10113, 13092, 1, 1798, 4243, 14021, 2059, 3313]
    assert float_scale_selection(500, 8) == [208, 497, 358, 463, 0, 63, 149, 492]
    assert sorted(hellaswag_selection(500, 500)) == list(range(500))
    assert hellaswag_selection(20, 20) == LLAMACPP["hellaswag-20"]["order"]


def test_uniform_below_rejects_like_libstdcxx():
    class Fixed:  # a generator whose first draw falls in the rejection zone of range 3
        def __init__(self, values):
            self.values = list(values)

        def __call__(self):
            return self.values.pop(0)

    # range 3: threshold = 2^32 mod 3 = 1; a draw whose low product word is 0 is rejected
    assert uniform_below(Fixed([0, 0xFFFFFFFF]), 3) == 2
    assert uniform_below(Fixed([0x80000000]), 2) == 1


# --- scores, task by task ------------------------------------------------------------------------


def test_hellaswag_matches_llamacpp_task_by_task(hellaswag):
    ref = LLAMACPP["hellaswag-20"]  # llama-perplexity --hellaswag -c 128 --hellaswag-tasks 20
    assert [t.index for t in hellaswag.tasks] == ref["order"]
    assert [t.choice for t in hellaswag.tasks] == ref["choices"]
    assert [int(t.correct) for t in hellaswag.tasks] == ref["right"]
    assert hellaswag.accuracy == sum(ref["right"]) / 20
    lo, hi = wilson_interval(sum(ref["right"]), 20)
    assert (hellaswag.ci_low, hellaswag.ci_high) == (lo, hi)
    assert all(len(t.scores) == 4 and all(s < 0 for s in t.scores) for t in hellaswag.tasks)


def test_multiple_choice_binary_and_jsonl_match_llamacpp(stories, mmlu):
    ref = LLAMACPP["mmlu-20"]  # llama-perplexity --multiple-choice -bf mmlu-20.bin -c 256
    assert [t.choice for t in mmlu.tasks] == ref["choices"]
    assert [int(t.correct) for t in mmlu.tasks] == ref["right"]
    assert mmlu.random_chance == 0.25
    jsonl = evaluate(stories, MMLU_JSONL, ctx=256)
    assert [t.choice for t in jsonl.tasks] == ref["choices"]
    assert len(jsonl.topics) == 20 and sum(total for _, total in jsonl.topics.values()) == 20
    assert not mmlu.topics  # the binary format has no topics


def test_winogrande_matches_llamacpp(stories):
    ref = LLAMACPP["winogrande-10"]  # llama-perplexity --winogrande -c 128
    res = evaluate(stories, WINOGRANDE, ctx=128)
    assert res.kind == "winogrande" and res.n_tasks == 10
    assert [t.choice for t in res.tasks] == ref["choices"]
    # rows 3 and 4 score the choice word (short continuations), with llama.cpp's FIXME logits
    np.testing.assert_allclose([t.scores for t in res.tasks], ref["scores"], atol=2e-3)


def test_lora_adapter_matches_llamacpp(stories):
    # llama-perplexity --hellaswag -c 128 --hellaswag-tasks 20 --lora <adapter>: 5 of 20 choices move
    res = evaluate(stories, HELLASWAG, tasks=20, ctx=128, lora=[DATA / "lora" / "stories260K-convert-f16.gguf"])
    assert [t.choice for t in res.tasks] == LLAMACPP["hellaswag-20-lora"]["choices"]
    assert LLAMACPP["hellaswag-20-lora"]["choices"] != LLAMACPP["hellaswag-20"]["choices"]


def test_finetune_eval_benchmark(tmp_path):
    """--eval-benchmark: scored before training and after each epoch, in the result and the metrics."""

    text = tmp_path / "train.txt"
    text.write_text("Once upon a time there was a little girl named Lily. She liked to play outside. " * 12)
    metrics = tmp_path / "m.jsonl"
    res = llmtune.finetune(STORIES, text, tmp_path / "out.gguf", ctx=32, batch=128, epochs=1, lr=1e-3, val_split=0.0,
                           eval_benchmark=str(WINOGRANDE), metrics=str(metrics))
    assert res.bench_before == pytest.approx(0.3)  # stories260K on winogrande-10 (llama.cpp: 3 right)
    assert all(0 <= e.bench_accuracy <= 1 and e.bench_accuracy_err > 0 for e in res.epochs)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    bench = [r for r in records if r["type"] == "benchmark"]
    assert [r["epoch"] for r in bench] == [0, 1] and bench[0]["kind"] == "winogrande"


def test_choices_do_not_depend_on_batching_or_workers(stories, mmlu):
    bench = prepare_benchmark(stories, MMLU_BIN, ctx=256, tasks=6)  # 6 random tasks, llama.cpp's draw
    assert [t.index for t in bench.tasks] == float_scale_selection(20, 6)
    want = [mmlu.tasks[t.index] for t in bench.tasks]
    with blas_threads(1):  # one worker: keep OpenBLAS's threads from stalling on a busy machine
        one = score_benchmark(stories, bench, batch=1, workers=1)  # a pass per task
    two = score_benchmark(stories, bench, batch=4096, workers=2)
    for res in (one, two):
        assert [t.choice for t in res.tasks] == [t.choice for t in want]
        np.testing.assert_allclose([t.scores for t in res.tasks], [t.scores for t in want], atol=1e-5)
    assert one.n_passes == len(bench.tasks) > two.n_passes


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gemma3", "phi3", "gpt2"])
def test_shared_prefixes_score_as_separate_rows(family, tmp_path):
    """Rows of a group (a question's answers) computed from one shared trunk (arch/prefix.py) give
    each row's numbers alone: biases, sliding windows, softcaps, rope variants and learned
    positions included. Lengths vary so passes mix trunks and branches of several sizes."""

    model = load_model(family_check.make_model(family_check.load_fixture(family), tmp_path))
    rows = _grouped_rows(model.hp.n_vocab, [(9, 4), (30, 3), (2, 2), (17, 4), (60, 1)])
    alone = [Row(r.tokens, r.positions, r.targets) for r in rows]
    backend = get_backend("cpu")
    shared = score_rows([model], rows, backend=backend, batch=96, workers=1)
    single = score_rows([model], alone, backend=backend, batch=96, workers=1)
    assert shared.n_passes < single.n_passes
    assert shared.n_tokens == single.n_tokens == single.n_computed > shared.n_computed
    for a, b in zip(shared.logprob, single.logprob):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def test_shared_prefixes_fit_learned_positions(tmp_path):
    """gpt2-tiny has 256 learned positions: a task whose longest sequence takes all 256 is scored
    with shared prefixes too (its pass keeps exact lengths where rounding would pass 256)."""

    model = load_model(family_check.make_model(family_check.load_fixture("gpt2"), tmp_path))
    assert model.max_positions == 256
    rows = _grouped_rows(model.hp.n_vocab, [(200, 4), (150, 2)])
    rows.append(Row(np.concatenate([rows[0].tokens[:200], np.arange(1, 57)]), np.arange(199, 255), np.arange(1, 57),
                    group=0))
    prefix = rows[4].tokens[:150]  # and a task of a shorter question with a longer answer
    rows.append(Row(np.concatenate([prefix, np.arange(1, 101)]), np.arange(149, 249), np.arange(1, 101), group=1))
    alone = [Row(r.tokens, r.positions, r.targets) for r in rows]
    shared = score_rows([model], rows, backend=get_backend("cpu"), batch=4096, workers=1)  # both tasks fit a pass
    single = score_rows([model], alone, backend=get_backend("cpu"), batch=4096, workers=1)
    assert shared.n_computed < single.n_computed
    for a, b in zip(shared.logprob, single.logprob):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def _grouped_rows(n_vocab: int, tasks: list[tuple[int, int]]) -> list:
    """Random tasks of (prefix tokens, answers): each answer a row of the task's group."""

    rng = np.random.default_rng(0)
    rows = []
    for task, (n_prefix, n_answers) in enumerate(tasks):
        prefix = rng.integers(1, n_vocab, n_prefix)
        for a in range(n_answers):
            seq = np.concatenate([prefix, rng.integers(1, n_vocab, 1 + 5 * a)])
            first = n_prefix - 1 - (a % 2)  # a scored token inside the prefix shortens the trunk
            rows.append(Row(seq, np.arange(first, seq.size - 1), seq[first + 1:], group=task))
    return rows


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda), "cuda-emu"])
def test_shared_prefixes_on_the_cuda_kernels(stories, device):
    """The shared-prefix layout through the CUDA backend's kernels (on a GPU, or under the C++
    emulator) gives the cpu's numbers."""

    if device == "cuda":
        pytest.importorskip("cupy")
        if not cuda.available():
            pytest.skip("cupy sees no CUDA device")
        backend = cuda.CUDABackend(np.float32)
    elif not cuda_emu.available():
        pytest.skip("no C++ compiler for the CUDA kernel emulator")
    else:
        backend = cuda.CUDABackend(np.float32, runtime=cuda_emu.EmuRuntime())
    rows = _grouped_rows(stories.hp.n_vocab, [(9, 4), (30, 3), (17, 2)])
    got = score_rows([stories], rows, backend=backend, batch=96, workers=1)
    want = score_rows([stories], rows, backend=get_backend("cpu"), batch=96, workers=1)
    assert got.n_passes == want.n_passes < len(rows)
    for a, b in zip(got.logprob, want.logprob):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_kl_base_with_itself(stories, mmlu):
    res = evaluate(stories, MMLU_BIN, ctx=256, kl_base=stories)
    assert res.kl == pytest.approx(0.0, abs=1e-9) and res.same_choice == 1.0
    assert res.base_accuracy == res.accuracy == mmlu.accuracy
    assert [t.base_choice for t in res.tasks] == [t.choice for t in res.tasks]


def test_converter_writes_llamacpp_binary():
    tasks = read_multiple_choice(MMLU_JSONL)
    assert multiple_choice_bytes(tasks) == MMLU_BIN.read_bytes()
    back = read_multiple_choice(MMLU_BIN)
    assert [(t.question, t.answers, t.labels) for t in back] == [(t.question, t.answers, t.labels) for t in tasks]


def test_winogrande_csv_parsing(tmp_path):
    csv = tmp_path / "w.csv"
    csv.write_text('index,sentence,choice1,choice2,answer\n'
                   '0,"Tom said, ""hi,"" so _ waved.",Tom,Sue,2\n'
                   '1,The cat saw _ run.,a dog,"a mouse, small",1')  # last row without a newline
    rows = read_winogrande(csv)
    assert len(rows) == 2
    assert rows[0].first == 'Tom said, ""hi,"" so ' and rows[0].second == " waved." and rows[0].answer == 2
    assert rows[1].choices == ["a dog", '"a mouse, small"']  # llama.cpp keeps a quoted choice's quotes
    assert detect_kind(csv) == "winogrande"


def test_detect_kind():
    assert detect_kind(HELLASWAG) == "hellaswag"
    assert detect_kind(MMLU_BIN) == detect_kind(MMLU_JSONL) == "multiple-choice"
    assert detect_kind(WINOGRANDE) == "winogrande"


def test_letter_answers_and_byte_order_marks(tmp_path):
    """ARC's letter answers ("A": the first choice) read as indices; a UTF-8 byte-order mark before
    a JSONL, HellaSwag or Winogrande file is dropped (not a binary file, not part of a context)."""
    rows = [json.loads(line) for line in MMLU_JSONL.read_text().splitlines() if line.strip()]
    for k, row in enumerate(rows):
        row["answer"] = "ABCD"[row["answer"]] if k % 2 else "abcd"[row["answer"]]
    lettered = _bad(tmp_path, "arc.jsonl", b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    assert detect_kind(lettered) == "multiple-choice"
    want = [(t.question, t.answers, t.labels) for t in read_multiple_choice(MMLU_JSONL)]
    assert [(t.question, t.answers, t.labels) for t in read_multiple_choice(lettered)] == want
    hs = _bad(tmp_path, "hs.txt", b"\xef\xbb\xbf" + HELLASWAG.read_bytes())
    assert detect_kind(hs) == "hellaswag" and read_hellaswag(hs) == read_hellaswag(HELLASWAG)
    wg = _bad(tmp_path, "w.csv", b"\xef\xbb\xbf0,The _ sat.,a,b,1\n")
    assert [t.answer for t in read_winogrande(wg)] == [1]


# --- command line --------------------------------------------------------------------------------


def _eval(monkeypatch, capsys, *args):
    return run_cli(monkeypatch, capsys, "eval", *args)


def _one_line_error(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def test_cli_hellaswag_lines_and_json(monkeypatch, capsys, tmp_path, hellaswag):
    out_json = tmp_path / "hs.json"
    code, out, _ = _eval(monkeypatch, capsys, STORIES, HELLASWAG, "--hellaswag", "-c", "128", "--tasks", "20",
                         "--json", out_json)
    assert code == 0
    assert "task\tacc_norm\t95% confidence interval" in out
    right = sum(LLAMACPP["hellaswag-20"]["right"])
    lo, hi = wilson_interval(right, 20)
    assert f"20\t{100 * right / 20:3.8f}%\t[{100 * lo:3.4f}%, {100 * hi:3.4f}%]" in out  # llama.cpp's last line
    data = json.loads(out_json.read_text())
    assert data["kind"] == "hellaswag" and data["n_tasks"] == 20 and data["n_correct"] == right
    assert [t["choice"] for t in data["tasks"]] == LLAMACPP["hellaswag-20"]["choices"]
    assert all(len(t["scores"]) == 4 for t in data["tasks"])


def test_cli_multiple_choice_topics(monkeypatch, capsys):
    code, out, _ = _eval(monkeypatch, capsys, STORIES, MMLU_JSONL, "-c", "256", "--topics", "--summary")
    assert code == 0
    assert "Final result:" in out and "Random chance: 25.0000" in out and "per topic" in out
    assert "task\tacc_norm" not in out  # --summary: no running lines


def test_cli_winogrande_lines(monkeypatch, capsys):
    code, out, _ = _eval(monkeypatch, capsys, STORIES, WINOGRANDE, "--winogrande", "-c", "128")
    assert code == 0 and "Final Winogrande score(10 tasks)" in out
    assert out.splitlines()[0].startswith("1\t0.0000\t")


def _bad(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _hellaswag_text(n_tasks=2, label="1"):
    return "".join(f"Context {i}: a man\n{label}\nruns.\nwalks.\nsits.\njumps.\n" for i in range(n_tasks))


@pytest.mark.parametrize("name, content, flag, words", [
    ("hs.txt", _hellaswag_text()[:-len("jumps.\n")], "--hellaswag", ["hs.txt", "not a multiple of 6", "task 2"]),
    ("hs.txt", _hellaswag_text(label="4"), "--hellaswag", ["hs.txt", "task 1 (line 2)", "label '4'"]),
    ("w.csv", "0,The cat sat.,a,b,1\n", "--winogrande", ["w.csv", "line 1", "no _"]),
    ("w.csv", "0,The _ sat.,a,b,3\n", "--winogrande", ["w.csv", "line 1", "not 1 or 2"]),
    ("w.csv", "0,The _ sat.,a\n", "--winogrande", ["w.csv", "line 1", "fewer than 4 commas"]),
    ("mc.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": 2}\n', "--multiple-choice",
     ["mc.jsonl", "line 1", "out of range"]),
    ("mc.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": 0}\n{nope\n', "--multiple-choice",
     ["mc.jsonl", "line 2", "not JSON"]),
    ("mc.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": 0}\n{"question": "Q?", "choices": ["a"], '
     '"answer": 0}\n', "--multiple-choice", ["mc.jsonl: line 2: one answer; a task needs at least 2 choices"]),
    ("mc.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": "C"}\n', "--multiple-choice",
     ["mc.jsonl: line 1: answer 'C' is out of range for 2 choices (a 0-based index 0-1, or a letter A-B)"]),
    ("mc.jsonl", '{"question": "Q?", "choices": ["a", "b"], "answer": "2"}\n', "--multiple-choice",
     ["mc.jsonl: line 1: answer '2' is a string of digits: give a 0-based index (1 if 2 counts from 1"]),
])
def test_cli_malformed_tasks(monkeypatch, capsys, tmp_path, name, content, flag, words):
    code, _, err = _eval(monkeypatch, capsys, STORIES, _bad(tmp_path, name, content), flag)
    _one_line_error(code, err, *words)


def _mc_binary(tasks_bytes: list[bytes], offsets=None) -> bytes:
    if offsets is None:
        offsets, pos = [], 4 + 4 * len(tasks_bytes)
        for b in tasks_bytes:
            offsets.append(pos)
            pos += len(b)
    return struct.pack(f"<I{len(offsets)}I", len(tasks_bytes), *offsets) + b"".join(tasks_bytes)


def _mc_task(question="Q?", answers=("yes", "no"), labels=(1, 0)) -> bytes:
    s = lambda t: struct.pack("<I", len(t.encode())) + t.encode()  # noqa: E731
    return (s(question) + struct.pack("<I", len(answers)) + b"".join(s(a) for a in answers)
            + struct.pack(f"<{len(labels)}i", *labels) + struct.pack("<I", 0))


@pytest.mark.parametrize("content, words", [
    (_mc_binary([_mc_task(), _mc_task()], offsets=[12, 99]), ["task 2", "offset 99"]),
    (_mc_binary([_mc_task()])[:-6], ["task 1", "file ends inside"]),
    (_mc_binary([_mc_task(labels=(2, 0))]), ["task 1", "label 2", "out of range"]),
    (_mc_binary([_mc_task(answers=("yes", ""))]), ["task 1", "answer 2 is empty"]),
    (_mc_binary([_mc_task(answers=("yes",), labels=(1,))]), ["task 1: one answer; a task needs at least 2 choices"]),
    (struct.pack("<I", 1000) + b"\0" * 8, ["1000 task offsets"]),
])
def test_cli_malformed_binary(monkeypatch, capsys, tmp_path, content, words):
    path = _bad(tmp_path, "mc.bin", content)
    code, _, err = _eval(monkeypatch, capsys, STORIES, path, "--multiple-choice")
    _one_line_error(code, err, "mc.bin", *words)


def test_cli_task_longer_than_context(monkeypatch, capsys):
    code, _, err = _eval(monkeypatch, capsys, STORIES, HELLASWAG, "--hellaswag", "-c", "16")
    _one_line_error(code, err, "hellaswag-20.txt", "task", "--ctx 16 holds 64")


def test_cli_bad_flags(monkeypatch, capsys, tmp_path):
    code, _, err = _eval(monkeypatch, capsys, STORIES, HELLASWAG, "--hellaswag", "--winogrande")
    _one_line_error(code, err, "choose one")
    code, _, err = _eval(monkeypatch, capsys, STORIES, HELLASWAG, "--tasks", "0")
    _one_line_error(code, err, "--tasks")
    code, _, err = _eval(monkeypatch, capsys, STORIES, tmp_path / "missing.txt")
    _one_line_error(code, err, "missing.txt: no such file")
    code, _, err = _eval(monkeypatch, capsys, STORIES, _bad(tmp_path, "odd.txt", "just some words\nand more\n"))
    _one_line_error(code, err, "odd.txt", "cannot tell")
    code, _, err = _eval(monkeypatch, capsys, STORIES, HELLASWAG, "--json", HELLASWAG)
    _one_line_error(code, err, "refusing to overwrite")


def test_library_errors(stories):

    with pytest.raises(LlmtuneError, match="unknown benchmark"):
        evaluate(stories, HELLASWAG, "arc")
    nan_output = np.full_like(stories.weights["output.weight"], np.nan)
    broken = dataclasses.replace(stories, weights={**stories.weights, "output.weight": nan_output})
    with pytest.raises(LlmtuneError, match="not finite"):
        evaluate(broken, WINOGRANDE, ctx=128)
