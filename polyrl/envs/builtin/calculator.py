"""``calculator``: multi-turn tool use. The model may call ``calculator(expression)`` (answered by
:func:`run_calculator`, reward 0) and ends with a reply without calls whose ``\\boxed{}`` is graded.

The designed demonstration mistake leaves an operand out of the calculator call.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from polyrl.envs.answers import ExpressionError, answer_value, evaluate_expression, same_number
from polyrl.envs.base import Message, Observation, StepResult, ToolSpec, register_env, tool_message
from polyrl.envs.builtin.base import (
    BuiltinBuilder,
    Policy,
    SyncEnv,
    assistant_message,
    demonstrate,
    user_message,
)
from polyrl.renderers.base import message_text

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


def _format_value(value: Fraction) -> str:
    """Integers exactly; other values as a short decimal (what a calculator shows)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


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


class CalculatorEnv(SyncEnv):
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
        return Observation([user_message(prompt)], [CALCULATOR_TOOL])

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
            replies.append(tool_message(call, i, run_calculator(call)))
        if errors:  # malformed calls have no id to answer, so they get one user message
            replies.append(user_message("Tool call error: " + "; ".join(str(e) for e in errors)))
        return StepResult(replies, 0.0, False)


@register_env("calculator")
class CalculatorBuilder(BuiltinBuilder):
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
                    yield assistant_message(f"\\boxed{{{t.answer + 1}}}")

                return demonstrate(CalculatorEnv(t, self.max_tool_calls), expert())

        def expert() -> Policy:
            call = {"id": "call_0", "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": expression}}}
            result = yield {"role": "assistant", "content": "", "tool_calls": [call]}
            yield assistant_message(f"\\boxed{{{result.messages[0]['content']}}}")

        return demonstrate(CalculatorEnv(t, self.max_tool_calls), expert())
