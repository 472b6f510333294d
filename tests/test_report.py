"""The run report: data extraction, incremental builds, `polyrl report`, the training hook, and the
page itself in headless Chromium (charts drawn, clicking through to an episode's turns)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from polyrl.report import build_report
from polyrl.report import data as D
from polyrl.report.synthetic import synthetic_episode, write_synthetic_run
from polyrl.tracking.files import RunFiles, step_file


def _js_payload(path: Path):
    """The arguments of the one call in a report data file, e.g. ``polyrlStep(3, {...});``."""
    m = re.fullmatch(r"(\w+)\((.*)\);\s*", path.read_text(), re.S)
    assert m, path
    return json.loads("[" + m.group(2) + "]")


def _index(run: Path) -> dict:
    return _js_payload(run / "report" / "data" / "index.js")[0]


# ---------------------------------------------------------------------------------------- extraction
def test_clean_number_rounds_and_drops_what_json_cannot_hold():
    assert D.clean_number(0.123456789) == 0.12346
    assert D.clean_number(3.0) == 3 and isinstance(D.clean_number(3.0), int)
    assert D.clean_number(True) == 1
    assert D.clean_number(float("nan")) is None and D.clean_number(float("inf")) is None
    assert D.clean_number("x") is None and D.clean_number(None) is None
    assert D.clean_number(-1.5e-7) == -1.5e-7


def test_metrics_one_row_per_step_torn_line_ignored_missing_keys_are_gaps(tmp_path):
    rows = [
        {"step": 0, "reward/mean": 0.1},
        {"step": 1, "reward/mean": 0.2, "optim/loss": float("nan")},
        {"step": 1, "reward/mean": 0.3, "optim/kl_sample_train_v1": 0.01},  # a re-run step: the last row wins
        {"step": 2, "reward/mean": 0.4, "note": "text"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    read = D.read_metrics(tmp_path)
    assert [r["step"] for r in read] == [0, 1, 2]
    table = D.metric_table(read)
    assert table["steps"] == [0, 1, 2]
    assert table["series"]["reward/mean"] == [0.1, 0.3, 0.4]
    assert table["series"]["optim/kl_sample_train_v1"] == [None, 0.01, None]
    assert "note" not in table["series"] and "optim/loss" not in table["series"]  # text / only NaN


def test_chart_specs_per_env_lines_eval_points_and_only_charts_with_data():
    keys = {
        "reward/mean",
        "env/calc/reward/mean",
        "env/guess/reward/mean",
        "success/mean",
        "env/calc/success/mean",
        "test/calc/reward",
        "test/calc/pass@1",
        "test/calc/pass@4",
        "test/pass@1",
        "optim/kl_sample_train_v1",
        "optim/entropy",
        "optim/loss",
        "optim/grad_norm",
        "env/calc/tool_calls",
        "env/calc/failed_rollouts",
        "rollouts/failed",
        "time/rollout",
        "time/total",
        "async/staleness_mean",
        "async/staleness_max",
        "env/calc/tokens/action_per_episode",
        "weird/thing",
    }
    envs = D.env_names({"environments": {"calc": {}}}, keys)
    assert envs == ["calc", "guess"]
    charts = {c["id"]: c for c in D.chart_specs(keys, envs)}
    reward = charts["reward"]["series"]
    assert [(s["key"], s["style"]) for s in reward] == [
        ("reward/mean", "line"),
        ("env/calc/reward/mean", "line"),
        ("env/guess/reward/mean", "line"),
        ("test/calc/reward", "points"),
    ]
    assert (
        reward[0]["color"] == -1 and reward[1]["color"] == reward[3]["color"] == 0 and reward[2]["color"] == 1
    )
    success = {s["key"]: s for s in charts["success"]["series"]}
    assert success["test/calc/pass@1"]["style"] == success["test/calc/pass@4"]["style"] == "points"
    assert success["test/calc/pass@4"]["label"] == "calc pass@4" and "test/pass@1" in success
    assert {"kl", "entropy", "loss", "grad_norm", "failed", "time", "action_tokens",
            "staleness"} <= set(charts)
    assert [s["label"] for s in charts["staleness"]["series"]] == ["mean", "max"]
    assert [s["label"] for s in charts["time"]["series"]] == ["waiting for rollouts", "total"]
    assert [s["key"] for s in charts["env-calc"]["series"]] == ["env/calc/tool_calls"]
    assert [s["key"] for s in charts["other-weird"]["series"]] == ["weird/thing"]
    assert "dropped" not in charts and "clip" not in charts and "stale" not in charts  # no data, no chart
    used = [s["key"] for c in charts.values() for s in c["series"]]
    assert sorted(used) == sorted(set(used)) and set(used) == keys  # every key drawn exactly once


def test_compact_episode_keeps_turns_and_sampled_logprobs_drops_token_ids():
    row = {
        "step": 3,
        "env": "calc",
        "group": 1,
        "task_index": 7,
        "reward": 1.0,
        "success": True,
        "advantages": [0.5, -0.25],
        "step_rewards": [0.0, 1.0],
        "num_turns": 2,
        "stop_reasons": ["tool_calls", "stop"],
        "error": None,
        "dropped": False,
        "metrics": {"tool_calls": 1.0},
        "duration_s": 1.23456,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"function": {"name": "calculator"}}],
        "tokens": [1, 2, 3, 4, 5, 6],
        "token_text": ["a", "b", "c", "d", "e", "f"],
        "logprobs": [0.0, -0.123456, -2.0, 0.0, -0.5, 0.0],
        "action_mask": [0, 1, 1, 0, 1, 0],
        "turn_spans": [[1, 3], [4, 5]],
        "sampler_step": 2,
    }
    ep = D.compact_episode(row, 9)
    assert ep["lag"] == 1 and D.compact_episode({**row, "sampler_step": None}, 0)["lag"] is None
    assert "tokens" not in ep and ep["text"] == row["token_text"]
    assert ep["lp"] == [0, -0.123, -2, 0, -0.5, 0]
    assert ep["mask"] == [[1, 3], [4, 5]] and ep["spans"] == [[1, 3], [4, 5]]
    assert (ep["i"], ep["env"], ep["group"], ep["task"], ep["adv"], ep["turns"]) == (
        9,
        "calc",
        1,
        7,
        [0.5, -0.25],
        2,
    )
    assert ep["dur"] == 1.23 and ep["messages"] == row["messages"]
    assert D.mask_runs([1, 1, 0, 1]) == [[0, 2], [3, 4]] and D.mask_runs([]) == []
    payload = D.step_payload(3, [row, {**row, "env": "abc", "group": 0}, {**row, "group": 0}])
    assert [(e["env"], e["group"], e["i"]) for e in payload["episodes"]] == [
        ("abc", 0, 1),
        ("calc", 0, 2),
        ("calc", 1, 0),
    ]
    assert payload["tools"]["calc"] == row["tools"]
    summary = D.summarize_step([row, {**row, "reward": 0.0, "success": False, "error": "boom", "group": 2}])
    assert summary == {"calc": {"n": 2, "g": 2, "r": 0.5, "s": 0.5, "f": 1}}


def test_config_is_redacted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-very-secret-123")
    (tmp_path / "config.json").write_text(
        json.dumps({"base_url": "http://x?key=tml-very-secret-123", "wandb_api_key": "abc", "max_tokens": 5})
    )
    assert D.read_config(tmp_path) == {
        "base_url": "http://x?key=***",
        "wandb_api_key": "***",
        "max_tokens": 5,
    }


# ---------------------------------------------------------------------------------------- building
def _mtimes(report: Path) -> dict[str, int]:
    return {str(p.relative_to(report)): p.stat().st_mtime_ns for p in report.rglob("*") if p.is_file()}


def test_build_writes_page_index_and_one_data_file_per_step_then_only_what_changed(tmp_path):
    run = write_synthetic_run(
        tmp_path / "run",
        steps=5,
        episodes_per_step=8,
        group_size=4,
        eval_every=2,
        save_every=2,
        think_words=5,
    )
    page = build_report(run)
    report = run / "report"
    assert page == report / "index.html" and page.exists()
    assert {"report.js", "report.css", "data/index.js"} <= set(_mtimes(report))
    assert "{{version}}" not in page.read_text()
    index = _index(run)
    assert index["metrics"]["steps"] == list(range(5))
    assert [s["step"] for s in index["steps"]] == list(range(5))
    assert index["envs"] == ["arithmetic", "calculator", "guess_number"]
    assert [c["name"] for c in index["checkpoints"]] == ["000002", "000004", "final"]
    assert index["run"]["max_steps"] == 5 and index["run"]["last_step"] == 4
    assert any(s["key"] == "test/calculator/pass@4" for c in index["charts"] for s in c["series"])
    step, payload = _js_payload(report / "data" / "step_000003.js")
    assert step == 3 and len(payload["episodes"]) == 8
    assert sum(e["n"] for e in index["steps"][3]["envs"].values()) == 8

    # nothing changed: nothing is rewritten
    before = _mtimes(report)
    time.sleep(0.01)
    build_report(run)
    assert _mtimes(report) == before

    # a run in progress: a new step, and a torn last metrics line
    rows = [synthetic_episode(5, "calculator", 0, 50, random.Random(0), 1.0, 0.5)]
    RunFiles(run).log_trajectories(5, rows)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "reward/mean": 1.0}) + "\n" + '{"step": 6, "rewa')
    build_report(run)
    after = _mtimes(report)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {"data/step_000005.js", "data/index.js", "data/manifest.json", "index.html"}
    assert _index(run)["metrics"]["steps"] == list(range(6))


def test_resumed_run_drops_and_rewrites_truncated_steps(tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=4, episodes_per_step=4, think_words=3)
    build_report(run)
    files = RunFiles(run)
    files.truncate_from(2)  # what a resume from the step-2 checkpoint does
    build_report(run)
    data = run / "report" / "data"
    assert not (data / "step_000002.js").exists() and not (data / "step_000003.js").exists()
    assert [s["step"] for s in _index(run)["steps"]] == [0, 1]
    rows = [synthetic_episode(2, "guess_number", 0, 9, random.Random(1), 0.0, -1.0)]
    files.log_trajectories(2, rows)
    build_report(run)
    _, payload = _js_payload(data / "step_000002.js")
    assert [e["env"] for e in payload["episodes"]] == ["guess_number"]


def test_refresh_of_a_1000_step_run_is_cheap_when_nothing_changed(tmp_path):
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    row = synthetic_episode(0, "calculator", 0, 0, random.Random(0), 1.0, 0.0, think_words=2)
    line = json.dumps(row) + "\n"
    metrics = {
        f"env/{e}/{k}": 0.5 for e in ("a", "b", "c") for k in ("reward/mean", "success/mean", "turns/mean")
    }
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1000):
            (run / "trajectories" / step_file(step)).write_text(line)
            f.write(json.dumps({"step": step, "reward/mean": step / 1000, **metrics}) + "\n")
    build_report(run)
    t0 = time.perf_counter()
    build_report(run)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"no-change refresh took {elapsed:.3f}s"
    assert len(_index(run)["steps"]) == 1000


def test_refresh_during_training_never_raises(tmp_path):
    from polyrl.report import refresh_for_training

    class Console:
        def __init__(self):
            self.lines: list[str] = []

        def info(self, text):
            self.lines.append(text)

    console = Console()
    assert refresh_for_training(tmp_path / "missing", console) is None
    assert console.lines[-1].startswith("report not refreshed: FileNotFoundError")
    run = write_synthetic_run(tmp_path / "run", steps=1, episodes_per_step=4, think_words=3)
    assert refresh_for_training(run, console) == run / "report" / "index.html"
    assert console.lines[-1] == f"report: {run / 'report' / 'index.html'}"


def test_cli_report(tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=2, episodes_per_step=4, think_words=3)
    out = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "report", str(run)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(run / "report" / "index.html")
    out = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "no run directory" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------- browser
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1800"]


def _ensure_chromium() -> None:
    """Debian's chromium + chromium-driver, installed here when missing (as root); skip otherwise."""
    why = "not root or no apt-get"
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
            for cmd in (["apt-get", "update", "-q"], install):
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
                why = f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[-300:]}"
        if not (shutil.which("chromium") and shutil.which("chromedriver")):
            pytest.skip(f"headless Chromium (Debian packages chromium, chromium-driver) is missing and "
                        f"could not be installed: {why}")
    pytest.importorskip("selenium", reason="the browser test drives Chromium with selenium: "
                                           "pip install selenium")


