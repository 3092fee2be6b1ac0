"""llmtune eval vs llama-perplexity --hellaswag / --winogrande / --multiple-choice, task by task.

    python bench/check_benchmarks.py --bin PATH/TO/llama.cpp/build/bin [--data DIR] [--json OUT]
        [--mc-every 47] [--full-mmlu] [--skip-finetuned]
    python bench/check_benchmarks.py convert IN.jsonl OUT.bin [--every K]   # JSONL -> llama.cpp binary
    python bench/check_benchmarks.py fixtures --bin DIR                      # re-record tests/data/benchmarks

For stories260K and a stories260K finetuned by llmtune.finetune (a few steps), on
- HellaSwag (`--data`/hellaswag-val-500.txt, -c 128): 400 random tasks (llama.cpp's default) and all 500;
- an MMLU slice (every `--mc-every`-th question of mmlu-test.jsonl) converted to llama.cpp's binary
  multiple-choice file, -c 768 (the longest MMLU question needs 2971 tokens with stories260K's vocabulary);
- a Winogrande CSV written here (quoted sentences with commas and doubled quotes included), -c 128;
the chosen answer of every task is compared.

llama-perplexity prints only the running accuracy for HellaSwag and multiple choice, so the answer
it chose is recovered by re-running it with every task's label set to answer 0, then 1, then 2
(a task is right in run k exactly when it chose k; none: it chose 3). Each task is decoded in a batch
of its own there (4 sequences), so a task's choice does not depend on which others run: the 400-task
run is checked through its per-task right/wrong pattern and the choices of the all-task runs.
llama.cpp's logger can lose a run's last lines at exit on a busy machine, so every run ends with
sacrificial tasks that llama.cpp evaluates last (see PAD). Tasks whose chosen answers differ are
re-run in llama.cpp with float32 attention (`-fa off -ctk f32 -ctv f32`, see EXACT): its default
flash attention over an F16 KV cache moves scores by up to ~1e-3, enough to flip near-ties.

--full-mmlu also times all 14,042 MMLU questions: llama-perplexity on the binary file and
`llmtune eval` on the same binary file (and on the JSONL), each a fresh process, wall time.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmtune.eval.benchmarks import evaluate  # noqa: E402
from llmtune.eval.tasks import MultipleChoiceTask, multiple_choice_bytes, read_multiple_choice, select_tasks  # noqa: E402

DATA = ROOT / "tests" / "data"
STORIES = DATA / "stories260K.gguf"
FIXTURES = DATA / "benchmarks"
LORA = DATA / "lora" / "stories260K-convert-f16.gguf"
SHARED = ROOT.parent / "shared" / "data"

# Winogrande-style rows (sentence with one _, choice 1, choice 2, answer); several need quoting.
WINOGRANDE = [
    ("Sarah was a much better surgeon than Maria so _ always got the easier cases.", "Sarah", "Maria", 2),
    ("The cat chased the dog, but _ was too slow to catch it.", "the cat", "the dog", 1),
    ('Tom said, "I will help you," because _ was kind.', "Tom", "Jerry", 1),
    # a continuation of 3 tokens or fewer: the choice word is scored too (and llama.cpp's FIXME applies)
    ("In the end, the winner of the race was _.", "Tom", "the slow old turtle", 2),
    ("The cake was eaten by _.", "Ben", "the dog", 2),
    ("The trophy didn't fit into the suitcase because _ was too big.", "the trophy", "the suitcase", 1),
    ("The trophy didn't fit into the suitcase because _ was too small.", "the trophy", "the suitcase", 2),
    ("Anna gave Lily a gift, so _ said thank you.", "Anna", "Lily", 2),
    ("The boy lifted the box easily because _ was strong.", "the boy", "the box", 1),
    ("When the rain started, Ben ran inside but _ stayed outside in the mud.", "Ben", "the dog", 2),
    ("The little girl hugged her mom because _ loved her very much.", "the little girl", "her mom", 1),
    ("Once upon a time, a bird and a fish met; _ could fly over the sea.", "the bird", "the fish", 1),
    ("Lily wanted to play with the ball, but _ was too high in the tree.", "Lily", "the ball", 2),
    ("The sun was hot and the ice cream was cold, so _ melted quickly.", "the sun", "the ice cream", 2),
    ('Mom said, "Eat your soup," but _ did not like soup.', "Mom", "Timmy", 2),
    ("The dog barked at the cat because _ was angry.", "the dog", "the cat", 1),
    ("Ben could not open the jar because _ was too weak.", "Ben", "the jar", 1),
    ("Ben could not open the jar because _ was too tight.", "Ben", "the jar", 2),
    ("The bird sang to the flower, and _ listened.", "the bird", "the flower", 2),
    ("Max was faster than Sam, so _ won the race.", "Max", "Sam", 1),
    ("Max was faster than Sam, so _ lost the race.", "Max", "Sam", 2),
    ("The teacher gave the student a book because _ wanted to read.", "the teacher", "the student", 2),
    ('"Look at the big tree," said Sue, and _ pointed at it.', "Sue", "the tree", 1),
    ("The car hit the wall, and _ was broken.", "the car", "the wall", 1),
    ("Emma shared her cake with Lucy because _ was hungry.", "Emma", "Lucy", 2),
    ("Emma shared her cake with Lucy because _ was generous.", "Emma", "Lucy", 1),
    ("The fox hid from the bear because _ was scared.", "the fox", "the bear", 1),
    ("The fox hid from the bear because _ was dangerous.", "the fox", "the bear", 2),
    ("Jack poured water into the cup until _ was full.", "Jack", "the cup", 2),
    ("Jack poured water into the cup until _ was empty.", "the jug", "the cup", 1),
    ("The girl, who was tired, went to bed, and _ fell asleep.", "the girl", "the bed", 1),
    ("The ball broke the window, so _ had to be fixed.", "the ball", "the window", 2),
    ('Dad said, "We will go to the park," and _ was happy.', "Dad", "Lily", 2),
    ("Sam gave the puppy a bone, and _ wagged its tail.", "Sam", "the puppy", 2),
    ("The rock sank but the leaf floated, because _ was heavy.", "the rock", "the leaf", 1),
    ("The rock sank but the leaf floated, because _ was light.", "the rock", "the leaf", 2),
    ("Mia asked Zoe for help because _ knew the way.", "Mia", "Zoe", 2),
    ("The mouse ran from the cat, yet _ caught it.", "the mouse", "the cat", 2),
    ("Tim painted the fence, and _ looked new.", "Tim", "the fence", 2),
    ("The baby cried when the dog barked, because _ was loud.", "the baby", "the dog", 2),
    ("Grandma baked cookies for Ben, so _ ate them all.", "Grandma", "Ben", 2),
    ("The moon was bright, and the stars were dim; _ lit the path.", "the moon", "the stars", 1),
]


# ------------------------------------------------------------------------------------ files
def write_winogrande(path: Path, rows=WINOGRANDE, final_blank_line: bool = True) -> Path:
    """A Winogrande CSV with a header; sentences with a comma or quote are quoted (quotes doubled).
    It ends with a blank line: llama-perplexity drops the last row of a file that ends with a single
    newline (its getline loop stops at end of file), with the blank line it reads every row."""
    lines = ["index,sentence,choice1,choice2,answer"]
    for i, (sentence, c1, c2, answer) in enumerate(rows):
        if "," in sentence or '"' in sentence:
            sentence = '"' + sentence.replace('"', '""') + '"'
        lines.append(f"{i},{sentence},{c1},{c2},{answer}")
    path.write_text("\n".join(lines) + "\n" + ("\n" if final_blank_line else ""))
    return path


def mmlu_slice(jsonl: Path, every: int) -> list[MultipleChoiceTask]:
    return read_multiple_choice(jsonl)[::every]


def convert(src: Path, dst: Path, every: int = 1) -> int:
    """Any multiple-choice file (JSONL or binary) -> llama.cpp's binary file."""
    tasks = read_multiple_choice(src)[::every]
    dst.write_bytes(multiple_choice_bytes(tasks))
    return len(tasks)


