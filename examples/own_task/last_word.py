"""Last word: reply with the last word of a short list of words (a single-turn task, reward 1 or 0).

The dataset + reward form of a ``module:`` environment: ``load_environment(**args)`` returns an object
with a ``dataset`` (rows with a ``question`` and an ``answer``), an ``eval_dataset`` (the held-out
rows of the test split), a ``system_prompt`` and a ``rubric`` (reward functions, called with the
reply as ``completion`` and the row's ``answer``). Point a config at this file with
``type: module:examples/own_task/last_word.py``; ``make_demos.py`` writes demonstrations of it.
"""

from __future__ import annotations

import random

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "chair", "ocean", "pencil",
         "garden", "rocket", "yellow", "window", "forest", "button", "candle", "silver", "planet", "winter",
         "basket", "mirror", "island", "carpet")
SYSTEM_PROMPT = "Reply with the last word of the list, nothing else."


def make_rows(n: int, seed: int, min_words: int = 3, max_words: int = 5) -> list[dict]:
    """``n`` tasks: a list of words to read and the last one as the answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(min_words, max_words))
        rows.append({"question": " ".join(words), "answer": words[-1]})
    return rows


def exact_match(completion: str, answer: str) -> float:
    """1 when the reply is the answer (spaces and a final full stop aside), else 0."""
    return float(completion.strip().rstrip(".").strip() == answer)


class LastWord:
    system_prompt = SYSTEM_PROMPT

    def __init__(self, num_train: int = 2000, num_test: int = 64, seed: int = 0):
        self.dataset = make_rows(num_train, seed)
        self.eval_dataset = make_rows(num_test, seed + 1)  # other lists than the training ones
        self.rubric = [exact_match]


def load_environment(num_train: int = 2000, num_test: int = 64, seed: int = 0) -> LastWord:
    return LastWord(num_train, num_test, seed)
