"""Running groups of episodes against a sampling client.

One episode is :mod:`polyrl.rl.episode`'s job (its record, its context and :func:`run_episode`); this
module runs them by the group. :class:`EnvRuntime` is one configured environment (builder, settings,
task order); :func:`collect_group` runs one planned group (training draws them one by one, see
:mod:`polyrl.rl.rollout_queue`); :func:`collect_groups` runs a whole plan at once (evaluation).
:func:`plan_step` is which environment and task each group of a training step draws, and
:func:`sample_group` runs one group of that plan.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polyrl.config.env import SplitName
from polyrl.config.schema import EnvConfig
from polyrl.envs.base import EnvBuilder, call_env
from polyrl.envs.registry import make_env_builder
from polyrl.errors import RunStoppedError
from polyrl.renderers.base import Renderer
from polyrl.rl.chat_models import ChatModel
from polyrl.rl.episode import (
    Episode,
    RolloutContext,
    RolloutSettings,
    SamplerRef,
    check_rewards,
    run_episode,
)
from polyrl.rl.judge import Judge

if TYPE_CHECKING:
    from polyrl.clients import SamplingClient


async def run_group(builder: EnvBuilder, episodes: list[Episode], renderer: Renderer,
                    sampler: SamplingClient | SamplerRef, settings: RolloutSettings,
                    seeds: Sequence[int | None], partner: ChatModel | None = None) -> list[Episode]:
    """Run a group's rollouts concurrently, each turn with ``sampler``'s newest. A failing rollout
    (exception or timeout) is marked with ``error`` and kept in the list, so the caller can apply the
    failure budget. A builder that drives its own rollouts may return several episodes (roles) per
    rollout; sampled tokens it appended without their sampler step count as sampled by the sampler the
    rollout started with. ``partner``: the entry's partner model, for builders that drive rollouts."""
    samplers = SamplerRef.of(sampler)

    async def one(ep: Episode, seed: int | None) -> list[Episode]:
        try:
            if builder.drives_rollouts:
                ctx = RolloutContext(ep.env_name, ep.split, ep.task_index, ep.group_id, samplers, renderer,
                                     settings, seed, partner)
                done = list(await asyncio.wait_for(call_env(builder.rollout, ctx), settings.timeout))
            else:
                env = builder.make(ep.split, ep.task_index)
                playing = run_episode(env, ep, renderer, samplers, settings, seed)
                done = [await asyncio.wait_for(playing, settings.timeout)]
            for episode in done:
                check_rewards(episode, settings.max_abs_reward)
            return done
        except asyncio.TimeoutError:
            ep.error = f"timeout after {settings.timeout:g}s"
        except RunStoppedError:  # the service or its sampler is gone: not this episode's failure
            raise
        except Exception as e:  # noqa: BLE001 - an environment or sampler failure is counted, not fatal
            ep.error = f"{type(e).__name__}: {e}"
            ep.metrics["traceback_lines"] = float(len(traceback.format_exc().splitlines()))
        return [ep]

    async def recorded(ep: Episode, seed: int | None) -> list[Episode]:
        started = samplers.step
        done = await one(ep, seed)
        for episode in done:
            episode.fill_sampler_steps(started)
        return done

    results = await asyncio.gather(*(recorded(ep, s) for ep, s in zip(episodes, seeds)))
    return [ep for eps in results for ep in eps]


def split_roles(episodes_G: list[list[Episode]]) -> list[list[Episode]]:
    """Groups of single-role environments unchanged; multi-role groups split into one group per role
    (failed rollouts, which have no role, stay with the first role's group)."""
    out = []
    for group in episodes_G:
        roles = list(dict.fromkeys(ep.role for ep in group if not ep.failed)) or [""]
        if len(roles) == 1:
            out.append(group)
            continue
        for i, role in enumerate(roles):
            out.append([ep for ep in group if ep.role == role or (i == 0 and ep.failed)])
    return out


# ---------------------------------------------------------------------------- configured environments
BOUNDS = ("max_abs_reward", "max_observation_tokens", "max_observation_bytes", "max_image_bytes",
          "max_image_pixels")


def rollout_bounds(config: Any) -> dict[str, Any]:
    """The run config's bounds on what environments hand back (``config.limits``), as
    :class:`RolloutSettings` fields."""
    return {key: getattr(config.limits, key) for key in BOUNDS}


