"""Writing ``LOG_PATH/report/``: ``index.html`` + ``report.js`` + ``report.css`` (copied from
``static/``), ``data/index.js`` (the headline and banners of the first screen, metric series, chart
layout, step list, config and its difference from the defaults, checkpoints) and one
``data/step_NNNNNN.js`` per trajectory file, loaded by the page on demand.

Incremental: ``data/manifest.json`` remembers each trajectory file's (mtime, size) and summary, so a
refresh rewrites only step files that are new or changed, deletes those whose source is gone (a
resumed run), and rewrites the index only when one of its inputs changed.

Data files are JavaScript (``window.polyrlStep(N, {...})``), not JSON, so the page works from
file:// where browsers refuse fetch().
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from importlib import resources
from pathlib import Path

from polyrl.fileio import atomic_write_text
from polyrl.report import data as D
from polyrl.report import summary
from polyrl.report.config_diff import config_diff
from polyrl.secrets import redact
from polyrl.tracking.files import read_jsonl

FORMAT = 2  # bump when the data files change shape: every step file is rewritten
STATIC_FILES = ("report.js", "report.css")


def _write(path: Path, text: str) -> None:
    """Whole-file write through a temporary name (a reader never sees half a file); no fsync:
    everything here can be rebuilt from the run directory."""
    atomic_write_text(path, text, durable=False)


def _write_if_changed(path: Path, text: str) -> bool:
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    _write(path, text)
    return True


def _js_call(fn: str, *args) -> str:
    """The text of a data file; secrets masked once more (the run files were written redacted)."""
    body = ", ".join(json.dumps(redact(a), separators=(",", ":"), allow_nan=False) for a in args)
    return f"{fn}({body});\n"


def _stat_key(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _static(name: str) -> str:
    return resources.files("polyrl.report").joinpath("static", name).read_text()


def build_report(log_path: str | Path, force: bool = False) -> Path:
    """Create or refresh ``LOG_PATH/report`` and return the path of its ``index.html``."""
    root = Path(log_path)
    if not root.is_dir():
        raise FileNotFoundError(f"no run directory at {root}")
    out = root / "report"
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for tmp in (*out.glob(".*.tmp-*"), *data_dir.glob(".*.tmp-*")):  # left by a killed refresh
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > 600:
                tmp.unlink()
    manifest_path = data_dir / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    if force or manifest.get("format") != FORMAT:
        manifest = {"format": FORMAT, "steps": {}, "inputs": None}

    old_steps = manifest["steps"]
    steps = _refresh_steps(root / "trajectories", data_dir, old_steps)
    changed = steps != old_steps
    manifest["steps"] = steps

    static = {name: _static(name) for name in (*STATIC_FILES, "index.html")}
    inputs: dict[str, object] = {name: _stat_key(root / name)
              for name in ("metrics.jsonl", "checkpoints.jsonl", "config.json", "wandb.json", "sft.json",
                         "attempts.jsonl")}
    inputs["steps"] = _digest(sorted((name, s["v"]) for name, s in steps.items()))
    inputs["static"] = _digest(static)
    missing = not (data_dir / "index.js").exists() or not (out / "index.html").exists()
    if inputs != manifest.get("inputs") or missing:
        text = _js_call("polyrlIndex", build_index(root, steps))
        _write(data_dir / "index.js", text)
        version = _digest([text, inputs["static"]])[:10]  # new URLs, so a reload never mixes versions
        for name in STATIC_FILES:
            _write_if_changed(out / name, static[name])
        _write_if_changed(out / "index.html", static["index.html"].replace("{{version}}", version))
        manifest["inputs"] = inputs
        changed = True
    if changed:
        _write(manifest_path, json.dumps(manifest, separators=(",", ":")))
    return out / "index.html"


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj).encode()).hexdigest()


def _refresh_steps(traj_dir: Path, data_dir: Path, old_steps: dict[str, dict]) -> dict[str, dict]:
    """(Re)write ``data/step_NNNNNN.js`` for trajectory files that are new or changed (by mtime and
    size), delete those whose source is gone; returns the new manifest entries by source name."""
    steps: dict[str, dict] = {}
    entries = sorted(os.scandir(traj_dir), key=lambda e: e.name) if traj_dir.is_dir() else []
    for entry in entries:
        step = D.step_of(Path(entry.name))
        if step is None:
            continue
        st = entry.stat()
        src = [st.st_mtime_ns, st.st_size]
        target = f"step_{step:06d}.js"
        old = old_steps.get(entry.name)
        if old and old["src"] == src and (data_dir / target).exists():
            steps[entry.name] = old
            continue
        rows = [r for r in read_jsonl(Path(entry.path)) if isinstance(r, dict)]
        _write(data_dir / target, _js_call("polyrlStep", step, D.step_payload(step, rows)))
        steps[entry.name] = {"src": src, "step": step, "file": target, "v": _digest(src)[:8],
                             "envs": D.summarize_step(rows)}
    for name, old in old_steps.items():
        if name not in steps:
            (data_dir / old["file"]).unlink(missing_ok=True)
    return steps


def build_index(root: Path, steps: dict[str, dict]) -> dict:
    """Everything the page needs up front (trajectories themselves stay in the step files)."""
    config = D.read_config(root)
    rows = D.read_metrics(root)
    table = D.metric_table(rows)
    elapsed = D.elapsed_seconds(root, table)
    step_list = sorted(
        ({"step": s["step"], "v": s["v"], "envs": s["envs"]} for s in steps.values()), key=lambda s: s["step"]
    )
    sft = D.read_sft(root)
    kind = "sft" if D.is_sft_run(root, config) else "rl"
    if kind == "sft":
        envs: list[str] = []  # SFT's environments gave demonstrations, not episodes: no per-env curves
        head = summary.sft_headline(table, config, sft, elapsed)
        banners: list[dict] = []
        checkpoints = [{"name": config.get("save_name"), "batch": head["steps_done"], "final": True,
                        "state_path": sft.get("state_path"), "sampler_path": sft.get("sampler_path")}
                       ] if sft and sft.get("state_path") else []
    else:
        envs = D.env_names(config, table["series"], (e for s in step_list for e in s["envs"]))
        head = summary.headline(table, config, envs, elapsed)
        banners = summary.banners(table, config, envs)
        checkpoints = D.read_checkpoints(root)
    return {
        "run": {
            "name": root.resolve().name,
            "path": str(root.resolve()),
            "kind": kind,
            "finished": any(c.get("final") for c in checkpoints),
            "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
            "model": config.get("model_name"),
            "max_steps": config.get("max_steps"),
            "last_step": table["steps"][-1] if table["steps"] else None,
            "wandb": D.read_wandb(root),
        },
        "envs": envs,
        "headline": head,
        "banners": banners,
        "charts": D.chart_specs(table["series"], envs),
        "metrics": table,
        "steps": step_list,
        "checkpoints": checkpoints,
        "config": config,
        "config_diff": config_diff(config, _sft_schema() if kind == "sft" else None),
    }


def _sft_schema():
    from polyrl.sft import SFTConfig  # only for SFT runs: it brings the training client's imports

    return SFTConfig
