"""Loss functions with Tinker's semantics, in one registry.

Every loss sees the whole ``forward_backward`` batch flattened: ``logprobs`` are the learner's
log-probabilities of the target tokens of all datums concatenated (shape ``[N]``, with gradient;
``[N, K]`` for a loss registered with ``top_k=True`` given ``(N, K)`` targets), ``inputs`` the matching
``loss_fn_inputs`` tensors, and ``segments`` which datum each token belongs to (for sequence-level
losses). Losses are **sums** over tokens and datums, as in Tinker; a loss returns ``(loss, metrics)``
with metric keys of the form ``name:reduction``. A loss registered with ``provenance=True`` also gets
``sampled`` (1.0 on targets a provenance span names as sampled tokens) and ``sampler_logprobs`` (their
logprobs as the sampler recorded them; see :mod:`polyrl.local.stability`).

Adding a loss is one decorated function::

    @register_loss("my_loss", inputs=("target_tokens", "logprobs", "advantages"))
    def my_loss(logprobs, inputs, segments, config): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

Tensor = torch.Tensor
DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05
DEFAULT_MAX_RATIO = 2.0  # stable_reinforce: importance weights are truncated here
DEFAULT_KL_COEFF = 0.0


@dataclass(frozen=True)
class Segments:
    """Which datum each flattened token belongs to."""

    ids: Tensor  # [N] int64, datum index of each token
    count: int  # number of datums

    def mean(self, values: Tensor, mask: Tensor) -> Tensor:
        """Per-datum mean of ``values`` over tokens where ``mask`` is set; shape ``[count]``."""
        total = torch.zeros(self.count, dtype=values.dtype, device=values.device)
        n = torch.zeros(self.count, dtype=values.dtype, device=values.device)
        total = total.index_add(0, self.ids, values * mask)
        n = n.index_add(0, self.ids, mask.to(values.dtype))
        return total / n.clamp(min=1)


LossFn = Callable[[Tensor, Mapping[str, Tensor], Segments, Mapping[str, float]], tuple[Tensor, dict[str, float]]]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    inputs: tuple[str, ...]  # required loss_fn_inputs keys
    optional_inputs: tuple[str, ...]
    config_keys: tuple[str, ...]
    top_k: bool = False  # takes (N, K) target_tokens and weights
    provenance: bool = False  # needs provenance spans resolved against recorded sequences


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    inputs: tuple[str, ...],
    optional_inputs: tuple[str, ...] = (),
    config_keys: tuple[str, ...] = (),
    top_k: bool = False,
    provenance: bool = False,
) -> Callable[[LossFn], LossFn]:
    def deco(fn: LossFn) -> LossFn:
        LOSSES[name] = LossSpec(name, fn, inputs, optional_inputs, config_keys, top_k, provenance)
        return fn

    return deco


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss_fn {name!r}; supported: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


def _clip_bounds(inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> tuple[Tensor | float, Tensor | float]:
    """Ratio bounds: per-token inputs win over ``loss_fn_config``, which wins over 0.8 / 1.2."""
    low = inputs.get("clip_low_threshold", config.get("clip_low_threshold", DEFAULT_CLIP_LOW))
    high = inputs.get("clip_high_threshold", config.get("clip_high_threshold", DEFAULT_CLIP_HIGH))
    return low, high


def _clamp(x: Tensor, low: Tensor | float, high: Tensor | float) -> Tensor:
    low_t = torch.as_tensor(low, dtype=x.dtype, device=x.device)
    high_t = torch.as_tensor(high, dtype=x.dtype, device=x.device)
    return torch.minimum(torch.maximum(x, low_t), high_t)


def _clip_metrics(ratio: Tensor, low, high, advantages: Tensor) -> dict[str, float]:
    active = advantages != 0
    clipped = ((ratio < torch.as_tensor(low)) | (ratio > torch.as_tensor(high))) & active
    return {"clipped_tokens:sum": float(clipped.sum()), "active_tokens:sum": float(active.sum())}


@register_loss("cross_entropy", inputs=("target_tokens",), optional_inputs=("weights",), top_k=True)
def cross_entropy(logprobs, inputs, segments, config):
    """``-sum w * logp``; with (N, K) targets and weights, over all K targets of every position (Tinker's
    top-K distillation: soft targets are weights such as a teacher's renormalized probabilities)."""
    weights = inputs.get("weights")
    loss = -(logprobs * weights).sum() if weights is not None else -logprobs.sum()
    return loss, {"loss:sum": float(loss.detach())}


@register_loss("importance_sampling", inputs=("target_tokens", "logprobs", "advantages"))
def importance_sampling(logprobs, inputs, segments, config):
    ratio = torch.exp(logprobs - inputs["logprobs"])
    loss = -(ratio * inputs["advantages"]).sum()
    return loss, {"loss:sum": float(loss.detach())}


@register_loss(
    "ppo",
    inputs=("target_tokens", "logprobs", "advantages"),
    optional_inputs=("clip_low_threshold", "clip_high_threshold"),
    config_keys=("clip_low_threshold", "clip_high_threshold"),
)
def ppo(logprobs, inputs, segments, config):
    low, high = _clip_bounds(inputs, config)
    adv = inputs["advantages"]
    ratio = torch.exp(logprobs - inputs["logprobs"])
    objective = torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)
    loss = -objective.sum()
    return loss, {"loss:sum": float(loss.detach()), **_clip_metrics(ratio.detach(), low, high, adv)}


