"""A multi-turn environment written against polyrl's own API: an EnvBuilder that makes one Env per task.

What it trains: a model to find a secret number from 1 to 4 in at most two guesses (the config is
examples/envs/guess.yaml). A first-try hit earns 1.0, a hit after the "higher"/"lower" hint 0.5;
the environment gives its own verdict, ``success``, for a hit on either try.

Run, from the repository root:
  polyrl train --config_path examples/envs/guess.yaml
  its demonstrations (a first-try hit) can warm-start a model first:
  polyrl sft --overrides model_name=HuggingFaceTB/SmolLM2-135M-Instruct \
      environments.guess.type=module:examples/envs/guess.py:GuessBuilder \
      environments.guess.splits.train.num_samples=64

Expect: reward/mean and success/mean per step; env/guess/tries, the guesses an episode took.
docs/guides/environments.md explains each part.
"""

from __future__ import annotations

import random
from typing import Any

from polyrl.envs.base import Env, EnvBuilder, Message, Observation, StepResult, ToolSpec


def prompt(high: int) -> Message:
    return {"role": "user", "content": f"I am thinking of a number from 1 to {high}. Guess it: reply with "
                                       "the number only."}


class GuessEnv(Env):
    """One game: ``reset`` asks for a guess, each ``step`` judges one."""

    def __init__(self, secret: int, high: int):
        self.secret, self.high, self.tries = secret, high, 0

    async def reset(self) -> Observation:
        return Observation([prompt(self.high)])

    async def step(self, action: Message) -> StepResult:
        self.tries += 1
        text = action["content"].strip()
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            reward = 1.0 if self.tries == 1 else 0.5
            return StepResult(reward=reward, done=True, metrics={"success": 1.0, "tries": self.tries})
        if self.tries == 2:
            return StepResult(reward=0.0, done=True, metrics={"success": 0.0, "tries": self.tries})
        hint = "Higher." if guess is not None and guess < self.secret else "Lower."
        if guess is None:
            hint = "Reply with a number only."
        return StepResult(messages=[{"role": "user", "content": f"No. {hint} One more try."}])


class GuessBuilder(EnvBuilder):
    """Args: ``high`` (the largest secret, default 4)."""

    def __init__(self, args: dict[str, Any], seed: int = 0):
        super().__init__(args, seed)
        unknown = sorted(set(self.args) - {"high"})
        if unknown:  # checked when the config loads: `polyrl train --print-config` reports it
            raise ValueError(f"unknown arg {unknown[0]!r} (known: high)")
        self.high = self.args.get("high", 4)
        if not isinstance(self.high, int) or self.high < 2:
            raise ValueError(f"high must be an integer >= 2, got {self.high!r}")

    def secret(self, split: str, index: int) -> int:
        """The task: a function of (seed, split, index) alone, so runs and resumes see the same ones."""
        return random.Random(f"{self.seed}/{split}/{index}").randint(1, self.high)

    def make(self, split: str, index: int) -> GuessEnv:
        return GuessEnv(self.secret(split, index), self.high)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        """An expert game for `polyrl sft`: the prompt, then the right number at once."""
        return [prompt(self.high), {"role": "assistant", "content": str(self.secret(split, index))}], []
