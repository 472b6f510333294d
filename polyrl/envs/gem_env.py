"""GEM environments (``pip install --no-deps gem-llm``): ``type: gem:<env_id>``.

``gem:game:GuessTheNumber-v0-easy``, ``gem:rg:leg_counting``, ... -- any id of GEM's registry, made
with ``gem.make`` and GEM's own wrappers, played multi-turn with GEM's per-step rewards::

    environments:
      guess:
        type: gem:game:GuessTheNumber-v0-easy
        max_turns: 4
        args:
          wrappers: [episode_tracking]      # GEM wrapper names, applied in order (optional)
          env_kwargs: {max_turns: 4}        # override the registered constructor kwargs (optional)

The reset observation is the first user message; every step's observation is the next user
message (with GEM's ``info`` prefix/suffix such as "Enter your next guess.", as GEM's observation
wrapper adds them; ``info_suffix: false`` leaves them out). The conversation itself carries the
history, so GEM's history-concatenating observation wrappers (``concat*``) are refused: they would
repeat it. With the ``qwen3_game`` / ``qwen3_general`` / ``no`` renderers the observations are
wrapped in GEM's plain templates instead of a chat template. An observation that is a mapping with
``images`` (GEM's visual ``math:`` environments give ``{"problem": ..., "images": [...]}``) becomes a user
message of image parts followed by its ``problem`` (or ``question``) text, for a vision-language model.

Args: ``wrappers`` (list or comma string of GEM wrapper names), ``env_kwargs``, ``info_suffix``
(default true), ``success_reward`` (an episode is a success when its final step reward is at least
this, default 1.0), ``system_prompt`` (optional system message).

Tasks: task ``index`` of a split resets a fresh copy of the environment with a seed derived from
(run seed, env id, split, index); train seeds are even and test seeds odd, so the splits never share
a seed (``rg:`` ids additionally draw test tasks from a differently seeded data set). GEM seeds and
draws from the process-global ``random``/``numpy`` state; every GEM call runs on the episode's own
private copy of that state (:mod:`polyrl.envs.global_rng`), so results do not depend on how episodes
interleave and the rest of the process is not disturbed.

At config load the id, the args and the wrappers are checked and one instance is created and reset,
so missing data (GEM's word games need the nltk ``words`` corpus; ``math:``/``code:``/``qa:``/
``logic:``/``eval:`` ids download data sets from the Hugging Face hub) is a config error, not a
failing run.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from typing import Any

from polyrl.envs.base import Message, Observation, StepResult, register_env
from polyrl.envs.game_adapter import GameBuilder, GameEnv, GameSpec, one_line
from polyrl.envs.global_rng import PrivateGlobalRng

_ARGS = ("wrappers", "env_kwargs", "info_suffix", "success_reward", "system_prompt")
_HISTORY_WRAPPERS = ("concat", "concat_chat", "concat_with_action", "concat_chat_on_reset")
_WORD_GAMES = ("gem.envs.game_env.wordle", "gem.envs.game_env.hangman", "gem.envs.game_env.word_search")
_HUB_DATASETS = ("gem.envs.math_env", "gem.envs.math_visual_env", "gem.envs.code_env", "gem.envs.qa_env")
_RG_ENTRY = "gem.envs.reasoning_gym:ReasoningGymEnv"
_TEST_SEED_OFFSET = 1_000_003
_TERMINAL_STATE = "<｜TERMINAL_STATE｜>"  # gem.utils.constants.TERMINAL_STATE
_INSTALL = ("pip install --no-deps gem-llm msgspec "
            "(GEM pins an old reasoning-gym; install it without its pins)")

# (env_id, wrappers, env_kwargs, split kind) -> a created-and-reset instance to copy episodes from
_PROTOTYPES: dict[str, Any] = {}


def _import_gem():
    """``import gem`` without its side effect on logging (it calls ``logging.basicConfig(INFO)``)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with PrivateGlobalRng().active():  # importing reasoning-gym (which GEM does) draws from it
            import gem
            import gem.envs  # noqa: F401 - registers the ids
    except ImportError as exc:
        raise ValueError(f"GEM environments need the gem-llm package ({exc}); {_INSTALL}") from exc
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return gem