@register_loss(
    "cispo",
    inputs=("target_tokens", "logprobs", "advantages"),
    optional_inputs=("clip_low_threshold", "clip_high_threshold"),
    config_keys=("clip_low_threshold", "clip_high_threshold"),
)
def cispo(logprobs, inputs, segments, config):
    low, high = _clip_bounds(inputs, config)
    adv = inputs["advantages"]
    ratio = torch.exp(logprobs - inputs["logprobs"]).detach()
    loss = -(_clamp(ratio, low, high) * logprobs * adv).sum()
    return loss, {"loss:sum": float(loss.detach()), **_clip_metrics(ratio, low, high, adv)}


@register_loss("dro", inputs=("target_tokens", "logprobs", "advantages"), optional_inputs=("mask",),
               config_keys=("beta",))
def dro(logprobs, inputs, segments, config):
    """The quadratic penalty pulls every token towards its sampler logprob; with ``mask`` only the
    masked (sampled) tokens, so prompt tokens with a 0.0 placeholder logprob are left alone."""
    beta = float(config.get("beta", DEFAULT_DRO_BETA))
    penalty = (logprobs - inputs["logprobs"]) ** 2
    if "mask" in inputs:
        penalty = penalty * (inputs["mask"] != 0)
    objective = logprobs * inputs["advantages"] - 0.5 * beta * penalty
    loss = -objective.sum()
    return loss, {"loss:sum": float(loss.detach())}


@register_loss(
    "gspo",
    inputs=("target_tokens", "logprobs", "advantages"),
    optional_inputs=("sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold"),
    config_keys=("clip_low_threshold", "clip_high_threshold"),
)
def gspo(logprobs, inputs, segments, config):
    """GSPO-token: every token carries its sequence's geometric-mean ratio (value) with its own
    log-probability's gradient. The ratio averages over ``sequence_ratio_mask`` tokens, or, when
    it is absent, over the tokens with a nonzero advantage (the sampled tokens in an RL datum)."""
    low, high = _clip_bounds(inputs, config)
    adv = inputs["advantages"]
    mask = inputs.get("sequence_ratio_mask")
    mask = (mask != 0) if mask is not None else (adv != 0)
    log_ratio = segments.mean(logprobs.detach() - inputs["logprobs"], mask.to(logprobs.dtype))
    ratio = torch.exp(log_ratio[segments.ids] + logprobs - logprobs.detach())
    objective = torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)
    loss = -objective.sum()
    return loss, {"loss:sum": float(loss.detach()), **_clip_metrics(ratio.detach(), low, high, adv)}


@register_loss("stable_reinforce", inputs=("target_tokens", "advantages"), optional_inputs=("logprobs",),
               config_keys=("kl_coeff", "max_ratio"), provenance=True)
def stable_reinforce(logprobs, inputs, segments, config):
    """REINFORCE with truncated importance weights against the *recorded* sampler logprobs ``q``, on the
    targets provenance names as sampled (``m``), plus an optional KL term towards the sampler::

        r = exp(logp - q);  loss = -sum m * sg(min(r, max_ratio)) * A * logp
                                   + kl_coeff * sum m * (r - 1 - log r)

    The weight's gradient is stopped, so a token's gradient is ``min(r, max_ratio) * A * grad logp``:
    the importance-sampled policy gradient while ``r <= max_ratio``, and never more than ``max_ratio``
    times the on-policy one however stale the sample or far the sampler's numerics. ``r - 1 - log r``
    (>= 0) estimates KL(sampler || learner) from the sampler's tokens. A client's own ``logprobs`` input
    is not used."""
    max_ratio = float(config.get("max_ratio", DEFAULT_MAX_RATIO))
    kl_coeff = float(config.get("kl_coeff", DEFAULT_KL_COEFF))
    if not max_ratio > 0:
        raise ValueError(f"loss_fn_config max_ratio must be > 0, got {max_ratio}")
    if not kl_coeff >= 0:
        raise ValueError(f"loss_fn_config kl_coeff must be >= 0, got {kl_coeff}")
    mask = inputs["sampled"]
    log_ratio = (logprobs - inputs["sampler_logprobs"]) * mask
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio.detach(), max=max_ratio)
    kl = (ratio - 1 - log_ratio) * mask
    loss = -(mask * weight * inputs["advantages"] * logprobs).sum() + kl_coeff * kl.sum()
    truncated = (ratio.detach() > max_ratio) & (mask != 0)
    return loss, {"loss:sum": float(loss.detach()), "sampled_tokens:sum": float(mask.sum()),
                  "truncated_tokens:sum": float(truncated.sum()), "kl_sampler:sum": float(kl.detach().sum())}
