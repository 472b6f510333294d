"""One episode: the record a rollout fills, and the code that plays it.

Tokens, not text: an episode keeps one growing token sequence. Each turn's prompt is the previous
prompt + the exact sampled tokens + the newly rendered environment messages; nothing is re-rendered,
so what is trained is exactly what was sampled. Sampled tokens carry their sampler logprobs, the
sampler step of the weights that produced them and an action mask of 1; prompt and environment tokens
carry 0 (they get no weight in the loss) and sampler step -1.

An episode samples through a :class:`SamplerRef`, asked for the newest sampler at every turn (and every
chunk of a long turn): fixed in evaluation and in the synchronous loop, swapped for newer weights by the
rollout queue while asynchronous training plays the episode (partial rollouts).

Images are content like text: an observation's image parts are read and bounded (``max_image_bytes``,
``max_image_pixels``), rendered into the sequence (their positions hold the model's image placeholder id,
as many as its processor counts), and kept as :class:`~polyrl.images.ImageSpan` s in ``Episode.images``;
:meth:`Episode.model_input` gives the ``ModelInput`` (text and ``ImageChunk`` s) the sampler and the
Datums take. The episode's messages keep a reference instead of each image (``images/<hash>.jpeg``, the
file the run stores it in once), so nothing downstream holds pixels or base64.

This module sits just above the environment interface (:mod:`polyrl.envs.base`), so environments
that drive their own rollouts (``EnvBuilder.rollout``) import what they need from it at the top:
:class:`Episode`, the :class:`RolloutContext` they are given, :func:`run_episode` and
:func:`finalize_reward`. Groups of episodes and the training plan are :mod:`polyrl.rl.rollouts`' job.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polyrl import images
from polyrl.backend import service_lost
from polyrl.config.schema import (
    DEFAULT_MAX_ABS_REWARD,
    DEFAULT_MAX_OBSERVATION_BYTES,
    DEFAULT_MAX_OBSERVATION_TOKENS,
)
from polyrl.envs.base import Env, call_env
from polyrl.errors import RunStoppedError, ServiceLostError, UserInputError
from polyrl.images import ImageSpan
from polyrl.renderers.base import Message, Rendered, Renderer

if TYPE_CHECKING:
    from tinker import types

    from polyrl.clients import SamplingClient


class SamplerError(RunStoppedError):
    """The sampling service answered without what training needs (its logprobs; zeros in their place
    would silently make the importance ratio ``exp(logprob)``). Not an environment failure, so it is
    not counted against a failure budget: the run stops."""


class RewardOutOfBounds(ValueError):
    """An episode's reward or one of its step rewards is past ``max_abs_reward``: the episode fails
    (counted against the failure budget) instead of overflowing the advantages."""


class ObservationTooLarge(ValueError):
    """An observation holds more bytes or renders to more tokens than ``max_observation_bytes`` /
    ``max_observation_tokens``: the episode fails (counted) before the observation costs its memory."""


@dataclass
class Episode:
    """One rollout: messages for people, tokens for training."""

    env_name: str
    split: str
    task_index: int
    group_id: int
    role: str = ""  # multi-agent workflows: advantages are grouped per role
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    images: list[ImageSpan] = field(default_factory=list)  # where images sit in ``tokens``
    image_files: dict[str, bytes] = field(default_factory=dict)  # every image of ``messages``, by reference
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    # per token: the optimizer steps the weights that sampled it had seen; -1 on prompt/environment tokens
    sampler_steps: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each sampled turn
    # [start, end) and sequence_id (None where the sampler gave none) of each sampled sequence: one per
    # turn, or one per chunk of a turn sampled in chunks; what a stable_reinforce Datum names as the
    # source of its tokens (provenance)
    sequence_runs: list[tuple[int, int, str | None]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    done_by_env: bool = False
    reward: float = 0.0
    success: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    duration_s: float = 0.0
    turn_rewards: list[float] | None = None  # per-turn shares of ``reward`` (see finalize_reward)
    # the advantage of each sampled turn this episode was trained with: recorded once by the training
    # step (polyrl.rl.update) for its Datum and the trajectory log; the estimators return them as values
    turn_advantages: list[float] = field(default_factory=list)
    # an environment's judge (polyrl.rl.judge): one record per rubric item, its prompt, verdict and score
    judge: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def action_tokens(self) -> int:
        return sum(self.action_mask)

    def model_input(self, end: int | None = None):
        """The ``ModelInput`` of ``tokens[:end]``: text chunks and each image's ``ImageChunk``."""
        return images.model_input(self.tokens, self.images, end)

    def keep_images(self, messages: list[Message], spans: list[ImageSpan] | None) -> list[Message]:
        """``messages`` as the episode keeps them: each image part a reference to the file its encoded
        bytes are stored in (``{"type": "image", "image": "images/<hash>.jpeg", "width", "height"}``, the
        bytes in ``image_files``). ``spans``: the images as rendered, in order (None: the messages were not
        rendered, and each image gets the canonical encoding)."""
        if not images.has_images(messages):
            return list(messages)
        found = list(images.image_parts(messages))
        if spans is not None and len(spans) != len(found):
            raise ValueError(f"the renderer rendered {len(spans)} of the observation's {len(found)} images")
        encoded = iter([(span.data, span.format) for span in spans] if spans is not None else
                       [(images.encode(part["image"]), images.ENCODING) for part in found])

        def reference(part: dict) -> dict:
            data, fmt = next(encoded)
            name = images.stored_name(data, fmt)
            self.image_files[name] = data
            width, height = part["image"].size
            return {"type": "image", "image": name, "width": width, "height": height}

        return images.map_images(messages, reference)

    def append_rendered(self, rendered: Rendered) -> None:
        """Append rendered prompt/environment tokens and the images among them."""
        self.images.extend(span.shifted(len(self.tokens)) for span in rendered.images)
        self.append(rendered.tokens)

    def append(self, tokens: list[int], logprobs: list[float] | None = None,
               sampler_steps: list[int] | None = None,
               runs: list[tuple[int, str | None]] | None = None) -> None:
        """Append prompt/environment tokens (``logprobs`` None) or one sampled turn, with the sampler step
        of each of its tokens (not given: -1, see :meth:`fill_sampler_steps`) and the length and
        sequence_id of each sequence it was sampled as (not given: one sequence without an id)."""
        self.tokens.extend(tokens)
        if logprobs is None:
            self.logprobs.extend([0.0] * len(tokens))
            self.action_mask.extend([0] * len(tokens))
            self.sampler_steps.extend([-1] * len(tokens))
        else:
            self.turn_spans.append((len(self.tokens) - len(tokens), len(self.tokens)))
            start = len(self.tokens) - len(tokens)
            for length, sequence_id in runs or [(len(tokens), None)]:
                self.sequence_runs.append((start, start + length, sequence_id))
                start += length
            self.logprobs.extend(logprobs)
            self.action_mask.extend([1] * len(tokens))
            self.sampler_steps.extend([-1] * len(tokens) if sampler_steps is None else sampler_steps)

    def fill_sampler_steps(self, step: int) -> None:
        """Sampled tokens appended without their sampler step (by an environment that samples on its
        own) count as sampled by the weights after ``step`` updates, those its rollout started with."""
        self.sampler_steps = [step if m and s < 0 else s
                              for s, m in zip(self.sampler_steps, self.action_mask)]

    def sampled_steps(self) -> list[int]:
        """The sampler step of each sampled token, in order."""
        return [s for s, m in zip(self.sampler_steps, self.action_mask) if m]


