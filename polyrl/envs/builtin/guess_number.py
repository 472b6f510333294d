"""``guess_number``: multi-turn, guess a secret integer with higher/lower feedback.

Replies are a bare number (``8``). The expert demonstration is a binary search; the designed mistake
a linear search that runs out of guesses.
"""

from __future__ import annotations

from polyrl.envs.answers import answer_value, same_number
from polyrl.envs.base import Message, Observation, StepResult, ToolSpec, register_env
from polyrl.envs.builtin.base import (
    BuiltinBuilder,
    Policy,
    SyncEnv,
    assistant_message,
    demonstrate,
    user_message,
)
from polyrl.renderers.base import message_text

_HIGHER, _LOWER, _UNPARSEABLE = "Higher.", "Lower.", "Reply with one number."


class GuessNumberEnv(SyncEnv):
    """Multi-turn: guess a secret integer with higher/lower feedback; every reply is a guess."""

    def __init__(self, secret: int, low: int, high: int, max_guesses: int):
        super().__init__()
        self.secret, self.low, self.high, self.max_guesses = secret, low, high, max_guesses
        self.guesses = 0

    def _reset(self) -> Observation:
        return Observation(
            [
                user_message(
                    f"Guess my secret number between {self.low} and {self.high}. You have "
                    f"{self.max_guesses} guesses. Reply with one number; I will say higher or lower."
                )
            ]
        )

    def _step(self, action: Message) -> StepResult:
        self.guesses += 1
        guess = answer_value(message_text(action))
        if same_number(guess, self.secret):
            return StepResult([], 1.0, True, {"success": 1.0, "num_guesses": float(self.guesses)})
        if self.guesses >= self.max_guesses:
            return StepResult([], 0.0, True, {"success": 0.0, "num_guesses": float(self.guesses)})
        if guess is None:
            reply = _UNPARSEABLE
        else:
            reply = _HIGHER if self.secret > guess else _LOWER
        return StepResult([user_message(reply)], 0.0, False)


@register_env("guess_number")
class GuessNumberBuilder(BuiltinBuilder):
    """Args: ``low``/``high`` (default 1..16), ``max_guesses`` (default 6), ``demo_error_rate``.

    No hash partition here: with ~16 secrets it would leave test a couple of values; train and test
    still use separate random streams.
    """

    name = "guess_number"
    defaults = {"low": 1, "high": 16, "max_guesses": 6}

    def _validate(self) -> None:
        self.low, self.high = self._range_args("low", "high")
        if self.low == self.high:
            raise ValueError(f"{self.name}: high must be greater than low")
        self.max_guesses = self._int_arg("max_guesses", 1)

    def secret(self, split: str, index: int) -> int:
        return self._rng(split, index).randint(self.low, self.high)

    def make(self, split: str, index: int) -> GuessNumberEnv:
        return GuessNumberEnv(self.secret(split, index), self.low, self.high, self.max_guesses)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        """Binary search (expert) or, as the designed mistake, a linear search in steps of 1 from
        the end of the range farther from the secret (it runs out of guesses whenever
        ``(high - low) / 2 >= max_guesses``, as with the defaults)."""
        secret = self.secret(split, index)
        env = self.make(split, index)
        if self._demo_has_error(split, index):
            start, step = (self.high, -1) if secret - self.low <= self.high - secret else (self.low, 1)

            def expert() -> Policy:
                guess = start
                while True:
                    yield assistant_message(str(guess))
                    guess += step

        else:

            def expert() -> Policy:
                lo, hi = self.low, self.high
                while True:
                    guess = (lo + hi) // 2
                    result = yield assistant_message(str(guess))
                    if result.messages and result.messages[0]["content"] == _HIGHER:
                        lo = guess + 1
                    else:
                        hi = guess - 1

        return demonstrate(env, expert(), max_steps=self.max_guesses)