# ------------------------------------------------------------------------------------ llama.cpp
# llama.cpp's logger writes from a worker thread that the process does not wait for at exit
# (common/log.cpp, "logs may be lost if not flushed before the program exits"): on a busy machine a
# run's last lines go missing. Every run below therefore ends with PAD sacrificial tasks (copies of
# a real one) that llama.cpp evaluates last, and only the lines of the real tasks are used.
PAD = 8


# llama-perplexity's threads (--llama-threads): on a busy 2-core machine its second thread spins
# waiting for a descheduled sibling and one thread is several times faster
LLAMA_THREADS = ["-t", "2"]


def llama(bin_dir: Path, model: Path, args: list[str]) -> tuple[str, float]:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), *LLAMA_THREADS, *args]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
    return done.stdout + "\n" + done.stderr, wall


def running_hits(output: str, expect: int) -> list[int]:
    """Per task 1/0 (right/wrong) of the first `expect` tasks, from llama.cpp's running-accuracy
    lines 'i<TAB>acc...' (HellaSwag and multiple choice)."""
    acc = {int(m.group(1)): float(m.group(2))
           for m in re.finditer(r"^(\d+)\t([0-9.]+)%?(?:\t\[|\n|$)", output, re.M)}
    if any(i not in acc for i in range(1, expect + 1)):
        raise RuntimeError(f"llama.cpp printed {len(acc)} running lines, {expect} needed")
    hits, prev = [], 0
    for i in range(1, expect + 1):
        c = round(acc[i] * i / 100)
        hits.append(c - prev)
        prev = c
    return hits


