"""What a step reports: its metrics row, its trajectory rows, and the reason it trained nothing.

Pure functions of the step's values (its batch, its update, its checkpoint and evaluation); writing
them is :func:`polyrl.rl.train.log_step`'s job. Metric names are fixed: ``reward/mean``,
``optim/kl_sample_train_v1``, ``env/<name>/...`` and so on (docs/guides/runs.md lists them).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable

from polyrl.rl.episode import Episode, ObservationTooLarge, RewardOutOfBounds
from polyrl.rl.judge import judge_metrics
from polyrl.rl.rollout_queue import Group, StepBatch
from polyrl.rl.update import GroupCounts, Minibatch, Optimized, StepUpdate

if TYPE_CHECKING:
    from tinker import types

    from polyrl.clients import OptimParams, Tokenizer
    from polyrl.config.schema import TrainConfig


def update_metrics(params: OptimParams, minibatches: list[Minibatch],
                   optimized: Optimized | None) -> dict[str, float]:
    """The update's metrics: the learning rate, the per-token signals' (weighted by sampled tokens),
    then either the skipped step or the loss, clipping, sampler/learner KL and the optimizer's own,
    then what was trained on."""
    metrics: dict[str, float] = {"optim/lr": getattr(params, "learning_rate"),  # on every family
                                 **token_weighted([(m.episodes_D, m.metrics) for m in minibatches])}
    episodes_D = [ep for m in minibatches for ep in m.episodes_D]
    if optimized is not None and optimized.refused is not None:
        metrics["optim/nonfinite_skipped"] = 1.0
    elif optimized is not None and optimized.optim is not None:
        data_D = [datum for m in minibatches for datum in m.data_D]
        outputs = [out for result in optimized.results for out in result.loss_fn_outputs]
        metrics.update(kl_metrics(data_D, [ep.action_mask[1:] for ep in episodes_D], outputs))
        fwd_metrics = [result.metrics for result in optimized.results]
        metrics["optim/loss"] = sum(m.get("loss:sum", float("nan")) for m in fwd_metrics)
        if any("clipped_tokens:sum" in m for m in fwd_metrics):
            metrics["optim/clip_frac"] = sum(m.get("clipped_tokens:sum", 0.0) for m in fwd_metrics) / max(
                1.0, sum(m.get("active_tokens:sum", 1.0) for m in fwd_metrics))
        metrics.update(off_policy_metrics(fwd_metrics + [m.correction for m in minibatches]))
        for key, value in (optimized.optim.metrics or {}).items():  # "sampler/..." keep their names
            name = key.split(":")[0]
            metrics[name if "/" in name else f"optim/{name}"] = value
    metrics["optim/datums"] = float(len(episodes_D))
    metrics["tokens/action"] = float(sum(ep.action_tokens for ep in episodes_D))
    metrics["tokens/total"] = float(sum(len(ep.tokens) - 1 for ep in episodes_D))
    return metrics


def off_policy_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The off-policy correction's metrics (``off_policy.correction``), from the loss's (or the client-side
    folding's) ``is_*`` sums, maxima and minima: the importance weight rho = p_learner / p_sampler over the
    sampled tokens (mean, max, min) and the fractions of those tokens truncated and masked."""
    parts = [p for p in parts if p.get("is_tokens:sum")]
    tokens = sum(p["is_tokens:sum"] for p in parts)
    if not tokens:
        return {}
    return {"off_policy/is_weight_mean": sum(p["is_weight:sum"] for p in parts) / tokens,
            "off_policy/is_weight_max": max(p["is_weight:max"] for p in parts),
            "off_policy/is_weight_min": min(p["is_weight:min"] for p in parts),
            "off_policy/truncated_frac": sum(p["is_truncated:sum"] for p in parts) / tokens,
            "off_policy/masked_frac": sum(p["is_masked:sum"] for p in parts) / tokens}


