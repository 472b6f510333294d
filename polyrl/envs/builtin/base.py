"""What the built-in environments share: a synchronous core (:class:`SyncEnv`), expert
demonstrations replayed through it (:func:`demonstrate`), and :class:`BuiltinBuilder` (argument
checks, per-task seeding and the held-out test partition).

Tasks are deterministic functions of (builder seed, split, index). Each split has its own random
stream, and the task space is additionally partitioned by a hash of the task (about 1/8 held out for
``test``), so test problems never appear in train.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable, Generator, TypeVar

from polyrl.envs.base import Env, EnvBuilder, Message, Observation, StepResult, ToolSpec

T = TypeVar("T")

_SPLITS = ("train", "test")
_TEST_BUCKETS = 8  # 1 in 8 tasks (by hash) belongs to the test split
_MAX_DRAWS = 200


def assistant_message(content: str) -> Message:
    return {"role": "assistant", "content": content}


def user_message(content: str) -> Message:
    return {"role": "user", "content": content}


class SyncEnv(Env):
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


def demonstrate(env: SyncEnv, policy: Policy, max_steps: int = 100) -> tuple[list[Message], list[ToolSpec]]:
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


class BuiltinBuilder(EnvBuilder):
    """Arg validation, per-task seeding and the held-out partition shared by the built-ins.

    A subclass sets ``name`` and ``defaults`` (its args and their default values; ``demo_error_rate``
    is always known) and checks ``self.opts`` in ``_validate``.
    """

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

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        """The constructor's checks of ``args`` (unknown names, types, ranges), run when the config is
        loaded, so that a typo is a config error (``--print-config`` too), not a failure once the run
        starts."""
        cls(args)

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
