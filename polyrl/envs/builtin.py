"""Built-in environments: procedurally generated, offline, cheap, and verifiable.

They exist so polyrl can be tested and demonstrated end to end without any network or external
package: a tiny model can be warm-started on their demonstrations and then improved by RL.

Answer format: the final answer is the content of the last ``\\boxed{...}`` in the reply; without a
box, the last number (see :func:`extract_answer`), or for ``countdown`` the last arithmetic run of
the reply (:func:`countdown_expression`). Prompts ask for the box and demonstrations use it
(``\\boxed{57}``, ``\\boxed{(3+5)*2}``), except ``guess_number`` whose replies are a bare number (``8``).

Tasks are deterministic functions of (builder seed, split, index). Each split has its own random
stream, and the task space is additionally partitioned by a hash of the task (about 1/8 held out for
``test``), so test problems never appear in train (except ``guess_number``, whose task space is a
handful of secrets).

``demo_error_rate`` makes a fixed, per-task fraction of demonstrations contain one *consistent*
mistake (dropped carries, missed targets, linear search, an operand left out of the calculator call),
so a supervised warm start leaves RL something real to fix.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Generator, TypeVar, Union

from polyrl.envs.answers import (
    ExpressionError,
    answer_value,
    boxed_contents,
    evaluate_expression,
    extract_answer,
    parse_number,
    same_number,
)
from polyrl.envs.base import Env, EnvBuilder, Message, Observation, StepResult, ToolSpec, register_env
from polyrl.renderers.base import message_text

__all__ = [
    "ExpressionError",
    "answer_value",
    "evaluate_expression",
    "extract_answer",
    "parse_number",
]

T = TypeVar("T")


def _format_value(value: Fraction) -> str:
    """Integers exactly; other values as a short decimal (what a calculator shows)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


# --------------------------------------------------------------------------------------------------
# Shared machinery.

_SPLITS = ("train", "test")
_TEST_BUCKETS = 8  # 1 in 8 tasks (by hash) belongs to the test split
_MAX_DRAWS = 200


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


class _SyncEnv(Env):
    """A synchronous core behind the async interface.

    Demonstrations replay the expert through the very same ``_reset``/``_step`` logic (so demos and
    rewards cannot disagree) without needing an event loop inside ``EnvBuilder.demonstration``.
    """

    def __init__(self) -> None:
        self._started = False
        self._done = False

    async def reset(self) -> Observation:
        return self.reset_sync()

    async def step(self, action: Message) -> StepResult:
        return self.step_sync(action)

    def reset_sync(self) -> Observation:
        self._started = True
        return self._reset()

    def step_sync(self, action: Message) -> StepResult:
        if not self._started:
            raise RuntimeError("step() called before reset()")
        if self._done:
            raise RuntimeError("step() called after the episode ended")
        result = self._step(action)
        self._done = result.done
        return result

    def _reset(self) -> Observation:
        raise NotImplementedError

    def _step(self, action: Message) -> StepResult:
        raise NotImplementedError


# An expert policy: yields assistant messages, is sent each StepResult of the env.
Policy = Generator[Message, StepResult, None]


def _demonstrate(env: _SyncEnv, policy: Policy, max_steps: int = 100) -> tuple[list[Message], list[ToolSpec]]:
    """Run ``policy`` against ``env``; the whole conversation (prompt, replies, env answers)."""
    obs = env.reset_sync()
    messages = list(obs.messages)
    action = next(policy)
    for _ in range(max_steps):
        result = env.step_sync(action)
        messages += [action, *result.messages]
        if result.done:
            return messages, obs.tools
        action = policy.send(result)
    raise RuntimeError("demonstration did not finish")