class SamplerRef:
    """The sampler an episode samples with, asked for at every turn: ``current`` is ``(sampler, step)``,
    the sampler and the optimizer steps its weights have seen. In asynchronous training the rollout queue
    :meth:`swap` s in each new policy's sampler, so episodes in flight continue with the newest weights;
    with ``chunk_tokens`` a turn also asks again after every that many tokens."""

    def __init__(self, sampler: SamplingClient, step: int = 0, chunk_tokens: int | None = None):
        self.current = (sampler, step)  # one tuple: never the sampler of one swap with the step of another
        self.chunk_tokens = chunk_tokens

    @classmethod
    def of(cls, sampler: SamplingClient | SamplerRef) -> SamplerRef:
        """``sampler`` as a reference: a fixed sampler becomes one that is never swapped."""
        return sampler if isinstance(sampler, SamplerRef) else cls(sampler)

    def swap(self, sampler: SamplingClient, step: int) -> None:
        self.current = (sampler, step)

    @property
    def sampler(self) -> SamplingClient:
        return self.current[0]

    @property
    def step(self) -> int:
        return self.current[1]


@dataclass
class RolloutContext:
    """What an environment that drives its own rollouts (``EnvBuilder.rollout``) is given. ``sampler_ref``
    may be given a plain sampler (it is then never swapped); ``sampler`` is the newest one. ``partner`` is
    the entry's partner model (``partner:``, see :mod:`polyrl.rl.chat_models`), if it has one:
    ``await ctx.partner(messages, seed)`` answers as the other side."""

    env_name: str
    split: str
    task_index: int
    group_id: int
    sampler_ref: SamplerRef
    renderer: Renderer
    settings: RolloutSettings
    seed: int | None
    partner: Any = None

    def __post_init__(self) -> None:
        self.sampler_ref = SamplerRef.of(self.sampler_ref)

    @property
    def sampler(self) -> SamplingClient:
        return self.sampler_ref.sampler

    def episode(self, role: str = "") -> Episode:
        """A fresh episode of this rollout's task for ``role``."""
        return Episode(self.env_name, self.split, self.task_index, self.group_id, role=role)

    async def sample(self, episode: Episode, max_tokens: int | None = None, stream: int = 0) -> Message:
        """Sample one assistant turn continuing ``episode.tokens`` with the newest sampler; append it (each
        token with the sampler step that produced it); return the parsed message. With the reference's
        ``chunk_tokens``, the turn is sampled that many tokens at a time, each chunk continuing the turn so
        far (the prefix re-encoded) with the newest sampler, until a stop or ``max_tokens``. Seeded per
        (rollout seed, ``stream``, turn, chunk), so a resumed run samples exactly what the original did;
        a workflow gives each of its parallel calls (e.g. several solvers) its own ``stream``."""
        from tinker import types  # not at the top: `polyrl chat` imports this module to build its parser

        turn = len(episode.turn_spans) + 7919 * stream
        budget, chunk_tokens = max_tokens or self.settings.max_tokens, self.sampler_ref.chunk_tokens
        stops = self.renderer.stop_sequences()
        tokens: list[int] = []
        logprobs: list[float] = []
        steps_T: list[int] = []
        runs: list[tuple[int, str | None]] = []  # (length, sequence_id) of each chunk
        for chunk in itertools.count():
            sampler, step = self.sampler_ref.current
            wanted = budget - len(tokens) if chunk_tokens is None else min(chunk_tokens, budget - len(tokens))
            params = types.SamplingParams(max_tokens=wanted, temperature=self.settings.temperature,
                                          stop=stops, seed=self.chunk_seed(turn, chunk))
            new, new_logprobs, stop_reason, sequence_id = await sample_once(
                sampler, images.model_input(episode.tokens + tokens, episode.images), params)
            start = len(tokens)
            tokens, logprobs, steps_T = tokens + new, logprobs + new_logprobs, steps_T + [step] * len(new)
            if chunk and (end := stop_across(tokens, start, stops, self.renderer.decode)) is not None:
                tokens, logprobs, steps_T, stop_reason = tokens[:end], logprobs[:end], steps_T[:end], "stop"
            runs.append((len(tokens) - start, sequence_id))
            if chunk_tokens is None or stop_reason != "length" or len(new) < wanted or len(tokens) >= budget:
                break
        episode.append(tokens, logprobs, steps_T, runs)
        episode.stop_reasons.append(stop_reason)
        message = self.renderer.parse_response(tokens)
        episode.messages.append(message)
        return message

    def chunk_seed(self, turn: int, chunk: int) -> int | None:
        """The seed of a turn's ``chunk``: the first chunk's is the turn's (as without chunks)."""
        return None if self.seed is None else (self.seed * 1009 + turn + 1_000_003 * chunk) % (2**31)


