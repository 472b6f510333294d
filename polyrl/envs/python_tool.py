"""``python_tool``: math and countdown problems where the model may run Python through a tool.

The tool is ``python(code)``: the code runs in :func:`polyrl.envs.sandbox.run_python` (a fresh,
confined interpreter with the standard library: no network, no files outside its own temporary
directory, capped time, memory, output and processes) and the tool message is what it printed --
plus the value of a final expression, as in an interactive session. Anything that goes wrong (an
exception, a timeout, too much output, a memory bomb, an attempt to fork, open a socket or read
outside the directory) comes back to the model as an ``error: ...`` tool message; the episode goes
on. A reply without tool calls is the final answer, scored like the built-in environments
(``\\boxed{...}``); the reward is 1 for a right answer, 0 otherwise.

Tasks are deterministic functions of (seed, split, index), with the built-ins' held-out partition:

- ``math``: sums over a range with a divisibility condition, modular powers, digit sums of powers
  (exact integers a model gets wrong in its head and right with three lines of Python);
- ``countdown``: the ``countdown`` environment's problems (``countdown_*`` args), answered with an
  expression that uses each number once.

Args: ``tasks`` (default ``["math", "countdown"]``), ``max_tool_calls`` (default 4), the sandbox's
``timeout`` (seconds, default 5), ``memory_mb`` (256), ``max_output_bytes`` (2048),
``countdown_numbers`` (3), ``countdown_max`` (10), ``demo_error_rate``.

Demonstrations run the expert's code through the same sandbox: one tool call that computes the
answer (for countdown, that checks the solution's value), then the boxed result. The designed
mistake is an off-by-one in that code (or a near-miss countdown expression), boxed as computed.
The sandbox needs Linux with Landlock; where it is missing the environment is refused when the
config is loaded.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from polyrl.envs.answers import ExpressionError, answer_value, evaluate_expression, same_number
from polyrl.envs.base import Env, Message, Observation, StepResult, ToolSpec, register_env, tool_message
from polyrl.envs.builtin.base import BuiltinBuilder
from polyrl.envs.builtin.countdown import CountdownBuilder, CountdownTask, countdown_expression, render_tree
from polyrl.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_layers
from polyrl.renderers.base import message_text

PYTHON_TOOL: ToolSpec = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code (standard library only) in a fresh sandbox and return what it "
        "prints, plus the value of a final expression. No network, no files outside its own directory.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "For example: print(sum(range(10)))"}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class MathTask:
    question: str
    code: str  # the expert's program; prints the answer
    wrong_code: str  # the same program with the designed off-by-one
    answer: int


def _math_task(rng: random.Random) -> MathTask:
    kind = rng.choice(("divisible_sum", "power_mod", "digit_sum"))
    if kind == "divisible_sum":
        n, k, m = rng.randint(200, 5000), rng.randint(3, 9), rng.randint(11, 19)
        code = "print(sum(i for i in range(1, {n}) if i % {k} == 0 or i % {m} == 0))"
        answer = sum(i for i in range(1, n + 1) if i % k == 0 or i % m == 0)
        question = (f"What is the sum of all integers from 1 to {n} (inclusive) that are divisible by {k} "
                    f"or by {m}?")
        return MathTask(question, code.format(n=n + 1, k=k, m=m), code.format(n=n, k=k, m=m), answer)
    if kind == "power_mod":
        a, e, m = rng.randint(2, 99), rng.randint(20, 200), rng.randint(1000, 9999)
        return MathTask(f"What is {a}^{e} mod {m}?", f"print(pow({a}, {e}, {m}))",
                        f"print(pow({a}, {e - 1}, {m}))", pow(a, e, m))
    a, e = rng.randint(2, 9), rng.randint(30, 120)
    return MathTask(f"What is the sum of the decimal digits of {a}^{e}?",
                    f"print(sum(int(d) for d in str({a}**{e})))",
                    f"print(sum(int(d) for d in str({a}**{e - 1})))",
                    sum(int(d) for d in str(a**e)))


def _code_argument(call: Any) -> tuple[str | None, str | None]:
    """(code, None) from a parsed ``python`` tool call, or (None, the error the model should see)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return None, "error: malformed tool call"
    if function.get("name") != "python":
        return None, f"error: unknown tool {function.get('name')!r}; the only tool is python"
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None, "error: arguments are not valid JSON"
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return None, "error: missing string argument 'code'"
    return args["code"], None


def tool_reply(code: str, limits: SandboxLimits) -> str:
    """What the model sees for one call: the output, or ``error: <reason>`` and the output so far."""
    result = run_python(code, limits)
    reason = result.error(limits)
    if reason is None:
        return result.output if result.output.strip() else "(no output)"
    output = result.output.rstrip()
    return f"error: {reason}" + (f"\n{output}" if output else "")


