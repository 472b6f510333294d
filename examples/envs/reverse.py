"""A single-turn environment in polyrl's short form: a dataset of prompts and a reward function.

What it trains: a model to spell a short word backwards (the config is examples/envs/reverse.yaml).
Full marks (1.0) for the exact reversal; partial credit (0.5) for a reply with the right letters in
another order, which is not a success: success needs full marks unless the entry sets
``success_threshold``.

Run, from the repository root:
  polyrl train --config_path examples/envs/reverse.yaml
  its demonstrations (each row's completion) can warm-start a model first:
  polyrl sft --overrides model_name=HuggingFaceTB/SmolLM2-135M-Instruct \
      environments.reverse.type=module:examples/envs/reverse.py

Expect: reward/mean and success/mean per step, and env/reverse/reward/reversed_word, the reward
function's own value. docs/guides/environments.md explains each part.
"""

from __future__ import annotations

import random

from polyrl.envs.base import SingleTurnEnv

WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "red", "owl", "fig", "jam",
         "kite", "lamp", "frog", "milk", "nest", "ring", "star", "tree", "wolf", "yarn", "zinc", "bolt"]


def reversed_word(completion: str, answer: str) -> float:
    """1.0 for the reversed word, 0.5 for its letters in another order, else 0."""
    reply = completion.strip().strip(".").lower()
    if reply == answer:
        return 1.0
    return 0.5 if sorted(reply) == sorted(answer) else 0.0


def rows(words: list[str]) -> list[dict]:
    return [{"question": f"Spell the word '{w}' backwards. Reply with the reversed word only.",
             "answer": w[::-1], "completion": w[::-1]} for w in words]


def load_environment(num_test: int = 4, seed: int = 0) -> SingleTurnEnv:
    """The entry's ``args`` arrive here: ``num_test`` words are held out for evaluation."""
    words = list(WORDS)
    random.Random(seed).shuffle(words)
    return SingleTurnEnv(dataset=rows(words[num_test:]), eval_dataset=rows(words[:num_test]),
                         rubric=reversed_word)
