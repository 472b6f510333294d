"""What the adapters for game packages (``gem:``, ``textarena:``) share.

Each adapter parses its ``type`` and args into a spec (a :class:`GameSpec`: ``env_kwargs``,
``success_reward``, ``system_prompt`` and its own args), plays one game per :class:`GameEnv` on a
private copy of the process-global RNG state (:mod:`polyrl.envs.global_rng`), and seeds task
``index`` of a split with :meth:`GameBuilder.task_seed`: even for train, odd for test, so the splits
never share a seed.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
from typing import Any, Callable

from polyrl.envs.base import Env, EnvBuilder, Message, Observation, parse_prefixed_type
from polyrl.envs.global_rng import PrivateGlobalRng, as_reward


class GameSpec:
    """The checked ``type`` and the args every game adapter takes; a subclass checks its own args."""

    prefix = ""  # the type prefix: "gem", "textarena"
    package = ""  # the package as error messages name it: "GEM", "textarena"
    example = ""  # a valid type, shown when the type is malformed
    known_args: tuple[str, ...] = ()  # every arg the adapter takes

    def __init__(self, type_name: str, args: dict[str, Any]):
        self.env_id = parse_prefixed_type(type_name, self.prefix, self.example, args, self.known_args)
        self.env_kwargs = args.get("env_kwargs") or {}
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"env_kwargs must be a mapping, got {self.env_kwargs!r}")
        self.success_reward = args.get("success_reward", 1.0)
        if as_reward(self.success_reward) is None or isinstance(self.success_reward, bool):
            raise ValueError(f"success_reward must be a number, got {self.success_reward!r}")
        self.system_prompt = args.get("system_prompt")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt must be a string, got {self.system_prompt!r}")

    def check_env_id(self, registry: Any) -> None:
        """The id must be in the package's registry; a near miss is suggested."""
        if self.env_id not in registry:
            close = difflib.get_close_matches(self.env_id, list(registry), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"unknown {self.package} env id {self.env_id!r}{hint}")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters (for a config error)."""
    return " ".join(str(exc).split())[:300]


class GameEnv(Env):
    """One game on a private copy of the global RNG state; ``self.env`` is the package's game."""

    def __init__(self, spec: GameSpec, seed: int):
        self.spec, self.seed = spec, seed
        self.rng = PrivateGlobalRng(seed)
        self.env: Any = None

    @staticmethod
    def fresh_game(prototype: Any, create: Callable[[], Any]) -> Any:
        """A copy of the created-and-reset ``prototype``; a game that cannot be copied is created afresh."""
        try:
            return copy.deepcopy(prototype)
        except Exception:  # noqa: BLE001 - any failure to copy falls back to creating it
            return create()

    def first_observation(self, text: str) -> Observation:
        """The optional system prompt, then the game's first observation as the user message."""
        messages: list[Message] = []
        if self.spec.system_prompt:
            messages.append({"role": "system", "content": self.spec.system_prompt})
        messages.append({"role": "user", "content": text})
        return Observation(messages)

    @staticmethod
    def checked_reward(raw: Any) -> tuple[float, dict[str, float]]:
        """A reward the package gave, as a finite float; a non-number counts as 0 and is flagged in the
        ``reward_invalid`` metric."""
        value = as_reward(raw)
        return (0.0 if value is None else value), {"reward_invalid": float(value is None)}

    def success(self, reward: float) -> float:
        return float(reward >= float(self.spec.success_reward))


class GameBuilder(EnvBuilder):
    """Builds the adapter's spec from ``type`` and args, and gives each task its seed."""

    spec_class: type[GameSpec] = GameSpec

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str | None = None):
        super().__init__(args, seed, type_name)
        self.spec = self.spec_class(self.type_name, self.args)

    def task_seed(self, split: str, index: int) -> int:
        """Seed of task ``index``: even for train, odd for test (never shared)."""
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}")
        key = f"polyrl/{self.spec.prefix}/{self.spec.env_id}/{self.seed}/{split}/{index}"
        digest = hashlib.sha256(key.encode()).digest()
        return (int.from_bytes(digest[:4], "little") & 0x7FFFFFFE) | (split == "test")
