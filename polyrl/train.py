"""``polyrl train``: RL fine-tuning on many environments at once.

One step, top to bottom: pick which environment each group of the batch comes from (by weight),
run every group's episodes concurrently with the current sampler, drop groups over their failure
budget, compute advantages, turn episodes into Datums, submit ``forward_backward`` and
``optim_step`` back to back, take a new sampler, and log metrics, trajectories and checkpoints.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from tinker import types

from polyrl import advantages as adv_lib
from polyrl.backend import make_service_client
from polyrl.config import EnvConfig, TrainConfig
from polyrl.envs.base import EnvBuilder
from polyrl.envs.registry import make_env_builder
from polyrl.renderers import get_renderer, infer_renderer
from polyrl.report import refresh_for_training
from polyrl.rollouts import Episode, RolloutSettings, run_group, split_roles
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles


def stable_seed(*parts: Any) -> int:
    """A seed from any values, equal across processes (unlike ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass
class EnvRuntime:
    """A configured environment: its builder, rollout settings and task order."""

    name: str
    cfg: EnvConfig
    builder: EnvBuilder
    settings: RolloutSettings
    run_seed: int

    @classmethod
    def create(cls, name: str, cfg: EnvConfig, seed: int, max_tokens: int) -> "EnvRuntime":
        builder = make_env_builder(cfg.type or name, cfg.args, seed=seed)
        settings = RolloutSettings(
            max_turns=cfg.max_turns,
            max_tokens=cfg.max_tokens or max_tokens,
            temperature=cfg.temperature,
            timeout=cfg.timeout,
            reward_reduction=cfg.reward_reduction,
            nonterminal_reward=cfg.nonterminal_reward,
        )
        return cls(name, cfg, builder, settings, seed)

    def num_tasks(self, split: str) -> int | None:
        split_cfg = self.cfg.splits.get(split)
        limit = split_cfg.num_samples if split_cfg else None
        available = self.builder.num_tasks(split)
        if limit is None:
            return available
        return limit if available is None else min(limit, available)

    def task_index(self, split: str, position: int) -> int:
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


async def collect_groups(runtimes: dict[str, EnvRuntime], plan: list[tuple[str, int]], split: str,
                         group_size: dict[str, int] | int, sampler: Any, renderer: Any, seed_parts: tuple,
                         progress=None) -> list[list[Episode]]:
    """Run one group per ``(env name, task index)`` in ``plan``, all concurrently."""

    async def group(g: int, env_name: str, task: int) -> list[Episode]:
        rt = runtimes[env_name]
        n = group_size if isinstance(group_size, int) else group_size[env_name]
        episodes = [Episode(env_name, split, task, g) for _ in range(n)]
        seeds = [stable_seed(*seed_parts, g, i) for i in range(n)]
        result = await run_group(rt.builder, episodes, renderer, sampler, rt.settings, seeds)
        if progress is not None:
            progress.advance(progress.task_ids[0])
        return result

    return list(await asyncio.gather(*(group(g, name, task) for g, (name, task) in enumerate(plan))))


def episode_row(step: int, ep: Episode, tokenizer, dropped: bool) -> dict:
    """One line of ``trajectories/step_NNNNNN.jsonl``."""
    return {
        "step": step,
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
        "dropped": dropped,
        "metrics": ep.metrics,
        "duration_s": round(ep.duration_s, 4),
        "messages": ep.messages,
        "tools": ep.tools,
        "tokens": ep.tokens,
        "token_text": tokenizer.batch_decode([[t] for t in ep.tokens]) if ep.tokens else [],
        "logprobs": [round(x, 5) for x in ep.logprobs],
        "action_mask": ep.action_mask,
        "turn_spans": ep.turn_spans,
    }


def filter_groups(groups: list[list[Episode]], runtimes: dict[str, EnvRuntime],
                  remove_constant: bool) -> tuple[list[list[Episode]], dict[str, dict[str, float]]]:
    """Apply each environment's failure budget; failing episodes of a kept group are left out.
    Returns the kept groups and per-environment counters."""
    kept, stats = [], {}
    for group in groups:
        name = group[0].env_name
        s = stats.setdefault(name, {"failed_rollouts": 0.0, "dropped_groups": 0.0, "constant_groups": 0.0})
        failures = sum(ep.failed for ep in group)
        s["failed_rollouts"] += failures
        ok = [ep for ep in group if not ep.failed]
        if failures > runtimes[name].cfg.max_failing_rollouts or not ok:
            s["dropped_groups"] += 1
            continue
        if len({ep.reward for ep in ok}) == 1:
            s["constant_groups"] += 1
            if remove_constant:
                continue
        kept.append(ok)
    return kept, stats


def episode_metrics(groups: list[list[Episode]], stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """Reward, success, lengths and environment metrics, overall and per environment."""
    out: dict[str, float] = {}
    by_env: dict[str, list[Episode]] = {}
    for group in groups:
        for ep in group:
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
    for name, s in stats.items():
        for k, v in s.items():
            out[f"env/{name}/{k}"] = v
    out["rollouts/failed"] = sum(s["failed_rollouts"] for s in stats.values())
    out["rollouts/dropped_groups"] = sum(s["dropped_groups"] for s in stats.values())
    out["episodes/count"] = float(len(everything))
    return out


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def kl_metrics(datums: list[types.Datum], outputs: list[dict]) -> dict[str, float]:
    """Sampler vs learner logprobs on the action tokens: KL estimators and entropy."""
    diffs, sampler_lps = [], []
    for d, out in zip(datums, outputs):
        s_lp = d.loss_fn_inputs["logprobs"].tolist()
        adv = d.loss_fn_inputs["advantages"].tolist()
        mask = d.loss_fn_inputs["mask"].tolist() if "mask" in d.loss_fn_inputs else None
        l_lp = out["logprobs"].tolist()
        for i, (s, lr) in enumerate(zip(s_lp, l_lp)):
            if (mask[i] if mask is not None else (s != 0.0 or adv[i] != 0.0)):
                diffs.append(s - lr)
                sampler_lps.append(s)
    if not diffs:
        return {}
    return {
        "optim/kl_sample_train_v1": _mean(diffs),
        "optim/kl_sample_train_v2": _mean(0.5 * x * x for x in diffs),
        "optim/entropy": -_mean(sampler_lps),
    }


async def train_async(config: TrainConfig, console: ConsoleLog | None = None) -> dict[str, float]:
    console = console or ConsoleLog()
    files = RunFiles(config.log_path)
    files.write_config(config.dump())
    runtimes = {name: EnvRuntime.create(name, cfg, config.seed, config.max_tokens)
                for name, cfg in config.environments.items()}
    service = make_service_client(config)

    # ---- start, warm start or resume ------------------------------------------------------------
    checkpoints = files.checkpoints()
    row = next((r for r in reversed(checkpoints) if r.get("state_path") == config.resume_from), None) \
        if config.resume_from else files.last_resumable()
    cursors = {name: 0 for name in runtimes}
    start_step = 0
    wandb_id = None
    if row is not None:
        training = await service.create_training_client_from_state_with_optimizer(row["state_path"])
        start_step = int(row["batch"])
        cursors.update(row.get("cursors", {}))
        wandb_id = row.get("wandb_run_id")
        console.info(f"resuming from {row['state_path']} at step {start_step}")
    elif config.resume_from:
        training = await service.create_training_client_from_state(config.resume_from)
        console.info(f"initialized weights from {config.resume_from}")
    else:
        training = await service.create_lora_training_client(base_model=config.model_name, rank=config.lora_rank,
                                                              seed=config.seed)
    files.truncate_from(start_step)
    tokenizer = training.get_tokenizer()
    renderer = get_renderer(config.renderer or infer_renderer(config.model_name, tokenizer), tokenizer)
    sampler = await training.save_weights_and_get_sampling_client()
    wandb = None
    if config.wandb_project_name:
        from polyrl.tracking.wandb_log import WandbLog

        wandb = WandbLog(config.wandb_project_name, config.wandb_run_name, config.dump(), str(files.root), wandb_id)
    uploader = None
    if config.openreward_run_name:
        from polyrl.tracking.openreward_upload import OpenRewardUploader

        uploader = OpenRewardUploader(config, runtimes, start_step)

    adam = types.AdamParams(learning_rate=config.learning_rate, beta1=config.adam_beta1, beta2=config.adam_beta2,
                            eps=config.adam_eps, weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
    weights = {n: rt.cfg.weight for n, rt in runtimes.items() if rt.cfg.splits.get("train") is not None}
    last_row: dict[str, float] = {}
    for step in range(start_step, config.max_steps):
        t0 = time.monotonic()
        # ---- rollouts ------------------------------------------------------------------------------
        plan = []
        for name in allocate_groups(weights, config.batch_size, step):
            plan.append((name, runtimes[name].task_index("train", cursors[name])))
            cursors[name] += 1
        sizes = {n: rt.cfg.num_rollouts for n, rt in runtimes.items()}
        with console.progress(f"step {step} rollouts", len(plan)) as progress:
            groups = await collect_groups(runtimes, plan, "train", sizes, sampler, renderer,
                                          (config.seed, "train", step), progress)
        t_rollout = time.monotonic() - t0

        # ---- advantages and update ---------------------------------------------------------------
        kept, stats = filter_groups(split_roles(groups), runtimes, config.remove_constant_reward_groups)
        adv_lib.compute_advantages(kept, config.advantage_estimator, config.normalize_advantages_by_std, config.gamma)
        episodes = [ep for g in kept for ep in g if any(a != 0 for a in ep.turn_advantages) and ep.action_tokens]
        datums = [adv_lib.to_datum(ep) for ep in episodes]
        row_metrics = {"step": step, "progress/done_frac": (step + 1) / config.max_steps, "optim/lr": config.learning_rate}
        t1 = time.monotonic()
        if datums:
            fwd = training.forward_backward(datums, config.loss_fn, dict(config.loss_fn_config) or None)
            opt = training.optim_step(adam)
            fwd_result, opt_result = await fwd, await opt
            row_metrics.update(kl_metrics(datums, fwd_result.loss_fn_outputs))
            row_metrics["optim/loss"] = fwd_result.metrics.get("loss:sum", float("nan"))
            if "clipped_tokens:sum" in fwd_result.metrics:
                row_metrics["optim/clip_frac"] = fwd_result.metrics["clipped_tokens:sum"] / max(
                    1.0, fwd_result.metrics.get("active_tokens:sum", 1.0))
            for k, v in (opt_result.metrics or {}).items():
                row_metrics[f"optim/{k.split(':')[0]}"] = v
        row_metrics["optim/datums"] = float(len(datums))
        row_metrics["tokens/action"] = float(sum(ep.action_tokens for ep in episodes))
        row_metrics["tokens/total"] = float(sum(len(d.model_input.to_ints()) for d in datums))
        t_train = time.monotonic() - t1

        # ---- new sampler, checkpoint ---------------------------------------------------------------
        t2 = time.monotonic()
        done_steps = step + 1
        final = done_steps == config.max_steps
        checkpoint_row = None
        if final or (config.save_every and done_steps % config.save_every == 0):
            name = "final" if final else f"{done_steps:06d}"
            state = await training.save_state(name)
            sampler_path = (await training.save_weights_for_sampler(name)).path
            sampler = await training.create_sampling_client(sampler_path)
            checkpoint_row = {"name": name, "batch": done_steps, "final": final, "state_path": state.path,
                              "sampler_path": sampler_path, "cursors": dict(cursors),
                              "wandb_run_id": wandb.run_id if wandb else None}
            console.info(f"checkpoint {name}: {state.path}")
        else:
            sampler = await training.save_weights_and_get_sampling_client()
        t_save = time.monotonic() - t2

        # ---- evaluation and logs -------------------------------------------------------------------
        if config.eval_every and (done_steps % config.eval_every == 0 or final):
            from polyrl.evaluate import evaluate_sampler

            row_metrics.update(await evaluate_sampler(sampler, renderer, runtimes, config.eval_num_samples, config.seed))
        row_metrics.update(episode_metrics(groups, stats))
        row_metrics.update({"time/rollout": t_rollout, "time/train": t_train, "time/save": t_save,
                            "time/total": time.monotonic() - t0})
        kept_ids = {id(ep) for g in kept for ep in g}
        files.log_trajectories(step, [episode_row(step, ep, tokenizer, dropped=id(ep) not in kept_ids)
                                      for group in groups for ep in group])
        if uploader:
            uploader.upload_step(step, [ep for group in groups for ep in group], row_metrics,
                                 {id(ep) for group in groups for ep in group} - kept_ids)
        files.log_metrics(row_metrics)
        if checkpoint_row is not None:  # last: a resume from this row must find the step fully logged
            files.log_checkpoint(checkpoint_row)
        if wandb:
            wandb.log(row_metrics, step)
        console.step(row_metrics)
        last_row = row_metrics
        if config.report and not final and config.save_every and done_steps % config.save_every == 0:
            refresh_for_training(files.root, console)
    if config.report:
        refresh_for_training(files.root, console)
    if wandb:
        wandb.close()
    if uploader:
        uploader.close()
    for rt in runtimes.values():
        await rt.builder.aclose()
    return last_row


def train(config: TrainConfig, console: ConsoleLog | None = None) -> dict[str, float]:
    return asyncio.run(train_async(config, console))