def winogrande_lines(output: str, expect: int) -> list[tuple[float, float, int, int]]:
    """(score 1, score 2, chosen 1/2, answer 1/2) of the first `expect` rows."""
    rows = [(float(m.group(1)), float(m.group(2)), int(m.group(3)), int(m.group(4)))
            for m in re.finditer(r"^\d+\t[0-9.]+\t\s*(\S+)\s+(\S+)\s+(\d)\s+(\d)\s*$", output, re.M)]
    if len(rows) < expect:
        raise RuntimeError(f"llama.cpp printed {len(rows)} Winogrande rows, {expect} needed")
    return rows[:expect]


def hellaswag_blocks(path: Path) -> list[list[str]]:
    lines = path.read_text().rstrip("\n").split("\n")
    return [lines[i:i + 6] for i in range(0, len(lines), 6)]


def padded_hellaswag(blocks: list[list[str]], dst: Path, label: int | None = None) -> list[int]:
    """Write the tasks plus PAD copies of the first where llama.cpp draws its last PAD tasks when it
    takes them all; -> the task (index into `blocks`) of each of its first len(blocks) lines."""
    n = len(blocks) + PAD
    order = select_tasks("hellaswag", n, n)
    spare, real = set(order[-PAD:]), iter(range(len(blocks)))
    slot = {}
    out = []
    for pos in range(n):
        k = 0 if pos in spare else next(real)
        if pos not in spare:
            slot[pos] = k
        block = list(blocks[k])
        if label is not None:
            block[1] = str(label)
        out += block
    dst.write_text("\n".join(out) + "\n")
    return [slot[pos] for pos in order[:len(blocks)]]


def llama_hellaswag(bin_dir, model, blocks, work: Path, extra=()) -> tuple[list[int], list[int], float]:
    """llama.cpp's chosen ending and right/wrong for every task of `blocks`, by task index: runs
    with every label 0, then 1, then 2 (right in run k <=> chose k; never right: chose 3), and one
    with the true labels."""
    n = len(blocks)
    choice, right, wall = [3] * n, [0] * n, 0.0
    for label in (0, 1, 2, None):
        f = work / f"hs-pad-{label}.txt"
        task_of = padded_hellaswag(blocks, f, label)
        out, w = llama(bin_dir, model,
                       ["-f", str(f), "--hellaswag", "-c", "128", "--hellaswag-tasks", str(n + PAD), *extra])
        wall += w
        for line, hit in enumerate(running_hits(out, n)):
            t = task_of[line]
            if label is None:
                right[t] = hit
            elif hit and choice[t] == 3:
                choice[t] = label
    return choice, right, wall


def padded_mc(tasks: list[MultipleChoiceTask], dst: Path, label: int | None = None) -> Path:
    """The tasks (every label at answer `label` when given) plus PAD copies of the first, as binary."""
    out = [t if label is None
           else MultipleChoiceTask(t.question, t.answers, [int(k == label) for k in range(len(t.answers))])
           for t in tasks]
    dst.write_bytes(multiple_choice_bytes(out + [tasks[0]] * PAD))
    return dst