@contextlib.contextmanager
def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never download anything
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with tempfile.TemporaryDirectory() as profile:
        for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def _wait(driver, script: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {script}")


def _select(driver, select_id: str, value) -> None:
    driver.execute_script(
        "const s = document.getElementById(arguments[0]); s.value = String(arguments[1]);"
        "s.dispatchEvent(new Event('change'));",
        select_id,
        value,
    )


def _check_charts(driver, required: set[str]) -> None:
    _wait(driver, "return document.body.dataset.ready === 'charts'")
    lines = driver.execute_script(
        "return [...document.querySelectorAll('svg.plot path.series-line')]"
        ".map(p => [p.dataset.key, +p.dataset.points, p.getAttribute('d')])"
    )
    keys = {k for k, _, _ in lines}
    assert required <= keys, keys
    for key, n, d in lines:
        assert n >= 1 and d.startswith("M") and d.count("L") == n - 1, (key, n, d[:80])
    reward = next(d for k, _, d in lines if k == "reward/mean")
    assert reward.count("L") >= 2  # several steps drawn
    titles = driver.execute_script(
        "return [...document.querySelectorAll('.chart h3')].map(h => h.textContent)"
    )
    assert {"Reward", "Turns per episode", "Failing rollouts", "Time per phase (s)"} <= set(titles), titles


def _open_episode(driver, step: int, env: str) -> list[str]:
    _select(driver, "step-select", step)
    _wait(driver, f"return document.getElementById('step-select').value === '{step}'")
    _select(driver, "env-select", env)
    _wait(driver, "return document.querySelectorAll('#groups .ep-card').length")
    driver.find_element("css selector", "#groups .ep-card").click()
    _wait(driver, "return document.querySelectorAll('#episode .msg').length")
    return driver.execute_script(
        "return [...document.querySelectorAll('#episode .msg')].map(m => m.dataset.role)"
    )


@pytest.mark.slow
def test_report_from_a_real_training_run_in_headless_chromium(small_model_dir, tmp_path):
    from polyrl.config.schema import TrainConfig
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    _ensure_chromium()

    class Recording(ConsoleLog):
        def __init__(self):
            super().__init__(enabled=False)
            self.lines: list[str] = []

        def info(self, text: str) -> None:
            self.lines.append(text)

    console = Recording()
    cfg = TrainConfig(
        model_name=small_model_dir,
        lora_rank=4,
        batch_size=3,
        max_steps=4,
        max_tokens=6,
        save_every=2,
        eval_every=2,
        eval_num_samples=2,
        log_path=str(tmp_path / "run"),
        local={"store_dir": str(tmp_path / "store")},
        environments={
            "arithmetic": {"num_rollouts": 2, "splits": {"test": {"num_samples": 2}}},
            "calculator": {"num_rollouts": 2, "max_turns": 2},
            "guess_number": {"num_rollouts": 2, "max_turns": 2},
        },
    )
    train(cfg, console)
    run = tmp_path / "run"
    page = run / "report" / "index.html"
    assert (
        f"report: {page}" in console.lines
    )  # refreshed at the step-2 checkpoint and at the end, path printed
    assert sum(line.startswith("report: ") for line in console.lines) >= 2
    index = _index(run)
    assert [s["step"] for s in index["steps"]] == [0, 1, 2, 3]
    assert any(s["key"].startswith("test/arithmetic/pass@") for c in index["charts"] for s in c["series"])
    # the config as written by the run: exactly what this test set differs from the defaults
    assert {d["path"] for d in index["config_diff"]} == {
        "model_name", "lora_rank", "batch_size", "max_steps", "max_tokens", "save_every", "eval_every",
        "eval_num_samples", "log_path", "local.store_dir", "environments.arithmetic.num_rollouts",
        "environments.arithmetic.splits.test.num_samples", "environments.calculator.num_rollouts",
        "environments.calculator.max_turns", "environments.guess_number.num_rollouts",
        "environments.guess_number.max_turns"}
    headline = index["headline"]
    assert headline["steps_done"] == 4 and headline["wall_kind"] == "elapsed"  # real time, not the steps
    assert headline["wall_s"] >= 0.999 * sum(t or 0 for t in index["metrics"]["series"]["time/total"])
    defs = {r["env"]: r["success_def"] for r in headline["rows"]}
    assert defs["arithmetic"] == defs["calculator"] == "success = the environment's verdict"  # `success`
    assert [r["env"] for r in headline["rows"]] == [None, "arithmetic", "calculator", "guess_number"]
    # evaluated before training (the row of step -1) and after steps 1 and 3
    assert all((r["held_out"]["first_step"], r["held_out"]["last_step"]) == (-1, 3) for r in headline["rows"])

    # a copy of the run with a synthetic multi-turn tool episode (tiny random models rarely call tools)
    tools_run = tmp_path / "tools_run"
    shutil.copytree(run, tools_run)
    rng = random.Random(0)
    traj = tools_run / "trajectories" / step_file(3)
    rows = [json.loads(x) for x in traj.read_text().splitlines()]
    rows += [
        synthetic_episode(3, "calculator", 90, 5, rng, r, a, tool_turns=2, think_words=12)
        for r, a in ((1.0, 0.5), (0.0, -0.5))
    ]
    traj.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_report(tools_run)

    with _browser() as driver:
        driver.get(page.as_uri())
        _check_charts(
            driver,
            {"reward/mean", "success/mean", "turns/mean", "time/total", "env/guess_number/reward/mean"},
        )
        roles = _open_episode(driver, 1, "guess_number")
        assert roles[0] == "user" and 1 <= roles.count("assistant") <= 2, roles  # multi-turn: max_turns=2
        assert driver.execute_script("return location.hash").startswith("#step=1&env=guess_number&ep=")

        driver.get((tools_run / "report" / "index.html").as_uri())
        _check_charts(driver, {"reward/mean", "time/total"})
        _select(driver, "smooth-select", "0.6")  # smoothed lines over faint raw ones
        _wait(driver, "return document.querySelectorAll('svg.plot path.series-raw').length")
        _check_charts(driver, {"reward/mean", "time/total"})
        _select(driver, "step-select", 3)
        _select(driver, "env-select", "calculator")
        _wait(driver, "return document.querySelector('#groups [data-group=\"90\"] .ep-card')")
        driver.find_element("css selector", '#groups [data-group="90"] .ep-card').click()
        _wait(driver, "return document.querySelectorAll('#episode .msg-tool').length")
        roles = driver.execute_script(
            "return [...document.querySelectorAll('#episode .msg')].map(m => m.dataset.role)"
        )
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"], roles
        calls = driver.execute_script(
            "return [...document.querySelectorAll('#episode .tool-call')].map(c => c.textContent)"
        )
        assert len(calls) == 2 and all("calculator" in c and "expression" in c for c in calls), calls
        tool_head = driver.find_element("css selector", "#episode .msg-tool .msg-head").text
        assert "result of calculator" in tool_head, tool_head
        driver.find_element("css selector", '#episode [data-tab="tokens"]').click()
        shaded = driver.execute_script(
            "return [...document.querySelectorAll('#episode .tokens .tok')].map(t => t.style.background)"
        )
        assert shaded and all(s.startswith("rgba(37, 99, 235") for s in shaded), shaded[
            :3
        ]  # advantage > 0: blue
        _select(driver, "shade-select", "lp")
        shaded = driver.execute_script(
            "return [...document.querySelectorAll('#episode .tokens .tok')].map(t => t.style.background)"
        )
        assert shaded and all(s.startswith("rgba(234, 88, 12") for s in shaded), shaded[:3]
        assert not driver.execute_script("return document.querySelector('#episode .tokens').hidden")
        driver.execute_script("document.getElementById('trajectories').scrollIntoView()")
        driver.save_screenshot(str(tmp_path / "report_tokens.png"))
        driver.find_element("css selector", '#episode [data-tab="turns"]').click()
        assert driver.execute_script("return document.querySelector('#episode .tokens').hidden")
        shot = tmp_path / "report.png"
        driver.save_screenshot(str(shot))
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors
    assert shot.stat().st_size > 10_000
    print(f"screenshots: {shot}, {tmp_path / 'report_tokens.png'}")


# ---------------------------------------------------------------------------------------- W&B link
def test_the_report_links_the_wandb_run(tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=2, episodes_per_step=2, think_words=3)
    build_report(run)
    assert _index(run)["run"]["wandb"] is None  # no W&B run, no link
    url = "https://wandb.ai/team/polyrl/runs/abc123"
    (run / "wandb.json").write_text(json.dumps({"id": "abc123", "project": "polyrl", "name": "sweep-1",
                                                "url": url, "offline": False}))
    build_report(run)  # a new wandb.json alone refreshes the index
    assert _index(run)["run"]["wandb"] == {"id": "abc123", "project": "polyrl", "name": "sweep-1", "url": url,
                                           "offline": False, "dir": None}
    (run / "wandb.json").write_text(json.dumps({"id": "abc123", "url": "javascript:alert(1)"}))
    build_report(run)
    assert _index(run)["run"]["wandb"]["url"] is None  # only https links are made links

    _ensure_chromium()
    offline = tmp_path / "offline"
    shutil.copytree(run, offline)
    record = {"id": "xyz9", "project": "polyrl", "name": "local", "url": None, "offline": True,
              "dir": "/runs/wandb/offline-run-xyz9"}
    (offline / "wandb.json").write_text(json.dumps(record))
    build_report(offline)
    record = {"id": "abc123", "project": "polyrl", "name": "sweep-1", "url": url}
    (run / "wandb.json").write_text(json.dumps(record))
    build_report(run)
    with _browser() as driver:
        driver.get((run / "report" / "index.html").as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        link = driver.find_element("css selector", "#run-meta a#wandb-link")
        assert link.get_attribute("href") == url and link.text == "W&B polyrl/sweep-1"
        driver.get((offline / "report" / "index.html").as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        assert not driver.find_elements("css selector", "#run-meta a#wandb-link")
        note = driver.find_element("css selector", "#run-meta span#wandb-link")
        assert note.text == "W&B polyrl/local (offline run xyz9)"
        assert note.get_attribute("title") == "upload with: wandb sync /runs/wandb/offline-run-xyz9"


# ---------------------------------------------------------------------------------------- images
def test_the_trajectory_browser_shows_images_in_place(tmp_path, vl_tokenizer):
    """An episode of the visual environment, played through the rollout code and logged as training
    logs it (each image stored once under images/, referenced from the row): the browser shows the
    picture in its message and in place of its tokens, loaded from the stored file."""
    import asyncio

    from test_vision import ReplySampler

    from polyrl.envs.builtin.visual import VisualBuilder
    from polyrl.renderers import get_renderer
    from polyrl.rl.episode import Episode, RolloutSettings, run_episode
    from polyrl.rl.step_metrics import episode_row

    run = write_synthetic_run(tmp_path / "run", steps=2, episodes_per_step=2, think_words=3)
    builder = VisualBuilder({}, seed=0)
    renderer = get_renderer("qwen3_vl_instruct", vl_tokenizer)
    settings = RolloutSettings(max_turns=1, max_tokens=8, temperature=1.0, timeout=60)
    episodes = []
    for group, reply in enumerate([f"\\boxed{{{builder.task('train', 0).answer}}}", "\\boxed{white}"]):
        ep = Episode("visual", "train", 0, group)
        episodes.append(asyncio.run(run_episode(builder.make("train", 0), ep, renderer,
                                                ReplySampler(vl_tokenizer, [reply]), settings)))
    files = RunFiles(run)
    traj = run / "trajectories" / step_file(1)
    rows = [json.loads(x) for x in traj.read_text().splitlines()]
    for ep in episodes:
        files.save_images(ep.image_files)
    rows += [episode_row(1, ep, vl_tokenizer, dropped=False) for ep in episodes]
    traj.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_report(run)
    assert len(list((run / "images").iterdir())) == 1  # one picture, two episodes

    _ensure_chromium()
    with _browser() as driver:
        driver.get((run / "report" / "index.html").as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        roles = _open_episode(driver, 1, "visual")
        assert roles == ["user", "assistant"], roles
        loaded = _wait(driver, "const i = document.querySelector('#episode .msg-user figure.image img');"
                               "return i && i.complete && i.naturalWidth "
                               "? [i.naturalWidth, i.naturalHeight] : null")
        assert loaded == [64, 64]
        caption = driver.find_element("css selector", "#episode .msg-user figure.image figcaption").text
        assert caption == "64 × 64"
        driver.find_element("css selector", '#episode [data-tab="tokens"]').click()
        in_tokens = _wait(driver, "const i = document.querySelector('#episode .tokens figure.image img');"
                                  "return i && i.complete && i.naturalWidth ? i.title : null")
        assert in_tokens == episodes[0].images[0].name
        text = driver.find_element("css selector", "#episode .tokens").text
        assert "4 tokens" in text and "<|image_pad|>" not in text and "<|vision_start|>" in text
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors


# ---------------------------------------------------------------------------------------- first screen
from polyrl.report import summary as S  # noqa: E402
from polyrl.report.config_diff import config_diff  # noqa: E402


def _table(rows: list[dict]) -> dict:
    return D.metric_table(rows)


def test_headline_start_end_means_held_out_first_last_and_wall_time_by_hand():
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.9]
    rows = []
    for step, r in enumerate(rewards):
        row = {"step": step, "reward/mean": r, "success/mean": float(r >= 0.5), "time/total": 10.0 + step,
               "env/a/reward/mean": r, "env/b/reward/mean": 1 - r, "env/a/stop/length_frac": 0.25,
               "env/c/reward/mean": r, "env/c/success": float(r > 0.5)}  # c's episodes give a verdict
        if step in (3, 7, 11):  # evaluations after steps 3, 7 and 11 (env a only has a test split)
            row.update({"test/a/pass@1": step / 20, "test/a/reward": step / 10, "test/pass@1": step / 20})
        rows.append(row)
    config = {"max_steps": 20, "eval_every": 4,
              "environments": {"a": {"success_threshold": 0.5}, "b": {}, "c": {}}}
    h = S.headline(_table(rows), config, ["a", "b", "c"])
    assert (h["steps_done"], h["max_steps"], h["wall_s"], h["wall_kind"], h["eval_note"]) == \
        (12, 20, 186, "steps", None)
    overall, a, b, c = h["rows"]
    assert [r["env"] for r in h["rows"]] == [None, "a", "b", "c"]
    # the first five steps (0-4) and the last five (7-11)
    assert overall["reward"] == {"start": 0.2, "start_steps": [0, 4], "end": 0.86, "end_steps": [7, 11],
                                 "points": 12}
    assert overall["success"]["start"] == 0 and overall["success"]["end"] == 1
    assert b["reward"]["start"] == 0.8 and b["reward"]["end"] == 0.14
    assert overall["held_out"] == {"first": 0.15, "first_step": 3, "last": 0.55, "last_step": 11, "points": 3}
    assert a["held_out"]["last"] == 0.55 and a["held_out_metric"] == "pass@1"
    assert a["held_out_reward"] == {"first": 0.3, "first_step": 3, "last": 1.1, "last_step": 11, "points": 3}
    assert b["held_out"] is None and b["held_out_reward"] is None  # missing, not 0
    assert b["success"] is None and a["truncated"]["end"] == 0.25
    # what decided success: the threshold, else the environment's verdict where its episodes gave one
    assert a["success_def"] == "success = reward ≥ 0.5 (success_threshold)"
    assert b["success_def"] == "success = reward ≥ 1 (full marks)"  # b's episodes never gave a verdict
    assert c["success_def"] == "success = the environment's verdict"
    assert S.success_definition(None, None) == "success = the environment's verdict (else reward ≥ 1)"
    assert S.headline(_table([]), config, ["b"])["rows"][0]["success_def"] == S.success_definition(None)
    # the run's real time when the files tell it (never less than the time in steps)
    assert S.headline(_table(rows), config, ["a"], elapsed_s=250.0)["wall_s"] == 250
    assert S.wall_time(_table(rows), 250.0) == {"wall_s": 250, "wall_kind": "elapsed"}
    assert S.wall_time(_table(rows), 100.0) == {"wall_s": 186, "wall_kind": "steps"}  # copied files

    # a short run without evaluation: one step averaged at each end, and the missing eval said plainly
    h = S.headline(_table(rows[:3]), {"eval_every": 0, "environments": {"a": {}}}, ["a"])
    assert [r["env"] for r in h["rows"]] == ["a"]
    assert h["rows"][0]["reward"]["start_steps"] == [0, 0] and h["rows"][0]["reward"]["end_steps"] == [2, 2]
    assert h["rows"][0]["held_out"] is None
    assert h["eval_note"].startswith("no held-out evaluation: eval_every")
    assert S.headline(_table([]), {}, [])["steps_done"] == 0


def test_headline_of_a_synthetic_run_matches_its_trajectories(tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=8, episodes_per_step=12, group_size=4, eval_every=4,
                              think_words=3)
    build_report(run)
    index = _index(run)
    per_step = []
    for step in range(8):
        rows = [json.loads(x) for x in (run / "trajectories" / step_file(step)).read_text().splitlines()]
        per_step.append(sum(r["reward"] for r in rows) / len(rows))
    overall = index["headline"]["rows"][0]
    assert overall["reward"]["start_steps"] == [0, 3] and overall["reward"]["end_steps"] == [4, 7]
    assert overall["reward"]["start"] == pytest.approx(sum(per_step[:4]) / 4, abs=1e-4)
    assert overall["reward"]["end"] == pytest.approx(sum(per_step[4:]) / 4, abs=1e-4)
    assert overall["held_out"]["first_step"] == 3 and overall["held_out"]["last_step"] == 7
    assert index["headline"]["steps_done"] == 8 and index["banners"] == []  # a healthy run: no banner


def test_wall_time_is_the_real_time_from_the_run_files(tmp_path):
    rows = [{"step": s, "time/total": 2.0} for s in range(6)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "checkpoints.jsonl").write_text('{"name": "final", "final": true}\n')
    table = D.metric_table(D.read_metrics(run))
    os.utime(run / "config.json", (1000, 1000))  # the launch: start-up, then six steps of 2 s
    os.utime(run / "metrics.jsonl", (1030, 1030))
    os.utime(run / "checkpoints.jsonl", (1035, 1035))  # the final checkpoint, saved after the last step
    assert D.elapsed_seconds(run, table) == 35
    # resumed at step 4: the earlier launch counts its steps' time (4 × 2 s), not the pause between
    (run / "attempts.jsonl").write_text('{"step": 0}\n{"step": 4}\n')
    assert D.elapsed_seconds(run, table) == 35 + 8
    # a relaunch that has logged nothing yet (config.json newer than everything): the times cannot tell
    os.utime(run / "config.json", (2000, 2000))
    assert D.elapsed_seconds(run, table) is None
    assert S.headline(table, {}, ["a"], D.elapsed_seconds(run, table))["wall_kind"] == "steps"
    # through the report
    os.utime(run / "config.json", (1000, 1000))
    build_report(run)
    assert (_index(run)["headline"]["wall_s"], _index(run)["headline"]["wall_kind"]) == (43, "elapsed")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_report_of_an_sft_run(tmp_path, tiny_model_dir):
    from polyrl.config.files import load_config
    from polyrl.sft import SFTConfig, sft
    from polyrl.tracking.console import ConsoleLog

    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                     {"role": "assistant", "content": w.upper()}]}) + "\n"
                            for w in ("one", "two", "three")))
    run = tmp_path / "sft"
    config = load_config(None, [
        f"model_name={tiny_model_dir}", f"data={data}", "lora_rank=4", "max_steps=6", "batch_size=4",
        "learning_rate=1e-2", f"log_path={run}", f"local.store_dir={tmp_path / 'store'}",
        "environments.arithmetic.splits.train.num_samples=2"], model=SFTConfig)
    state_path = sft(config, ConsoleLog(enabled=False))
    assert json.loads((run / "sft.json").read_text())["sources"] == [
        {"data": str(data), "conversations": 3}, {"environment": "arithmetic", "demonstrations": 2}]
    page = build_report(run)
    index = _index(run)
    losses = [json.loads(x)["optim/loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    head = index["headline"]
    assert index["run"]["kind"] == "sft" and index["run"]["finished"] is True
    assert head["kind"] == "sft" and (head["steps_done"], head["max_steps"]) == (6, 6)
    assert head["loss"]["start"] == pytest.approx(sum(losses[:3]) / 3, rel=1e-3)
    assert head["loss"]["end"] == pytest.approx(sum(losses[3:]) / 3, rel=1e-3)
    assert head["wall_kind"] == "elapsed"
    assert index["banners"] == [] and index["envs"] == [] and "rows" not in head
    sampler_path = json.loads((run / "sft.json").read_text())["sampler_path"]
    assert index["checkpoints"] == [{"name": "sft", "batch": 6, "final": True, "state_path": state_path,
                                     "sampler_path": sampler_path}]
    # the difference from SFT's own defaults (its learning_rate default is not train's)
    assert {d["path"] for d in index["config_diff"]} == {
        "model_name", "data", "lora_rank", "max_steps", "batch_size", "learning_rate", "log_path",
        "local.store_dir", "environments.arithmetic.splits.train.num_samples"}

    # the same run before it finished (no sft.json yet): an SFT run in progress, its sources from the config
    going = tmp_path / "going"
    shutil.copytree(run, going, ignore=shutil.ignore_patterns("report", "sft.json"))
    build_report(going)
    assert (_index(going)["run"]["kind"], _index(going)["run"]["finished"]) == ("sft", False)
    assert _index(going)["headline"]["sources"] == [
        {"data": str(data), "conversations": None}, {"environment": "arithmetic", "demonstrations": 2}]

    _ensure_chromium()
    with _browser() as driver:
        driver.set_window_size(1280, 900)
        driver.get(page.as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        assert driver.find_element("css selector", "#run-badge").text == "finished"
        text = driver.find_element("css selector", "#headline").text
        assert "supervised fine-tuning" in text and "loss per token" in text and "wall time" in text
        assert f"data file {data} · 3 conversations" in text
        assert "environment arithmetic · 2 demonstrations" in text
        assert "no data" not in text and "not evaluated" not in text
        shown = driver.execute_script(
            "return [document.getElementById('trajectories').offsetHeight, "
            "document.querySelector('nav a[href=\"#trajectories\"]').offsetHeight, "
            "[...document.querySelectorAll('.chart')].map(c => c.dataset.chart)]")
        assert shown[:2] == [0, 0] and "loss" in shown[2]  # no episodes to browse; the loss curve drawn
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors


def test_first_screen_fits_1280_px_in_headless_chromium(tmp_path):
    from polyrl.report.screenshot import readme_run

    page = build_report(readme_run(tmp_path / "demo"))  # three environments, held-out scores, a banner
    _ensure_chromium()
    with _browser() as driver:
        driver.set_window_size(1280, 900)
        driver.get(page.as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        box = driver.execute_script("""
            const t = document.querySelector('#headline table').getBoundingClientRect();
            const h = document.getElementById('headline'), c = document.querySelector('#headline thead tr');
            return {right: t.right, bottom: t.bottom, width: document.documentElement.clientWidth,
                    height: innerHeight, box: h.getBoundingClientRect().right,
                    scroll: h.scrollWidth - h.clientWidth,
                    last: c.lastElementChild.getBoundingClientRect().right};""")
        assert box["right"] <= box["width"] and box["last"] <= box["box"], box  # the last column in view
        assert box["scroll"] <= 0 and box["bottom"] <= box["height"], box  # no sideways scrolling
        defs = driver.execute_script(
            "return [...document.querySelectorAll('#headline .def')].map(d => d.textContent)")
        assert defs == ["success = the environment's verdict", "success = reward ≥ 0.5 (success_threshold)",
                        "success = reward ≥ 1 (full marks)"]  # arithmetic, calculator, guess_number
        assert driver.find_element("css selector", "#wall-time").text.startswith("wall time ")


def _kinds(banners: list[dict]) -> list[tuple[str, str]]:
    return [(b["kind"], b["level"]) for b in banners]


def test_banners_for_runs_that_stopped_learning_and_none_for_a_healthy_one(tmp_path):
    envs = ["calculator", "guess_number", "arithmetic"]

    def banners_of(name: str, **kw) -> list[dict]:
        run = write_synthetic_run(tmp_path / name, steps=10, episodes_per_step=24, think_words=2, **kw)
        return S.banners(D.metric_table(D.read_metrics(run)), D.read_config(run), sorted(envs))

    assert banners_of("healthy") == []
    assert banners_of("some_long", truncated={"calculator": 0.2}) == []  # a few cut answers: no banner

    stalled = banners_of("stalled", learning=False)
    assert _kinds(stalled) == [("no_update", "bad")]
    assert stalled[0]["what"].startswith("Every step left the weights unchanged: 10 steps had no learning")
    assert "num_rollouts" in stalled[0]["try"]

    cut = banners_of("cut", truncated={e: 1.0 for e in envs})
    assert _kinds(cut) == [("truncation", "warn")]
    assert cut[0]["title"] == "Every episode of arithmetic, calculator, guess_number was cut at max_tokens"
    assert "calculator: 100% in the last 5 steps (100% over the run; max_tokens 512)" in cut[0]["what"]

    # updates refused as non-finite (limits.nonfinite_steps: skip): one step of twelve, then all of them
    rows = [{"step": s, "reward/mean": 0.5, "optim/datums": 8.0, "rollouts/dropped_groups": 0.0}
            for s in range(12)]
    rows[5]["optim/nonfinite_skipped"] = 1.0
    refused = S.banners(_table(rows), {}, ["a"])
    assert _kinds(refused) == [("nonfinite", "warn")] and "first: step 5" in refused[0]["what"]
    every = S.banners(_table([{**r, "optim/nonfinite_skipped": 1.0} for r in rows]), {}, ["a"])
    assert _kinds(every) == [("no_update", "bad")] and "12 steps had a non-finite update" in every[0]["what"]
    # groups dropped over their failure budget in 3 of 12 steps: a warning naming that cause
    failed = [{**r, "optim/datums": 0.0, "rollouts/dropped_groups": 2.0} if r["step"] < 3 else r
              for r in rows[:5] + [{**rows[5], "optim/nonfinite_skipped": 0.0}] + rows[6:]]
    warned = S.banners(_table(failed), {}, ["a"])
    assert _kinds(warned) == [("no_update", "warn")] and warned[0]["title"] == "3 of 12 steps made no update"
    assert "3 steps dropped their groups over the failure budget" in warned[0]["what"]


def test_config_diff_lists_exactly_the_changed_settings(tmp_path, monkeypatch):
    from polyrl.config.schema import TrainConfig

    cfg = TrainConfig(
        model_name="some/model", learning_rate=3e-5, optimizer={"grad_clip_norm": 1.0},
        kl={"penalty_coef": 0.1}, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8},
        environments={"arithmetic": {"num_rollouts": 2, "splits": {"test": None}}, "calculator": {},
                      "calc2": {"type": "calculator", "max_turns": 3}},
    )
    assert config_diff(cfg.dump()) == [
        {"path": "model_name", "value": "some/model"},
        {"path": "loss_fn", "value": "ppo", "default": "importance_sampling"},
        {"path": "loss_fn_config.clip_low_threshold", "value": 0.8},
        {"path": "kl.penalty_coef", "value": 0.1},
        {"path": "learning_rate", "value": 3e-5, "default": 1e-4},
        {"path": "optimizer.grad_clip_norm", "value": 1.0, "default": 0.0},
        {"path": "environments.arithmetic.splits.test", "value": None,
         "default": {"shuffle": False, "num_samples": 32, "seed": None}},
        {"path": "environments.arithmetic.num_rollouts", "value": 2, "default": 8},
        {"path": "environments.calculator", "value": {}},
        {"path": "environments.calc2.type", "value": "calculator", "default": "calc2"},
        {"path": "environments.calc2.max_turns", "value": 3, "default": 8},
    ]
    # an older release's flat key lands where the schema has it now; an unknown key is listed as set
    assert config_diff({"model_name": "m", "grad_clip_norm": 2.0, "kl_penalty_coef": 0, "odd": 1}) == [
        {"path": "model_name", "value": "m"}, {"path": "odd", "value": 1},
        {"path": "optimizer.grad_clip_norm", "value": 2.0, "default": 0.0}]

    # through the report: secrets stay redacted in the difference too
    monkeypatch.setenv("TINKER_API_KEY", "tml-very-secret-123")
    run = write_synthetic_run(tmp_path / "run", steps=1, episodes_per_step=4, think_words=2)
    config = json.loads((run / "config.json").read_text())
    config["base_url"] = "http://x?key=tml-very-secret-123"
    (run / "config.json").write_text(json.dumps(config))
    build_report(run)
    assert "very-secret" not in (run / "report" / "data" / "index.js").read_text()
    assert {"path": "base_url", "value": "http://x?key=***", "default": None} in _index(run)["config_diff"]


def test_first_screen_of_a_run_that_made_no_update_in_headless_chromium(tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=6, episodes_per_step=8, think_words=2, learning=False,
                              env_config={"calculator": {"success_threshold": 0.5}})
    page = build_report(run)
    _ensure_chromium()
    with _browser() as driver:
        driver.set_window_size(1280, 900)
        driver.get(page.as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        seen = driver.execute_script("""
            const h = innerHeight, shown = (q) => { const e = document.querySelector(q);
              if (!e) return null; const r = e.getBoundingClientRect();
              return r.height > 0 && r.top >= 0 && r.bottom <= h; };
            return {banner: shown('#banners .banner.bad[data-kind="no_update"]'),
                    headline: shown('#headline table'), diff: shown('#config-diff table'),
                    badge: document.getElementById('run-badge').className};""")
        assert seen == {"banner": True, "headline": True, "diff": True, "badge": "badge bad"}, seen
        assert driver.find_element("css selector", "#run-badge").text == "finished · no update"
        banner = driver.find_element("css selector", "#banners .banner.bad").text
        assert "No step made an update" in banner and "Try to give the groups different rewards" in banner
        cells = driver.execute_script(
            "return [...document.querySelectorAll('#headline tbody tr')].map(r => [r.dataset.env, "
            "r.querySelector('[data-metric=reward]').textContent, r.querySelector('[data-metric=held_out]')"
            ".textContent, r.cells[0].textContent])")
        assert [c[0] for c in cells] == ["all", "arithmetic", "calculator", "guess_number"]
        assert all("→" in c[1] and c[2] == "not evaluated" for c in cells), cells
        assert cells[2][3] == "calculatorsuccess = reward ≥ 0.5 (success_threshold)"
        assert "eval_every is 0" in driver.find_element("css selector", "#headline .foot").text
        assert not driver.find_element("css selector", "#config-full").get_attribute("open")
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors


def test_screenshot_script_renders_a_report_png(tmp_path):
    _ensure_chromium()
    run = write_synthetic_run(tmp_path / "run", steps=3, episodes_per_step=4, think_words=2)
    out = tmp_path / "shot.png"
    done = subprocess.run([sys.executable, "-m", "polyrl.report.screenshot", str(out), "--run", str(run)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    head = out.read_bytes()[:24]
    size = (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big"))
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and size == (1280, 900)
    assert (run / "report" / "index.html").exists()  # built on the way
    done = subprocess.run([sys.executable, "-m", "polyrl.report.screenshot", str(out), "--run",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=180)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: --run '{tmp_path / 'nope'}': no run directory there"
