"""tinker-cookbook's recipes for rewards that no code computes, run unmodified against ``polyrl serve`` with
a tiny model (the model served under the recipes' own names where they hard-code one): an LLM grader
with rubrics, pairwise preferences as a reward, and tic-tac-toe self-play. Each test reads the recipe's
own metrics: they are the reference behaviour polyrl's own judges, preferences and self-play
(``tests/test_judge.py``, ``tests/test_env_textarena.py``) are held to. The rubric test also trains
``polyrl train`` on the recipe's own data file (the ``prompts`` environment reads its format)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_serve import KEY, Served

from polyrl.config.schema import TrainConfig
from polyrl.tracking.console import ConsoleLog

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("serve-store"))
    yield s
    s.stop()


def recipe(module: str, served: Served, tmp_path: Path, *args: str) -> list[dict]:
    """``python -m MODULE ARGS`` as its users run it against a Tinker service (``TINKER_BASE_URL``: the
    recipes that build their own clients read it), logging to ``tmp_path / 'log'``; its metrics rows."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_BASE_URL": served.url, "TINKER_TELEMETRY": "0",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets-cache")}
    cmd = [sys.executable, "-m", module, f"log_path={tmp_path / 'log'}", "behavior_if_log_dir_exists=delete",
           *args]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]


def test_the_rubric_recipe_grades_with_the_served_model_and_polyrl_trains_on_its_data(
        served, tiny_model_dir, tmp_path):
    from tinker_cookbook.recipes.rubric.generate_data import generate_dataset

    train_file, test_file = generate_dataset(num_train=8, num_test=2, seed=0, write_dir=str(tmp_path))
    rows = recipe("tinker_cookbook.recipes.rubric.train", served, tmp_path, f"base_url={served.url}",
                  f"model_name={tiny_model_dir}", "renderer_name=qwen3", f"grader_llm_name={tiny_model_dir}",
                  "grader_renderer_name=qwen3", f"train_jsonl_path={train_file}",
                  f"test_jsonl_path={test_file}",
                  "groups_per_batch=2", "train_group_size=2", "max_tokens=8", "lora_rank=4", "eval_every=0",
                  "save_every=0", "max_steps=2")
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == [0, 1]
    # a tiny grader writes no <score>: the recipe counts that as a score of 0 without saying so
    assert all(r["env/all/reward/total"] <= 0.0 for r in trained)

    # polyrl train on the recipe's own file: the same tasks and rubrics, graded by the same base model;
    # the unreadable verdicts are failures it counts, not zeros
    from polyrl.rl.train import train

    config = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=1, max_tokens=8,
                         save_every=0, eval_every=0, log_path=str(tmp_path / "polyrl"),
                         local={"store_dir": str(tmp_path / "store")}, outputs={"report": False},
                         environments={"rubric": {"type": "prompts", "num_rollouts": 2,
                                                  "splits": {"test": None}, "args": {"path": train_file},
                                                  "judge": {"max_tokens": 8}}})
    train(config, ConsoleLog(enabled=False))
    run = tmp_path / "polyrl"
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["judge/parse_failures"] == row["judge/calls"] + row["judge/cached"] == 4
    episode = json.loads((run / "trajectories" / "step_000000.jsonl").read_text().splitlines()[0])
    assert episode["judge"][0]["rubric"].startswith("Does the chatbot correctly get the answer")
    assert [m["role"] for m in episode["messages"]][:3] == ["user", "assistant", "user"]  # the recipe's convo


def test_the_shorter_preference_recipe(served, tiny_model_dir, tmp_path):
    rows = recipe("tinker_cookbook.recipes.preference.shorter.train", served, tmp_path,
                  f"model_name={tiny_model_dir}", "renderer_name=qwen3", "batch_size=2", "group_size=4",
                  "max_tokens=8", "eval_every=0", "max_steps=2")
    trained = [r for r in rows if any(k.startswith("env/") for k in r)]
    assert [r["step"] for r in trained] == [0, 1]
    rewards = [v for r in trained for k, v in r.items() if k.startswith("env/all/reward")]
    assert rewards and all(-1.0 <= v <= 1.0 for v in rewards)  # win rates of pairwise comparisons


def test_the_text_arena_self_play_recipe(served, tiny_model_dir, tmp_path):
    rows = recipe("tinker_cookbook.recipes.multiplayer_rl.text_arena.train", served, tmp_path,
                  f"model_name={tiny_model_dir}", "renderer_name=qwen3", "game_name=TicTacToe-v0",
                  "batch_size=2", "num_train_datapoints=4", "num_test_datapoints=2", "max_tokens=8",
                  "eval_every=0", "save_every=0", "max_steps=2")
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == [0, 1]
    assert all(-1.0 <= r["env/all/reward/total"] <= 1.0 for r in trained)
