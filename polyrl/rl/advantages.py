"""Advantages: GRPO group baselines and GEM-style batch return normalization, per-token terms from
other policies (a KL penalty against a reference, on-policy distillation from a teacher), and the
Datums they become.

Every estimator (:class:`Estimator`, registered with :func:`register_estimator`) returns values: for
each group, for each of its episodes, one advantage per sampled turn (``advantages_G``). The training
step passes them on and records them once on the episodes (:func:`record_advantages`) just before
:func:`to_datum` broadcasts each onto that turn's action tokens and adds the per-token terms, if any
(zero on prompt and environment tokens).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from tinker import types

from polyrl.errors import RunStoppedError
from polyrl.images import next_token_inputs
from polyrl.local import losses
from polyrl.rl.episode import Episode

#: Per group, per episode, one advantage per sampled turn.
Advantages = list[list[list[float]]]
#: The ``advantages:`` settings every estimator is called with, and their defaults (the values that
#: mean "not set": an estimator that does not use a setting refuses any other value at config load).
SETTINGS: dict[str, float | bool] = {"gamma": 1.0, "normalize_by_std": False}


class Estimator(Protocol):
    """An advantage estimator: the step's groups of episodes in, per group, per episode, one advantage
    per sampled turn (``ep.num_turns``) out. It is called with every setting of :data:`SETTINGS`."""

    def __call__(self, episodes_G: list[list[Episode]], *, gamma: float,
                 normalize_by_std: bool) -> Advantages: ...


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Estimator
    uses: tuple[str, ...]  # the settings it reads; the others must keep their defaults
    per_group: bool  # a group's advantages depend on that group alone (minibatches can be streamed)


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, *, uses: tuple[str, ...] = (),
                       per_group: bool = True) -> Callable[[Callable[..., Advantages]], Estimator]:
    """``@register_estimator("name")`` on an :class:`Estimator`: ``advantages.estimator: name`` then
    chooses it. ``uses`` names the settings (of :data:`SETTINGS`) it honours; a config that sets another
    is refused when it loads. ``per_group=False``: it compares episodes across groups (a batch-wide
    normalization), so minibatches cannot be trained before the whole batch is in. A function without
    the interface's signature is a TypeError here, not at the first training step."""
    if unknown := sorted(set(uses) - set(SETTINGS)):
        raise TypeError(f"estimator {name!r}: uses {unknown} are not advantages settings "
                        f"({', '.join(SETTINGS)})")

    def deco(fn: Callable[..., Advantages]) -> Estimator:
        try:
            inspect.signature(fn).bind([], **SETTINGS)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"estimator {name!r}: {getattr(fn, '__name__', fn)}{_signature(fn)} does not "
                            "take fn(episodes_G, *, gamma, normalize_by_std) (the groups of episodes in, per "
                            f"group, per episode, per turn advantages out) ({exc})") from None
        ESTIMATORS[name] = EstimatorSpec(name, fn, tuple(uses), per_group)
        return fn

    return deco


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def get_estimator(name: str) -> EstimatorSpec:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


def unused_settings(spec: EstimatorSpec, settings: dict[str, float | bool]) -> list[str]:
    """The settings of ``settings`` set away from their defaults that estimator ``spec`` does not use."""
    return [key for key, value in settings.items() if key not in spec.uses and value != SETTINGS[key]]


def _std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def centred(xs: list[float], normalize_by_std: bool) -> list[float]:
    """Each of ``xs`` minus their mean (over their std + 1e-6, when normalizing). Values so large that
    a sum of them or of their squares could overflow are first divided by a power of two near their
    largest magnitude (exact), so the result is finite whenever it can be: always when normalized,
    and for rewards within ``max_abs_reward``. Other values take the plain formula, bit for bit."""
    exponent = math.frexp(max(abs(x) for x in xs))[1]
    scale = math.ldexp(1.0, exponent - 1) if exponent > 256 else 1.0
    ys = [x / scale for x in xs]
    mean = sum(ys) / len(ys)
    if normalize_by_std:
        std = _std(ys)
        return [(y - mean) / (std + 1e-6 / scale) for y in ys]
    return [(y - mean) * scale for y in ys]


