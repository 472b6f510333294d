"""One run mixing GEM, reasoning-gym, textarena and the solver_judge workflow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

CONFIG = """
lora_rank: 4
batch_size: 5
max_steps: 2
max_tokens: 8
save_every: 0
learning_rate: 0.003
seed: 5
eval_every: 2
eval_num_samples: 2
environments:
  guess:
    type: gem:game:GuessTheNumber-v0-easy
    num_rollouts: 2
    max_turns: 4
    args: {wrappers: [episode_tracking]}
    splits: {test: {num_samples: 2}}
  power:
    type: reasoning_gym:power_function
    num_rollouts: 4
    max_turns: 1
    args: {answer_extraction: regex, answer_regex: '-?\\d+', test_size: 4}
    splits: {test: {num_samples: 2}}
  auction:
    type: textarena:SimpleBlindAuction-v0-quick
    num_rollouts: 4
    max_turns: 4
    args: {opponent: random, player_id: alternate}
    splits: {test: {num_samples: 2}}
  sj:
    type: solver_judge
    num_rollouts: 2
    weight: 2
    args: {num_solvers: 2}
    splits: {test: {num_samples: 2}}
"""
ENVS = {"guess", "power", "auction", "sj"}


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _trajectories(run, step):
    return [json.loads(x) for x in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_mixed_ecosystems_train_evaluate_and_repeat_exactly(tiny_model_dir, tmp_path):
    from polyrl.config.files import load_config
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    data = yaml.safe_load(CONFIG)
    data.update(model_name=tiny_model_dir, log_path=str(tmp_path / "a"),
                local={"store_dir": str(tmp_path / "store")})
    config_path = tmp_path / "mixed.yaml"
    config_path.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "train", "--config_path", str(config_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]

    before, *rows = _rows(tmp_path / "a")  # the evaluation before training, then the steps
    assert before["step"] == -1 and {f"test/{name}/pass@1" for name in ENVS} <= set(before)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollouts/failed"] == 0 and r["rollouts/dropped_groups"] == 0
        assert {f"env/{name}/reward/mean" for name in ENVS} <= set(r)
    for step, r in enumerate(rows):  # every kept episode with an advantage became a datum of the update
        trained = [t for t in _trajectories(tmp_path / "a", step)
                   if not t["dropped"] and any(a != 0 for a in t["advantages"]) and sum(t["action_mask"]) > 0]
        assert r["optim/datums"] == len(trained)
    final = rows[-1]
    for name in ENVS:
        assert {f"test/{name}/reward", f"test/{name}/pass@1", f"test/{name}/pass@2"} <= set(final)
        assert final[f"test/{name}/failed"] == 0
        assert 0.0 <= final[f"test/{name}/pass@1"] <= final[f"test/{name}/pass@2"] <= 1.0
    assert final["env/guess/info/step_counter"] >= 1.0 and "env/auction/opponent_moves" in final

    traj = _trajectories(tmp_path / "a", 0) + _trajectories(tmp_path / "a", 1)
    assert {t["env"] for t in traj} == ENVS
    assert {t["role"] for t in traj if t["env"] == "sj"} == {"solver", "judge"}
    assert {t["role"] for t in traj if t["env"] != "sj"} == {""}
    for t in traj:
        assert t["error"] is None and t["messages"][0]["role"] in ("system", "user")
        assert len(t["step_rewards"]) == t["num_turns"] and len(t["advantages"]) == t["num_turns"]

    # `polyrl eval` on the final checkpoint, in a fresh process
    checkpoint = json.loads((tmp_path / "a" / "checkpoints.jsonl").read_text()
                            .splitlines()[-1])["sampler_path"]
    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "eval", "--config_path", str(config_path),
                          "--checkpoint", checkpoint], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = dict(line.split() for line in out.stdout.strip().splitlines())
    for name in ENVS:
        assert float(printed[f"test/{name}/failed"]) == 0.0 and f"test/{name}/pass@2" in printed

    # the same config again, in this process: the same tasks, samples and rewards (the packages'
    # use of the global RNG stays on each episode's private copy)
    cfg = load_config(config_path, [f"log_path={tmp_path / 'b'}", f"local.store_dir={tmp_path / 'store_b'}"])
    train(cfg, ConsoleLog(enabled=False))
    for step in (0, 1):
        first, second = _trajectories(tmp_path / "a", step), _trajectories(tmp_path / "b", step)
        for a, b in zip(first, second, strict=True):
            assert (a["env"], a["messages"], a["step_rewards"], a["tokens"]) == \
                (b["env"], b["messages"], b["step_rewards"], b["tokens"])
