"""What the report shows, extracted from a run directory: metric series, chart layout, compact
episodes and per-step summaries. Pure functions of the rows ``polyrl train`` writes (see
``polyrl/tracking/files.py``); writing files is ``build.py``'s job.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

from polyrl.secrets import redact_config
from polyrl.tracking.files import read_jsonl

PALETTE_SIZE = 10  # report.js has as many colors; env i gets color i % PALETTE_SIZE


# ---------------------------------------------------------------------------------------- numbers
def clean_number(value: Any, digits: int = 5) -> float | int | None:
    """A JSON-safe number rounded to ``digits`` significant digits; None for NaN, inf and non-numbers."""
    kind = type(value)
    if kind is bool:
        return int(value)
    if kind is int:
        return value
    if kind is not float:
        return clean_number(float(value), digits) if isinstance(value, (int, float)) else None
    if not math.isfinite(value):
        return None
    rounded = float("%.*g" % (digits, value))
    return int(rounded) if rounded.is_integer() and abs(rounded) < 1e15 else rounded


# ---------------------------------------------------------------------------------------- run files
def read_config(root: Path) -> dict:
    """``config.json``, secrets redacted once more; {} when missing or unreadable (a run just starting)."""
    try:
        return redact_config(json.loads((root / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def read_metrics(root: Path) -> list[dict]:
    """Rows of ``metrics.jsonl`` by step, one per step (the last one wins), torn last line ignored."""
    by_step: dict[int, dict] = {}
    for row in read_jsonl(root / "metrics.jsonl"):
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def read_wandb(root: Path) -> dict | None:
    """The run's W&B run (``wandb.json``, written by the W&B logger): id, project, name, the URL
    when it was logged online, the local directory when offline; None when there is none."""
    try:
        record = json.loads((root / "wandb.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not record.get("id"):
        return None
    url = record.get("url")
    return {"id": str(record["id"]), "project": record.get("project"), "name": record.get("name"),
            "url": url if isinstance(url, str) and url.startswith("https://") else None,
            "offline": bool(record.get("offline")), "dir": record.get("dir")}


def read_sft(root: Path) -> dict | None:
    """``sft.json``, written by ``polyrl sft`` when it finished: its checkpoint paths, steps and the
    conversations it learned from (``sources``); None when there is none (an RL run, or SFT still going)."""
    try:
        record = json.loads((root / "sft.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_sft_run(root: Path, config: dict) -> bool:
    """Whether ``root`` holds a ``polyrl sft`` run: its ``sft.json``, or a config with SFT's own fields
    (``data`` and ``save_name``; a run still going has no ``sft.json`` yet)."""
    return (root / "sft.json").exists() or ("data" in config and "save_name" in config)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def elapsed_seconds(root: Path, table: dict) -> float | None:
    """The run's real time: from ``config.json`` (written as a launch starts) to the last write of
    ``metrics.jsonl``, ``checkpoints.jsonl`` or ``sft.json``, plus the step times of the steps before
    that launch (a resumed run: ``attempts.jsonl``'s last row says where it resumed), so pauses between
    launches are not counted. None when the files' times cannot tell (nothing logged since the launch)."""
    start = _mtime(root / "config.json")
    ends = [t for t in (_mtime(root / n) for n in ("metrics.jsonl", "checkpoints.jsonl", "sft.json")) if t]
    if start is None or not ends or max(ends) <= start:
        return None
    attempts = [r for r in read_jsonl(root / "attempts.jsonl") if isinstance(r, dict)]
    resumed_at = attempts[-1].get("step") if attempts else None
    before = 0.0
    if isinstance(resumed_at, int):
        times = table["series"].get("time/total") or []
        before = sum(t for s, t in zip(table["steps"], times) if s < resumed_at and t is not None)
    return max(ends) - start + before


def read_checkpoints(root: Path) -> list[dict]:
    keep = ("name", "batch", "final", "state_path", "sampler_path")
    return [
        {k: row.get(k) for k in keep}
        for row in read_jsonl(root / "checkpoints.jsonl")
        if isinstance(row, dict)
    ]


def metric_table(rows: list[dict]) -> dict:
    """Columns of the metric rows: ``{"steps": [...], "series": {key: [value or None per step]}}``."""
    steps = [row["step"] for row in rows]
    keys = sorted({k for row in rows for k, v in row.items() if k != "step" and isinstance(v, (int, float))})
    series = {k: [clean_number(row.get(k)) for row in rows] for k in keys}
    return {"steps": steps, "series": {k: v for k, v in series.items() if any(x is not None for x in v)}}


# ---------------------------------------------------------------------------------------- charts
def env_names(config: dict, keys: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """Environment names: the config's, those seen in trajectories, and those in metric keys."""
    names = set((config.get("environments") or {}).keys()) | set(extra)
    for key in keys:
        m = re.match(r"env/(.+?)/reward/mean$", key) or re.match(r"test/(.+?)/(reward|pass@\d+)$", key)
        if m:
            names.add(m.group(1))
    return sorted(names)


# The charts, in page order: (id, title, unit, series). Series are either fixed ``(key, label)`` pairs
# or ``PerEnv(overall key or None, per-environment suffix)``: the overall line plus one per environment.
PerEnv = tuple[str | None, str]
CHARTS: list[tuple[str, str, str, list[tuple[str, str]] | PerEnv]] = [
    ("reward", "Reward", "", ("reward/mean", "reward/mean")),
    ("success", "Success (eval pass@k as points)", "", ("success/mean", "success/mean")),
    ("kl", "KL sample → learner", "", [("optim/kl_sample_train_v1", "v1"),
                                         ("optim/kl_sample_train_v2", "v2")]),
    ("kl_reference", "KL sample → reference (penalized)", "",
     [("kl/reference", "kl/reference"), ("kl_policy_base", "kl_policy_base (cookbook)")]),
    ("kl_teacher", "KL sample → teacher (distilled)", "", [("kl/teacher", "kl/teacher"),
                                                          ("teacher_kl", "teacher_kl (cookbook)")]),
    ("entropy", "Entropy (sampled tokens)", "nats", [("optim/entropy", "entropy")]),
    ("loss", "Loss", "", [("optim/loss", "loss")]),
    ("grad_norm", "Gradient norm", "", [("optim/grad_norm", "grad norm")]),
    ("action_tokens", "Sampled tokens per episode", "", ("tokens/action_per_episode",) * 2),
    ("total_tokens", "Total tokens per episode", "", ("tokens/total_per_episode",) * 2),
    ("turns", "Turns per episode", "", ("turns/mean", "turns/mean")),
    ("failed", "Failing rollouts", "", ("rollouts/failed", "failed_rollouts")),
    ("dropped", "Dropped groups", "", ("rollouts/dropped_groups", "dropped_groups")),
    ("constant", "Constant-reward groups", "", (None, "constant_groups")),
    ("length", "Stopped at max_tokens (fraction)", "", ("stop/length_frac", "stop/length_frac")),
    ("staleness", "Staleness (updates the samplers were behind)", "steps",
     [("async/staleness_mean", "mean"), ("async/staleness_max", "max")]),
    ("stale", "Groups dropped as stale", "", [("async/stale_dropped", "dropped")]),
    ("time", "Time per phase", "s", [("time/rollout", "waiting for rollouts"), ("time/train", "train"),
                                     ("time/save", "save"), ("time/total", "total")]),
    ("step_tokens", "Tokens per step", "", [("tokens/action", "sampled"), ("tokens/total", "in datums")]),
    ("datums", "Datums and episodes per step", "", [("optim/datums", "datums"),
                                                     ("episodes/count", "episodes")]),
    ("clip", "Clipped token fraction", "", [("optim/clip_frac", "clip frac")]),
    ("lr", "Learning rate", "", [("optim/learning_rate", "learning_rate"), ("optim/lr", "configured")]),
]


def _series(key: str, label: str, color: int, style: str = "line", marker: str = "circle") -> dict:
    return {"key": key, "label": label, "color": color, "style": style, "marker": marker}


def chart_specs(keys: Iterable[str], envs: list[str]) -> list[dict]:
    """Which charts to draw and which series each has; only series with data, only charts with a series.

    A series is ``{key, label, color, style: line|points, marker}``: color -1 is the all-environment
    line, an env's lines share its palette color; evaluation results (``test/...``) are points on the
    reward and success charts. Keys no chart claims get charts of their own, so nothing is hidden.
    """
    keys = set(keys)
    env_color = {e: i % PALETTE_SIZE for i, e in enumerate(envs)}
    evals = {e: sorted(k for k in keys if re.fullmatch(re.escape(f"test/{e}/") + r"(reward|pass@\d+)", k))
             for e in envs}
    specs: list[tuple[str, str, str, list[dict]]] = []
    for cid, title, unit, series in CHARTS:
        if isinstance(series, list):
            lines = [_series(key, label, i % PALETTE_SIZE) for i, (key, label) in enumerate(series)]
        else:
            overall, suffix = series
            lines = [_series(overall, "all", -1)] if overall else []
            lines += [_series(f"env/{e}/{suffix}", e, env_color[e]) for e in envs]
        for e in envs if cid in ("reward", "success") else []:
            for k in evals[e]:
                name = k.rsplit("/", 1)[1]
                if (name == "reward") == (cid == "reward"):
                    label = f"{e} eval reward" if name == "reward" else f"{e} {name}"
                    marker = "circle" if name in ("reward", "pass@1") else "square"
                    lines.append(_series(k, label, env_color[e], "points", marker))
        if cid == "success":
            lines += [_series(k, f"all {k[5:]}", -1, "points", "diamond")
                      for k in sorted(keys) if re.fullmatch(r"test/pass@\d+", k)]
        specs.append((cid, title, unit, lines))

    used = {s["key"] for *_, lines in specs for s in lines}
    for e in envs:  # each environment's own metrics (env/<name>/<metric>)
        prefix = f"env/{e}/"
        own = sorted(k for k in keys - used if k.startswith(prefix) and not k.startswith(prefix + "tokens/"))
        specs.append((f"env-{e}", f"{e}: environment metrics", "",
                      [_series(k, k[len(prefix):], i % PALETTE_SIZE) for i, k in enumerate(own)]))
    used = {s["key"] for *_, lines in specs for s in lines}
    groups: dict[str, list[str]] = {}  # what is left, by first path segment; test/... are points
    for k in sorted(keys - used - {"progress/done_frac"}):
        groups.setdefault(k.split("/", 1)[0], []).append(k)
    evals_left = groups.pop("test", [])
    specs.append(("eval-other", "Evaluation: other metrics", "",
                  [_series(k, k[5:], i % PALETTE_SIZE, "points") for i, k in enumerate(evals_left)]))
    for group, group_keys in groups.items():
        specs.append((f"other-{group}", f"Other: {group}", "",
                      [_series(k, k, i % PALETTE_SIZE) for i, k in enumerate(group_keys)]))

    charts = []
    for cid, title, unit, lines in specs:
        present = [s for s in lines if s["key"] in keys]
        if present:
            charts.append({"id": cid, "title": title, "unit": unit, "series": present})
    return charts


# ---------------------------------------------------------------------------------------- episodes
def mask_runs(mask: list[int]) -> list[list[int]]:
    """``[start, end)`` runs of ones in a 0/1 mask."""
    runs, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append([start, i])
            start = None
    if start is not None:
        runs.append([start, len(mask)])
    return runs


def compact_episode(row: dict, index: int) -> dict:
    """An episode as the browser needs it: no token ids, logprobs rounded, the action mask as runs."""
    text = row.get("token_text") or []
    mask = row.get("action_mask") or []
    return {
        "i": index,
        "env": row.get("env", "?"),
        "group": row.get("group", 0),
        "task": row.get("task_index"),
        "reward": clean_number(row.get("reward")),
        "success": bool(row.get("success")),
        "adv": [clean_number(a, 4) for a in row.get("advantages") or []],
        "step_rewards": [clean_number(r, 4) for r in row.get("step_rewards") or []],
        "turns": row.get("num_turns", 0),
        "stop": row.get("stop_reasons") or [],
        "done_by_env": row.get("done_by_env"),
        "error": row.get("error"),
        "dropped": bool(row.get("dropped")),
        "lag": _lag(row),
        "metrics": {k: clean_number(v) for k, v in (row.get("metrics") or {}).items()},
        "dur": clean_number(row.get("duration_s"), 3),
        "messages": [_with_safe_images(m) for m in row.get("messages") or []],
        "images": [{"start": s["start"], "length": s["length"], "image": s["image"]}
                   for s in row.get("images") or [] if isinstance(s, dict) and _stored_image(s.get("image"))],
        "text": text,
        "lp": [clean_number(x, 3) if m else 0 for x, m in zip(row.get("logprobs") or [], mask)],
        "mask": mask_runs(mask),
        "spans": row.get("turn_spans") or [],
        "judge": [{"rubric": j.get("rubric"), "prompt": j.get("prompt"), "verdict": j.get("verdict"),
                   "score": clean_number(j.get("score"), 4), "raw": clean_number(j.get("raw_score"), 4),
                   "pair": j.get("pair"), "preferred": j.get("preferred"),
                   "failure": j.get("failure"), "error": j.get("error"), "cached": bool(j.get("cached")),
                   "secs": clean_number(j.get("seconds"), 3)}
                  for j in row.get("judge") or [] if isinstance(j, dict)],
    }


_STORED_IMAGE = re.compile(r"images/[0-9a-f]{32}\.(jpeg|png)")


def _stored_image(name: Any) -> bool:
    """Whether ``name`` is an image the run stored (``images/<hash>.<format>``), the only files the
    report links to."""
    return isinstance(name, str) and _STORED_IMAGE.fullmatch(name) is not None


def _with_safe_images(message: Any) -> Any:
    """A message whose image parts name only stored images (any other source shows as a plain image part)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for part in message["content"]:
        if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
            part = {"type": "image", "image": part.get("image") if _stored_image(part.get("image")) else None,
                    "width": part.get("width"), "height": part.get("height")}
        parts.append(part)
    return {**message, "content": parts}


def _lag(row: dict) -> int | None:
    """How many updates the policy that sampled an episode was behind the step that logged it."""
    step, sampler = row.get("step"), row.get("sampler_step")
    return step - sampler if isinstance(step, int) and isinstance(sampler, int) else None


def step_payload(step: int, rows: list[dict]) -> dict:
    """A step file's content: its episodes ordered by environment and group, tool specs once per env."""
    episodes = sorted(
        (compact_episode(r, i) for i, r in enumerate(rows)), key=lambda ep: (ep["env"], ep["group"], ep["i"])
    )
    tools: dict[str, list] = {}
    for r in rows:
        if r.get("tools") and r.get("env") not in tools:
            tools[r.get("env", "?")] = r["tools"]
    return {"step": step, "tools": tools, "episodes": episodes}


def summarize_step(rows: list[dict]) -> dict[str, dict]:
    """Per environment: episodes ``n``, groups ``g``, mean reward ``r``, success fraction ``s``,
    failed (error) episodes ``f`` — what the step picker shows without loading the step."""
    out: dict[str, dict] = {}
    for r in rows:
        s = out.setdefault(r.get("env", "?"), {"n": 0, "groups": set(), "r": 0.0, "s": 0, "f": 0})
        s["n"] += 1
        s["groups"].add(r.get("group"))
        s["r"] += r.get("reward") or 0.0
        s["s"] += bool(r.get("success"))
        s["f"] += r.get("error") is not None
    return {
        env: {
            "n": s["n"],
            "g": len(s["groups"]),
            "r": clean_number(s["r"] / s["n"], 4),
            "s": clean_number(s["s"] / s["n"], 4),
            "f": s["f"],
        }
        for env, s in sorted(out.items())
    }


def step_of(path: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
    return int(m.group(1)) if m else None