def llama_mc(bin_dir, model, tasks, work: Path, ctx: int, extra=()) -> tuple[list[int], list[int], float]:
    """llama.cpp's chosen answer and right/wrong per task (file order), as llama_hellaswag."""
    n = len(tasks)
    choice, right, wall = [3] * n, [0] * n, 0.0
    for label in (0, 1, 2, None):
        f = padded_mc(tasks, work / f"mc-pad-{label}.bin", label)
        out, w = llama(bin_dir, model, ["-bf", str(f), "--multiple-choice", "-c", str(ctx), *extra])
        wall += w
        for t, hit in enumerate(running_hits(out, n)):
            if label is None:
                right[t] = hit
            elif hit and choice[t] == 3:
                choice[t] = label
    return choice, right, wall


def llama_winogrande(bin_dir, model, rows, work: Path, extra=()) -> tuple[list, float]:
    f = write_winogrande(work / "wg-pad.csv", list(rows) + [rows[0]] * PAD)
    out, wall = llama(bin_dir, model, ["-f", str(f), "--winogrande", "-c", "128", *extra])
    return winogrande_lines(out, len(rows)), wall


# llama.cpp's defaults run attention as ggml's flash attention over an F16 KV cache, which moves
# answer scores by up to ~1e-3 (llmtune computes in float32); with these flags its scores equal
# llmtune's to ~1e-6. Tasks whose answers differ are re-run with them.
EXACT = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]


# ------------------------------------------------------------------------------------ checks
def compare(name: str, ours, choice: list[int] | None, right: list[int], extra: dict | None = None) -> dict:
    """One row of the report: tasks whose chosen answer (and right/wrong) agree."""
    row = {"check": name, "tasks": ours.n_tasks, "llmtune_accuracy": round(100 * ours.accuracy, 4),
           "llamacpp_accuracy": round(100 * sum(right) / len(right), 4),
           "same_right_wrong": sum(int(t.correct) == h for t, h in zip(ours.tasks, right))}
    if choice is not None:
        row["same_choice"] = sum(t.choice == c for t, c in zip(ours.tasks, choice))
        row["differ"] = [t.index for t, c in zip(ours.tasks, choice) if t.choice != c]
    row["llmtune_seconds"] = round(ours.seconds, 2)
    row.update(extra or {})
    print(json.dumps(row), flush=True)
    return row


def recheck(row: dict, ours, llama_choices_of) -> None:
    """The tasks whose answers differ, re-run in llama.cpp with EXACT (float32 attention): how many
    then agree. llama_choices_of(file task indices) -> llama.cpp's choices for them."""
    idx = row.get("differ") or []
    if idx:
        exact = llama_choices_of(idx)
        mine = {t.index: t.choice for t in ours.tasks}
        row["differ_same_with_exact"] = sum(mine[i] == c for i, c in zip(idx, exact))
        print(json.dumps({"check": row["check"], "differ": idx,
                          "differ_same_with_exact": row["differ_same_with_exact"]}),
              flush=True)


