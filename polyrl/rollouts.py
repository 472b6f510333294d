"""Running episodes and groups of episodes against a sampling client.

Tokens, not text: an episode keeps one growing token sequence. Each turn's prompt is the previous
prompt + the exact sampled tokens + the newly rendered environment messages; nothing is re-rendered,
so what is trained is exactly what was sampled. Sampled tokens carry their sampler logprobs and an
action mask of 1; prompt and environment tokens carry 0 (they get no weight in the loss).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from polyrl.envs.base import Env, maybe_await
from polyrl.renderers.base import Renderer


@dataclass
class Episode:
    """One rollout: messages for people, tokens for training."""

    env_name: str
    split: str
    task_index: int
    group_id: int
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each sampled turn
    step_rewards: list[float] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    done_by_env: bool = False
    reward: float = 0.0
    success: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    duration_s: float = 0.0
    turn_advantages: list[float] = field(default_factory=list)  # filled by polyrl.advantages

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def action_tokens(self) -> int:
        return sum(self.action_mask)

    def append(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Append prompt/environment tokens (``logprobs`` None) or sampled tokens."""
        self.tokens.extend(tokens)
        if logprobs is None:
            self.logprobs.extend([0.0] * len(tokens))
            self.action_mask.extend([0] * len(tokens))
        else:
            self.turn_spans.append((len(self.tokens) - len(tokens), len(self.tokens)))
            self.logprobs.extend(logprobs)
            self.action_mask.extend([1] * len(tokens))


@dataclass(frozen=True)
class RolloutSettings:
    max_turns: int
    max_tokens: int
    temperature: float
    timeout: float
    reward_reduction: str = "sum"
    nonterminal_reward: float | None = None


async def run_episode(env: Env, episode: Episode, renderer: Renderer, sampler: Any,
                      settings: RolloutSettings, seed: int | None = None) -> Episode:
    """Play one episode to the end; exceptions propagate (the caller counts them as failures)."""
    start = time.monotonic()
    try:
        obs = await maybe_await(env.reset())
        episode.messages = list(obs.messages)
        episode.tools = list(obs.tools)
        episode.append(renderer.initial_prompt(obs.messages, obs.tools or None))
        stop = renderer.stop_sequences()
        for turn in range(settings.max_turns):
            params = types.SamplingParams(
                max_tokens=settings.max_tokens,
                temperature=settings.temperature,
                stop=stop,
                seed=None if seed is None else (seed * 1009 + turn) % (2**31),
            )
            response = await sampler.sample(types.ModelInput.from_ints(episode.tokens), 1, params)
            seq = response.sequences[0]
            episode.append(list(seq.tokens), list(seq.logprobs or [0.0] * len(seq.tokens)))
            episode.stop_reasons.append(seq.stop_reason)
            message = renderer.parse_response(list(seq.tokens))
            episode.messages.append(message)
            result = await maybe_await(env.step(message))
            episode.step_rewards.append(float(result.reward))
            episode.metrics.update({k: float(v) for k, v in result.metrics.items()})
            episode.messages.extend(result.messages)
            if result.done:
                episode.done_by_env = True
                break
            if turn + 1 < settings.max_turns:
                episode.append(renderer.continuation(result.messages, assistant_finished=seq.stop_reason == "stop"))
    finally:
        await maybe_await(env.close())
        episode.duration_s = time.monotonic() - start
    finalize_reward(episode, settings)
    return episode


def finalize_reward(episode: Episode, settings: RolloutSettings) -> None:
    """The episode's scalar reward (sum or mean of step rewards; ``nonterminal_reward`` when the
    environment never ended it) and its success flag."""
    rewards = episode.step_rewards or [0.0]
    total = sum(rewards) if settings.reward_reduction == "sum" else sum(rewards) / len(rewards)
    if not episode.done_by_env and settings.nonterminal_reward is not None:
        total = settings.nonterminal_reward
    episode.reward = total
    episode.success = bool(episode.metrics["success"]) if "success" in episode.metrics else total > 0


async def run_group(make_env, episodes: list[Episode], renderer: Renderer, sampler: Any,
                    settings: RolloutSettings, seeds: list[int | None]) -> list[Episode]:
    """Run a group's episodes concurrently. A failing episode (exception or timeout) is marked
    with ``error`` and kept in the list, so the caller can apply the failure budget."""

    async def one(ep: Episode, seed: int | None) -> Episode:
        try:
            env = make_env()
            return await asyncio.wait_for(run_episode(env, ep, renderer, sampler, settings, seed), settings.timeout)
        except asyncio.TimeoutError:
            ep.error = f"timeout after {settings.timeout:g}s"
        except Exception as e:  # noqa: BLE001 - an environment or sampler failure is counted, not fatal
            ep.error = f"{type(e).__name__}: {e}"
            ep.metrics["traceback_lines"] = float(len(traceback.format_exc().splitlines()))
        return ep

    return list(await asyncio.gather(*(one(ep, s) for ep, s in zip(episodes, seeds))))
