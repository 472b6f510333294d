"""reasoning-gym adapter (``reasoning_gym:<dataset>``) with the real reasoning-gym package, offline."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.registry import make_env_builder


def _reply(env, text: str):
    return asyncio.run(env.step({"role": "assistant", "content": text}))


def test_questions_are_scored_by_the_datasets_own_score_answer():
    import reasoning_gym

    builder = make_env_builder("reasoning_gym:leg_counting", {"config": {"min_animals": 2, "max_animals": 3}},
                               seed=0)
    env = builder.make("train", 0)
    obs = asyncio.run(env.reset())
    # reasoning-gym's prompt
    assert obs.messages[0]["role"] == "system" and "<answer>" in obs.messages[0]["content"]
    assert obs.messages[1] == {"role": "user", "content": env.entry["question"]}
    answer = env.entry["answer"]
    right = _reply(env, f"Counting... <answer>{answer}</answer>")
    assert (right.done and right.reward == 1.0 and right.metrics["success"] == 1.0
            and right.metrics["format_ok"] == 1.0)
    wrong = _reply(env, f"<answer>{int(answer) + 1}</answer>")
    assert (wrong.reward == env.dataset.score_answer(str(int(answer) + 1), env.entry)
            and wrong.metrics["success"] == 0.0)
    assert _reply(env, answer).metrics["format_ok"] == 0.0  # no tags, no answer
    # a test task is reasoning-gym's own item for (split seed, index)
    ds = reasoning_gym.create_dataset("leg_counting", size=builder.spec.test_size, seed=builder._seed("test"),
                                      min_animals=2, max_animals=3)
    assert builder.make("test", 4).entry == ds[4]


@pytest.mark.parametrize("extraction,args,reply", [
    ("boxed", {}, "so the result is \\boxed{ANSWER}"),
    ("last_line", {}, "thinking\nANSWER\n"),
    ("full", {}, " ANSWER "),
    ("regex", {"answer_regex": r"Result: (-?\d+)"}, "blah Result: ANSWER"),
    ("answer_tag", {"answer_tag": "final"}, "<final>ANSWER</final>"),
])
def test_answer_extraction_is_configurable(extraction, args, reply):
    builder = make_env_builder("reasoning_gym:basic_arithmetic", {"answer_extraction": extraction, **args},
                               seed=1)
    env = builder.make("test", 2)
    answer = env.entry["answer"]
    assert _reply(env, reply.replace("ANSWER", answer)).reward == 1.0
    assert _reply(env, reply.replace("ANSWER", str(int(answer) + 1))).reward < 1.0
    demo = builder.demonstration("test", 2)
    if extraction != "regex":
        assert demo is not None and demo[0][-1]["role"] == "assistant"
        assert _reply(env, demo[0][-1]["content"]).reward == 1.0


def test_splits_are_disjoint_deterministic_and_sized():
    args = {"config": {"min_animals": 1, "max_animals": 1, "max_instances": 3}, "train_size": 50,
            "test_size": 10}
    builder = make_env_builder("reasoning_gym:leg_counting", args, seed=0)
    assert builder.num_tasks("train") == 50 and builder.num_tasks("test") == 10
    test_q = {builder.make("test", i).entry["question"] for i in range(10)}
    random.seed(5)
    before = random.getstate()
    train_q = [builder.make("train", i).entry["question"] for i in range(50)]
    assert random.getstate() == before
    assert not test_q & set(train_q)  # a tiny task space, yet no test question is trained on
    again = make_env_builder("reasoning_gym:leg_counting", args, seed=0)
    assert [again.make("train", i).entry["question"] for i in range(50)] == train_q


def test_composite_mixture():
    args = {"config": {"datasets": [{"name": "leg_counting", "weight": 1, "config": {}},
                                    {"name": "basic_arithmetic", "weight": 1, "config": {}}]}}
    builder = make_env_builder("reasoning_gym:composite", args, seed=0)
    sources = {builder.make("train", i).entry["metadata"]["source_dataset"] for i in range(20)}
    assert sources == {"leg_counting", "basic_arithmetic"}
    env = builder.make("train", 3)
    assert _reply(env, f"<answer>{env.entry['answer']}</answer>").reward == 1.0


def test_what_reasoning_gym_rejects_is_a_config_error():
    cases = [
        ({"type": "reasoning_gym:leg_count"}, "did you mean leg_counting"),
        ({"type": "reasoning_gym:leg_counting", "args": {"config": {"legs": 3}}},
         "unexpected keyword argument 'legs'"),
        ({"type": "reasoning_gym:leg_counting", "args": {"config": {"min_animals": 5, "max_animals": 2}}},
         "max_animals must be >= min_animals"),
        ({"type": "reasoning_gym:leg_counting", "args": {"config": {"size": 5}}}, "use train_size/test_size"),
        ({"type": "reasoning_gym:leg_counting", "args": {"answer_extraction": "xml"}},
         "answer_extraction must be"),
        ({"type": "reasoning_gym:leg_counting", "args": {"answer_extraction": "regex"}},
         "needs answer_regex"),
    ]
    for env, message in cases:
        with pytest.raises(ConfigError, match="environments.r.args") as err:
            load_config(None, [], base={"model_name": "m", "environments": {"r": env}})
        assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_reasoning_gym_trains_two_steps(tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    # power_function gives 0.01 for any parseable but wrong number and 0 for none: a random tiny model
    # already gets different rewards within a group, so the update has advantages to follow
    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=3, max_steps=2, max_tokens=12,
                      save_every=0, log_path=str(tmp_path / "run"),
                      local={"store_dir": str(tmp_path / "store")}, seed=1,
                      environments={"power": {"type": "reasoning_gym:power_function", "num_rollouts": 6,
                                              "max_turns": 1,
                                              "args": {"answer_extraction": "regex",
                                                       "answer_regex": r"-?\d+"}}})
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    traj = [json.loads(x) for step in (0, 1)
            for x in (tmp_path / "run" / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert len(traj) == 36
    for t in traj:
        assert t["error"] is None and t["num_turns"] == 1 and t["done_by_env"]
        assert t["reward"] in (0.0, 0.01, 1.0)
        assert (t["reward"] > 0) == (t["metrics"]["format_ok"] == 1.0)
        assert t["messages"][0]["role"] == "user" and "exponentiation" in t["messages"][0]["content"]
    assert {t["reward"] for t in traj} >= {0.0, 0.01}
    assert sum(r["optim/datums"] for r in rows) > 0
    assert all(np.isfinite(r["optim/loss"]) for r in rows if r["optim/datums"])
