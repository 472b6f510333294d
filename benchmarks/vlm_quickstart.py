"""Vision-language RL on a CPU: warm-start the tiny VLM on flawed demonstrations of the built-in
``visual`` environment, then fix it with RL; prints held-out success before and after, and the time.

Like ``make quickstart`` (polyrl/quickstart.py), offline and through the same code paths as real runs:

1. Build the tiny Qwen3-VL model (``polyrl tiny-model --size vl-unit``: random weights, a real Qwen2-VL
   image processor config, ~0.3M parameters; a 64 x 64 picture is 4 image tokens) unless the work
   directory has it.
2. Warm start, ``polyrl.sft`` (cross_entropy on LoRA of the language model; the vision tower stays as
   built): demonstrations of ``visual`` (``colour``: "What colour is the largest shape?"), a share of
   which (``demo_error_rate``) name the background (``\\boxed{white}``) instead of the shape. The
   warm-started policy learns to read the colour *and* the habit, which no further imitation removes.
3. ``polyrl.rl.train``: GRPO, reward 1 for the right colour. Groups that sampled both habits get a clear
   advantage, so RL drops "white".
4. Held-out pass@1 (one reply at temperature 1, averaged over samples) on test tasks never trained on.

``--serve`` runs the RL phase through ``polyrl serve`` on 127.0.0.1 (the official SDK; images travel
over HTTP as ImageChunks); ``--loss-fn`` picks the RL loss (e.g. ``stable_reinforce``, which trains on
the sequences its samplers recorded, pictures included). Each run is fresh and seeded, so it reproduces
its numbers; ``summary.json`` in the work directory holds them, with the first RL step's loss, gradient
norm and reward.

    PYTHONPATH=. python benchmarks/vlm_quickstart.py [--sft-steps N] [--rl-steps N] [--serve] [--loss-fn L]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import time
from pathlib import Path

from polyrl.config.checks import check_config
from polyrl.config.schema import EnvConfig, TrainConfig
from polyrl.evaluate import evaluate_checkpoint
from polyrl.models.tiny import build_tiny_model
from polyrl.quickstart import served
from polyrl.rl.train import train_async
from polyrl.sft import SFTConfig, sft_async
from polyrl.tracking.console import ConsoleLog

ENV = "visual"
ARGS = {"kinds": ["colour"], "image_size": 64, "max_distractors": 2, "demo_error_rate": 0.6}
SIZE = "vl-unit"
LORA_RANK = 16
SFT = {"learning_rate": 1e-2, "batch_size": 32, "lr_schedule": "linear"}
RL = {"learning_rate": 2e-3, "batch_size": 16, "group_size": 8, "temperature": 1.0}
DEMOS = 1024
MAX_TOKENS = 8
NUM_TEST = 96
EVAL_SAMPLES = 4


def env_config(split: str, group_size: int = 1, demos: bool = False) -> dict[str, EnvConfig]:
    if split == "train":
        splits = {"train": {"shuffle": True, "num_samples": DEMOS if demos else None}, "test": None}
    else:
        splits = {"train": None, "test": {"shuffle": False, "num_samples": NUM_TEST}}
    return {ENV: EnvConfig(args=ARGS, max_turns=1, max_tokens=MAX_TOKENS, temperature=RL["temperature"],
                           num_rollouts=group_size, splits=splits)}


async def run(workdir: Path, sft_steps: int, rl_steps: int, seed: int, serve: bool, quiet: bool,
              threads: int = 1, loss_fn: str = "importance_sampling") -> dict:
    console = ConsoleLog(enabled=not quiet)
    times: dict[str, float] = {}
    t0 = mark = time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        times[name], mark = time.monotonic() - mark, time.monotonic()

    model_dir = workdir / f"model-{SIZE}"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, SIZE, seed=0)
    for sub in ("sft", "rl", "store"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    common = {"model_name": str(model_dir), "lora_rank": LORA_RANK, "seed": seed,
              "local": {"store_dir": str(workdir / "store")}}
    lap("setup")

    console.info(f"warm start: {sft_steps} SFT steps on {DEMOS} demonstrations of {ENV}")
    sft_config = check_config(SFTConfig(**common, **SFT, max_steps=sft_steps, log_path=str(workdir / "sft"),
                                        environments=env_config("train", demos=True)))
    sft_state = await sft_async(sft_config, console)
    sft_sampler = json.loads((workdir / "sft" / "sft.json").read_text())["sampler_path"]
    lap("sft")

    eval_config = check_config(TrainConfig(**common, eval_num_samples=EVAL_SAMPLES,
                                           environments=env_config("test")))
    before = (await evaluate_checkpoint(eval_config, sft_sampler))[f"test/{ENV}/pass@1"]
    console.info(f"held-out pass@1 after the warm start: {before:.2f}")
    lap("eval_before")

    console.info(f"RL: {rl_steps} steps x {RL['batch_size']} groups x {RL['group_size']} samples, "
                 f"loss {loss_fn}" + (", through polyrl serve" if serve else ""))
    with served(model_dir, workdir / "store", threads) if serve else contextlib.nullcontext({}) as backend:
        where = backend or {"local": common["local"]}
        rl_config = check_config(TrainConfig(
            **{k: v for k, v in common.items() if k != "local"}, **where, resume_from=sft_state,
            learning_rate=RL["learning_rate"], batch_size=RL["batch_size"], max_steps=rl_steps,
            loss_fn=loss_fn,
            max_tokens=MAX_TOKENS, save_every=0, outputs={"report": False}, log_path=str(workdir / "rl"),
            environments=env_config("train", group_size=RL["group_size"])))
        await train_async(rl_config, console)
    final = json.loads((workdir / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (workdir / "rl" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if "optim/loss" in r)
    first_step = {k: first[k] for k in ("optim/loss", "optim/grad_norm", "optim/entropy", "reward/mean")}
    lap("rl")

    after = (await evaluate_checkpoint(eval_config, final["sampler_path"]))[f"test/{ENV}/pass@1"]
    lap("eval_after")
    times["total"] = time.monotonic() - t0
    summary = {"before": before, "after": after, "first_rl_step": first_step, "seconds": times,
               "sft_steps": sft_steps, "rl_steps": rl_steps, "seed": seed, "serve": serve, "loss_fn": loss_fn}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".vlm_quickstart", help="model, checkpoints and logs")
    p.add_argument("--sft-steps", type=int, default=300, help="warm-start steps (default: 300)")
    p.add_argument("--rl-steps", type=int, default=30, help="RL steps (default: 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of LoRA init, data order and sampling")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--serve", action="store_true", help="run the RL phase through `polyrl serve`")
    p.add_argument("--loss-fn", default="importance_sampling",
                   help="the RL loss (default: importance_sampling)")
    p.add_argument("--quiet", action="store_true", help="print only the results")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    s = asyncio.run(run(Path(args.workdir), args.sft_steps, args.rl_steps, args.seed, args.serve, args.quiet,
                        args.threads, args.loss_fn))
    t = s["seconds"]
    print(f"held-out success ({ENV}, colour of the largest shape): before {s['before']:.2f} -> after "
          f"{s['after']:.2f}   (pass@1 at temperature {RL['temperature']:g}, {NUM_TEST} test tasks x "
          f"{EVAL_SAMPLES} samples)")
    print(f"time: {t['total']:.0f} s (warm start {t['sft']:.0f} s, RL {t['rl']:.0f} s, evaluation "
          f"{t['eval_before'] + t['eval_after']:.0f} s, set-up {t['setup']:.0f} s); first RL step's loss "
          f"{s['first_rl_step']['optim/loss']:.6g}" + (" (through polyrl serve)" if s["serve"] else ""))


if __name__ == "__main__":
    main()
