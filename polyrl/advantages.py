"""Advantages: GRPO group baselines and GEM-style batch return normalization, and the Datums they
become.

Every estimator sets ``episode.turn_advantages`` (one number per sampled turn); :func:`to_datum`
broadcasts each onto that turn's action tokens (zero on prompt and environment tokens).
"""

from __future__ import annotations

import math
from typing import Callable

from tinker import types

from polyrl.rollouts import Episode

ESTIMATORS: dict[str, Callable[..., None]] = {}


def register_estimator(name: str):
    def deco(fn):
        ESTIMATORS[name] = fn
        return fn

    return deco


def _std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


@register_estimator("grpo")
def grpo(groups: list[list[Episode]], normalize_by_std: bool = False, gamma: float = 1.0) -> None:
    """Episode reward minus its group's mean (optionally over the group's std), on every turn."""
    for group in groups:
        rewards = [ep.reward for ep in group]
        mean = sum(rewards) / len(rewards)
        std = _std(rewards)
        for ep in group:
            adv = ep.reward - mean
            if normalize_by_std:
                adv /= std + 1e-6
            ep.turn_advantages = [adv] * ep.num_turns


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    out, running = [], 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


@register_estimator("rebn")
def rebn(groups: list[list[Episode]], normalize_by_std: bool = True, gamma: float = 1.0) -> None:
    """Return batch normalization: each turn's discounted return-to-go, normalized over every turn
    of the batch (mean 0, std 1). Credits individual turns of multi-turn episodes."""
    per_episode = []
    for group in groups:
        for ep in group:
            per_episode.append((ep, discounted_returns(turn_rewards(ep), gamma)))
    flat = [g for _, rets in per_episode for g in rets]
    if not flat:
        return
    mean, std = sum(flat) / len(flat), _std(flat)
    for ep, rets in per_episode:
        ep.turn_advantages = [(g - mean) / (std + 1e-6) for g in rets]


def turn_rewards(ep: Episode) -> list[float]:
    """One reward per sampled turn, adding up to ``ep.reward``: the rollout's ``turn_rewards`` (see
    :func:`polyrl.rollouts.finalize_reward`), else the step rewards; whatever the episode's reward
    adds beyond them (a workflow that sets the reward itself) lands on the last turn."""
    source = ep.turn_rewards if ep.turn_rewards is not None else ep.step_rewards
    rewards = list(source[: ep.num_turns]) + [0.0] * max(0, ep.num_turns - len(source))
    if rewards and abs(ep.reward - sum(rewards)) > 1e-9:
        rewards[-1] += ep.reward - sum(rewards)
    return rewards


def compute_advantages(groups: list[list[Episode]], estimator: str = "grpo", normalize_by_std: bool = False,
                       gamma: float = 1.0) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {', '.join(sorted(ESTIMATORS))}")
    kwargs = {"gamma": gamma}
    if estimator == "grpo":
        kwargs["normalize_by_std"] = normalize_by_std
    ESTIMATORS[estimator](groups, **kwargs)


def token_advantages(ep: Episode) -> list[float]:
    """Per-token advantages over ``ep.tokens``: each turn's advantage on its sampled tokens."""
    adv = [0.0] * len(ep.tokens)
    for (start, end), a in zip(ep.turn_spans, ep.turn_advantages):
        for i in range(start, end):
            adv[i] = a
    return adv


#: Losses that must be told which tokens were sampled, and the ``loss_fn_inputs`` key that says it:
#: DRO's quadratic penalty and GSPO's sequence ratio would otherwise also cover prompt and
#: environment tokens, whose sampler logprob is a 0.0 placeholder.
ACTION_MASK_INPUTS = {"dro": "mask", "gspo": "sequence_ratio_mask"}


def to_datum(ep: Episode, loss_fn: str = "importance_sampling") -> types.Datum:
    """The training example for an episode: input ``tokens[:-1]`` predicts ``tokens[1:]``; sampler
    logprobs and advantages are shifted the same way, zero outside the sampled tokens; losses in
    :data:`ACTION_MASK_INPUTS` also get the action mask."""
    adv = token_advantages(ep)
    inputs = {
        "target_tokens": types.TensorData(data=ep.tokens[1:], dtype="int64"),
        "logprobs": types.TensorData(data=ep.logprobs[1:], dtype="float32"),
        "advantages": types.TensorData(data=adv[1:], dtype="float32"),
    }
    if loss_fn in ACTION_MASK_INPUTS:
        inputs[ACTION_MASK_INPUTS[loss_fn]] = types.TensorData(data=[float(m) for m in ep.action_mask[1:]],
                                                               dtype="float32")
    return types.Datum(model_input=types.ModelInput.from_ints(ep.tokens[:-1]), loss_fn_inputs=inputs)