class _BuiltinBuilder(EnvBuilder):
    """Arg validation, per-task seeding and the held-out partition shared by the built-ins."""

    name = ""
    defaults: dict[str, Any] = {}

    def __init__(self, args: dict[str, Any] | None = None, seed: int = 0):
        super().__init__(args or {}, seed)
        known = {**self.defaults, "demo_error_rate": 0.0}
        unknown = sorted(set(self.args) - set(known))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown arg {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        self.opts: dict[str, Any] = {**known, **self.args}
        rate = self.opts["demo_error_rate"]
        if not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"{self.name}: demo_error_rate must be in [0, 1], got {rate!r}")
        self._validate()

    def _validate(self) -> None:
        """Check ``self.opts``; raise ValueError naming the bad arg."""

    def _int_arg(self, key: str, minimum: int | None = None) -> int:
        value = self.opts[key]
        if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
            raise ValueError(f"{self.name}: {key} must be an integer >= {minimum}, got {value!r}")
        return value

    def _range_args(self, low_key: str, high_key: str, minimum: int | None = None) -> tuple[int, int]:
        low, high = self._int_arg(low_key, minimum), self._int_arg(high_key, minimum)
        if low > high:
            raise ValueError(f"{self.name}: {low_key} ({low}) must not exceed {high_key} ({high})")
        return low, high

    def _list_arg(self, key: str, allowed: tuple[str, ...]) -> list[str]:
        value = self.opts[key]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value or any(v not in allowed for v in value):
            raise ValueError(
                f"{self.name}: {key} must be a non-empty list from {list(allowed)}, got {value!r}"
            )
        return list(value)

    def _rng(self, split: str, index: int, purpose: str = "task") -> random.Random:
        """A private stream per (seed, split, index, purpose); string seeds hash stably across runs."""
        if split not in _SPLITS:
            raise ValueError(f"{self.name}: unknown split {split!r} (expected one of {_SPLITS})")
        return random.Random(f"polyrl/{self.name}/{self.seed}/{split}/{index}/{purpose}")

    def _in_test_bucket(self, key: str) -> bool:
        digest = hashlib.sha256(f"{self.name}/{self.seed}/{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % _TEST_BUCKETS == 0

    def _draw(
        self, split: str, index: int, sample: Callable[[random.Random], T], key: Callable[[T], str]
    ) -> T:
        """A task of ``split``: rejection-sample until it falls on the split's side of the partition.

        Gives up after ``_MAX_DRAWS`` so a degenerate (tiny) task space cannot loop forever.
        """
        rng = self._rng(split, index)
        want_test = split == "test"
        task = sample(rng)
        for _ in range(_MAX_DRAWS):
            if self._in_test_bucket(key(task)) == want_test:
                break
            task = sample(rng)
        return task

    def _demo_has_error(self, split: str, index: int) -> bool:
        """Whether this task's demonstration carries the designed mistake (fixed per task)."""
        return self._rng(split, index, "demo").random() < self.opts["demo_error_rate"]


# --------------------------------------------------------------------------------------------------
# arithmetic


@dataclass(frozen=True)
class ArithmeticTask:
    a: int
    op: str
    b: int
    answer: int


class ArithmeticEnv(_SyncEnv):
    """Single turn: "What is A op B?"; reward 1 for the right number."""

    def __init__(self, task: ArithmeticTask):
        super().__init__()
        self.task = task

    def _reset(self) -> Observation:
        t = self.task
        return Observation([_user(f"What is {t.a} {t.op} {t.b}? Put the final answer in \\boxed{{}}.")])

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
class ArithmeticBuilder(_BuiltinBuilder):
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
            yield _assistant(f"\\boxed{{{answer}}}")

        return _demonstrate(ArithmeticEnv(t), expert())


# --------------------------------------------------------------------------------------------------
# countdown

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


def _render(tree: Tree) -> str:
    """Compact infix with only the parentheses the value needs: ``(3+5)*2``."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    left_s, right_s = _render(left), _render(right)
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


class CountdownEnv(_SyncEnv):
    """Single turn: combine the given numbers, each exactly once, into the target."""

    def __init__(self, task: CountdownTask):
        super().__init__()
        self.task = task

    def _reset(self) -> Observation:
        nums = ", ".join(map(str, self.task.numbers))
        return Observation(
            [
                _user(
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
class CountdownBuilder(_BuiltinBuilder):
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
            return _render(rng.choice(positive or candidates))
        solution = task.solution
        return _render(solution[1] if not isinstance(solution, int) else solution + 1)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        t = self.task(split, index)
        if self._demo_has_error(split, index):
            expression = self.mistaken_expression(t, self._rng(split, index, "mistake"))
        else:
            expression = _render(t.solution)

        def expert() -> Policy:
            yield _assistant(f"\\boxed{{{expression}}}")

        return _demonstrate(CountdownEnv(t), expert())


# --------------------------------------------------------------------------------------------------
# guess_number

_HIGHER, _LOWER, _UNPARSEABLE = "Higher.", "Lower.", "Reply with one number."


class GuessNumberEnv(_SyncEnv):
    """Multi-turn: guess a secret integer with higher/lower feedback; every reply is a guess."""

    def __init__(self, secret: int, low: int, high: int, max_guesses: int):
        super().__init__()
        self.secret, self.low, self.high, self.max_guesses = secret, low, high, max_guesses
        self.guesses = 0

    def _reset(self) -> Observation:
        return Observation(
            [
                _user(
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
        return StepResult([_user(reply)], 0.0, False)


@register_env("guess_number")
class GuessNumberBuilder(_BuiltinBuilder):
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
                    yield _assistant(str(guess))
                    guess += step

        else:

            def expert() -> Policy:
                lo, hi = self.low, self.high
                while True:
                    guess = (lo + hi) // 2
                    result = yield _assistant(str(guess))
                    if result.messages and result.messages[0]["content"] == _HIGHER:
                        lo = guess + 1
                    else:
                        hi = guess - 1

        return _demonstrate(env, expert(), max_steps=self.max_guesses)


# --------------------------------------------------------------------------------------------------
# calculator

CALCULATOR_TOOL: ToolSpec = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example: 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}


@dataclass(frozen=True)
class CalculatorTask:
    expression: str  # as shown in the prompt, and what the expert sends to the tool
    answer: int


def run_calculator(call: dict[str, Any]) -> str:
    """The tool's reply to one parsed call: the result, or an ``error: ...`` text (never raises)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return "error: malformed tool call"
    name = function.get("name")
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator"
    args = function.get("arguments")
    if isinstance(args, str):  # some renderers keep the raw JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return "error: arguments are not valid JSON"
    if not isinstance(args, dict) or "expression" not in args:
        return "error: missing argument 'expression'"
    expression = args["expression"]
    if isinstance(expression, bool) or not isinstance(expression, (str, int, float)):
        return "error: 'expression' must be a string"
    try:
        value, _ = evaluate_expression(str(expression), allow_decimals=True, allow_unary=True)
        return _format_value(value)
    except (ExpressionError, OverflowError) as e:
        return f"error: {e}"


class CalculatorEnv(_SyncEnv):
    """Multi-turn tool use: tool calls are answered (reward 0), a reply without calls is final."""

    def __init__(self, task: CalculatorTask, max_tool_calls: int):
        super().__init__()
        self.task, self.max_tool_calls = task, max_tool_calls
        self.tool_calls = 0

    def _reset(self) -> Observation:
        prompt = (
            f"What is {self.task.expression}? Use the calculator tool, "
            "then put the final answer in \\boxed{}."
        )
        return Observation([_user(prompt)], [CALCULATOR_TOOL])

    def _step(self, action: Message) -> StepResult:
        calls = action.get("tool_calls") or []
        errors = action.get("tool_call_errors") or []
        if not calls and not errors:
            success = float(same_number(answer_value(message_text(action)), self.task.answer))
            return StepResult([], success, True, {"success": success, "tool_calls": float(self.tool_calls)})
        self.tool_calls += len(calls) + len(errors)
        if self.tool_calls > self.max_tool_calls:
            return StepResult([], 0.0, True, {"success": 0.0, "tool_calls": float(self.tool_calls)})
        replies: list[Message] = []
        for i, call in enumerate(calls):
            call_id = call.get("id") if isinstance(call, dict) else None
            replies.append(
                {"role": "tool", "tool_call_id": call_id or f"call_{i}", "content": run_calculator(call)}
            )
        if errors:  # malformed calls have no id to answer, so they get one user message
            replies.append(_user("Tool call error: " + "; ".join(str(e) for e in errors)))
        return StepResult(replies, 0.0, False)


@register_env("calculator")
class CalculatorBuilder(_BuiltinBuilder):
    """Args: ``kinds`` (``mul``: a * b, ``add3``: a + b + c; default both), ``min_value``/
    ``max_value`` (operands, default 10..999), ``max_tool_calls`` (default 4), ``demo_error_rate``."""

    name = "calculator"
    defaults = {"kinds": ["mul", "add3"], "min_value": 10, "max_value": 999, "max_tool_calls": 4}

    def _validate(self) -> None:
        self.kinds = self._list_arg("kinds", ("mul", "add3"))
        self.low, self.high = self._range_args("min_value", "max_value", minimum=0)
        self.max_tool_calls = self._int_arg("max_tool_calls", 1)

    def _sample(self, rng: random.Random) -> CalculatorTask:
        if rng.choice(self.kinds) == "mul":
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            return CalculatorTask(f"{a} * {b}", a * b)
        terms = [rng.randint(self.low, self.high) for _ in range(3)]
        return CalculatorTask(" + ".join(map(str, terms)), sum(terms))

    def task(self, split: str, index: int) -> CalculatorTask:
        return self._draw(split, index, self._sample, lambda t: t.expression)

    def make(self, split: str, index: int) -> CalculatorEnv:
        return CalculatorEnv(self.task(split, index), self.max_tool_calls)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        """Call the tool with the problem's expression, then box its result. The designed mistake
        drops the last operand from the call (``a + b`` for ``a + b + c``, ``a`` for ``a * b``) and boxes
        what the tool returns, so both habits share the second turn and differ in one choice inside the
        call. Where dropping the operand would not change the result (a last operand of 0, or 1 in a
        product), the mistake skips the tool and boxes an answer off by 1 instead."""
        t = self.task(split, index)
        expression = t.expression
        if self._demo_has_error(split, index):
            expression = t.expression.rsplit(" ", 2)[0]
            if evaluate_expression(expression)[0] == t.answer:

                def expert() -> Policy:
                    yield _assistant(f"\\boxed{{{t.answer + 1}}}")

                return _demonstrate(CalculatorEnv(t, self.max_tool_calls), expert())

        def expert() -> Policy:
            call = {"id": "call_0", "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": expression}}}
            result = yield {"role": "assistant", "content": "", "tool_calls": [call]}
            yield _assistant(f"\\boxed{{{result.messages[0]['content']}}}")

        return _demonstrate(CalculatorEnv(t, self.max_tool_calls), expert())
