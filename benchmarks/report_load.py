"""How fast the run report loads for a large run: 1,000 steps, 100,000 episodes (multi-turn tool
episodes of ~250-400 tokens each).

Writes a synthetic run, builds the report (first build, a no-change refresh, a one-step refresh),
then loads the page in headless Chromium and measures time to interactive (navigation start until
the charts are drawn, ``window.polyrlReady``) and the time to open a step's trajectories. The peer,
measured in the same browser, is a trivial static page drawing one SVG line from a script. The last
line is the ratio report / peer and the report's absolute load time; the bar is < 2 s.

    python benchmarks/report_load.py [--steps 1000] [--episodes 100] [--keep DIR]

Needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver) and selenium.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from polyrl.report import build_report
from polyrl.report.synthetic import write_synthetic_run

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
]

PEER = """<!doctype html><html><head><meta charset="utf-8"><title>peer</title></head><body>
<svg id="s" viewBox="0 0 480 210" width="480" height="210"></svg>
<script>
const pts = Array.from({length: 1000}, (_, i) => [i * 0.47, 105 + 80 * Math.sin(i / 50)]);
const p = document.createElementNS("http://www.w3.org/2000/svg", "path");
p.setAttribute("d", "M" + pts.map(q => q[0].toFixed(1) + " " + q[1].toFixed(1)).join("L"));
p.setAttribute("fill", "none"); p.setAttribute("stroke", "#1f77b4");
document.getElementById("s").append(p);
window.polyrlReady = performance.now();
</script></body></html>
"""


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def driver_for(profile: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    return webdriver.Chrome(
        service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options
    )


def time_to_ready(driver, url: str, timeout: float = 60.0) -> float:
    """Milliseconds from navigation start until the page set ``window.polyrlReady``."""
    driver.get("about:blank")
    driver.get(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = driver.execute_script("return window.polyrlReady")
        if ready:
            return float(ready)
        time.sleep(0.01)
    raise TimeoutError(url)


def time_to_open_step(driver, step: int) -> float:
    """Milliseconds to load a step's data file and render its groups and first episode."""
    return float(
        driver.execute_async_script(
            """
        const [step, done] = arguments; const t0 = performance.now();
        polyrlReport.selectStep(step).then(() => {
          const card = document.querySelector('#groups .ep-card');
          card.click();
          done(performance.now() - t0);
        });""",
            step,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--episodes", type=int, default=100, help="episodes per step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--keep", help="write the run here and keep it (default: a temporary directory, removed)")
    args = p.parse_args()

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="report-load-"))
    try:
        run = work / "run"
        t = time.perf_counter()
        if not (run / "metrics.jsonl").exists():
            write_synthetic_run(run, args.steps, args.episodes, group_size=4, eval_every=50, save_every=100)
        size = du(run / "trajectories") / 1e6
        print(f"synthetic run: {args.steps} steps x {args.episodes} episodes, {size:.0f} MB of trajectories "
              f"({time.perf_counter() - t:.1f} s)")

        shutil.rmtree(run / "report", ignore_errors=True)
        t = time.perf_counter()
        page = build_report(run)
        print(
            f"first build: {time.perf_counter() - t:.1f} s, report {du(run / 'report') / 1e6:.0f} MB, "
            f"data/index.js {(run / 'report/data/index.js').stat().st_size / 1e3:.0f} kB"
        )
        t = time.perf_counter()
        build_report(run)
        print(f"refresh, nothing changed: {(time.perf_counter() - t) * 1e3:.0f} ms")
        last = sorted((run / "trajectories").glob("step_*.jsonl"))[-1]
        os.utime(last)
        with open(run / "metrics.jsonl", "a") as f:
            f.write("")
        t = time.perf_counter()
        build_report(run)
        print(f"refresh, one step file changed: {(time.perf_counter() - t) * 1e3:.0f} ms")

        peer = work / "peer.html"
        peer.write_text(PEER)
        with tempfile.TemporaryDirectory() as profile:
            driver = driver_for(profile)
            try:
                time_to_ready(driver, peer.as_uri())  # warm the browser up once
                report_ms, peer_ms, open_ms = [], [], []
                for i in range(args.repeats):
                    peer_ms.append(time_to_ready(driver, peer.as_uri()))
                    report_ms.append(time_to_ready(driver, page.as_uri()))
                    open_ms.append(time_to_open_step(driver, (i * 397) % args.steps))
            finally:
                driver.quit()
        r, q, o = statistics.median(report_ms), statistics.median(peer_ms), statistics.median(open_ms)
        print(
            f"report time to interactive (charts drawn): median {r:.0f} ms, max {max(report_ms):.0f} ms "
            f"over {args.repeats} loads"
        )
        print(f"peer (trivial static page with one SVG line): median {q:.0f} ms")
        print(f"open a step's trajectories ({args.episodes} episodes) and an episode: median {o:.0f} ms")
        verdict = "PASS" if max(report_ms) < 2000 else "FAIL"
        print(
            f"load ratio report/peer: {r / q:.2f}x; report loads in {r / 1000:.2f} s (bar < 2 s: {verdict})"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
