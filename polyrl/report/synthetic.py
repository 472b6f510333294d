"""Synthetic run directories in ``polyrl train``'s format, for the report's tests and load benchmark:
multi-turn tool-use episodes with tokens, logprobs, masks and advantages, at any scale.

    python -m polyrl.report.synthetic OUT_DIR --steps 50 --episodes 40   # then: polyrl report OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
from pathlib import Path

from polyrl.envs.builtin.calculator import CALCULATOR_TOOL
from polyrl.tracking.files import step_file

ENVS = ("calculator", "guess_number", "arithmetic")
JUDGING_ENVS = ("arithmetic",)  # episodes with their own verdict (a `success` metric); the others: full marks
_WORDS = ("the sum of first we add then so answer is let me check number result compute step carry "
          "value total because which gives now").split()


def _tokenize(text: str) -> list[str]:
    """Word-ish pieces that join back to ``text`` (stands in for a real tokenizer's pieces)."""
    return re.findall(r"\s*\S{1,6}|\s+", text) or [""]


def _sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words)).capitalize() + "."


def synthetic_episode(
    step: int,
    env: str,
    group: int,
    task: int,
    rng: random.Random,
    reward: float,
    advantage: float,
    tool_turns: int = 1,
    think_words: int = 40,
) -> dict:
    """One row of ``trajectories/step_NNNNNN.jsonl``: a user question, ``tool_turns`` assistant turns
    calling a calculator (each followed by the tool's result), then a final answer turn."""
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    tools = [CALCULATOR_TOOL]
    messages: list[dict] = [
        {
            "role": "user",
            "content": f"What is {a} + {b}? Use the calculator tool, then put the "
            "final answer in \\boxed{}.",
        }
    ]
    pieces: list[tuple[str, bool]] = [
        ("<|im_start|>system\n# Tools\n" + json.dumps(tools) + "<|im_end|>\n", False),
        (f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n", False),
    ]
    for t in range(tool_turns):
        call_id = f"call_{step}_{group}_{t}"
        args = json.dumps({"expression": f"{a} + {b}"})
        thought = _sentence(rng, think_words)
        messages.append(
            {
                "role": "assistant",
                "content": thought,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": args}}
                ],
                "tool_call_errors": [],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": str(a + b)})
        pieces.append(
            (
                f'{thought}\n<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n</tool_call>'
                "<|im_end|>",
                True,
            )
        )
        pieces.append(
            (
                f"\n<|im_start|>user\n<tool_response>\n{a + b}\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            )
        )
    answer = a + b if reward > 0 else a + b + rng.randint(1, 9)
    final = f"{_sentence(rng, think_words // 2)} The answer is \\boxed{{{answer}}}."
    messages.append({"role": "assistant", "content": final, "tool_calls": [], "tool_call_errors": []})
    pieces.append((final + "<|im_end|>", True))

    token_text: list[str] = []
    mask: list[int] = []
    spans: list[list[int]] = []
    for text, sampled in pieces:
        toks = _tokenize(text)
        if sampled:
            spans.append([len(token_text), len(token_text) + len(toks)])
        token_text += toks
        mask += [int(sampled)] * len(toks)
    logprobs = [round(-rng.expovariate(2.0), 5) if m else 0.0 for m in mask]
    turns = tool_turns + 1
    return {
        "step": step,
        "env": env,
        "split": "train",
        "task_index": task,
        "group": group,
        "reward": reward,
        "success": reward > 0,
        "step_rewards": [0.0] * tool_turns + [reward],
        "advantages": [advantage] * turns,
        "num_turns": turns,
        "stop_reasons": ["tool_calls"] * tool_turns + ["stop"],
        "done_by_env": True,
        "error": None,
        "dropped": False,
        "metrics": {"tool_calls": float(tool_turns),
                    **({"success": float(reward > 0)} if env in JUDGING_ENVS else {})},
        "duration_s": round(rng.uniform(0.5, 5.0), 4),
        "messages": messages,
        "tools": tools,
        "tokens": [rng.randrange(150000) for _ in token_text],
        "token_text": token_text,
        "logprobs": logprobs,
        "action_mask": mask,
        "turn_spans": spans,
    }


def synthetic_step(
    step: int,
    episodes: int,
    group_size: int,
    rng: random.Random,
    envs: tuple[str, ...] = ENVS,
    think_words: int = 40,
    learning: bool = True,
    truncated: dict[str, float] | None = None,
    pace: float = 200,
) -> list[dict]:
    """A step's episodes; ``learning=False``: every group's episodes get the same reward (no signal);
    ``truncated``: per environment, the share of episodes whose last turn stopped at max_tokens;
    ``pace``: steps over which the log-odds of a reward grow by 1."""
    rows = []
    for g in range(max(1, episodes // group_size)):
        env = envs[(g + step) % len(envs)]
        p = 1 / (1 + math.exp(-(step / pace - 1 + 0.3 * envs.index(env))))
        rewards = [float(rng.random() < p) for _ in range(group_size)]
        if not learning:
            rewards = [rewards[0]] * group_size
        mean = sum(rewards) / len(rewards)
        for r in rewards:
            turns = rng.randint(1, 3)
            adv = round(r - mean, 4)
            row = synthetic_episode(step, env, g, step * 100 + g, rng, r, adv, turns, think_words)
            if rng.random() < (truncated or {}).get(env, 0.0):
                row["stop_reasons"][-1] = "length"
            rows.append(row)
    return rows


def metrics_row(step: int, rows: list[dict], rng: random.Random) -> dict:
    row = {"step": step, "progress/done_frac": 0.0}
    envs = sorted({r["env"] for r in rows})
    for prefix, sel in [("", rows)] + [(f"env/{e}/", [r for r in rows if r["env"] == e]) for e in envs]:
        row[f"{prefix}reward/mean"] = sum(r["reward"] for r in sel) / len(sel)
        row[f"{prefix}success/mean"] = sum(r["success"] for r in sel) / len(sel)
        row[f"{prefix}turns/mean"] = sum(r["num_turns"] for r in sel) / len(sel)
        row[f"{prefix}tokens/action_per_episode"] = sum(sum(r["action_mask"]) for r in sel) / len(sel)
        row[f"{prefix}tokens/total_per_episode"] = sum(len(r["tokens"]) for r in sel) / len(sel)
        row[f"{prefix}stop/length_frac"] = sum("length" in r["stop_reasons"] for r in sel) / len(sel)
        if prefix:
            groups: dict[int, set] = {}
            for r in sel:
                groups.setdefault(r["group"], set()).add(r["reward"])
            row[f"{prefix}failed_rollouts"] = float(rng.random() < 0.05)
            row[f"{prefix}dropped_groups"] = 0.0
            row[f"{prefix}constant_groups"] = float(sum(len(rs) == 1 for rs in groups.values()))
            row[f"{prefix}tool_calls"] = sum(r["metrics"]["tool_calls"] for r in sel) / len(sel)
            if any("success" in r["metrics"] for r in sel):
                row[f"{prefix}success"] = sum(r["metrics"].get("success", 0.0) for r in sel) / len(sel)
    trained = [r for r in rows if any(r["advantages"])]  # what train.py makes Datums of
    row.update(
        {
            "rollouts/failed": 0.0,
            "rollouts/dropped_groups": 0.0,
            "episodes/count": float(len(rows)),
            "optim/lr": 1e-5,
            "optim/datums": float(len(trained)),
            "tokens/action": float(sum(sum(r["action_mask"]) for r in trained)),
            "tokens/total": float(sum(len(r["tokens"]) for r in trained)),
            "time/rollout": rng.uniform(20, 30),
            "time/train": rng.uniform(5, 8),
            "time/save": 0.3,
        }
    )
    if trained:
        row.update(
            {
                "optim/kl_sample_train_v1": abs(rng.gauss(0, 1e-3)),
                "optim/kl_sample_train_v2": abs(rng.gauss(0, 1e-6)),
                "optim/entropy": 0.6 + 0.2 * math.exp(-step / 300) + rng.gauss(0, 0.02),
                "optim/loss": rng.gauss(0, 1.0),
                "optim/grad_norm": abs(rng.gauss(0.5, 0.2)),
                "optim/learning_rate": 1e-5,
            }
        )
    row["time/total"] = row["time/rollout"] + row["time/train"] + row["time/save"]
    return row


def write_synthetic_run(
    root: str | Path,
    steps: int,
    episodes_per_step: int,
    group_size: int = 4,
    eval_every: int = 0,
    save_every: int = 0,
    seed: int = 0,
    think_words: int = 40,
    learning: bool = True,
    truncated: dict[str, float] | None = None,
    env_config: dict[str, dict] | None = None,
    pace: float = 200,
) -> Path:
    """A run directory as ``polyrl train`` leaves it: config, metrics, trajectories, checkpoints.
    ``learning=False``: no group ever has a learning signal, so no step makes an update; ``truncated``:
    per environment, the share of episodes cut at max_tokens; ``env_config``: more settings of each
    environment's config entry; ``pace``: how fast rewards rise (steps per unit of log-odds)."""
    root = Path(root)
    (root / "trajectories").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    config = {
        "model_name": "synthetic/model",
        "max_steps": steps,
        "batch_size": episodes_per_step // group_size,
        "max_tokens": 512,
        "eval_every": eval_every,
        "log_path": str(root),
        "environments": {e: {"num_rollouts": group_size, **(env_config or {}).get(e, {})} for e in ENVS},
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    spent = 60.0  # seconds of start-up, then each step's time/total
    with open(root / "metrics.jsonl", "w") as metrics, open(root / "checkpoints.jsonl", "w") as cps:
        for step in range(steps):
            rows = synthetic_step(step, episodes_per_step, group_size, rng, think_words=think_words,
                                  learning=learning, truncated=truncated, pace=pace)
            (root / "trajectories" / step_file(step)).write_text("".join(json.dumps(r) + "\n" for r in rows))
            row = metrics_row(step, rows, rng)
            row["progress/done_frac"] = (step + 1) / steps
            if eval_every and (step + 1) % eval_every == 0:
                for e in ENVS:
                    p1 = min(1.0, row.get(f"env/{e}/success/mean", 0.0) + 0.05)
                    row.update(
                        {f"test/{e}/reward": p1, f"test/{e}/pass@1": p1, f"test/{e}/pass@4": min(1.0, 2 * p1)}
                    )
                row["test/pass@1"] = sum(row[f"test/{e}/pass@1"] for e in ENVS) / len(ENVS)
            metrics.write(json.dumps(row) + "\n")
            spent += row["time/total"]
            done = step + 1
            if done == steps or (save_every and done % save_every == 0):
                name = "final" if done == steps else f"{done:06d}"
                cps.write(
                    json.dumps(
                        {
                            "name": name,
                            "batch": done,
                            "final": done == steps,
                            "state_path": f"tinker://synthetic/weights/{name}",
                            "sampler_path": f"tinker://synthetic/sampler_weights/{name}",
                            "cursors": {},
                            "wandb_run_id": None,
                        }
                    )
                    + "\n"
                )
    started = (root / "metrics.jsonl").stat().st_mtime - spent  # the times a run of that length leaves
    os.utime(root / "config.json", (started, started))
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--episodes", type=int, default=40, help="episodes per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=10)
    args = p.parse_args(argv)
    print(
        write_synthetic_run(
            args.out_dir,
            args.steps,
            args.episodes,
            args.group_size,
            args.eval_every,
            save_every=max(1, args.steps // 5),
        )
    )


if __name__ == "__main__":
    main()