def _wrapper_names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [w.strip() for w in value.split(",") if w.strip()]
    if isinstance(value, (list, tuple)) and all(isinstance(w, str) for w in value):
        return list(value)
    raise ValueError(f"wrappers must be a list of GEM wrapper names, got {value!r}")


def _entry_point(env_id: str) -> str:
    from gem.envs.registration import ENV_REGISTRY

    entry = ENV_REGISTRY[env_id].entry_point
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


class _Spec(GameSpec):
    """Parsed and checked type + args of one ``gem:`` entry."""

    prefix, package, example, known_args = "gem", "GEM", "gem:game:GuessTheNumber-v0-easy", _ARGS

    def __init__(self, type_name: str, args: dict[str, Any]):
        super().__init__(type_name, args)
        self.wrappers = _wrapper_names(args.get("wrappers"))
        self.info_suffix = args.get("info_suffix", True)
        if not isinstance(self.info_suffix, bool):
            raise ValueError(f"info_suffix must be true or false, got {self.info_suffix!r}")

        _import_gem()
        from gem.envs.registration import ENV_REGISTRY

        self.check_env_id(ENV_REGISTRY)
        self.entry = _entry_point(self.env_id)
        self._check_wrappers()
        self._check_resources()

    def _check_wrappers(self) -> None:
        try:
            from gem.wrappers.wrapper_factory import WRAPPER_FACTORY
        except ImportError as exc:
            if not self.wrappers:
                return
            raise ValueError(f"GEM wrappers cannot be imported ({exc}); {_INSTALL}") from exc
        for name in self.wrappers:
            if name in _HISTORY_WRAPPERS:
                raise ValueError(
                    f"GEM wrapper {name!r} is not supported: it folds the whole history into each "
                    "observation, but polyrl already keeps the conversation (every observation and reply) "
                    "in the episode's tokens; leave it out (with renderer qwen3_game/qwen3_general for GEM's "
                    "plain templates)"
                )
            if name not in WRAPPER_FACTORY:
                known = ", ".join(sorted(WRAPPER_FACTORY))
                raise ValueError(f"unknown GEM wrapper {name!r} (known: {known})")
            if name.startswith("search_tool") and not os.environ.get("SEARCH_URL"):
                raise ValueError(f"GEM wrapper {name!r} needs a search server: set SEARCH_URL")

    def _check_resources(self) -> None:
        module = self.entry.split(":")[0]
        if module in _WORD_GAMES:
            try:
                import nltk

                nltk.data.find("corpora/words")
            except LookupError:
                raise ValueError(
                    f"GEM {self.env_id!r} needs the nltk 'words' corpus, which is not installed here "
                    "(GEM would try to download it): run `python -m nltk.downloader words` with network "
                    "access, or point NLTK_DATA at a copy"
                ) from None
        local = os.path.isdir(os.path.expanduser(str(self.env_kwargs.get("dataset_name") or "")))
        if module in _HUB_DATASETS and "dataset" not in self.env_kwargs and not local:
            hub = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get(
                "HF_DATASETS_OFFLINE", ""
            ) not in ("", "0")
            if hub:
                raise ValueError(
                    f"GEM {self.env_id!r} downloads its data set from the Hugging Face hub, "
                    "but HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set; use a game: or rg: id, or the "
                    "reasoning_gym: adapter"
                )

    def test_kwargs(self) -> dict[str, Any]:
        """Constructor kwargs of the test split: ``rg:`` ids draw from a differently seeded data set."""
        if self.entry != _RG_ENTRY:
            return dict(self.env_kwargs)
        from gem.envs.registration import ENV_REGISTRY

        base = self.env_kwargs.get("seed", ENV_REGISTRY[self.env_id].kwargs.get("seed", 42))
        return {**self.env_kwargs, "seed": int(base) + _TEST_SEED_OFFSET}

    def key(self, split_kind: str) -> str:
        key = [self.env_id, self.wrappers, self.env_kwargs, split_kind]
        return json.dumps(key, sort_keys=True, default=str)


