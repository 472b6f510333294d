"""The report's first screen: the headline (reward and success at the start and the end of the run,
held-out scores at the first and the last evaluation, wall time, steps done; per environment) and
banners for a run that stopped learning (steps that made no update, updates refused as non-finite,
episodes cut at ``max_tokens``). Pure functions of the metric table (:func:`polyrl.report.data.metric_table`)
and the run's config; the metric names are those of :mod:`polyrl.rl.step_metrics`.
"""

from __future__ import annotations

from typing import Any

from polyrl.report.data import clean_number

WINDOW = 5  # steps averaged for "start" and "end" (fewer in a short run, so the two never overlap)
NO_UPDATE_WARN = 0.1  # share of steps without an update that raises a warning (all of them: an error)
TRUNCATION_WARN = 0.5  # share of episodes cut at max_tokens that raises a warning


def _present(steps: list[int], values: list | None) -> list[tuple[int, float]]:
    return [(s, v) for s, v in zip(steps, values or []) if v is not None]


def window_of(n: int) -> int:
    """Steps averaged at each end of a series of ``n`` values: up to :data:`WINDOW`, at most half."""
    return max(1, min(WINDOW, n // 2))


def start_end(steps: list[int], values: list | None) -> dict | None:
    """Mean of the first and of the last few steps that have a value, and which steps those were;
    None when the series is empty."""
    pts = _present(steps, values)
    if not pts:
        return None
    k = window_of(len(pts))
    head, tail = pts[:k], pts[-k:]
    return {"start": clean_number(sum(v for _, v in head) / k, 4), "start_steps": [head[0][0], head[-1][0]],
            "end": clean_number(sum(v for _, v in tail) / k, 4), "end_steps": [tail[0][0], tail[-1][0]],
            "points": len(pts)}


def first_last(steps: list[int], values: list | None) -> dict | None:
    """The first and the last value of a series (evaluations: one point each), with their steps."""
    pts = _present(steps, values)
    if not pts:
        return None
    return {"first": pts[0][1], "first_step": pts[0][0], "last": pts[-1][1], "last_step": pts[-1][0],
            "points": len(pts)}


def success_definition(env_config: Any, verdict: bool | None = None) -> str:
    """What decided an environment's successes: its entry's ``success_threshold`` when set, else the
    environment's own verdict when its episodes gave one (``verdict``: an ``env/<name>/success`` series,
    the mean of the episodes' ``success`` metric, is in the run's metrics), else full marks. ``verdict``
    None: not known yet (no step logged)."""
    threshold = env_config.get("success_threshold") if isinstance(env_config, dict) else None
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
        return f"success = reward ≥ {threshold:g} (success_threshold)"
    if verdict is None:
        return "success = the environment's verdict (else reward ≥ 1)"
    return "success = the environment's verdict" if verdict else "success = reward ≥ 1 (full marks)"


def _eval_key(series: dict, prefix: str) -> str | None:
    """The held-out score of ``prefix`` (``test/<env>`` or ``test``): pass@1, else the lowest pass@k."""
    if f"{prefix}/pass@1" in series:
        return f"{prefix}/pass@1"
    ks = sorted(int(k.rsplit("@", 1)[1]) for k in series
                if k.startswith(f"{prefix}/pass@") and k.rsplit("@", 1)[1].isdigit())
    return f"{prefix}/pass@{ks[0]}" if ks else None


def wall_time(table: dict, elapsed_s: float | None) -> dict:
    """The run's time: ``elapsed_s`` (real time, from the run files' times) when known and not shorter
    than the time spent in steps, else the sum of the steps' ``time/total`` (``kind`` says which)."""
    times = [t for t in table["series"].get("time/total") or [] if t is not None]
    in_steps = sum(times) if times else None
    if elapsed_s is not None and (in_steps is None or elapsed_s >= in_steps):
        return {"wall_s": clean_number(elapsed_s, 4), "wall_kind": "elapsed"}
    return {"wall_s": clean_number(in_steps, 4) if in_steps is not None else None, "wall_kind": "steps"}


def headline(table: dict, config: dict, envs: list[str], elapsed_s: float | None = None) -> dict:
    """The numbers of the first screen: one row for all environments (when there are several) and one
    per environment, each with reward and success start/end and held-out score and reward first/last;
    ``elapsed_s``: the run's real time (see :func:`wall_time`)."""
    steps, series = table["steps"], table["series"]
    env_configs = config.get("environments") or {}
    trained = any(s >= 0 for s in steps)  # step -1: the evaluation before training, no episodes
    rows = []
    for env in ([None] if len(envs) != 1 else []) + list(envs):
        own = f"env/{env}/" if env else ""

        def key(name: str, own: str = own) -> str:
            # one environment: its own series, or the overall ones when it has none of its own
            return own + name if own + name in series or len(envs) != 1 else name

        test = f"test/{env}" if env else "test"
        score = _eval_key(series, test)
        rows.append({
            "env": env,
            "reward": start_end(steps, series.get(key("reward/mean"))),
            "success": start_end(steps, series.get(key("success/mean"))),
            "success_def": success_definition(env_configs.get(env), f"env/{env}/success" in series
                                              if trained else None) if env else None,
            "held_out": first_last(steps, series.get(score)) if score else None,
            "held_out_metric": score.rsplit("/", 1)[1] if score else None,
            "held_out_reward": first_last(steps, series.get(f"{test}/reward")),
            "truncated": start_end(steps, series.get(key("stop/length_frac"))),
        })
    eval_every = config.get("eval_every")
    has_eval = any(r["held_out"] or r["held_out_reward"] for r in rows)
    if has_eval:
        eval_note = None
    elif eval_every == 0:
        eval_note = "no held-out evaluation: eval_every is 0 (set it to evaluate on the test splits)"
    else:
        eval_note = "no held-out evaluation logged yet"
    return {
        "steps_done": steps[-1] + 1 if steps else 0,
        "max_steps": config.get("max_steps"),
        **wall_time(table, elapsed_s),
        "window": WINDOW,
        "rows": rows,
        "eval_note": eval_note,
    }


def sft_headline(table: dict, config: dict, sft: dict | None, elapsed_s: float | None = None) -> dict:
    """The first screen of a ``polyrl sft`` run: steps, time, the loss per token at the start and the
    end, and what it learned from (``sft.json``'s sources when it finished; else the config's, with
    the environments' demonstration counts and the data files' counts unknown)."""
    steps, series = table["steps"], table["series"]
    sources = (sft or {}).get("sources")
    if not isinstance(sources, list):
        sources = [{"data": path, "conversations": None} for path in config.get("data") or []]
        for name, entry in (config.get("environments") or {}).items():
            train = ((entry or {}).get("splits") or {}).get("train") if isinstance(entry, dict) else None
            sources.append({"environment": name,
                            "demonstrations": train.get("num_samples") if isinstance(train, dict) else None})
    return {
        "kind": "sft",
        "steps_done": steps[-1] + 1 if steps else 0,
        "max_steps": config.get("max_steps"),
        **wall_time(table, elapsed_s),
        "window": WINDOW,
        "loss": start_end(steps, series.get("optim/loss")),
        "sources": sources,
    }


# ---------------------------------------------------------------------------------------- banners
def _count(values: list | None, test) -> int:
    return sum(1 for v in values or [] if v is not None and test(v))


def _steps_text(n: int) -> str:
    return f"{n} step{'' if n == 1 else 's'}"


def _max_tokens(config: dict, env: str | None) -> Any:
    entry = (config.get("environments") or {}).get(env) if env else None
    own = entry.get("max_tokens") if isinstance(entry, dict) else None
    return own or config.get("max_tokens")


def banners(table: dict, config: dict, envs: list[str]) -> list[dict]:
    """What the first screen warns about, worst first: ``{level: "bad"|"warn", kind, title, what, try}``.
    ``bad`` means the run did not learn at all (every step made no update)."""
    steps, series = table["steps"], table["series"]
    n = sum(1 for s in steps if s >= 0)  # steps trained; step -1 is the evaluation before training
    if not n:
        return []
    out: list[dict] = []
    datums = series.get("optim/datums")
    skipped = series.get("optim/nonfinite_skipped") or []
    refused_at = {i for i, v in enumerate(skipped) if v}
    empty_at = {i for i, v in enumerate(datums or []) if v is not None and v == 0} - refused_at
    dropped = series.get("rollouts/dropped_groups") or []
    failed_at = {i for i in empty_at if i < len(dropped) and dropped[i]}
    no_update = len(empty_at) + len(refused_at)

    if no_update == n or no_update >= NO_UPDATE_WARN * n:
        reasons, tries = [], []
        if empty_at - failed_at:
            reasons.append(f"{_steps_text(len(empty_at - failed_at))} had no learning signal (every group's "
                           "episodes got the same reward, so every advantage was 0)")
            tries.append("give the groups different rewards: more num_rollouts, an easier task or partial "
                         "rewards, and check that the reward function can pay out at all")
        if failed_at:
            reasons.append(f"{_steps_text(len(failed_at))} dropped their groups over the failure budget "
                           "(episodes that failed)")
            tries.append("open Trajectories with 'errors' shown to read the failing episodes' error "
                         "(max_failing_rollouts sets the budget)")
        if refused_at:
            reasons.append(f"{_steps_text(len(refused_at))} had a non-finite update that was refused")
            tries.append("lower learning_rate or set optimizer.grad_clip_norm")
        every = no_update == n
        out.append({
            "level": "bad" if every else "warn",
            "kind": "no_update",
            "title": ("No step made an update: the model did not train" if every
                      else f"{no_update} of {n} steps made no update"),
            "what": ("Every step" if every else f"{no_update} of {n} steps") + " left the weights unchanged: "
                    + "; ".join(reasons) + ".",
            "try": "Try to " + "; ".join(tries) + ".",
        })
    if refused_at and no_update != n:
        out.append({
            "level": "warn",
            "kind": "nonfinite",
            "title": f"{_steps_text(len(refused_at))} refused as non-finite",
            "what": f"The update of {_steps_text(len(refused_at))} (first: step {steps[min(refused_at)]}) "
                    "held a NaN or an infinity; it was discarded (limits.nonfinite_steps: skip).",
            "try": "Lower learning_rate, set optimizer.grad_clip_norm, or look for huge rewards in those "
                   "steps.",
        })

    cut = []
    targets = ([(e, f"env/{e}/stop/length_frac") for e in envs] if len(envs) > 1
               else [(envs[0] if envs else None, "stop/length_frac")])
    for env, key in targets:
        if key not in series and env is not None:
            key = f"env/{env}/stop/length_frac"
        frac = start_end(steps, series.get(key))
        if frac is None:
            continue
        values = [v for v in series[key] if v is not None]
        overall = sum(values) / len(values)
        if max(frac["end"], overall) >= TRUNCATION_WARN:
            cut.append((env if len(envs) > 1 else None, env, frac, overall))
    if cut:
        parts = [f"{label + ': ' if label else ''}{frac['end']:.0%} in the last "
                 f"{_steps_text(window_of(frac['points']))} ({overall:.0%} over the run; "
                 f"max_tokens {_max_tokens(config, env)})" for label, env, frac, overall in cut]
        every = all(f["end"] >= 1 and o >= 1 for *_, f, o in cut)
        names = ", ".join(label for label, *_ in cut if label)
        of = f" of {names}" if names else ""
        out.append({
            "level": "warn",
            "kind": "truncation",
            "title": f"Every episode{of} was cut at max_tokens" if every
                     else f"Most episodes{of} are cut at max_tokens",
            "what": "Share of episodes with a turn that stopped at max_tokens: " + "; ".join(parts) + ".",
            "try": "Raise max_tokens (or environments.NAME.max_tokens), or ask for a shorter answer in the "
                   "prompt: a cut-off answer seldom earns its reward.",
        })
    return out