def check_model(bin_dir: Path, model: Path, label: str, files: dict, work: Path) -> list[dict]:
    rows = []
    hs = files["hellaswag"]
    blocks = hellaswag_blocks(hs)
    n_hs = len(blocks)
    # every HellaSwag task: llama.cpp's choice (and right/wrong) by task
    choice, right, wall = llama_hellaswag(bin_dir, model, blocks, work)
    ours = evaluate(model, hs, "hellaswag", tasks=n_hs, ctx=128)  # all, in llama.cpp's random order
    rows.append(compare(f"{label} hellaswag all {n_hs}", ours, [choice[t.index] for t in ours.tasks],
                        [right[t.index] for t in ours.tasks], {"llamacpp_seconds_4_runs": round(wall, 1)}))
    recheck(rows[-1], ours, lambda idx: llama_hellaswag(bin_dir, model, [blocks[i] for i in idx], work, EXACT)[0])
    # the default 400 random tasks, run on the file itself: its right/wrong pattern checks the selection
    out, wall = llama(bin_dir, model, ["-f", str(hs), "--hellaswag", "-c", "128", "--hellaswag-tasks", str(400 + PAD)])
    hits = running_hits(out, min(400, n_hs))
    ours = evaluate(model, hs, "hellaswag", ctx=128)
    rows.append(compare(f"{label} hellaswag 400 random", ours, [choice[t.index] for t in ours.tasks], hits,
                        {"llamacpp_seconds": round(wall, 1)}))
    # the MMLU slice as llama.cpp's binary file (and llmtune on the JSONL too)
    mc_tasks = files["mc_tasks"]
    choice, right, wall = llama_mc(bin_dir, model, mc_tasks, work, 768)
    ours = evaluate(model, files["mc"], "multiple-choice", ctx=768)
    jsonl = evaluate(model, files["mc_jsonl"], "multiple-choice", ctx=768)
    rows.append(compare(f"{label} mmlu slice {len(mc_tasks)} (binary)", ours, choice, right,
                        {"llamacpp_seconds_4_runs": round(wall, 1),
                         "jsonl_same_choice": sum(a.choice == b.choice for a, b in zip(ours.tasks, jsonl.tasks))}))
    recheck(rows[-1], ours, lambda idx: llama_mc(bin_dir, model, [mc_tasks[i] for i in idx], work, 768, EXACT)[0])
    # the Winogrande CSV
    lines, wall = llama_winogrande(bin_dir, model, WINOGRANDE, work)
    ours = evaluate(model, files["winogrande"], "winogrande", ctx=128)
    diffs = [max(abs(a - b) for a, b in zip(t.scores, (s1, s2))) for t, (s1, s2, _, _) in zip(ours.tasks, lines)]
    exact, _ = llama_winogrande(bin_dir, model, WINOGRANDE, work, EXACT)
    exact_diff = max(abs(a - b) for t, (s1, s2, _, _) in zip(ours.tasks, exact) for a, b in zip(t.scores, (s1, s2)))
    rows.append(compare(f"{label} winogrande {len(WINOGRANDE)} rows", ours, [r - 1 for _, _, r, _ in lines],
                        [int(r == a) for _, _, r, a in lines],
                        {"max_score_diff": round(max(diffs), 6), "llamacpp_seconds": round(wall, 1),
                         "exact_same_choice": sum(t.choice == r - 1 for t, (_, _, r, _) in zip(ours.tasks, exact)),
                         "exact_max_score_diff": round(exact_diff, 7)}))
    return rows


def finetuned_model(work: Path) -> Path:
    """stories260K after a few AdamW steps on the first 20 KB of the bundled WikiText."""
    import llmtune

    text = work / "ft.txt"
    text.write_text((ROOT / "data" / "wikitext-100k.txt").read_text()[:20000])
    out = work / "stories260K-ft.gguf"
    llmtune.finetune(STORIES, text, out, ctx=64, batch=512, epochs=1, lr=2e-3, val_split=0.0, seed=1)
    return out


def full_mmlu(bin_dir: Path, model: Path, jsonl: Path, work: Path) -> dict:
    """All of MMLU: llama-perplexity and `llmtune eval` on the same binary file (and llmtune on the
    JSONL), each a fresh process timed by its wall clock, one after the other."""
    binary = work / "mmlu-test.bin"
    n = convert(jsonl, binary)
    out, wall = llama(bin_dir, model, ["-bf", str(binary), "--multiple-choice", "-c", "768"])
    m = re.search(r"Final result: ([0-9.]+) \+/- ([0-9.]+)", out)
    printed = max((int(k) for k in re.findall(r"^(\d+)\t[0-9.]+$", out, re.M)), default=0)
    theirs = running_hits(out, printed)
    res = {"tasks": n, "llamacpp_seconds": round(wall, 1), "llamacpp_lines": printed,
           "llamacpp_accuracy": float(m.group(1)) if m else round(100 * sum(theirs) / max(printed, 1), 4)}
    for name, f in (("binary", binary), ("jsonl", jsonl)):
        js = work / f"mmlu-{name}.json"
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "llmtune", "eval", str(model), str(f), "--multiple-choice",
                               "-c", "768", "--summary", "--json", str(js)], capture_output=True, text=True)
        wall = time.perf_counter() - t
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        data = json.loads(js.read_text())
        res[f"llmtune_{name}_seconds"] = round(wall, 1)
        res[f"llmtune_{name}_scoring_seconds"] = round(data["seconds"], 1)
        res[f"llmtune_{name}_accuracy"] = round(100 * data["accuracy"], 4)
        res[f"llmtune_{name}_same_right_wrong"] = sum(int(t["correct"]) == h for t, h in zip(data["tasks"], theirs))
    print(json.dumps(res), flush=True)
    return res