async def sample_once(sampler: SamplingClient, prompt: types.ModelInput,
                      params: types.SamplingParams) -> tuple[list[int], list[float], str, str | None]:
    """One sequence from ``sampler``: its tokens, their logprobs, its stop reason and sequence_id."""
    try:
        response = await sampler.sample(prompt, 1, params)
    except Exception as exc:
        if (lost := service_lost(exc)) is not None:  # not the environment's failure: the run reopens
            raise ServiceLostError(lost) from exc
        raise
    seq = response.sequences[0]
    logprobs = seq.logprobs
    if logprobs is None or len(logprobs) != len(seq.tokens):
        raise SamplerError(f"the sampler returned {len(seq.tokens)} tokens with "
                           f"{'no' if logprobs is None else len(logprobs)} logprobs; "
                           "the loss needs one per token")
    return list(seq.tokens), list(logprobs), seq.stop_reason, getattr(seq, "sequence_id", None)


def stop_across(tokens: list[int], start: int, stops: list[int] | list[str],
                decode: Callable[[list[int]], str]) -> int | None:
    """A sampler looks for its stop strings only in what it sampled itself, so one that a turn's chunk
    ``tokens[start:]`` completes but an earlier chunk began is found here: the number of tokens up to the
    one that completes it (the sampler would have stopped there), or None."""
    strings = [s for s in stops if isinstance(s, str)]
    if not strings or start == 0:
        return None
    reach = max(len(s) for s in strings) + 4  # tokens enough to hold a stop string (as the local sampler)
    first = max(0, start - reach)
    before = decode(tokens[first:start])
    for end in range(start + 1, min(len(tokens), start + reach) + 1):
        text = decode(tokens[first:end])
        if any(text.count(s) > before.count(s) for s in strings):
            return end
    return None