@register_estimator("grpo", uses=("normalize_by_std",))
def grpo(episodes_G: list[list[Episode]], *, gamma: float, normalize_by_std: bool) -> Advantages:
    """Episode reward minus its group's mean (optionally over the group's std), on every turn."""
    advantages_G = []
    for group in episodes_G:
        centred_rewards = centred([ep.reward for ep in group], normalize_by_std)
        advantages_G.append([[adv] * ep.num_turns for ep, adv in zip(group, centred_rewards)])
    return advantages_G


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    out, running = [], 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


@register_estimator("rebn", uses=("gamma",), per_group=False)
def rebn(episodes_G: list[list[Episode]], *, gamma: float, normalize_by_std: bool) -> Advantages:
    """Return batch normalization: each turn's discounted return-to-go, normalized over every turn
    of the batch (mean 0, std 1; always, so ``normalize_by_std`` is not among its settings). Credits
    individual turns of multi-turn episodes."""
    returns_G = [[discounted_returns(turn_rewards(ep), gamma) for ep in group] for group in episodes_G]
    flat = [r for returns in returns_G for rets in returns for r in rets]
    if not flat:
        return [[[] for _ in group] for group in episodes_G]
    advantages = iter(centred(flat, normalize_by_std=True))
    return [[[next(advantages) for _ in rets] for rets in returns] for returns in returns_G]


def turn_rewards(ep: Episode) -> list[float]:
    """One reward per sampled turn, adding up to ``ep.reward``: the rollout's ``turn_rewards`` (see
    :func:`polyrl.rl.episode.finalize_reward`), else the step rewards; whatever the episode's reward
    adds beyond them (a workflow that sets the reward itself) lands on the last turn."""
    source = ep.turn_rewards if ep.turn_rewards is not None else ep.step_rewards
    rewards = list(source[: ep.num_turns]) + [0.0] * max(0, ep.num_turns - len(source))
    if rewards and abs(ep.reward - sum(rewards)) > 1e-9:
        rewards[-1] += ep.reward - sum(rewards)
    return rewards


def compute_advantages(episodes_G: list[list[Episode]], estimator: str = "grpo",
                       normalize_by_std: bool = False, gamma: float = 1.0) -> Advantages:
    """The advantages ``estimator`` gives the episodes of ``episodes_G``, group by group: a ValueError
    for a setting it does not use, or for values that are not one advantage per sampled turn."""
    spec = get_estimator(estimator)
    settings: dict[str, float | bool] = {"gamma": gamma, "normalize_by_std": normalize_by_std}
    if unused := unused_settings(spec, settings):
        raise ValueError(f"advantage estimator {estimator!r} does not use {', '.join(unused)}")
    advantages_G = spec.fn(episodes_G, gamma=gamma, normalize_by_std=normalize_by_std)
    if problem := shape_problem(episodes_G, advantages_G):
        raise ValueError(f"advantage estimator {estimator!r} returned {problem}")
    return advantages_G


def shape_problem(episodes_G: list[list[Episode]], advantages_G: object) -> str | None:
    """What is wrong with ``advantages_G`` as per group, per episode, per turn advantages, or None."""
    if not isinstance(advantages_G, list) or len(advantages_G) != len(episodes_G):
        return f"{_described(advantages_G)} for {len(episodes_G)} groups (one list per group expected)"
    for g, (group, advantages) in enumerate(zip(episodes_G, advantages_G)):
        if not isinstance(advantages, list) or len(advantages) != len(group):
            return f"{_described(advantages)} for group {g} of {len(group)} episodes (one list per episode)"
        for e, (ep, turns) in enumerate(zip(group, advantages)):
            if not isinstance(turns, list) or len(turns) != ep.num_turns \
                    or not all(isinstance(a, numbers.Real) and not isinstance(a, bool) for a in turns):
                return (f"{_described(turns)} for episode {e} of group {g}, which has {ep.num_turns} sampled "
                        "turns (a list of one number per turn expected)")
    return None


