"""``make quickstart``: warm-start a tiny model on flawed demonstrations, then fix it with RL.

Everything runs offline on a CPU in a few minutes, through the same code paths as real runs:

1. Build a tiny Qwen3-architecture model (random weights, ChatML tokenizer, ~0.16M parameters,
   preset ``quickstart-cpu``) unless the work directory already has it.
2. Warm start, ``polyrl.sft`` (cross_entropy on LoRA): demonstrations of two environments,
   ``calculator`` (tool use: call the calculator on ``a + b + c``, then box its result) and
   ``guess_number`` (multi-turn: find a secret in 1..16 from higher/lower feedback). A fixed share of
   the demonstrations makes one *consistent* mistake (``demo_error_rate``): the calculator call leaves
   out the last operand (``6 + 2`` for ``6 + 2 + 8``, whose result is then boxed), or the number is
   searched linearly instead of by bisection. Each mistake is a habit chosen at one token (end the
   expression or add the last term; the first guess), and both habits share everything else, so the
   warm-started policy learns the right skill (copying the numbers into the tool call and the tool's
   result into the box; the bisection tree) *and* the bad habit at the demonstrated rate. It is neither
   hopeless (it succeeds whenever it picks the good habit) nor perfect, and no amount of further
   imitation would fix it: only reward tells the two habits apart.
3. ``polyrl.train.train_async``: GRPO on both environments at once, reward 1 for a correct final
   answer. Groups that sampled both habits get a clear advantage, so RL drops the bad one.
4. Held-out evaluation before and after RL on test tasks that never appear in training: pass@1 of
   one reply sampled at temperature 1 (the policy as trained, not its greedy mode -- greedy decoding
   would simply pick whichever habit the demonstrations showed more often), averaged over 4 samples
   for each of 128 test tasks per environment.

What a tiny random-init transformer learns in a CPU minute shaped these choices: copying tokens from a
fixed place and choosing a habit at one token are quick to learn; arithmetic is not (so the calculator
adds single digits and the tool does the sum). A mistake that writes its own number after ``\boxed{``
(skipping the tool and boxing a near miss) taught the model to make numbers up there even after a tool
call, which RL was slow to unlearn; leaving out an operand keeps the box a pure copy in both habits.
Each run is fresh (the warm start and RL are redone; only the model is reused) and seeded, so it
reproduces its numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

from polyrl.config import EnvConfig, TrainConfig
from polyrl.config_checks import check_config
from polyrl.evaluate import evaluate_checkpoint
from polyrl.models.tiny import SIZES, build_tiny_model
from polyrl.sft import SFTConfig, sft_async
from polyrl.tracking.console import ConsoleLog
from polyrl.train import train_async

# Per environment: builder args, turn limits, and how many demonstrations the warm start sees.
ENVIRONMENTS: dict[str, dict] = {
    "calculator": {
        "args": {"kinds": ["add3"], "min_value": 1, "max_value": 9, "demo_error_rate": 0.5},
        "max_turns": 2,  # one tool call, then the answer
        "max_tokens": 32,
        "demos": 2400,
    },
    "guess_number": {
        "args": {"demo_error_rate": 0.7},  # 1..16, 6 guesses: bisection always wins, linear search rarely
        "max_turns": 6,
        "max_tokens": 4,
        "demos": 1200,
    },
}
LORA_RANK = 32
SFT = {"learning_rate": 1e-2, "batch_size": 24, "lr_schedule": "linear"}
RL = {"learning_rate": 1e-3, "batch_size": 16, "group_size": 8, "temperature": 1.0}
NUM_TEST = 128  # held-out tasks per environment
EVAL_SAMPLES = 4  # samples per held-out task (pass@1 is their mean success)


def env_configs(split: str, group_size: int = 1, demos: bool = False) -> dict[str, EnvConfig]:
    """The environments with one split: ``train`` (each environment's ``demos`` tasks for the warm
    start, unbounded for RL) or ``test`` (the held-out tasks)."""
    out = {}
    for name, spec in ENVIRONMENTS.items():
        if split == "train":
            train = {"shuffle": True, "num_samples": spec["demos"] if demos else None}
            splits = {"train": train, "test": None}
        else:
            splits = {"train": None, "test": {"shuffle": False, "num_samples": NUM_TEST}}
        out[name] = EnvConfig(args=spec["args"], max_turns=spec["max_turns"], max_tokens=spec["max_tokens"],
                              temperature=RL["temperature"], num_rollouts=group_size, splits=splits)
    return out


def ensure_model(model_dir: Path, size: str, seed: int = 0) -> None:
    """Build the tiny model unless ``model_dir`` already holds this very preset."""
    from dataclasses import asdict

    marker = model_dir / "polyrl_tiny.json"
    want = {"size": size, "seed": seed, "spec": asdict(SIZES[size])}
    if marker.exists() and json.loads(marker.read_text()) == want and (model_dir / "config.json").exists():
        return
    shutil.rmtree(model_dir, ignore_errors=True)
    build_tiny_model(model_dir, size, seed=seed)


def pass_at_1(metrics: dict[str, float]) -> dict[str, float]:
    return {env: metrics[f"test/{env}/pass@1"] for env in ENVIRONMENTS}


@contextlib.contextmanager
def served(model_dir: Path, store: Path, threads: int) -> Iterator[dict]:
    """``polyrl serve`` on 127.0.0.1 over the quickstart's store, for the RL phase: yields the config
    keys that point a run at it (backend tinker, base_url; its API key in ``TINKER_API_KEY``)."""
    key = f"tml-quickstart-{secrets.token_hex(8)}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, "-m", "polyrl.serve", "--port", "0", "--models", str(model_dir), "--api-key", key,
           "--store-dir", str(store), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    old_key = os.environ.get("TINKER_API_KEY")
    try:
        url = None
        for line in proc.stdout:
            if "listening on" in line:
                url = line.rsplit(" ", 1)[-1].strip()
                break
        if url is None:
            raise RuntimeError(f"polyrl serve did not start (exit code {proc.wait()})")
        os.environ["TINKER_API_KEY"] = key
        yield {"backend": "tinker", "base_url": url}
    finally:
        if old_key is None:
            os.environ.pop("TINKER_API_KEY", None)
        else:
            os.environ["TINKER_API_KEY"] = old_key
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run(workdir: Path, size: str, sft_steps: int, rl_steps: int, seed: int, quiet: bool,
              max_steps_off_policy: int = 0, loss_fn: str = "importance_sampling", serve: bool = False,
              threads: int = 1) -> dict:
    console = ConsoleLog(enabled=not quiet)
    say = console.info
    times: dict[str, float] = {}
    t0 = mark = time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        times[name] = now - mark
        mark = now

    model_dir = workdir / f"model-{size}"
    ensure_model(model_dir, size)
    for sub in ("sft", "rl", "store"):  # a fresh warm start and RL run every time
        shutil.rmtree(workdir / sub, ignore_errors=True)
    common = {"model_name": str(model_dir), "lora_rank": LORA_RANK, "seed": seed,
              "local": {"store_dir": str(workdir / "store")}}
    lap("setup")

    demos = sum(spec["demos"] for spec in ENVIRONMENTS.values())
    say(f"warm start: {sft_steps} SFT steps on {demos} demonstrations of {', '.join(ENVIRONMENTS)}")
    sft_config = check_config(SFTConfig(**common, **SFT, max_steps=sft_steps, log_path=str(workdir / "sft"),
                                        environments=env_configs("train", demos=True)))
    sft_state = await sft_async(sft_config, console)
    sft_sampler = json.loads((workdir / "sft" / "sft.json").read_text())["sampler_path"]
    lap("sft")

    eval_config = check_config(TrainConfig(**common, eval_num_samples=EVAL_SAMPLES,
                                           environments=env_configs("test")))
    before = await evaluate_checkpoint(eval_config, sft_sampler)
    say("held-out pass@1 after the warm start: "
        + ", ".join(f"{k} {v:.2f}" for k, v in pass_at_1(before).items()))
    lap("eval_before")

    say(f"RL: {rl_steps} steps x {RL['batch_size']} groups x {RL['group_size']} samples, both environments"
        + (f", sampling up to {max_steps_off_policy} steps ahead" if max_steps_off_policy else "")
        + f", loss {loss_fn}" + (", through polyrl serve" if serve else ""))
    with served(model_dir, workdir / "store", threads) if serve else contextlib.nullcontext({}) as backend:
        where = backend or {"local": common["local"]}
        rl_config = check_config(TrainConfig(
            **{k: v for k, v in common.items() if k != "local"}, **where, resume_from=sft_state,
            learning_rate=RL["learning_rate"], batch_size=RL["batch_size"], loss_fn=loss_fn,
            max_steps=rl_steps, max_tokens=32, save_every=0, outputs={"report": False},
            log_path=str(workdir / "rl"), off_policy={"max_steps": max_steps_off_policy},
            environments=env_configs("train", group_size=RL["group_size"]),
        ))
        await train_async(rl_config, console)
    final = json.loads((workdir / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    lap("rl")

    after = await evaluate_checkpoint(eval_config, final["sampler_path"])
    lap("eval_after")
    times["total"] = time.monotonic() - t0
    summary = {"before": pass_at_1(before), "after": pass_at_1(after), "seconds": times,
               "sft_steps": sft_steps, "rl_steps": rl_steps, "seed": seed,
               "max_steps_off_policy": max_steps_off_policy, "loss_fn": loss_fn, "serve": serve}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".quickstart",
                   help="model, checkpoints and logs (default: .quickstart)")
    p.add_argument("--sft-steps", type=int, default=600, help="warm-start steps (default: 600)")
    p.add_argument("--rl-steps", type=int, default=40, help="RL steps (default: 40)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of LoRA init, data order and sampling (default: 0)")
    p.add_argument("--size", default="quickstart-cpu", help="tiny model preset (default: quickstart-cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default: 1; these matrices are too small to gain from more)")
    p.add_argument("--max-steps-off-policy", type=int, default=0,
                   help="RL sampling this many steps ahead of training (default: 0, the synchronous loop)")
    p.add_argument("--loss-fn", default="importance_sampling",
                   choices=typing.get_args(TrainConfig.model_fields["loss_fn"].annotation),
                   help="the RL loss (default: importance_sampling)")
    p.add_argument("--serve", action="store_true",
                   help="run the RL phase through `polyrl serve` on 127.0.0.1 (backend tinker) instead of "
                        "the in-process engine")
    p.add_argument("--quiet", action="store_true", help="print only the results")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    s = asyncio.run(run(Path(args.workdir), args.size, args.sft_steps, args.rl_steps, args.seed, args.quiet,
                        args.max_steps_off_policy, args.loss_fn, args.serve, args.threads))
    b, a, t = s["before"], s["after"], s["seconds"]
    for env in ENVIRONMENTS:
        print(f"  {env:<13} before {b[env]:.2f} -> after {a[env]:.2f}")
    print(f"  time: {t['total']:.0f} s (warm start {t['sft']:.0f} s, RL {t['rl']:.0f} s, "
          f"evaluation {t['eval_before'] + t['eval_after']:.0f} s, set-up {t['setup']:.0f} s)")
    mean_b, mean_a = sum(b.values()) / len(b), sum(a.values()) / len(a)
    print(f"held-out success: before {mean_b:.2f} -> after {mean_a:.2f}"
          f"   (pass@1 at temperature {RL['temperature']:g}, mean of {len(b)} environments x {NUM_TEST} test "
          "tasks)")


if __name__ == "__main__":
    main()
