"""Loss functions with Tinker's semantics, in one registry.

Every loss sees the whole ``forward_backward`` batch flattened: ``logprobs`` are the learner's
log-probabilities of the target tokens of all datums concatenated (shape ``[N]``, with gradient),
``inputs`` the matching ``loss_fn_inputs`` tensors, and ``segments`` which datum each token belongs
to (for sequence-level losses). Losses are **sums** over tokens and datums, as in Tinker; a loss
returns ``(loss, metrics)`` with metric keys of the form ``name:reduction``.

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


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    inputs: tuple[str, ...],
    optional_inputs: tuple[str, ...] = (),
    config_keys: tuple[str, ...] = (),
) -> Callable[[LossFn], LossFn]:
    def deco(fn: LossFn) -> LossFn:
        LOSSES[name] = LossSpec(name, fn, inputs, optional_inputs, config_keys)
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


@register_loss("cross_entropy", inputs=("target_tokens",), optional_inputs=("weights",))
def cross_entropy(logprobs, inputs, segments, config):
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