def _described(value: object) -> str:
    return f"a list of {len(value)}" if isinstance(value, list) else f"a {type(value).__name__}"


def scale_advantages(advantages_G: Advantages, weight: float) -> Advantages:
    """Every turn advantage times ``weight`` (the share of rewards next to other signals)."""
    return [[[a * weight for a in turns] for turns in group] for group in advantages_G]


def record_advantages(episodes_G: list[list[Episode]], advantages_G: Advantages) -> None:
    """Write each episode's advantages into its record (``turn_advantages``), which its Datum and the
    trajectory log read; the training step does this once, when the step's advantages are final."""
    for group, advantages in zip(episodes_G, advantages_G, strict=True):
        for ep, turns in zip(group, advantages, strict=True):
            ep.turn_advantages = turns


# ---- per-token terms from another policy's logprobs of the sampled tokens ----------------------------
def logprob_gaps(ep: Episode, other: Sequence[float | None]) -> list[float]:
    """``log p_sampler - log p_other`` of each sampled token of ``ep``; 0 on prompt and environment
    tokens. ``other`` is a ``compute_logprobs`` answer for ``ep.tokens`` (None for the first token)."""
    if len(other) != len(ep.tokens):
        raise ValueError(f"{len(other)} logprobs for an episode of {len(ep.tokens)} tokens")
    return [s - o if m else 0.0  # type: ignore[operator]
            for s, o, m in zip(ep.logprobs, other, ep.action_mask)]


def mean_gap(episodes: Sequence[Episode], gaps: Sequence[list[float]]) -> float:
    """The mean of ``gaps`` over every sampled token: a KL estimate of the sampler from the other policy."""
    tokens = sum(ep.action_tokens for ep in episodes)
    return sum(sum(g) for g in gaps) / tokens if tokens else 0.0


def _on_sampled_tokens(ep: Episode, values: list[float], discount: float) -> list[float]:
    """``values`` on sampled tokens, or with a ``discount`` each one's discounted sum with the sampled
    tokens' values after it; zero elsewhere (a discounted sum would otherwise also land on environment
    tokens)."""
    values = [v if m else 0.0 for v, m in zip(values, ep.action_mask)]
    if discount > 0:
        values = [v if m else 0.0 for v, m in zip(discounted_returns(values, discount), ep.action_mask)]
    return values


def reference_kl_terms(episodes: Sequence[Episode], reference_logprobs: Sequence[Sequence[float | None]],
                       coef: float, discount: float = 0.0) -> tuple[list[list[float]], float]:
    """tinker-cookbook's KL penalty (``incorporate_kl_penalty``): with ``d`` = sampler logprob - reference
    logprob of a sampled token and ``mean`` its mean over the batch's sampled tokens, the token's term is
    ``coef * (mean - d)``. Returns the per-token terms of each episode and ``mean`` (``kl/reference``)."""
    gaps = [logprob_gaps(ep, ref) for ep, ref in zip(episodes, reference_logprobs)]
    mean = mean_gap(episodes, gaps)
    terms = [_on_sampled_tokens(ep, [coef * (mean - d) for d in g], discount)
             for ep, g in zip(episodes, gaps)]
    return terms, mean


