"""Held-out evaluation: mean reward, pass@1 and pass@k per environment on the test splits.

pass@k uses the unbiased estimator of Chen et al. (2021): with ``n`` samples of which ``c`` succeed,
``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over tasks.
"""

from __future__ import annotations

from math import comb
from typing import Any

from polyrl.backend import ServiceGuard, ending_session, service_url
from polyrl.rl.rollouts import EnvRuntime, collect_groups, rollout_bounds
from polyrl.rl.run import close_environments, open_env_models
from polyrl.tracking.console import ConsoleLog


def pass_at_k(n: int, c: int, k: int) -> float:
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


async def evaluate_sampler(sampler: Any, renderer: Any, runtimes: dict, num_samples: int = 1, seed: int = 0,
                           prefix: str = "test") -> dict[str, float]:
    """Run every test task of every environment with a test split ``num_samples`` times."""
    plan = []
    for name, rt in sorted(runtimes.items()):
        if rt.cfg.splits.get("test") is None:
            continue
        n_tasks = rt.num_tasks("test")
        if n_tasks is None:
            raise ValueError(f"environments.{name}.splits.test.num_samples must be set: the test split is "
                             "unbounded")
        plan += [(name, rt.task_index("test", i)) for i in range(n_tasks)]
    if not plan:
        return {}
    groups = await collect_groups(runtimes, plan, "test", num_samples, sampler, renderer, (seed, "test"))
    out: dict[str, float] = {}
    by_env: dict[str, list] = {}
    for g in groups:
        by_env.setdefault(g[0].env_name, []).append(g)
    successes = []
    for name, env_groups in by_env.items():
        roles = list(dict.fromkeys(ep.role for g in env_groups for ep in g if not ep.failed))
        if len(roles) > 1 or (roles and roles[0]):
            # a multi-agent workflow: each role on its own; the environment's numbers are those of the
            # role whose output is the workflow's answer (the builder's ``eval_role``, else the first)
            for role in roles:
                _score(out, f"{prefix}/{name}/{role}", _role_groups(env_groups, role), num_samples)
            primary = getattr(runtimes[name].builder, "eval_role", None)
            env_groups = _role_groups(env_groups, primary if primary in roles else roles[0])
        _score(out, f"{prefix}/{name}", env_groups, num_samples)
        successes.append(out[f"{prefix}/{name}/pass@1"])
    out[f"{prefix}/pass@1"] = sum(successes) / len(successes)
    return out


def _role_groups(groups: list[list], role: str) -> list[list]:
    """Each task's episodes of ``role``; a failed rollout (no role) counts as a failure of every role."""
    return [[ep for ep in g if ep.role == role or ep.failed] for g in groups]


def _score(out: dict[str, float], key: str, groups: list[list], num_samples: int) -> None:
    episodes = [ep for g in groups for ep in g]
    out[f"{key}/reward"] = sum(ep.reward for ep in episodes) / len(episodes)
    judged = [ep.metrics["judge/score"] for ep in episodes if "judge/score" in ep.metrics]
    if judged:
        out[f"{key}/judge_score"] = sum(judged) / len(judged)
    out[f"{key}/failed"] = float(sum(ep.failed for ep in episodes))
    for k in sorted({1, num_samples}):
        scores = [pass_at_k(len(g), sum(ep.success and not ep.failed for ep in g), k) for g in groups]
        out[f"{key}/pass@{k}"] = sum(scores) / len(scores)


async def evaluate_checkpoint(config: Any, checkpoint: str | None = None) -> dict[str, float]:
    """``polyrl eval``: the test splits of ``config.environments`` against a checkpoint (a sampler or
    state path) or, without one, the base model."""
    from polyrl.rl.policy import open_policy

    runtimes = {n: EnvRuntime.create(n, c, config.seed, config.max_tokens, **rollout_bounds(config))
                for n, c in config.environments.items()}
    policy = await open_policy(config, model_path=checkpoint)
    console = ConsoleLog()
    async with ending_session(policy.service, service_url(config)):
        guard = ServiceGuard(service_url(config), config.limits.service_timeout, console.warn)
        try:
            await open_env_models(config.model_name, runtimes, policy.service, guard, policy.renderer)
            return await evaluate_sampler(policy.client, policy.renderer, runtimes, config.eval_num_samples,
                                          config.seed)
        finally:
            await close_environments(runtimes, console)