#: The reward an episode needs to count as a success when neither its environment nor its entry's
#: ``success_threshold`` says otherwise.
FULL_MARKS = 1.0


@dataclass(frozen=True)
class RolloutSettings:
    max_turns: int
    max_tokens: int
    temperature: float
    timeout: float
    reward_reduction: str = "sum"
    nonterminal_reward: float | None = None
    success_threshold: float | None = None
    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD
    max_observation_tokens: int = DEFAULT_MAX_OBSERVATION_TOKENS
    max_observation_bytes: int = DEFAULT_MAX_OBSERVATION_BYTES
    max_image_bytes: int = images.MAX_IMAGE_BYTES
    max_image_pixels: int = images.MAX_IMAGE_PIXELS

    @property
    def image_limits(self) -> images.ImageLimits:
        return images.ImageLimits(self.max_image_bytes, self.max_image_pixels)


async def run_episode(env: Env, episode: Episode, renderer: Renderer, sampler: SamplingClient | SamplerRef,
                      settings: RolloutSettings, seed: int | None = None) -> Episode:
    """Play one episode to the end, each turn with ``sampler``'s newest; exceptions propagate (the caller
    counts them as failures)."""
    start = time.monotonic()
    ctx = RolloutContext(episode.env_name, episode.split, episode.task_index, episode.group_id,
                         SamplerRef.of(sampler), renderer, settings, seed)
    try:
        obs = await call_env(env.reset)
        check_observation_bytes([obs.messages, obs.tools], settings)  # before it is kept or tokenized
        messages = await read_images(obs.messages, settings)
        episode.tools = list(obs.tools)
        prompt = check_observation_tokens(render(renderer, messages, obs.tools or None), settings)
        episode.messages = episode.keep_images(messages, prompt.images)
        episode.append_rendered(prompt)
        for turn in range(settings.max_turns):
            message = await ctx.sample(episode)
            result = await call_env(env.step, message)
            episode.step_rewards.append(float(result.reward))
            episode.metrics.update({k: float(v) for k, v in result.metrics.items()})
            check_observation_bytes(result.messages, settings)
            messages = await read_images(result.messages, settings)
            if result.done:
                episode.messages.extend(episode.keep_images(messages, None))
                episode.done_by_env = True
                break
            if turn + 1 >= settings.max_turns:
                episode.messages.extend(episode.keep_images(messages, None))
            else:
                finished = episode.stop_reasons[-1] == "stop"
                rendered = check_observation_tokens(
                    render(renderer, messages, finished=finished), settings)
                episode.messages.extend(episode.keep_images(messages, rendered.images))
                episode.append_rendered(rendered)
    finally:
        await call_env(env.close)
        episode.duration_s = time.monotonic() - start
    finalize_reward(episode, settings)
    return episode