def _create(spec: _Spec, kwargs: dict[str, Any]) -> Any:
    """``gem.make`` + wrappers on a throwaway RNG stream; reset once so a broken id fails here."""
    gem = _import_gem()
    rng = PrivateGlobalRng(0)
    with rng.active(), contextlib.redirect_stdout(io.StringIO()):
        env = gem.make(spec.env_id, **kwargs)
        if spec.wrappers:
            from gem.wrappers.wrapper_factory import WRAPPER_FACTORY

            for name in spec.wrappers:
                env = WRAPPER_FACTORY[name](env)
        env.reset(seed=0)
    return env


def _prototype(spec: _Spec, split: str) -> Any:
    kind = "test" if split == "test" else "train"
    key = spec.key(kind)
    if key not in _PROTOTYPES:
        kwargs = spec.test_kwargs() if kind == "test" else dict(spec.env_kwargs)
        try:
            _PROTOTYPES[key] = _create(spec, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the package becomes one clear line
            hint = ""
            if spec.entry.split(":")[0] in _HUB_DATASETS:
                hint = " (this id downloads its data set from the Hugging Face hub)"
            raise ValueError(
                f"GEM {spec.env_id!r} cannot be created here{hint}: {type(exc).__name__}: {one_line(exc)}"
            ) from exc
    return _PROTOTYPES[key]


def _obs_text(obs: dict) -> str:
    """The text of a mapping observation with images: its problem (or question)."""
    return str(next((obs[k] for k in ("problem", "question", "text") if obs.get(k) is not None), ""))


def _message_text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


class GemEnv(GameEnv):
    """One GEM episode on a private copy of the builder's prototype and of the global RNG state."""

    spec: _Spec

    def __init__(self, spec: _Spec, prototype: Any, seed: int):
        super().__init__(spec, seed)
        self.prototype = prototype

    def _observation(self, obs: Any, info: Any, done: bool = False) -> str:
        """Like GEM's observation wrapper for the newest observation: prefix + obs + newline + suffix."""
        text = "" if obs is None else str(obs)
        if self.spec.info_suffix and isinstance(info, dict) and not done:
            if info.get("suffix") and text and not text.endswith("\n"):
                text += "\n"
            text = str(info.get("prefix", "")) + text + str(info.get("suffix", ""))
        return text

    async def reset(self) -> Observation:
        with self.rng.active():
            self.env = self.fresh_game(self.prototype, lambda: _create(self.spec, self.spec.env_kwargs))
            obs, info = self.env.reset(seed=self.seed)
        if isinstance(obs, dict) and obs.get("images"):
            observation = self.first_observation(self._observation(_obs_text(obs), info))
            text = observation.messages[-1]["content"]
            pictures = obs["images"] if isinstance(obs["images"], (list, tuple)) else [obs["images"]]
            observation.messages[-1]["content"] = [*({"type": "image", "image": p} for p in pictures),
                                                   {"type": "text", "text": text}]
            return observation
        return self.first_observation(self._observation(obs, info))

    async def step(self, action: Message) -> StepResult:
        with self.rng.active():
            obs, reward, terminated, truncated, info = self.env.step(_message_text(action))
        value, metrics = self.checked_reward(reward)
        done = bool(terminated or truncated)
        text = self._observation(obs, info, done)
        if done:
            metrics["success"] = self.success(value)
            metrics["truncated"] = float(bool(truncated))
            for k, v in (info if isinstance(info, dict) else {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "suffix":
                    metrics[f"info/{k}"] = float(v)
            if str(obs) == _TERMINAL_STATE or not str(obs or "").strip():
                return StepResult([], value, True, metrics)
        else:
            metrics["success"] = 0.0
            text = text if text.strip() else "(no observation)"
        return StepResult([{"role": "user", "content": text}], value, done, metrics)


@register_env("gem:")
class GemBuilder(GameBuilder):
    """``gem:<env_id>``: see the module docstring."""

    spec_class = _Spec
    spec: _Spec

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        spec = _Spec(type_name, args)
        _prototype(spec, "train")
        _prototype(spec, "test")

    def make(self, split: str, index: int) -> GemEnv:
        return GemEnv(self.spec, _prototype(self.spec, split), self.task_seed(split, index))
