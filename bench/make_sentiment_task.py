"""Write the project's verifiable GRPO task: one-word sentiment labels for short product reviews.

data/sentiment-train.jsonl and data/sentiment-test.jsonl hold chat prompt records
{"prompt": [{"role": "user", "content": ...}], "label": "positive" | "negative"}, scored by
`--reward exact:label`. The reviews are composed here from hand-written clauses (no download, no
model): a subject and one or two clauses of the same polarity, so every label is unambiguous. The
test split uses subjects the training split never sees, so a rising held-out reward is the answer
format and the polarity generalising, not memorised reviews.

SmolLM2-135M-Instruct knows the polarity but answers in a sentence ("This review is negative."),
so greedy decoding scores ~0 under exact:label and sampling at temperature 1 sometimes answers in
one word: the reward varies within a group, which is what GRPO learns from.

    python bench/make_sentiment_task.py   # rewrites both files (deterministic: seed 0)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TRAIN_SUBJECTS = ["food", "service", "movie", "hotel room", "phone", "battery", "book", "coffee", "laptop",
                  "headphones", "pizza", "delivery", "camera", "shoes", "app", "concert", "hotel staff",
                  "keyboard", "game", "jacket", "soup", "printer", "car", "tour guide"]
TEST_SUBJECTS = ["restaurant", "vacuum cleaner", "backpack", "museum", "blender", "train ride", "novel",
                 "bakery", "monitor", "yoga class"]
POSITIVE = ["was wonderful", "exceeded my expectations", "works perfectly", "was a delight", "is excellent value",
            "made my day", "was fantastic", "is the best I have had", "was friendly and quick",
            "was worth every penny", "was beautifully made", "arrived early and works great"]
NEGATIVE = ["was awful", "broke after a day", "was a waste of money", "was cold and bland", "stopped working",
            "was rude and slow", "is the worst I have had", "was a disappointment", "was dirty",
            "arrived late and damaged", "was painfully boring", "fell apart quickly"]
POSITIVE_REMARKS = ["I would buy it again.", "I loved it.", "Highly recommended!", "Five stars.", "So happy with it."]
NEGATIVE_REMARKS = ["I want my money back.", "Never again.", "I regret buying it.", "One star.", "Avoid it."]
QUESTION = "Review: \"{review}\" Is this review positive or negative? Answer with one word."


def review(rng: random.Random, subject: str, positive: bool) -> str:
    """'The {subject} {clause}' with an optional second clause and an optional remark, all of one polarity."""
    first, second = rng.sample(POSITIVE if positive else NEGATIVE, 2)
    text = f"The {subject} {first}" + (f" and {second}" if rng.random() < 0.3 else "") + rng.choice([".", "!"])
    if rng.random() < 0.5:
        text += " " + rng.choice(POSITIVE_REMARKS if positive else NEGATIVE_REMARKS)
    return text


def records(rng: random.Random, subjects: list[str], n: int) -> list[dict]:
    out = []
    for i in range(n):
        label = "positive" if i % 2 == 0 else "negative"
        text = review(rng, rng.choice(subjects), label == "positive")
        out.append({"prompt": [{"role": "user", "content": QUESTION.format(review=text)}], "label": label})
    rng.shuffle(out)
    return out


def main() -> None:
    rng = random.Random(0)
    root = Path(__file__).resolve().parent.parent / "data"
    splits = (("sentiment-train.jsonl", TRAIN_SUBJECTS, 128), ("sentiment-test.jsonl", TEST_SUBJECTS, 64))
    for name, subjects, n in splits:
        rows = records(rng, subjects, n)
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{root / name}: {len(rows)} records")


if __name__ == "__main__":
    main()
