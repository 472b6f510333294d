"""Shout: write a given word in capital letters, with one retry after feedback.

Minds RL's step-based shape, which polyrl's ``module:`` adapter runs as it is:
``load_environment(**args)`` makes one object per episode; ``initial_observation(index, split)`` is
the task (the first user message) and ``step(text)`` scores a reply. A wrong first reply gets feedback
and another try (a mapping with an ``observation`` and ``done: False``); the reward is 1 for a first
try, ``retry_reward`` for a second, else 0.
"""

from __future__ import annotations

import random

WORDS = {  # held-out words for the test split: capitals are a skill, not a list to memorize
    "train": ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "chair", "ocean", "pencil",
              "garden", "rocket", "yellow", "window", "forest", "button"),
    "test": ("candle", "silver", "planet", "winter", "basket", "mirror", "island", "carpet"),
}
NUM_TASKS = {"train": 1000, "test": 32}


class Shout:
    def __init__(self, max_tries: int = 2, retry_reward: float = 0.5):
        self.max_tries, self.retry_reward = max_tries, retry_reward
        self.word, self.tries = "", 0

    def num_tasks(self, split: str) -> int:
        return NUM_TASKS[split]

    def initial_observation(self, index: int = 0, split: str = "train") -> str:
        self.word = random.Random(f"{split}-{index}").choice(WORDS[split])
        return f"Write the word {self.word} in capital letters. Reply with the word only."

    def step(self, action_text: str) -> dict:
        self.tries += 1
        reply = action_text.strip().strip(".!\"'*` ")
        if reply == self.word.upper():
            reward = 1.0 if self.tries == 1 else self.retry_reward
            return {"reward": reward, "done": True, "metrics": {"tries": float(self.tries)}}
        if self.tries < self.max_tries:
            return {"reward": 0.0, "done": False,
                    "observation": f"Not quite: reply with {self.word} in capital letters, nothing else."}
        return {"reward": 0.0, "done": True, "metrics": {"tries": float(self.tries)}}


def load_environment(max_tries: int = 2, retry_reward: float = 0.5) -> Shout:
    return Shout(max_tries, retry_reward)