def teacher_kl_terms(episodes: Sequence[Episode], teacher_logprobs: Sequence[Sequence[float | None]],
                     coef: float, discount: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """tinker-cookbook's on-policy distillation: a sampled token's term is ``-coef * d`` with ``d`` =
    sampler logprob - teacher logprob (the per-token reverse KL). Returns the terms and the gaps ``d``."""
    gaps = [logprob_gaps(ep, t) for ep, t in zip(episodes, teacher_logprobs)]
    terms = [_on_sampled_tokens(ep, [-coef * d for d in g], discount) for ep, g in zip(episodes, gaps)]
    return terms, gaps


def token_advantages(ep: Episode) -> list[float]:
    """Per-token advantages over ``ep.tokens``: each turn's advantage on its sampled tokens."""
    advantages_T = [0.0] * len(ep.tokens)
    for (start, end), a in zip(ep.turn_spans, ep.turn_advantages):
        for i in range(start, end):
            advantages_T[i] = a
    return advantages_T


def needs_provenance(loss_fn: str) -> bool:
    """Whether ``loss_fn``'s Datums must say which sampled sequence each token comes from
    (``Datum.with_provenance``; its registration's ``provenance``)."""
    return loss_fn in losses.LOSSES and losses.LOSSES[loss_fn].provenance


class MissingSequenceId(RunStoppedError):
    """A stable_reinforce Datum needs the sampler's sequence_id of every sampled turn of its episode."""


def provenance_spans(ep: Episode) -> tuple[list, int]:
    """Where each token of ``ep`` up to its last sampled sequence comes from: a sequence's request prompt
    was every token before it, so the tokens since the previous sequence are positions of that prompt,
    and the sequence's own tokens are its sampled tokens (a turn sampled in chunks is one sequence per
    chunk). Returns the spans and the number of tokens they cover (tokens after the last sequence were
    in no request and carry no loss)."""
    spans: list = []
    covered = 0
    for start, end, sequence_id in ep.sequence_runs:
        if sequence_id is None:
            raise MissingSequenceId(f"loss_fn stable_reinforce needs the sampler's sequence_id of every "
                                    f"sampled turn, and an episode of {ep.env_name} has a turn without one "
                                    "(its environment samples outside polyrl's sampler); use another loss_fn")
        if start > covered:
            spans.append(types.PromptProvenanceSpan(sequence_id=sequence_id, offset=covered,
                                                    length=start - covered))
        if end > start:
            spans.append(types.SampledProvenanceSpan(sequence_id=sequence_id, length=end - start))
        covered = end
    return spans, covered


def _without(spans: list, first: bool) -> list:
    """``spans`` less their first (or last) position."""
    span = spans[0] if first else spans[-1]
    rest = spans[1:] if first else spans[:-1]
    if span.length > 1:
        shorter = replace(span, offset=span.offset + 1, length=span.length - 1) if first else \
            replace(span, length=span.length - 1)
        rest = [shorter, *rest] if first else [*rest, shorter]
    return rest


def to_datum(ep: Episode, loss_fn: str = "importance_sampling",
             terms_T: list[float] | None = None) -> types.Datum:
    """The training example for an episode: input ``tokens[:-1]`` predicts ``tokens[1:]``; sampler
    logprobs and advantages (plus ``terms_T``, a per-token term for each token, if given) are shifted
    the same way, zero outside the sampled tokens. As the loss's registration says, the action mask
    goes in its ``action_mask`` input (DRO's penalty and GSPO's sequence ratio would otherwise also
    cover prompt and environment tokens, whose sampler logprob is a 0.0 placeholder), and a
    ``provenance`` loss gets provenance spans (the Datum then ends with the last sampled turn)."""
    advantages_T = token_advantages(ep)
    if terms_T is not None:
        advantages_T = [a + t for a, t in zip(advantages_T, terms_T, strict=True)]
    n, spans = len(ep.tokens), None
    if needs_provenance(loss_fn):
        spans, n = provenance_spans(ep)
    model_input, targets = next_token_inputs(ep.tokens[:n], [s for s in ep.images if s.end <= n])
    inputs = {
        "target_tokens": types.TensorData(data=targets, dtype="int64"),
        "logprobs": types.TensorData(data=ep.logprobs[1:n], dtype="float32"),
        "advantages": types.TensorData(data=advantages_T[1:n], dtype="float32"),
    }
    if (mask_key := losses.LOSSES[loss_fn].action_mask if loss_fn in losses.LOSSES else None) is not None:
        inputs[mask_key] = types.TensorData(data=[float(m) for m in ep.action_mask[1:n]], dtype="float32")
    datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
    if spans is None:
        return datum
    return datum.with_provenance(model_input=_without(spans, first=False),
                                 loss_fn_inputs=_without(spans, first=True))