def token_weighted(parts: list[tuple[list[Episode], dict[str, float]]]) -> dict[str, float]:
    """Per-minibatch means of the signal metrics combined into the step's, each minibatch weighted by
    its sampled tokens (of the named environment, for ``env/<name>/...``)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for episodes, metrics in parts:
        for key, value in metrics.items():
            env = key.split("/")[1] if key.startswith("env/") else None
            w = float(sum(ep.action_tokens for ep in episodes if env is None or ep.env_name == env))
            sums[key] = sums.get(key, 0.0) + value * w
            weights[key] = weights.get(key, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


def kl_metrics(data_D: list[types.Datum], masks_D: list[list[int]],
               outputs_D: list[dict]) -> dict[str, float]:
    """Sampler vs learner logprobs on the sampled tokens (``masks_D``): KL estimators, the largest
    |sampler - learner| logprob of a token (what a second engine's numerics, or staleness, change most), and
    entropy."""
    diffs, sampler_lps = [], []
    for d, mask, out in zip(data_D, masks_D, outputs_D):
        for s, lr, m in zip(d.loss_fn_inputs["logprobs"].tolist(), out["logprobs"].tolist(), mask):
            if m:
                diffs.append(s - lr)
                sampler_lps.append(s)
    if not diffs:
        return {}
    return {
        "optim/kl_sample_train_v1": _mean(diffs),
        "optim/kl_sample_train_v2": _mean(0.5 * x * x for x in diffs),
        "optim/logprob_diff_max": max(abs(x) for x in diffs),
        "optim/entropy": -_mean(sampler_lps),
    }


def episode_metrics(episodes_G: list[list[Episode]], counts: dict[str, GroupCounts]) -> dict[str, float]:
    """Reward, success, lengths and environment metrics, overall and per environment."""
    out: dict[str, float] = {}
    by_env: dict[str, list[Episode]] = {}
    for episodes in episodes_G:
        for ep in episodes:
            by_env.setdefault(ep.env_name, []).append(ep)
    everything = [ep for eps in by_env.values() for ep in eps]
    for prefix, eps in [("", everything)] + [(f"env/{n}/", eps) for n, eps in sorted(by_env.items())]:
        ok = [ep for ep in eps if not ep.failed]
        if not ok:
            continue
        out[f"{prefix}reward/mean"] = _mean(ep.reward for ep in ok)
        out[f"{prefix}success/mean"] = _mean(float(ep.success) for ep in ok)
        out[f"{prefix}turns/mean"] = _mean(ep.num_turns for ep in ok)
        out[f"{prefix}tokens/action_per_episode"] = _mean(ep.action_tokens for ep in ok)
        out[f"{prefix}tokens/total_per_episode"] = _mean(len(ep.tokens) for ep in ok)
        out[f"{prefix}stop/length_frac"] = _mean(float("length" in ep.stop_reasons) for ep in ok)
        if prefix:
            for key in sorted({k for ep in ok for k in ep.metrics}):
                out[f"{prefix}{key}"] = _mean(ep.metrics.get(key, 0.0) for ep in ok)
    out.update(judge_metrics(everything))
    for name, eps in sorted(by_env.items()):
        out.update({f"env/{name}/{k}": v for k, v in judge_metrics(eps).items()})
    for name, c in counts.items():
        out[f"env/{name}/failed_rollouts"] = c.failed_rollouts
        out[f"env/{name}/dropped_groups"] = c.dropped_groups
        out[f"env/{name}/constant_groups"] = c.constant_groups
    out["rollouts/failed"] = sum(c.failed_rollouts for c in counts.values())
    out["rollouts/dropped_groups"] = sum(c.dropped_groups for c in counts.values())
    out["episodes/count"] = float(len(everything))
    return out


def step_row(config: TrainConfig, batch: StepBatch, update: StepUpdate, evaluation: dict[str, float],
             save_seconds: float, started: float) -> dict[str, Any]:
    """The step's row of ``metrics.jsonl``: the update's metrics, evaluation, episodes, staleness of the
    batch's groups (their oldest tokens) and of the tokens trained, and where the time went."""
    step = batch.step
    row = {"step": step, "progress/done_frac": (step + 1) / config.max_steps, **update.metrics, **evaluation}
    row.update(episode_metrics(batch.episodes_G, update.counts))
    staleness = batch.staleness or [0]
    staleness_T = [step - s for ep in update.episodes_D for s in ep.sampled_steps()] or [0]
    row.update({"async/staleness_mean": _mean(staleness), "async/staleness_max": float(max(staleness)),
                "async/token_staleness_mean": _mean(staleness_T),
                "async/token_staleness_max": float(max(staleness_T)),
                "async/stale_dropped": float(len(batch.stale))})
    row.update({"time/rollout": batch.seconds, "time/train": update.seconds, "time/save": save_seconds,
                "time/total": time.monotonic() - started})
    return row


def episode_row(step: int, ep: Episode, tokenizer: Tokenizer, dropped: bool,
                group: Group | None = None) -> dict:
    """One line of ``trajectories/step_NNNNNN.jsonl``; ``group`` tells the oldest policy that sampled
    it and where it was drawn; ``sampler_steps`` the policy that sampled each token (-1: not sampled)."""
    return {
        "step": step,
        "sampler_step": step if group is None else group.sampler_step,
        "drawn": [step, ep.group_id] if group is None else [group.drawn, group.index],
        "env": ep.env_name,
        "split": ep.split,
        "task_index": ep.task_index,
        "group": ep.group_id,
        "role": ep.role,
        "reward": ep.reward,
        "success": ep.success,
        "step_rewards": ep.step_rewards,
        "advantages": ep.turn_advantages,
        "num_turns": ep.num_turns,
        "stop_reasons": ep.stop_reasons,
        "done_by_env": ep.done_by_env,
        "error": ep.error,
        "judge": ep.judge,
        "dropped": dropped,
        "metrics": ep.metrics,
        "duration_s": round(ep.duration_s, 4),
        "messages": ep.messages,
        "tools": ep.tools,
        "tokens": ep.tokens,
        "images": [{"start": span.start, "length": span.length, "image": span.name} for span in ep.images],
        "token_text": tokenizer.batch_decode([[t] for t in ep.tokens]) if ep.tokens else [],
        "logprobs": [round(x, 5) for x in ep.logprobs],
        "action_mask": ep.action_mask,
        "sampler_steps": ep.sampler_steps,
        "turn_spans": ep.turn_spans,
    }


def no_update_reason(episodes_G: list[list[Episode]], counts: dict[str, GroupCounts]) -> str:
    """Why a step trained nothing, in a few words: groups dropped and the most common episode error."""
    dropped = sum(c.dropped_groups for c in counts.values())
    constant = sum(c.constant_groups for c in counts.values())
    reason = (f"{dropped:g} of {len(episodes_G)} groups dropped over their failure budget, "
              f"{constant:g} with equal rewards")
    errors = Counter(" ".join(ep.error.split())[:200]
                     for episodes in episodes_G for ep in episodes if ep.error)
    if errors:
        error, count = errors.most_common(1)[0]
        reason += f"; most common episode error ({count}x): {error}"
    return reason


def bound_warnings(step: int, episodes: list[Episode]) -> list[str]:
    """A line for each bound the step's episodes ran into (an absurd reward, a huge observation)."""
    lines = []
    for kind in (RewardOutOfBounds, ObservationTooLarge):
        errors = [ep.error for ep in episodes if ep.error and ep.error.startswith(f"{kind.__name__}: ")]
        if errors:
            lines.append(f"step {step}: {len(errors)} episode(s) failed (counted against their failure "
                         f"budget): {errors[0]}")
    return lines


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
