"""``countdown``: single turn, combine the given numbers, each exactly once, into the target.

The answer is an expression (``\\boxed{(3+5)*2}``), read by :func:`countdown_expression` and
evaluated exactly. Every target is built from a random expression over the numbers, so every task
is solvable; the designed demonstration mistake swaps one operator
(:meth:`CountdownBuilder.mistaken_expression`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Union

from polyrl.envs.answers import ExpressionError, boxed_contents, evaluate_expression
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

Tree = Union[int, tuple[str, "Tree", "Tree"]]
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _tree_value(tree: Tree) -> Fraction:
    """Exact value; raises ZeroDivisionError."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, left, right = tree
    a, b = _tree_value(left), _tree_value(right)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b if op == "*" else a / b  # Fraction division by zero raises ZeroDivisionError


def render_tree(tree: Tree) -> str:
    """Compact infix with only the parentheses the value needs: ``(3+5)*2``."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    left_s, right_s = render_tree(left), render_tree(right)
    if not isinstance(left, int) and _PRECEDENCE[left[0]] < _PRECEDENCE[op]:
        left_s = f"({left_s})"
    if not isinstance(right, int) and (
        _PRECEDENCE[right[0]] < _PRECEDENCE[op] or (_PRECEDENCE[right[0]] == _PRECEDENCE[op] and op in "-/")
    ):
        right_s = f"({right_s})"
    return f"{left_s}{op}{right_s}"


def _op_variants(tree: Tree) -> list[Tree]:
    """Every tree that differs from ``tree`` in exactly one operator."""
    if isinstance(tree, int):
        return []
    op, left, right = tree
    variants: list[Tree] = [(other, left, right) for other in "+-*/" if other != op]
    variants += [(op, v, right) for v in _op_variants(left)]
    variants += [(op, left, v) for v in _op_variants(right)]
    return variants


@dataclass(frozen=True)
class CountdownTask:
    numbers: tuple[int, ...]  # in the order shown to the model
    target: int
    solution: Tree  # the expression the target was built from


_EXPRESSION_RUN_RE = re.compile(r"[0-9+\-*/()\u00d7\u00f7\u2212 ]+")


def countdown_expression(text: str) -> str:
    """The expression in a countdown reply: inside the last box (else the whole reply), the last run
    of arithmetic characters that contains an operator (so "= 16" suffixes and prose are skipped)."""
    boxed = [b for b in boxed_contents(text) if b.strip()]
    source = boxed[-1] if boxed else text
    runs = [r.strip() for r in _EXPRESSION_RUN_RE.findall(source) if any(c.isdigit() for c in r)]
    with_op = [r for r in runs if re.search(r"\d\s*[+\-*/\u00d7\u00f7\u2212]", r)]
    if with_op:
        return with_op[-1]
    return runs[-1] if runs else source.strip()


class CountdownEnv(SyncEnv):
    """Single turn: combine the given numbers, each exactly once, into the target."""

    def __init__(self, task: CountdownTask):
        super().__init__()
        self.task = task

    def _reset(self) -> Observation:
        nums = ", ".join(map(str, self.task.numbers))
        return Observation(
            [
                user_message(
                    f"Use {nums} to make {self.task.target}. Use each number exactly once, "
                    "with + - * / and parentheses. Put the expression in \\boxed{}."
                )
            ]
        )

    def _step(self, action: Message) -> StepResult:
        try:
            value, literals = evaluate_expression(countdown_expression(message_text(action)))
        except ExpressionError:
            return StepResult([], 0.0, True, {"success": 0.0, "format_ok": 0.0})
        success = float(Counter(literals) == Counter(self.task.numbers) and value == self.task.target)
        return StepResult([], success, True, {"success": success, "format_ok": 1.0})


@register_env("countdown")
class CountdownBuilder(BuiltinBuilder):
    """Args: ``num_numbers`` (2..6, default 3), ``min_number``/``max_number`` (default 1..10),
    ``ops`` used to build targets (subset of ``+ - * /``, default ``["+", "-", "*"]``; answers may
    always use all four), ``demo_error_rate``."""

    name = "countdown"
    defaults = {"num_numbers": 3, "min_number": 1, "max_number": 10, "ops": ["+", "-", "*"]}

    def _validate(self) -> None:
        self.count = self._int_arg("num_numbers", 2)
        if self.count > 6:
            raise ValueError(f"{self.name}: num_numbers must be at most 6, got {self.count}")
        self.low, self.high = self._range_args("min_number", "max_number", minimum=1)
        self.ops = self._list_arg("ops", ("+", "-", "*", "/"))

    def _sample(self, rng: random.Random) -> CountdownTask:
        """Build a random expression over random numbers; its value (a positive integer) is the
        target, so every task is solvable. Falls back to a plain sum if ``ops`` cannot yield one."""
        numbers = [rng.randint(self.low, self.high) for _ in range(self.count)]
        tree: Tree = 0
        for attempt in range(100):
            nodes: list[Tree] = list(numbers)
            while len(nodes) > 1:  # join a random adjacent pair: random tree shapes
                i = rng.randrange(len(nodes) - 1)
                nodes[i : i + 2] = [(rng.choice(self.ops), nodes[i], nodes[i + 1])]
            tree = nodes[0]
            try:
                value = _tree_value(tree)
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and value > 0:
                break
        else:
            tree = numbers[0]
            for n in numbers[1:]:
                tree = ("+", tree, n)
        shown = list(numbers)
        rng.shuffle(shown)  # the display order does not give the solution's order away
        return CountdownTask(tuple(shown), int(_tree_value(tree)), tree)

    def task(self, split: str, index: int) -> CountdownTask:
        return self._draw(split, index, self._sample, lambda t: f"{sorted(t.numbers)}->{t.target}")

    def make(self, split: str, index: int) -> CountdownEnv:
        return CountdownEnv(self.task(split, index))

    def mistaken_expression(self, task: CountdownTask, rng: random.Random) -> str:
        """A plausible near-miss: the solution with one operator swapped, still an integer (positive
        when possible) but not the target. If no swap works, part of the solution (numbers unused)."""
        candidates = []
        for variant in _op_variants(task.solution):
            try:
                value = _tree_value(variant)
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and value != task.target:
                candidates.append(variant)
        positive = [c for c in candidates if _tree_value(c) > 0]  # a countdown player aims positive
        if positive or candidates:
            return render_tree(rng.choice(positive or candidates))
        solution = task.solution
        return render_tree(solution[1] if not isinstance(solution, int) else solution + 1)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        t = self.task(split, index)
        if self._demo_has_error(split, index):
            expression = self.mistaken_expression(t, self._rng(split, index, "mistake"))
        else:
            expression = render_tree(t.solution)

        def expert() -> Policy:
            yield assistant_message(f"\\boxed{{{expression}}}")

        return demonstrate(CountdownEnv(t), expert())
