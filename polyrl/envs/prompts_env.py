"""``prompts``: tasks read from JSONL files, scored only by the entry's LLM judge (``judge:``).

Each line is one task, a prompt and the rubric items the judge grades the reply by::

    {"prompt": "text" | [messages], "rubrics": ["item", ...] | "item"}

or tinker-cookbook's rubric data, ``{"convo": [messages], "rubric_items": [{"rubric_str": ...}, ...]}``.
A task without rubrics is graded by the judge config's ``rubrics``. Episodes are single-turn, and the
environment's own reward is 0: the reward is the judge's.

Args: ``path`` (the train split's file), ``test_path`` (the test split's; without one the test split is
empty) and ``system_prompt`` (put before every prompt that has no system message).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyrl.envs.base import Env, EnvBuilder, Message, Observation, StepResult, register_env
from polyrl.envs.module_env import as_messages


def read_tasks(path: str) -> list[tuple[list[Message], list[str]]]:
    """The (prompt messages, rubric items) of every line of ``path``; a ``ValueError`` naming
    ``path:line`` for a line that is not a task."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    tasks = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict) or ("prompt" not in row and "convo" not in row):
            raise ValueError(f'{where}: expected {{"prompt": ..., "rubrics": [...]}}')
        try:
            messages, _ = as_messages(row["prompt"] if "prompt" in row else row["convo"], "the prompt")
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None
        rubrics = row.get("rubrics", [])
        if "rubric_items" in row:
            rubrics = [item.get("rubric_str") if isinstance(item, dict) else item
                       for item in row["rubric_items"]]
        rubrics = [rubrics] if isinstance(rubrics, str) else rubrics
        if not isinstance(rubrics, list) or not all(isinstance(r, str) and r.strip() for r in rubrics):
            raise ValueError(f"{where}: rubrics must be a list of non-empty strings")
        tasks.append((messages, rubrics))
    if not tasks:
        raise ValueError(f"{path}: no tasks (one JSON object per line expected)")
    return tasks


class PromptEnv(Env):
    def __init__(self, messages: list[Message]):
        self.messages = messages

    async def reset(self) -> Observation:
        return Observation(list(self.messages))

    async def step(self, action: Message) -> StepResult:
        return StepResult([], 0.0, True)


@register_env("prompts")
class PromptsBuilder(EnvBuilder):
    """Prompts from JSONL files with per-task rubrics, for a judge to score (see the module docstring)."""

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str | None = None):
        super().__init__(args, seed, type_name)
        unknown = sorted(set(args) - {"path", "test_path", "system_prompt"})
        if unknown:
            raise ValueError(f"prompts: unknown args {unknown} (path, test_path, system_prompt)")
        if not isinstance(args.get("path"), str):
            raise ValueError("prompts: args.path must name a JSONL file of tasks")
        self.system_prompt = args.get("system_prompt")
        self.tasks = {"train": read_tasks(args["path"])}
        self.tasks["test"] = read_tasks(args["test_path"]) if args.get("test_path") else []

    def num_tasks(self, split: str) -> int | None:
        return len(self.tasks[split])

    def _messages(self, split: str, index: int) -> list[Message]:
        messages = self.tasks[split][index][0]
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return list(messages)

    def make(self, split: str, index: int) -> Env:
        return PromptEnv(self._messages(split, index))

    def rubrics(self, split: str, index: int) -> list[str] | None:
        return self.tasks[split][index][1] or None
