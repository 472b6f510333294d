"""``arithmetic``: single turn, "What is A op B?"; reward 1 for the right number in ``\\boxed{}``.

The designed demonstration mistake drops a carry (``+``) or a borrow (``-``): :func:`arithmetic_mistake`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ArithmeticTask:
    a: int
    op: str
    b: int
    answer: int


class ArithmeticEnv(SyncEnv):
    """Single turn: "What is A op B?"; reward 1 for the right number."""

    def __init__(self, task: ArithmeticTask):
        super().__init__()
        self.task = task

    def _reset(self) -> Observation:
        t = self.task
        prompt = f"What is {t.a} {t.op} {t.b}? Put the final answer in \\boxed{{}}."
        return Observation([user_message(prompt)])

    def _step(self, action: Message) -> StepResult:
        value = answer_value(message_text(action))
        success = float(same_number(value, self.task.answer))
        return StepResult([], success, True, {"success": success, "format_ok": float(value is not None)})


def _forgot_carry(a: int, b: int) -> int:
    """a + b written column by column without carrying (the last column written in full): 48+35 -> 73."""
    result, place = 0, 1
    while a or b:
        column = a % 10 + b % 10
        a, b = a // 10, b // 10
        result += (column % 10 if a or b else column) * place
        place *= 10
    return result


def _forgot_borrow(a: int, b: int) -> int:
    """a - b (a >= b) borrowing 10 but never decrementing the next column: 52-17 -> 45."""
    result, place = 0, 1
    while a or b:
        da, db = a % 10, b % 10
        a, b = a // 10, b // 10
        result += (da - db if da >= db else da + 10 - db) * place
        place *= 10
    return result


def arithmetic_mistake(a: int, op: str, b: int, answer: int) -> int:
    """The designed wrong answer: the carry (``+``) or borrow (``-``) dropped; when that changes
    nothing (no carry, or ``*``, ``/``, negative operands) the answer off by 10 instead, so the
    mistake is always wrong."""
    wrong = answer
    if a >= 0 and b >= 0 and op == "+":
        wrong = _forgot_carry(a, b)
    elif a >= 0 and b >= 0 and op == "-":
        wrong = _forgot_borrow(a, b) if a >= b else -_forgot_borrow(b, a)
    if wrong == answer:
        wrong = answer - 10 if answer >= 10 else answer + 10
    return wrong


@register_env("arithmetic")
class ArithmeticBuilder(BuiltinBuilder):
    """Args: ``min_value``/``max_value`` (operands, default 0..99), ``ops`` (subset of
    ``+ - * /``, default ``["+", "-"]``; ``/`` is always exact), ``demo_error_rate``."""

    name = "arithmetic"
    defaults = {"min_value": 0, "max_value": 99, "ops": ["+", "-"]}

    def _validate(self) -> None:
        self.low, self.high = self._range_args("min_value", "max_value")
        self.ops = self._list_arg("ops", ("+", "-", "*", "/"))
        if "/" in self.ops and self.high < 1:
            raise ValueError(f"{self.name}: ops '/' needs max_value >= 1 (a non-zero divisor)")

    def _sample(self, rng: random.Random) -> ArithmeticTask:
        op = rng.choice(self.ops)
        if op == "/":  # a multiple of a non-zero divisor, so the answer is an integer
            b = rng.randint(max(1, self.low), self.high)
            q = rng.randint(self.low, self.high)
            return ArithmeticTask(b * q, op, b, q)
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return ArithmeticTask(a, op, b, answer)

    def task(self, split: str, index: int) -> ArithmeticTask:
        return self._draw(split, index, self._sample, lambda t: f"{t.a}{t.op}{t.b}")

    def make(self, split: str, index: int) -> ArithmeticEnv:
        return ArithmeticEnv(self.task(split, index))

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        t = self.task(split, index)
        answer = t.answer
        if self._demo_has_error(split, index):
            answer = arithmetic_mistake(t.a, t.op, t.b, t.answer)

        def expert() -> Policy:
            yield assistant_message(f"\\boxed{{{answer}}}")

        return demonstrate(ArithmeticEnv(t), expert())