class PythonToolEnv(Env):
    """Tool calls are answered (reward 0), a reply without calls is final."""

    def __init__(self, question: str, score, max_tool_calls: int, limits: SandboxLimits):
        self.question, self.score = question, score
        self.max_tool_calls, self.limits = max_tool_calls, limits
        self.tool_calls = self.tool_errors = 0

    def observation(self) -> Observation:
        prompt = (f"{self.question} You may run Python with the python tool. "
                  "Put the final answer in \\boxed{}.")
        return Observation([{"role": "user", "content": prompt}], [PYTHON_TOOL])

    async def reset(self) -> Observation:
        return self.observation()

    async def step(self, action: Message) -> StepResult:
        calls = action.get("tool_calls") or []
        errors = action.get("tool_call_errors") or []
        if not calls and not errors:
            success = float(self.score(message_text(action)))
            return StepResult([], success, True, self._metrics(success))
        self.tool_calls += len(calls) + len(errors)
        if self.tool_calls > self.max_tool_calls:
            return StepResult([], 0.0, True, self._metrics(0.0))
        replies: list[Message] = []
        for i, call in enumerate(calls):
            code, problem = _code_argument(call)
            content = problem if code is None else await asyncio.to_thread(tool_reply, code, self.limits)
            self.tool_errors += content.startswith("error:")
            replies.append(tool_message(call, i, content))
        if errors:
            self.tool_errors += len(errors)
            message = "Tool call error: " + "; ".join(str(e) for e in errors)
            replies.append({"role": "user", "content": message})
        return StepResult(replies, 0.0, False)

    def _metrics(self, success: float) -> dict[str, float]:
        return {"success": success, "tool_calls": float(self.tool_calls),
                "tool_errors": float(self.tool_errors)}


def _countdown_score(task: CountdownTask):
    def score(text: str) -> bool:
        try:
            value, literals = evaluate_expression(countdown_expression(text))
        except ExpressionError:
            return False
        return Counter(literals) == Counter(task.numbers) and value == task.target

    return score


@register_env("python_tool")
class PythonToolBuilder(BuiltinBuilder):
    """See the module docstring."""

    name = "python_tool"
    defaults = {"tasks": ["math", "countdown"], "max_tool_calls": 4, "timeout": 5, "memory_mb": 256,
                "max_output_bytes": 2048, "countdown_numbers": 3, "countdown_max": 10}

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        cls(args)
        try:
            sandbox_layers()
        except SandboxUnavailable as exc:
            raise ValueError(f"python_tool: {exc}") from exc

    def _validate(self) -> None:
        self.kinds = self._list_arg("tasks", ("math", "countdown"))
        self.max_tool_calls = self._int_arg("max_tool_calls", 1)
        timeout = self.opts["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 300:
            raise ValueError(f"{self.name}: timeout must be a number of seconds in (0, 300], got {timeout!r}")
        self.limits = SandboxLimits(timeout_s=float(timeout), memory_mb=self._int_arg("memory_mb", 32),
                                    max_output_bytes=self._int_arg("max_output_bytes", 16))
        self.countdown = CountdownBuilder({"num_numbers": self._int_arg("countdown_numbers", 2),
                                           "max_number": self._int_arg("countdown_max", 1)}, self.seed)

    def task(self, split: str, index: int) -> tuple[str, MathTask | CountdownTask]:
        kind = self._rng(split, index, "kind").choice(self.kinds)
        if kind == "countdown":
            return kind, self.countdown.task(split, index)
        return kind, self._draw(split, index, _math_task, lambda t: t.question)

    def _env(self, kind: str, task: MathTask | CountdownTask) -> PythonToolEnv:
        if kind == "countdown":
            numbers = ", ".join(map(str, task.numbers))
            question = (f"Use {numbers} to make {task.target}, each number exactly once, with + - * / and "
                        "parentheses; the answer is the expression.")
            return PythonToolEnv(question, _countdown_score(task), self.max_tool_calls, self.limits)
        return PythonToolEnv(task.question, lambda text: same_number(answer_value(text), task.answer),
                             self.max_tool_calls, self.limits)

    def make(self, split: str, index: int) -> PythonToolEnv:
        return self._env(*self.task(split, index))

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        kind, task = self.task(split, index)
        mistaken = self._demo_has_error(split, index)
        if kind == "countdown":
            rng = self._rng(split, index, "mistake")
            if mistaken:
                expression = self.countdown.mistaken_expression(task, rng)
            else:
                expression = render_tree(task.solution)
            code, final = f"print({expression})", f"\\boxed{{{expression}}}"
        else:
            code, final = (task.wrong_code if mistaken else task.code), None
        messages = list(self._env(kind, task).observation().messages)
        call = {"id": "call_0", "type": "function",
                "function": {"name": "python", "arguments": {"code": code}}}
        output = tool_reply(code, self.limits)
        final = final or f"\\boxed{{{output.strip()}}}"
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     tool_message(call, 0, output),
                     {"role": "assistant", "content": final}]
        return messages, [PYTHON_TOOL]

