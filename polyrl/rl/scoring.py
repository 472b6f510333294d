"""Other policies that score the tokens the policy sampled: the KL penalty's reference and the
on-policy distillation teacher.

Each is a ``SamplingClient`` of the run's own service, asked for ``compute_logprobs`` of every
episode's whole token sequence -- one Tinker client call, so it works the same on the local engine,
through ``polyrl serve`` and on hosted Tinker. What the logprobs become (per-token advantage terms)
is :mod:`polyrl.rl.advantages`' job; this module opens the samplers, checks they read the same token ids
as the policy, and asks them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from polyrl.backend import ServiceGuard
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.errors import UserInputError
from polyrl.rl import advantages as adv_lib
from polyrl.rl.episode import Episode, SamplerError

if TYPE_CHECKING:
    from polyrl.clients import SamplingClient, ServiceClient, Tokenizer


@dataclass
class Scorer:
    """A policy that scores sampled tokens: its sampler, and the config key and value that named it."""

    key: str
    source: str
    sampler: SamplingClient

    async def logprobs(self, episodes: Sequence[Episode]) -> list[list[float | None]]:
        """``compute_logprobs`` of each episode's tokens, all requests in flight at once."""
        answers = await asyncio.gather(*[self.sampler.compute_logprobs(ep.model_input()) for ep in episodes])
        for ep, lps in zip(episodes, answers):
            if len(lps) != len(ep.tokens):
                raise SamplerError(f"{self.key} ({self.source}): compute_logprobs returned {len(lps)} "
                                   f"logprobs for {len(ep.tokens)} tokens")
            if any(lp is None for lp, m in zip(lps, ep.action_mask) if m):
                raise SamplerError(f"{self.key} ({self.source}): compute_logprobs returned no logprob for "
                                   "some sampled tokens")
        return answers


async def open_scorer(key: str, source: str | None, config: TrainConfig, service: ServiceClient,
                      guard: ServiceGuard, policy: SamplingClient, tokenizer: Tokenizer,
                      warn: Callable[[str], None]) -> Scorer:
    """The sampler ``key`` names: ``source`` a ``tinker://`` checkpoint or a base model (null: the
    run's base model). Refused when it reads other token ids than the policy: its logprobs would be of
    other tokens than the ones sampled."""
    source = source or config.model_name
    where = {"model_path": source} if source.startswith("tinker://") else {"base_model": source}
    try:
        sampler = await guard(f"opening {key}", service.create_sampling_client, **where)
    except UserInputError as exc:  # the local engine's "checkpoint ... not found"
        raise ConfigError(f"{key}: {exc}") from None
    base, own = sampler.get_base_model(), policy.get_base_model()
    if base != own:
        try:
            same = sampler.get_tokenizer().get_vocab() == tokenizer.get_vocab()
        except Exception as exc:  # noqa: BLE001 - a tokenizer the client cannot load here
            warn(f"{key}: could not compare the tokenizers of {base} and {own} ({exc}); "
                 "they must be the same")
        else:
            if not same:
                raise ConfigError(f"{key}: {source} (base model {base}) does not share the tokenizer of "
                                  f"{own}, so it cannot score the tokens the policy samples")
    return Scorer(key, source, sampler)


class TokenSignals:
    """The per-token advantage terms a run adds to its reward advantages: a KL penalty against
    ``reference`` and the distillation signal of ``teacher``; none when neither is configured."""

    def __init__(self, config: TrainConfig | None = None, reference: Scorer | None = None,
                 teacher: Scorer | None = None):
        self.config, self.reference, self.teacher = config, reference, teacher

    @classmethod
    async def open(cls, config: TrainConfig, service: ServiceClient, guard: ServiceGuard,
                   policy: SamplingClient, tokenizer: Tokenizer, warn: Callable[[str], None]) -> TokenSignals:
        """Open the samplers ``config`` asks for; ``policy`` is a sampler of the policy being trained."""
        reference = teacher = None
        if config.kl is not None:
            reference = await open_scorer("kl.reference", config.kl.reference, config, service, guard, policy,
                                          tokenizer, warn)
        if config.teacher is not None:
            teacher = await open_scorer("teacher.model", config.teacher.model, config, service, guard, policy,
                                        tokenizer, warn)
        return cls(config, reference, teacher)

    @property
    def active(self) -> bool:
        """Whether every sampled token carries a signal (so no episode of a kept group is left out)."""
        return self.reference is not None or self.teacher is not None

    async def terms(self, episodes: list[Episode]) -> tuple[list[list[float]] | list[None], dict[str, float]]:
        """Per episode, the per-token terms to add to its advantages (``None`` each when inactive), and
        the metrics: ``kl/reference`` and ``kl/teacher`` (the mean ``sampler - other`` logprob over the
        sampled tokens; also under tinker-cookbook's names ``kl_policy_base`` and ``teacher_kl``)."""
        if not self.active or not episodes:
            return [None] * len(episodes), {}
        config = self.config
        assert config is not None
        scorers = [s for s in (self.reference, self.teacher) if s is not None]
        answers = await asyncio.gather(*[s.logprobs(episodes) for s in scorers])
        totals = [[0.0] * len(ep.tokens) for ep in episodes]
        metrics: dict[str, float] = {}
        for scorer, logprobs in zip(scorers, answers):
            if scorer is self.reference:
                kl = config.kl
                assert kl is not None
                terms, mean = adv_lib.reference_kl_terms(episodes, logprobs, kl.penalty_coef,
                                                         kl.discount_factor)
                metrics["kl/reference"] = metrics["kl_policy_base"] = mean
            else:
                teacher = config.teacher
                assert teacher is not None
                terms, gaps = adv_lib.teacher_kl_terms(episodes, logprobs, teacher.kl_coef,
                                                       teacher.kl_discount_factor)
                metrics["kl/teacher"] = metrics["teacher_kl"] = adv_lib.mean_gap(episodes, gaps)
                for name in sorted({ep.env_name for ep in episodes}):
                    mine = [(ep, g) for ep, g in zip(episodes, gaps) if ep.env_name == name]
                    metrics[f"env/{name}/kl/teacher"] = adv_lib.mean_gap([ep for ep, _ in mine],
                                                                         [g for _, g in mine])
            for total, term in zip(totals, terms):
                for i, t in enumerate(term):
                    total[i] += t
        return totals, metrics