def record_fixtures(bin_dir: Path) -> None:
    """llama.cpp's choices on the small slices in tests/data/benchmarks (stories260K)."""
    rec = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hs = FIXTURES / "hellaswag-20.txt"
        blocks = hellaswag_blocks(hs)
        choice, right, _ = llama_hellaswag(bin_dir, STORIES, blocks, work)
        order = select_tasks("hellaswag", 20, 20)
        rec["hellaswag-20"] = {"args": "--hellaswag -c 128 --hellaswag-tasks 20", "order": order,
                               "choices": [choice[t] for t in order], "right": [right[t] for t in order]}
        lora = ["--lora", str(LORA)]  # a LoRA adapter applied (llama.cpp's --lora)
        choice, _, _ = llama_hellaswag(bin_dir, STORIES, blocks, work, lora)
        rec["hellaswag-20-lora"] = {"args": f"--hellaswag -c 128 --hellaswag-tasks 20 --lora {LORA.relative_to(ROOT)}",
                                    "choices": [choice[t] for t in order]}
        tasks = read_multiple_choice(FIXTURES / "mmlu-20.bin")
        choice, right, _ = llama_mc(bin_dir, STORIES, tasks, work, 256)
        rec["mmlu-20"] = {"args": "--multiple-choice -c 256", "choices": choice, "right": right}
        lines, _ = llama_winogrande(bin_dir, STORIES, WINOGRANDE[:10], work)
        rec["winogrande-10"] = {"args": "--winogrande -c 128", "choices": [r - 1 for _, _, r, _ in lines],
                                "scores": [[a, b] for a, b, _, _ in lines]}
    path = FIXTURES / "llamacpp-choices.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "convert":
        ap = argparse.ArgumentParser(prog="check_benchmarks.py convert")
        ap.add_argument("src", type=Path)
        ap.add_argument("dst", type=Path)
        ap.add_argument("--every", type=int, default=1)
        a = ap.parse_args(sys.argv[2:])
        print(f"wrote {convert(a.src, a.dst, a.every)} tasks to {a.dst}")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "fixtures":
        ap = argparse.ArgumentParser(prog="check_benchmarks.py fixtures")
        ap.add_argument("--bin", type=Path, required=True)
        record_fixtures(ap.parse_args(sys.argv[2:]).bin)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp build/bin with llama-perplexity")
    ap.add_argument("--data", type=Path, default=SHARED, help="folder with hellaswag-val-500.txt and mmlu-test.jsonl")
    ap.add_argument("--mc-every", type=int, default=47, help="MMLU slice: every N-th question")
    ap.add_argument("--full-mmlu", action="store_true", help="also time all of MMLU (llama.cpp and llmtune)")
    ap.add_argument("--only-full-mmlu", action="store_true")
    ap.add_argument("--skip-finetuned", action="store_true")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-perplexity -t (1 is faster on a busy machine)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    LLAMA_THREADS[:] = ["-t", str(a.llama_threads)]
    results = {"checks": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mc_tasks = mmlu_slice(a.data / "mmlu-test.jsonl", a.mc_every)
        mc = work / "mmlu-slice.bin"
        mc.write_bytes(multiple_choice_bytes(mc_tasks))
        mc_jsonl = work / "mmlu-slice.jsonl"
        mc_jsonl.write_text("".join(json.dumps({"topic": t.topic, "question": t.question, "choices": t.answers,
                                                "answer": t.labels.index(1)}) + "\n" for t in mc_tasks))
        files = {"hellaswag": a.data / "hellaswag-val-500.txt", "mc": mc, "mc_tasks": mc_tasks, "mc_jsonl": mc_jsonl,
                 "winogrande": write_winogrande(work / "winogrande.csv")}
        if not a.only_full_mmlu:
            results["checks"] += check_model(a.bin, STORIES, "stories260K", files, work)
            if not a.skip_finetuned:
                results["checks"] += check_model(a.bin, finetuned_model(work), "finetuned", files, work)
        if a.full_mmlu or a.only_full_mmlu:
            results["mmlu"] = full_mmlu(a.bin, STORIES, a.data / "mmlu-test.jsonl", work)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