def render(renderer: Renderer, messages: list[Message], tools: list | None = None,
           finished: bool | None = None) -> Rendered:
    """The prompt (``finished`` None) or a continuation, images kept; a renderer with only the text methods
    (``initial_prompt`` / ``continuation``, not a :class:`Renderer` subclass) renders text only."""
    if hasattr(renderer, "render_prompt"):
        return (renderer.render_prompt(messages, tools) if finished is None else
                renderer.render_continuation(messages, assistant_finished=finished))
    if images.has_images(messages):
        raise UserInputError(f"renderer {type(renderer).__name__} has no image format; these messages hold "
                             "images")
    return Rendered(renderer.initial_prompt(messages, tools) if finished is None else
                    renderer.continuation(messages, assistant_finished=finished))


def check_observation_bytes(observation: Any, settings: RolloutSettings) -> None:
    """Refuse an observation holding more than ``max_observation_bytes`` of text, before it is tokenized."""
    size = _text_bytes(observation, settings.max_observation_bytes)
    if size > settings.max_observation_bytes:
        raise ObservationTooLarge(f"the observation holds more than {settings.max_observation_bytes:,} bytes "
                                  f"(max_observation_bytes)")


async def read_images(messages: list[Message], settings: RolloutSettings) -> list[Message]:
    """``messages`` with each image read, bounded and decoded (a thread: a big one takes a while)."""
    if not images.has_images(messages):
        return list(messages)
    return await asyncio.to_thread(images.decoded_parts, messages, settings.image_limits)


def check_observation_tokens(tokens: Any, settings: RolloutSettings) -> Any:
    """``tokens`` (a list or a :class:`Rendered`), unless an observation rendered to more than
    ``max_observation_tokens``."""
    if len(tokens) > settings.max_observation_tokens:
        raise ObservationTooLarge(f"the observation renders to {len(tokens):,} tokens, more than "
                                  f"max_observation_tokens={settings.max_observation_tokens:,}")
    return tokens


def _text_bytes(value: Any, limit: int) -> int:
    """UTF-8 bytes of the strings (and bytes) in ``value``, nested containers included; counting stops
    once past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) if len(item) > limit else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, (bytes, bytearray)):
            total += len(item)
        elif images.is_image_part(item):  # bounded by max_image_bytes / max_image_pixels instead
            continue
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item
    return total


def check_rewards(episode: Episode, bound: float) -> None:
    """Refuse an episode whose reward or a step reward is past ``bound`` in magnitude."""
    for what, value in [("reward", episode.reward), *(("step reward", r) for r in episode.step_rewards)]:
        if not abs(value) <= bound:
            raise RewardOutOfBounds(f"{what} {value:g} is past max_abs_reward={bound:g}")


def finalize_reward(episode: Episode, settings: RolloutSettings) -> None:
    """The episode's scalar reward (sum or mean of step rewards; ``nonterminal_reward`` when the
    environment never ended it), its success flag, and ``turn_rewards``: per-turn rewards that add
    up to the reward (each step reward, over the turn count under ``mean``; a ``nonterminal_reward``
    replaces what the last turn adds), the same for every episode with the same step rewards.

    Success is ``reward >= success_threshold`` when the entry sets one; otherwise the environment's
    own verdict (a ``success`` metric) where it gives one, else ``reward >= 1.0``: full marks, so
    partial credit is never a success."""
    rewards = list(episode.step_rewards) or [0.0]
    if settings.reward_reduction == "mean":
        rewards = [r / len(rewards) for r in rewards]
    total = sum(rewards)
    if not episode.done_by_env and settings.nonterminal_reward is not None:
        rewards[-1] += settings.nonterminal_reward - total
        total = settings.nonterminal_reward
    episode.turn_rewards = rewards
    episode.reward = total
    decide_success(episode, settings)


def decide_success(episode: Episode, settings: RolloutSettings) -> None:
    """``episode.success`` from its reward and metrics, as :func:`finalize_reward` describes."""
    if settings.success_threshold is not None:
        episode.success = episode.reward >= settings.success_threshold
    elif "success" in episode.metrics:
        episode.success = bool(episode.metrics["success"])
    else:
        episode.success = episode.reward >= FULL_MARKS
