"""reasoning-gym data sets (``pip install reasoning-gym``): ``type: reasoning_gym:<dataset>``.

Any of reasoning-gym's procedural data sets (``reasoning_gym:leg_counting``,
``reasoning_gym:basic_arithmetic``, ``reasoning_gym:composite`` for mixtures), one question per
episode, scored by the data set's own ``score_answer``::

    environments:
      legs:
        type: reasoning_gym:leg_counting
        max_turns: 1
        args:
          config: {min_animals: 2, max_animals: 4}   # the data set's config fields (not size/seed)
          answer_extraction: answer_tag              # answer_tag | boxed | last_line | full | regex
          train_size: 10000
          test_size: 200

Answer extraction (the assistant reply's content, reasoning excluded, to the string scored):
``answer_tag`` (default) is reasoning-gym's own ``extract_answer`` (last ``<answer>...</answer>``,
``answer_tag`` names another tag); ``boxed`` the last ``\\boxed{...}``; ``last_line`` the last
non-empty line; ``full`` the whole reply; ``regex`` the last match of ``answer_regex`` (its first
group if it has one). No answer found scores as reasoning-gym scores ``None`` (0).

The system prompt defaults to reasoning-gym's ``default`` prompt (asks for ``<answer>`` tags) with
``answer_tag`` extraction and to a one-line "put the final answer in \\boxed{}" with ``boxed``;
``system_prompt`` may name one of ``reasoning_gym.utils.SYSTEM_PROMPTS``, give literal text, or be
``""`` for none. GEM's plain-template renderers (``qwen3_general``) drop system messages and ask for
``\\boxed{}`` themselves: use ``answer_extraction: boxed`` with them.

Reward: ``score_answer`` in [0, 1] (validated as a number; an exception while scoring counts as 0 and
sets ``score_error``); success when it is at least ``success_threshold`` (default 1.0).

Splits: train and test are separate data sets of ``train_size``/``test_size`` items seeded from the
run seed; train items whose question also occurs in the test set are replaced by items of spare
data sets, so the splits are disjoint. Demonstrations (``polyrl sft``) answer with the data set's
own answer in the extraction format, when that answer scores 1.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from typing import Any

from polyrl.envs.answers import boxed_contents
from polyrl.envs.base import (
    Env,
    EnvBuilder,
    Message,
    Observation,
    StepResult,
    ToolSpec,
    parse_prefixed_type,
    register_env,
)
from polyrl.envs.global_rng import PrivateGlobalRng, as_reward

_ARGS = ("config", "answer_extraction", "answer_tag", "answer_regex", "system_prompt", "train_size",
         "test_size", "success_threshold")
_EXTRACTIONS = ("answer_tag", "boxed", "last_line", "full", "regex")
_BOXED_PROMPT = "Solve the problem. Put your final answer within \\boxed{}."
_MAX_SPARES = 20


def _import_rg():
    try:
        with PrivateGlobalRng().active():  # importing reasoning-gym draws from the global RNG
            import reasoning_gym
            import reasoning_gym.utils  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"reasoning_gym environments need the reasoning-gym package ({exc}): "
                         "pip install reasoning-gym") from exc
    return reasoning_gym


def _boxed(text: str) -> str | None:
    found = [b.strip() for b in boxed_contents(text)]
    return found[-1] if found else None


def _positive_int(args: dict[str, Any], key: str, default: int) -> int:
    value = args.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


class _Spec:
    """Parsed and checked type + args of one ``reasoning_gym:`` entry."""

    def __init__(self, type_name: str, args: dict[str, Any]):
        self.name = name = parse_prefixed_type(type_name, "reasoning_gym", "reasoning_gym:leg_counting",
                                               args, _ARGS)
        self.config = args.get("config") or {}
        if not isinstance(self.config, dict):
            raise ValueError(f"config must be a mapping of the data set's config fields, got {self.config!r}")
        for key in ("size", "seed"):
            if key in self.config:
                raise ValueError(f"config.{key} is set by polyrl "
                                 "(use train_size/test_size; seeds follow the run seed)")
        self.train_size = _positive_int(args, "train_size", 10_000)
        self.test_size = _positive_int(args, "test_size", 200)
        self.extraction = args.get("answer_extraction", "answer_tag")
        if self.extraction not in _EXTRACTIONS:
            raise ValueError(f"answer_extraction must be one of {', '.join(_EXTRACTIONS)}, "
                             f"got {self.extraction!r}")
        self.tag = args.get("answer_tag", "answer")
        if not isinstance(self.tag, str) or not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"answer_tag must be a tag name such as 'answer', got {self.tag!r}")
        self.regex = None
        if self.extraction == "regex":
            pattern = args.get("answer_regex")
            if not isinstance(pattern, str):
                raise ValueError("answer_extraction 'regex' needs answer_regex (a regular expression)")
            try:
                self.regex = re.compile(pattern, re.DOTALL)
            except re.error as exc:
                raise ValueError(f"answer_regex is not a valid regular expression: {exc}") from exc
        elif "answer_regex" in args:
            raise ValueError("answer_regex is only used with answer_extraction: regex")
        self.threshold = args.get("success_threshold", 1.0)
        if as_reward(self.threshold) is None or isinstance(self.threshold, bool):
            raise ValueError(f"success_threshold must be a number, got {self.threshold!r}")

        rg = _import_rg()
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if name not in DATASETS:
            close = difflib.get_close_matches(name, list(DATASETS), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"unknown reasoning-gym data set {name!r}{hint}")
        prompt = args.get("system_prompt")
        if prompt is None:
            defaults = {"answer_tag": SYSTEM_PROMPTS["default"], "boxed": _BOXED_PROMPT}
            prompt = defaults.get(self.extraction, "")
            if self.extraction == "answer_tag" and self.tag != "answer":
                prompt = prompt.replace("<answer>", f"<{self.tag}>").replace("</answer>", f"</{self.tag}>")
        elif not isinstance(prompt, str):
            raise ValueError(f"system_prompt must be a string, got {prompt!r}")
        self.system_prompt = SYSTEM_PROMPTS.get(prompt, prompt)
        self._rg = rg
        self.create(1, 0)[0]  # the config is valid and generates an item

    def create(self, size: int, seed: int) -> Any:
        config = dict(self.config)
        if self.name == "composite" and isinstance(config.get("datasets"), list):
            from reasoning_gym.composite import DatasetSpec

            config["datasets"] = [DatasetSpec(**d) if isinstance(d, dict) else d for d in config["datasets"]]
        try:
            with PrivateGlobalRng(seed).active():
                return self._rg.create_dataset(self.name, size=size, seed=seed, **config)
        except Exception as exc:  # noqa: BLE001 - a bad config is one clear line
            msg = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise ValueError(f"reasoning-gym {self.name!r} rejects config {self.config!r}: {msg}") from exc

    def extract(self, text: str) -> str | None:
        if self.extraction == "answer_tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(text, tag_name=self.tag)
        if self.extraction == "boxed":
            return _boxed(text)
        if self.extraction == "last_line":
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            return lines[-1] if lines else None
        if self.extraction == "full":
            return text.strip() or None
        matches = list(self.regex.finditer(text))  # type: ignore[union-attr]
        if not matches:
            return None
        last = matches[-1]
        return (last.group(1) if self.regex.groups else last.group(0)).strip()  # type: ignore[union-attr]

    def format_answer(self, answer: str) -> str | None:
        return {"answer_tag": f"<{self.tag}>{answer}</{self.tag}>", "boxed": f"\\boxed{{{answer}}}",
                "last_line": answer, "full": answer}.get(self.extraction)


class ReasoningGymEnv(Env):
    """One question; the reply is scored by the data set's ``score_answer`` and the episode ends."""

    def __init__(self, spec: _Spec, dataset: Any, entry: dict[str, Any]):
        self.spec, self.dataset, self.entry = spec, dataset, entry

    def prompt(self) -> list[Message]:
        messages: list[Message] = []
        if self.spec.system_prompt:
            messages.append({"role": "system", "content": self.spec.system_prompt})
        messages.append({"role": "user", "content": str(self.entry["question"])})
        return messages

    async def reset(self) -> Observation:
        return Observation(self.prompt())

    def score(self, text: str) -> tuple[float, dict[str, float]]:
        answer = self.spec.extract(text)
        metrics = {"format_ok": float(answer is not None), "score_error": 0.0, "reward_invalid": 0.0}
        try:
            with PrivateGlobalRng(0).active():
                raw = self.dataset.score_answer(answer=answer, entry=self.entry)
        except Exception:  # noqa: BLE001 - a scorer crashing on an odd answer scores 0
            raw, metrics["score_error"] = 0.0, 1.0
        reward = as_reward(raw)
        if reward is None:
            reward, metrics["reward_invalid"] = 0.0, 1.0
        metrics["success"] = float(reward >= float(self.spec.threshold))
        return reward, metrics

    async def step(self, action: Message) -> StepResult:
        content = action.get("content") or ""
        reward, metrics = self.score(content if isinstance(content, str) else str(content))
        return StepResult([], reward, True, metrics)


