"""Environment latency: the synchronous loop against ``max_steps_off_policy: 1`` with partial rollouts.

Workload: an environment whose every step waits ``--latency`` seconds (200 ms, like a hosted
environment answering over the network) and ends an episode after ``--turns`` turns (4), ``--groups``
groups of ``--group`` episodes per step (8 x 8 = 64 episodes), ``--tokens`` sampled tokens per turn,
the ``small`` tiny model on the local engine, ``--threads`` torch threads. The synchronous loop
already runs a step's episodes concurrently, so a step costs about one episode's chain of turns
(``turns`` x latency, plus sampling) and then the training; with ``max_steps_off_policy: 1`` the next
step's groups are sampled while a step finishes and trains, and their episodes take the newest weights
at each turn (partial rollouts), so each run also prints the mean staleness of the groups it trained
(their oldest tokens, the sampler a group started with) beside that of the tokens.
``--chunk N`` adds runs with ``off_policy.partial_chunk_tokens: N`` (a turn takes the newest weights
every N tokens too).

Both loops run in one process, alternating (sync, off-policy, sync, ...) ``--repeats`` times, each a
run of ``--steps`` steps; a run's rate is its steps after the first over the time between the first
and last step rows (so start-up and the final save are not counted). Printed: steps per minute of
each run and the median of each loop, first with an environment that blocks in ``time.sleep`` (sync
environment code runs on worker threads, so it must overlap too) and then with one that awaits
``asyncio.sleep``, and on the last line ``env_latency_off_policy_vs_sync: X.XXx``, the ratio of the
medians with the awaiting environment (the bar: at least 1.5x).

Run: ``.venv/bin/python benchmarks/env_latency.py [--steps 6] [--repeats 2] [--threads 1] [--chunk 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _models  # noqa: E402,F401 - offline, quiet environment

from polyrl.envs.base import EnvBuilder, Observation, StepResult, register_env  # noqa: E402
from polyrl.tracking.console import ConsoleLog  # noqa: E402

LATENCY_S = 0.2


class _Remote:
    """Every step waits LATENCY_S (awaiting, as a network call would); reward 1 for replies with an 'e'."""

    def __init__(self, blocking: bool):
        self.blocking = blocking

    def reset(self):
        return Observation([{"role": "user", "content": "Say a word with the letter e."}])

    def step(self, action):
        time.sleep(LATENCY_S)
        return _result(action)

    async def step_async(self, action):
        await asyncio.sleep(LATENCY_S)
        return _result(action)

    def close(self):
        return None


def _result(action) -> StepResult:
    ok = "e" in action["content"]
    return StepResult(reward=float(ok), done=False, messages=[{"role": "user", "content": "Another."}])


class _Awaiting(_Remote):
    async def step(self, action):  # type: ignore[override]
        return await self.step_async(action)


@register_env("bench_latency")
class LatencyBuilder(EnvBuilder):
    def make(self, split, index):
        return _Remote(blocking=True) if self.args.get("blocking") else _Awaiting(blocking=False)


class Clock(ConsoleLog):
    """Records when each step's row is logged."""

    def __init__(self):
        super().__init__(enabled=False)
        self.times: list[float] = []

    def step(self, row: dict) -> None:
        self.times.append(time.monotonic())


def run(model: Path, root: Path, args, off_policy: int, blocking: bool, name: str,
        chunk: int | None = None) -> tuple[float, float, float]:
    """Steps per minute of one run, and the mean staleness of the groups (their oldest tokens) and of the
    tokens it trained."""
    from polyrl.config.schema import TrainConfig
    from polyrl.rl.train import train

    cfg = TrainConfig(model_name=str(model), lora_rank=8, batch_size=args.groups, max_steps=args.steps,
                      max_tokens=args.tokens, save_every=0, outputs={"report": False}, learning_rate=1e-3,
                      seed=0, log_path=str(root / name), local={"store_dir": str(root / "store")},
                      off_policy={"max_steps": off_policy, "partial_chunk_tokens": chunk},
                      environments={"remote": {"type": "bench_latency", "num_rollouts": args.group,
                                               "max_turns": args.turns, "args": {"blocking": blocking},
                                               "splits": {"test": None}}})
    clock = Clock()
    train(cfg, clock)
    times = clock.times
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    groups = statistics.mean(r["async/staleness_mean"] for r in rows)
    tokens = statistics.mean(r["async/token_staleness_mean"] for r in rows)
    return 60.0 * (len(times) - 1) / (times[-1] - times[0]), groups, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="also run max_steps_off_policy=1 with partial_chunk_tokens CHUNK (0: not)")
    ap.add_argument("--model", help="a model directory instead of the 'small' tiny model")
    args = ap.parse_args()

    import torch

    from polyrl.local.engine import Engine
    from polyrl.models.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="polyrl-bench-latency-"))
    model = Path(args.model) if args.model else build_tiny_model(root / "model", "small", seed=0)
    if args.threads:
        torch.set_num_threads(args.threads)
        Engine.shared(root / "store").call(lambda: torch.set_num_threads(args.threads))

    print(f"{args.groups} groups x {args.group} episodes x {args.turns} turns per step, "
          f"{LATENCY_S * 1000:.0f} ms "
          f"per environment step, {args.tokens} tokens per turn, {args.steps} steps per run")
    cases = [("sync", 0, None), ("off-policy", 1, None)]
    if args.chunk:
        cases.append(("chunked", 1, args.chunk))
    ratios: dict[tuple[bool, str], float] = {}
    for blocking in (True, False):
        kind = "time.sleep (blocking)" if blocking else "asyncio.sleep"
        rates: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        for repeat in range(args.repeats):
            for name, off_policy, chunk in cases:
                label = f"{kind[:4]}-{name}-{repeat}"
                rate, groups, tokens = run(model, root, args, off_policy, blocking, label, chunk)
                rates[name].append(rate)
                chunked = f", partial_chunk_tokens={chunk}" if chunk else ""
                print(f"  {kind:<22} max_steps_off_policy={off_policy}{chunked}: {rate:6.1f} steps/min, "
                      f"mean staleness: groups {groups:.2f}, tokens {tokens:.2f} steps")
        sync = statistics.median(rates["sync"])
        for name, _, chunk in cases[1:]:
            ratios[(blocking, name)] = statistics.median(rates[name]) / sync
            what = f"max_steps_off_policy=1{f' chunk {chunk}' if chunk else ''}"
            print(f"{kind}: synchronous {sync:.1f} steps/min, {what} {statistics.median(rates[name]):.1f} "
                  f"steps/min ({ratios[(blocking, name)]:.2f}x)")
    print(f"env_latency_blocking_off_policy_vs_sync: {ratios[(True, 'off-policy')]:.2f}x")
    if args.chunk:
        print(f"env_latency_chunked_vs_sync: {ratios[(False, 'chunked')]:.2f}x "
              f"(blocking: {ratios[(True, 'chunked')]:.2f}x)")
    print(f"env_latency_off_policy_vs_sync: {ratios[(False, 'off-policy')]:.2f}x")


if __name__ == "__main__":
    main()
