"""``solver_judge``: several solver attempts at a countdown task, then a judge picks one.

One rollout = ``num_solvers`` solver trajectories (role ``solver``, sampled concurrently, each on its
own seed stream) + one judge trajectory (role ``judge``) that sees the task and the numbered
candidates and answers with the number of the one it picks in ``\\boxed{}``. Rewards: a solver gets
1 for a correct countdown answer (scored by the built-in countdown environment), the judge gets 1
when the candidate it picked is correct, else 0. Advantages are grouped per role: the solvers of all
rollouts of a task form one group, the judges another::

    environments:
      solver_judge:
        num_rollouts: 4           # rollouts per task: 4 judges, 4 * num_solvers solvers
        args:
          num_solvers: 3
          task_args: {num_numbers: 3, max_number: 10}   # the countdown environment's args
          judge_sees: full        # full (solver replies) | answer (their extracted expressions)

Args: ``num_solvers`` (default 3), ``task`` (only ``countdown``), ``task_args``, ``judge_sees``,
``max_candidate_chars`` (each candidate is cut to this many characters, default 1000),
``solver_max_tokens`` / ``judge_max_tokens`` (default: the environment's ``max_tokens``).

Metrics (the same on every trajectory of a rollout, so their means are per rollout):
``solver_accuracy``, ``judge_accuracy``, ``judge_valid_choice``, ``any_solver_correct``. Evaluation
(``polyrl eval``) reports the judge's pick as the workflow's answer (``eval_role``) and each role
separately.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from polyrl.envs.answers import answer_value
from polyrl.envs.base import EnvBuilder, Message, ToolSpec, register_env
from polyrl.envs.builtin.countdown import CountdownBuilder, CountdownEnv, countdown_expression
from polyrl.rl.episode import Episode, RolloutContext

_ARGS = ("num_solvers", "task", "task_args", "judge_sees", "max_candidate_chars", "solver_max_tokens",
         "judge_max_tokens")


def _positive_int(args: dict[str, Any], key: str, default: int | None) -> int | None:
    value = args.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"solver_judge: {key} must be a positive integer, got {value!r}")
    return value


def _text(message: Message) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


@register_env("solver_judge")
class SolverJudgeBuilder(EnvBuilder):
    """See the module docstring."""

    eval_role = "judge"  # the workflow's answer, for evaluation

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str | None = None):
        super().__init__(args, seed)
        self.type_name = type_name or "solver_judge"
        unknown = sorted(set(self.args) - set(_ARGS))
        if unknown:
            raise ValueError(f"solver_judge: unknown arg {unknown[0]!r} (known: {', '.join(_ARGS)})")
        task = self.args.get("task", "countdown")
        if task != "countdown":
            raise ValueError(f"solver_judge: task must be 'countdown', got {task!r}")
        task_args = self.args.get("task_args") or {}
        if not isinstance(task_args, dict):
            raise ValueError(f"solver_judge: task_args must be a mapping, got {task_args!r}")
        self.countdown = CountdownBuilder(task_args, seed)
        self.num_solvers = _positive_int(self.args, "num_solvers", 3)
        self.max_chars = _positive_int(self.args, "max_candidate_chars", 1000)
        self.solver_max_tokens = _positive_int(self.args, "solver_max_tokens", None)
        self.judge_max_tokens = _positive_int(self.args, "judge_max_tokens", None)
        self.judge_sees = self.args.get("judge_sees", "full")
        if self.judge_sees not in ("full", "answer"):
            raise ValueError(f"solver_judge: judge_sees must be 'full' or 'answer', got {self.judge_sees!r}")

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        cls(args, 0, type_name)

    # A plain single-solver view of the same tasks (what ``make`` users and ``polyrl sft`` get).
    def make(self, split: str, index: int) -> CountdownEnv:
        return self.countdown.make(split, index)

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]] | None:
        return self.countdown.demonstration(split, index)

    def judge_prompt(self, problem: str, replies: list[Message]) -> str:
        parts = [problem, "", f"{len(replies)} candidate solutions:"]
        for i, reply in enumerate(replies, 1):
            text = _text(reply)
            if self.judge_sees == "answer":
                shown = countdown_expression(text) if text.strip() else ""
            else:
                shown = text.strip()
            shown = shown[: self.max_chars] or "(empty)"
            parts += ["", f"Candidate {i}:", shown]
        parts += ["", "Which candidate is correct? Check each one, then give the number of a correct "
                      "candidate in \\boxed{}, e.g. \\boxed{1}."]
        return "\n".join(parts)

    async def rollout(self, ctx: RolloutContext) -> list[Episode]:
        start = time.monotonic()
        task = self.countdown.task(ctx.split, ctx.task_index)
        prompt = CountdownEnv(task).reset_sync().messages
        problem = _text(prompt[-1])

        async def solve(i: int) -> tuple[Episode, Message, bool]:
            ep = ctx.episode("solver")
            ep.messages = list(prompt)
            ep.append(ctx.renderer.initial_prompt(prompt))
            reply = await ctx.sample(ep, self.solver_max_tokens, stream=i)
            env = CountdownEnv(task)
            env.reset_sync()
            result = env.step_sync(reply)
            ep.step_rewards = [float(result.reward)]
            ep.done_by_env = True
            ep.reward = float(result.reward)
            ep.success = bool(result.metrics.get("success", result.reward > 0))
            return ep, reply, ep.success

        solved = await asyncio.gather(*(solve(i) for i in range(self.num_solvers)))
        solvers = [ep for ep, _, _ in solved]
        correct = [ok for _, _, ok in solved]

        judge = ctx.episode("judge")
        judge.messages = [{"role": "user", "content": self.judge_prompt(problem, [r for _, r, _ in solved])}]
        judge.append(ctx.renderer.initial_prompt(judge.messages))
        verdict = await ctx.sample(judge, self.judge_max_tokens, stream=self.num_solvers)
        choice = answer_value(_text(verdict))
        valid = isinstance(choice, int) and 1 <= choice <= self.num_solvers
        picked_correct = bool(valid and correct[choice - 1])  # type: ignore[operator]
        judge.step_rewards = [float(picked_correct)]
        judge.done_by_env = True
        judge.reward = float(picked_correct)
        judge.success = picked_correct

        metrics = {
            "solver_accuracy": sum(correct) / len(correct),
            "judge_accuracy": float(picked_correct),
            "judge_valid_choice": float(valid),
            "any_solver_correct": float(any(correct)),
        }
        duration = time.monotonic() - start
        for ep in [*solvers, judge]:
            ep.metrics.update(metrics)
            ep.duration_s = duration
        return [*solvers, judge]