@register_env("reasoning_gym:")
class ReasoningGymBuilder(EnvBuilder):
    """``reasoning_gym:<dataset>``: see the module docstring."""

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str | None = None):
        super().__init__(args, seed, type_name)
        self.spec = _Spec(self.type_name, self.args)
        self._datasets: dict[str, Any] = {}
        self._test_questions: set[str] | None = None

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        _Spec(type_name, args)

    def _seed(self, purpose: str) -> int:
        key = f"polyrl/reasoning_gym/{self.spec.name}/{self.seed}/{purpose}"
        digest = hashlib.sha256(key.encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def _dataset(self, purpose: str) -> Any:
        if purpose not in self._datasets:
            size = self.spec.test_size if purpose == "test" else self.spec.train_size
            self._datasets[purpose] = self.spec.create(size, self._seed(purpose))
        return self._datasets[purpose]

    def _item(self, dataset: Any, index: int) -> dict[str, Any]:
        with PrivateGlobalRng(index).active():
            return dataset[index]

    def entry(self, split: str, index: int) -> tuple[Any, dict[str, Any]]:
        """The data set and item of task ``index`` of ``split``."""
        if split == "test":
            if not 0 <= index < self.spec.test_size:
                raise IndexError(f"test task {index} out of range (test_size {self.spec.test_size})")
            ds = self._dataset("test")
            return ds, self._item(ds, index)
        if split != "train":
            raise ValueError(f"unknown split {split!r}")
        if not 0 <= index < self.spec.train_size:
            raise IndexError(f"train task {index} out of range (train_size {self.spec.train_size})")
        if self._test_questions is None:
            test = self._dataset("test")
            self._test_questions = {str(self._item(test, i)["question"]) for i in range(self.spec.test_size)}
        for spare in range(_MAX_SPARES + 1):
            ds = self._dataset("train" if spare == 0 else f"train-spare-{spare}")
            item = self._item(ds, index)
            if str(item["question"]) not in self._test_questions:
                return ds, item
        raise RuntimeError(f"reasoning-gym {self.spec.name!r}: train task {index} keeps coinciding with test "
                           "questions; the data set's task space is too small for disjoint splits "
                           "(lower test_size)")

    def num_tasks(self, split: str) -> int | None:
        return self.spec.test_size if split == "test" else self.spec.train_size

    def make(self, split: str, index: int) -> ReasoningGymEnv:
        return ReasoningGymEnv(self.spec, *self.entry(split, index))

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]] | None:
        env = self.make(split, index)
        reply = self.spec.format_answer(str(env.entry["answer"]))
        if reply is None or env.score(reply)[0] < 1.0:
            return None
        return env.prompt() + [{"role": "assistant", "content": reply}], []
