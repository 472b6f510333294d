"""Loss functions with Tinker's semantics, in one registry.

Every loss sees the whole ``forward_backward`` batch flattened: ``logprobs`` are the learner's
log-probabilities of the target tokens of all datums concatenated (shape ``[N]``, with gradient;
``[N, K]`` for a loss registered with ``top_k=True`` given ``(N, K)`` targets), ``inputs`` the matching
``loss_fn_inputs`` tensors, and ``segments`` which datum each token belongs to (for sequence-level
losses). Losses are **sums** over tokens and datums, as in Tinker; a loss returns ``(loss, metrics)``
with metric keys of the form ``name:reduction``. A loss registered with ``provenance=True`` also gets
``sampled`` (1.0 on targets a provenance span names as sampled tokens) and ``sampler_logprobs`` (their
logprobs as the sampler recorded them; see :mod:`polyrl.local.stability`). A loss registered with a
``correction`` role also takes the off-policy corrections' ``loss_fn_config`` keys (:data:`CORRECTIONS`).

Adding a loss is one decorated function::

    @register_loss("my_loss", inputs=("target_tokens", "logprobs", "advantages"))
    def my_loss(logprobs, inputs, segments, config): ...

The registry is the one list of losses: the engine, ``polyrl serve`` and the run config's ``loss_fn``
(:func:`policy_gradient_losses`: those that take ``advantages``) all read it.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Mapping, get_args

import torch
from tinker import types

from polyrl.optim_ranges import LOSS_CONFIG, range_problems

Tensor = torch.Tensor
DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05
DEFAULT_MAX_RATIO = 2.0  # stable_reinforce: importance weights are truncated here
DEFAULT_KL_COEFF = 0.0
MAX_LOG_RATIO = 60.0  # log-ratios are clamped here before exp, so a ratio stays finite in float32


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

    def sum(self, values: Tensor) -> Tensor:
        """Per-datum sum of ``values``; shape ``[count]``."""
        total = torch.zeros(self.count, dtype=values.dtype, device=values.device)
        return total.index_add(0, self.ids, values)


LossFn = Callable[[Tensor, Mapping[str, Tensor], Segments, Mapping[str, float]],
                  tuple[Tensor, dict[str, float]]]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    inputs: tuple[str, ...]  # required loss_fn_inputs keys
    optional_inputs: tuple[str, ...]
    config_keys: tuple[str, ...]
    top_k: bool = False  # takes (N, K) target_tokens and weights
    provenance: bool = False  # needs provenance spans resolved against recorded sequences
    correction: str | None = None  # how an off-policy correction applies (ANCHOR, WEIGHT, MASK_ONLY)
    action_mask: str | None = None  # the input through which an RL Datum says which tokens were sampled


LOSSES: dict[str, LossSpec] = {}
#: The loss names Tinker's SDK knows (its ``LossFnType``); ``polyrl serve`` tells these apart from
#: names no Tinker service has.
TINKER_LOSSES: tuple[str, ...] = get_args(types.LossFnType)


def register_loss(
    name: str,
    inputs: tuple[str, ...],
    optional_inputs: tuple[str, ...] = (),
    config_keys: tuple[str, ...] = (),
    top_k: bool = False,
    provenance: bool = False,
    correction: str | None = None,
    action_mask: str | None = None,
) -> Callable[[LossFn], LossFn]:
    """``correction`` (a loss with sampler logprobs): how the off-policy corrections apply to it; the
    registered function then takes their ``loss_fn_config`` keys too (see :func:`corrected`).
    ``action_mask``: one of its inputs, which the training loop's Datums fill with 1.0 on sampled tokens
    (a loss that must not act on prompt and environment tokens). ``provenance``: the Datums name the
    sampled sequence each token comes from."""
    if clash := sorted(set(config_keys) & set(CORRECTION_KEYS)):
        raise TypeError(f"loss {name!r}: config_keys {clash} are the off-policy corrections' keys")
    if action_mask is not None and action_mask not in inputs + optional_inputs:
        raise TypeError(f"loss {name!r}: action_mask {action_mask!r} is none of its inputs")

    def deco(fn: LossFn) -> LossFn:
        check_loss_signature(name, fn)
        keys = config_keys + (CORRECTION_KEYS if correction else ())
        wrapped = corrected(fn, name, correction) if correction else fn
        LOSSES[name] = LossSpec(name, wrapped, inputs, optional_inputs, keys, top_k, provenance, correction,
                                action_mask)
        return fn

    return deco


def check_loss_signature(name: str, fn: Callable) -> None:
    """A TypeError naming the loss unless ``fn`` takes ``fn(logprobs, inputs, segments, config)``."""
    try:
        inspect.signature(fn).bind(None, None, None, None)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"loss {name!r}: {getattr(fn, '__name__', fn)}{_signature(fn)} cannot be called as "
                        f"fn(logprobs, inputs, segments, config) ({exc})") from None


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def policy_gradient_losses() -> list[str]:
    """The registered losses a training run can use (``loss_fn``): those that take ``advantages``."""
    return sorted(name for name, spec in LOSSES.items() if "advantages" in spec.inputs)


def check_config_keys(spec: LossSpec, config: Mapping[str, float]) -> None:
    """Every ``loss_fn_config`` key must be one the loss uses (a ValueError in one line)."""
    unknown = sorted(set(config) - set(spec.config_keys))
    corrections = [k for k in unknown if k in CORRECTION_KEYS]
    if corrections:
        takers = ", ".join(s.name for s in LOSSES.values() if s.correction)
        raise ValueError(f"loss_fn_config keys {corrections} are an off-policy correction, which needs the "
                         f"sampler's logprobs: loss {spec.name!r} has none (corrections apply to {takers})")
    if unknown:
        raise ValueError(f"loss_fn_config keys {unknown} are not used by loss {spec.name!r} "
                         f"(it takes: {list(spec.config_keys) or 'none'})")
    if spec.correction:
        parse_correction(config, spec.name, spec.correction)


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss_fn {name!r}; supported: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]


# ---- off-policy corrections ------------------------------------------------------------------------
# The sampler's logprobs q (what was sampled) and the learner's p differ: lower-precision sampling,
# another engine's numerics, a stale sampler. With rho_t = exp(sg(p_t) - q_t) on the sampled tokens,
# a correction multiplies each token's advantage by a factor c_t (no gradient; see
# docs/guides/async.md, "Off-policy correction"):
#   tis      c_t = min(rho_t, cap)                          truncated importance sampling
#   mis      c_t = 1[low <= rho_t <= high]                  token-level masked importance sampling
#   seq_mis  c_t = 1[low <= prod_s rho_s <= high]           a whole sequence kept or masked (product)
#   geo_mis  c_t = 1[low <= exp(mean_s log rho_s) <= high]  the same with the geometric mean
#   icepop   c_t = rho_t * 1[low <= rho_t <= high]          IcePop's two-sided token mask
# For a loss whose importance ratio is taken against q (role ANCHOR), the ratio is taken against the
# learner's own detached logprobs instead: the factor carries the sampler/learner mismatch.
ANCHOR = "anchor"  # importance_sampling, ppo, cispo, gspo: the ratio's reference becomes sg(p)
WEIGHT = "weight"  # dro: no importance ratio; its penalty still pulls towards the sampler
MASK_ONLY = "mask_only"  # stable_reinforce: truncates its own weight (max_ratio), so masks only

CORRECTIONS: dict[str, tuple[str, ...]] = {
    "tis": ("tis_cap",),
    "mis": ("mis_low", "mis_high"),
    "seq_mis": ("seq_mis_low", "seq_mis_high"),
    "geo_mis": ("geo_mis_low", "geo_mis_high"),
    "icepop": ("icepop_low", "icepop_high"),
}
CORRECTION_KEYS = tuple(key for keys in CORRECTIONS.values() for key in keys)


@dataclass(frozen=True)
class Correction:
    kind: str  # a key of CORRECTIONS
    low: float = 0.0
    high: float = math.inf  # tis: the cap


def parse_correction(config: Mapping[str, float], loss: str = "",
                     role: str | None = ANCHOR) -> tuple[Correction | None, dict[str, float]]:
    """The correction ``loss_fn_config`` names (at most one, with all its keys) and the loss's own keys;
    a ValueError in one line for anything else."""
    own = {k: v for k, v in config.items() if k not in CORRECTION_KEYS}
    kinds = [kind for kind, keys in CORRECTIONS.items() if any(k in config for k in keys)]
    if not kinds:
        return None, own
    if len(kinds) > 1:
        raise ValueError(f"loss_fn_config names the off-policy corrections {kinds}; one at a time")
    kind = kinds[0]
    missing = [k for k in CORRECTIONS[kind] if k not in config]
    if missing:
        raise ValueError(f"loss_fn_config off-policy correction {kind!r} needs {list(CORRECTIONS[kind])}; "
                         f"{missing} missing")
    values = [float(config[k]) for k in CORRECTIONS[kind]]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"loss_fn_config {list(CORRECTIONS[kind])} must be finite, got {values}")
    if kind == "tis":
        if not values[0] >= 1:
            raise ValueError(f"loss_fn_config tis_cap must be >= 1, got {values[0]:g}")
        if role == MASK_ONLY:
            raise ValueError(f"loss {loss!r} truncates its importance weight itself (loss_fn_config "
                             "max_ratio); tis_cap would truncate it twice (use a mask: mis, seq_mis, "
                             "geo_mis, icepop)")
        return Correction(kind, high=values[0]), own
    low, high = values
    if not 0 <= low < 1 < high:
        raise ValueError(f"loss_fn_config {kind}_low and {kind}_high must have 0 <= low < 1 < high, got "
                         f"{low:g} and {high:g}")
    return Correction(kind, low, high), own


def sampled_tokens(inputs: Mapping[str, Tensor]) -> Tensor:
    """Which targets were sampled (bool): provenance's ``sampled``, else a ``mask`` or
    ``sequence_ratio_mask`` input, else the targets with a nonzero advantage."""
    for key in ("sampled", "mask", "sequence_ratio_mask"):
        if key in inputs:
            return inputs[key] != 0
    return inputs["advantages"] != 0


def correction_factor(log_ratio: Tensor, active: Tensor, segments: Segments,
                      correction: Correction) -> tuple[Tensor, dict[str, float]]:
    """The factor ``c_t`` (1 on tokens that were not sampled) of ``log_ratio`` = log(p / q) per token
    (detached), and its metrics as sums, maxima and minima over the sampled tokens (``active``)."""
    log_ratio = (log_ratio * active).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    kind, low, high = correction.kind, correction.low, correction.high
    truncated = torch.zeros_like(active)
    if kind == "tis":
        factor = torch.clamp(ratio, max=high)
        truncated = (ratio > high) & active
        keep = torch.ones_like(active)
    elif kind in ("seq_mis", "geo_mis"):
        seq_log = segments.sum(log_ratio)
        if kind == "geo_mis":
            seq_log = seq_log / segments.sum(active.to(log_ratio.dtype)).clamp(min=1)
        seq_ratio = torch.exp(seq_log.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        keep = ((seq_ratio >= low) & (seq_ratio <= high))[segments.ids]
        factor = keep.to(ratio.dtype)
    else:
        keep = (ratio >= low) & (ratio <= high)
        factor = torch.where(keep, ratio, torch.zeros_like(ratio)) if kind == "icepop" \
            else keep.to(ratio.dtype)
    factor = torch.where(active, factor, torch.ones_like(factor))
    n = int(active.sum())
    metrics = {"is_tokens:sum": float(n), "is_weight:sum": float((ratio * active).sum()),
               "is_truncated:sum": float(truncated.sum()), "is_masked:sum": float((~keep & active).sum())}
    if n:
        metrics["is_weight:max"] = float(ratio[active].max())
        metrics["is_weight:min"] = float(ratio[active].min())
    return factor, metrics


def corrected(fn: LossFn, name: str, role: str) -> LossFn:
    """``fn`` with the off-policy correction its ``loss_fn_config`` names applied to each token's
    advantage; without one, ``fn`` itself (bit for bit)."""

    def loss(logprobs, inputs, segments, config):
        correction, own = parse_correction(config, name, role)
        if correction is None:
            return fn(logprobs, inputs, segments, config)
        sampler = inputs["sampler_logprobs"] if "sampler_logprobs" in inputs else inputs["logprobs"]
        factor, metrics = correction_factor(logprobs.detach() - sampler, sampled_tokens(inputs), segments,
                                            correction)
        changed = {**inputs, "advantages": inputs["advantages"] * factor}
        if role == ANCHOR:
            changed["logprobs"] = logprobs.detach()
        value, loss_metrics = fn(logprobs, changed, segments, own)
        return value, {**loss_metrics, **metrics}

    return loss


def _clip_bounds(inputs: Mapping[str, Tensor],
                 config: Mapping[str, float]) -> tuple[Tensor | float, Tensor | float]:
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


@register_loss("importance_sampling", inputs=("target_tokens", "logprobs", "advantages"), correction=ANCHOR)
def importance_sampling(logprobs, inputs, segments, config):
    ratio = torch.exp(logprobs - inputs["logprobs"])
    loss = -(ratio * inputs["advantages"]).sum()
    return loss, {"loss:sum": float(loss.detach())}


@register_loss(
    "ppo",
    inputs=("target_tokens", "logprobs", "advantages"),
    optional_inputs=("clip_low_threshold", "clip_high_threshold"),
    config_keys=("clip_low_threshold", "clip_high_threshold"),
    correction=ANCHOR,
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
    correction=ANCHOR,
)
def cispo(logprobs, inputs, segments, config):
    low, high = _clip_bounds(inputs, config)
    adv = inputs["advantages"]
    ratio = torch.exp(logprobs - inputs["logprobs"]).detach()
    loss = -(_clamp(ratio, low, high) * logprobs * adv).sum()
    return loss, {"loss:sum": float(loss.detach()), **_clip_metrics(ratio, low, high, adv)}


@register_loss("dro", inputs=("target_tokens", "logprobs", "advantages"), optional_inputs=("mask",),
               config_keys=("beta",), correction=WEIGHT, action_mask="mask")
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
    correction=ANCHOR,
    action_mask="sequence_ratio_mask",
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
               config_keys=("kl_coeff", "max_ratio"), provenance=True, correction=MASK_ONLY)
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
    if problems := range_problems({"max_ratio": max_ratio, "kl_coeff": kl_coeff}, LOSS_CONFIG):
        raise ValueError("; ".join(f"loss_fn_config {key} {why}" for key, why in problems))
    mask = inputs["sampled"]
    log_ratio = (logprobs - inputs["sampler_logprobs"]) * mask
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio.detach(), max=max_ratio)
    kl = (ratio - 1 - log_ratio) * mask
    loss = -(mask * weight * inputs["advantages"] * logprobs).sum() + kl_coeff * kl.sum()
    truncated = (ratio.detach() > max_ratio) & (mask != 0)
    return loss, {"loss:sum": float(loss.detach()), "sampled_tokens:sum": float(mask.sum()),
                  "truncated_tokens:sum": float(truncated.sum()), "kl_sampler:sum": float(kl.detach().sum())}