def stable_seed(*parts: Any) -> int:
    """A seed from any values, equal across processes (unlike ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass
class EnvRuntime:
    """A configured environment: its builder, rollout settings and task order, and its judge and partner
    once the run's service has opened them (:func:`polyrl.rl.run.open_env_models`)."""

    name: str
    cfg: EnvConfig
    builder: EnvBuilder
    settings: RolloutSettings
    run_seed: int
    judge: Judge | None = None
    partner: ChatModel | None = None

    def rubrics(self, episode: Episode) -> list[str]:
        """The rubric items ``episode``'s task is judged by: its own, else the judge config's."""
        own = self.builder.rubrics(episode.split, episode.task_index)
        return list(own) if own else list(self.cfg.judge.rubrics if self.cfg.judge else [])

    @classmethod
    def create(cls, name: str, cfg: EnvConfig, seed: int, max_tokens: int, **bounds: Any) -> "EnvRuntime":
        """``bounds``: the :data:`BOUNDS` settings (see :func:`rollout_bounds`); their defaults otherwise."""
        builder = make_env_builder(cfg.type or name, cfg.args, seed=seed)
        settings = RolloutSettings(
            max_turns=cfg.max_turns,
            max_tokens=cfg.max_tokens or max_tokens,
            temperature=cfg.temperature,
            timeout=cfg.timeout,
            reward_reduction=cfg.reward_reduction,
            nonterminal_reward=cfg.nonterminal_reward,
            success_threshold=cfg.success_threshold,
            **bounds,
        )
        return cls(name, cfg, builder, settings, seed)

    def num_tasks(self, split: SplitName) -> int | None:
        split_cfg = self.cfg.splits.get(split)
        limit = split_cfg.num_samples if split_cfg else None
        available = self.builder.num_tasks(split)
        if limit is None:
            return available
        return limit if available is None else min(limit, available)

    def task_index(self, split: SplitName, position: int) -> int:
        """The task at ``position`` of the split's order: epochs of a seeded shuffle when the split
        is finite and ``shuffle`` is set, else sequential."""
        n = self.num_tasks(split)
        if n is None:
            return position
        epoch, k = divmod(position, n)
        split_cfg = self.cfg.splits.get(split)
        if split_cfg is not None and split_cfg.shuffle:
            seed = split_cfg.seed if split_cfg.seed is not None else self.run_seed
            order = list(range(n))
            random.Random(stable_seed(seed, self.name, split, epoch)).shuffle(order)
            return order[k]
        return k


async def collect_group(runtime: EnvRuntime, task: int, g: int, split: str, group_size: int,
                        sampler: SamplingClient | SamplerRef, renderer: Renderer,
                        seed_parts: tuple) -> list[Episode]:
    """The ``group_size`` episodes of one task, concurrently, graded by the environment's judge if it has
    one; episode ``i`` is seeded by ``(*seed_parts, g, i)``, so the same group samples the same tokens
    from the same weights."""
    episodes = [Episode(runtime.name, split, task, g) for _ in range(group_size)]
    seeds = [stable_seed(*seed_parts, g, i) for i in range(group_size)]
    done = await run_group(runtime.builder, episodes, renderer, sampler, runtime.settings, seeds,
                           runtime.partner)
    if runtime.judge is not None:
        await runtime.judge.grade_group(done, runtime.rubrics)
    return done


async def collect_groups(runtimes: dict[str, EnvRuntime], plan: list[tuple[str, int]], split: str,
                         group_size: dict[str, int] | int, sampler: SamplingClient, renderer: Renderer,
                         seed_parts: tuple, progress=None) -> list[list[Episode]]:
    """Run one group per ``(env name, task index)`` in ``plan``, all concurrently."""

    async def group(g: int, env_name: str, task: int) -> list[Episode]:
        n = group_size if isinstance(group_size, int) else group_size[env_name]
        result = await collect_group(runtimes[env_name], task, g, split, n, sampler, renderer, seed_parts)
        if progress is not None:
            progress.advance(progress.task_ids[0])
        return result

    return list(await asyncio.gather(*(group(g, name, task) for g, (name, task) in enumerate(plan))))


# ---------------------------------------------------------------------------- a training step's plan
def allocate_groups(weights: dict[str, float], batch_size: int, step: int) -> list[str]:
    """Environment name of each group in a step's batch: shares proportional to ``weight``; the
    leftover slots rotate with the step so small shares still get their turn."""
    total = sum(weights.values())
    quotas = {n: batch_size * w / total for n, w in weights.items()}
    counts = {n: math.floor(q) for n, q in quotas.items()}
    left = batch_size - sum(counts.values())
    names = sorted(weights, key=lambda n: (-(quotas[n] - counts[n]), n))
    if left:
        start = step % len(names)
        for n in (names[start:] + names[:start])[:left]:
            counts[n] += 1
    return [n for n in sorted(weights) for _ in range(counts[n])]


def plan_step(weights: dict[str, float], runtimes: dict[str, EnvRuntime], batch_size: int, step: int,
              cursors: dict[str, int]) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """The ``(environment, task index)`` of each group of ``step`` (``weights``: the environments with
    a train split, by batch share), and the data cursors after it. Pure: the same step and cursors
    always give the same plan."""
    cursors = dict(cursors)
    plan_P = []
    for name in allocate_groups(weights, batch_size, step):
        plan_P.append((name, runtimes[name].task_index("train", cursors[name])))
        cursors[name] += 1
    return plan_P, cursors


async def sample_group(runtimes: dict[str, EnvRuntime], renderer: Renderer, seed: int, step: int, index: int,
                       env_name: str, task: int, sampler: SamplerRef) -> list[Episode]:
    """Group ``index`` of ``step``'s plan, each turn sampled by ``sampler``'s newest (seeded by the run's
    ``seed``, the step and the index, so the same group samples the same tokens from the same weights)."""
    runtime = runtimes[env_name]
    return await collect_group(runtime, task, index, "train", runtime.cfg.num_rollouts, sampler, renderer,
                               (seed, "train", step))
