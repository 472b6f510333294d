"""GEM adapter (``gem:<env_id>``) with the real gem-llm package, offline."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
from scripted import ScriptedSampler

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.registry import make_env_builder
from polyrl.renderers import get_renderer
from polyrl.rl.episode import Episode, RolloutSettings, run_episode

GUESS = "gem:game:GuessTheNumber-v0-easy"


def _rng_state():
    return random.getstate(), np.random.get_state()[1].tobytes()


def _guess(n: int) -> dict:
    return {"role": "assistant", "content": f"My guess is \\boxed{{{n}}}"}


async def _secret(builder, split: str, index: int) -> int:
    """The secret of a task, found by asking the real environment."""
    for n in range(1, 11):
        env = builder.make(split, index)
        await env.reset()
        if (await env.step(_guess(n))).metrics["success"]:
            return n
    raise AssertionError("no secret in 1..10")


def test_tasks_are_seeded_per_split_and_leave_the_global_rng_alone():
    builder = make_env_builder(GUESS, {}, seed=3)
    assert builder.type_name == GUESS
    train = [builder.task_seed("train", i) for i in range(50)]
    test = [builder.task_seed("test", i) for i in range(50)]
    assert all(s % 2 == 0 for s in train) and all(s % 2 == 1 for s in test)  # disjoint splits
    assert len(set(train)) == 50

    random.seed(1234)
    np.random.seed(99)
    before = _rng_state()
    secrets = [asyncio.run(_secret(builder, "train", i)) for i in range(8)]
    assert _rng_state() == before  # GEM re-seeds the globals, but only on the episode's private copy
    assert secrets == [asyncio.run(_secret(builder, "train", i)) for i in range(8)]  # deterministic
    assert len(set(secrets)) > 1  # and tasks differ
    other = make_env_builder(GUESS, {}, seed=4)
    assert [asyncio.run(_secret(other, "train", i)) for i in range(8)] != secrets  # the run seed matters


def test_interleaved_episodes_do_not_disturb_each_other():
    builder = make_env_builder("gem:game:Minesweeper-v0-easy", {}, seed=0)

    async def play(index, moves):
        env = builder.make("train", index)
        out = [(await env.reset()).messages[-1]["content"]]
        for move in moves:
            result = await env.step({"role": "assistant", "content": move})
            out.append(result.messages[0]["content"] if result.messages else "")
            if result.done:
                break
        return out

    moves = ["\\boxed{reveal 2 2}", "\\boxed{reveal 0 0}", "\\boxed{reveal 4 4}"]
    alone = asyncio.run(play(1, moves))

    async def together():
        return await asyncio.gather(play(1, moves), play(2, moves), play(1, moves))

    first, _, again = asyncio.run(together())
    assert first == alone == again


def test_multi_turn_episode_with_per_step_rewards(tokenizer):
    builder = make_env_builder(GUESS, {"wrappers": ["episode_tracking"]}, seed=0)
    secret = asyncio.run(_secret(builder, "train", 5))
    wrong = [n for n in range(1, 11) if n != secret][:2]
    renderer = get_renderer("qwen3", tokenizer)
    policy = ScriptedSampler(renderer, [_guess(wrong[0]), _guess(wrong[1]), _guess(secret)])
    settings = RolloutSettings(max_turns=4, max_tokens=32, temperature=1.0, timeout=30)
    ep = asyncio.run(run_episode(builder.make("train", 5), Episode("guess", "train", 5, 0), renderer, policy,
                                 settings))
    assert ep.step_rewards == [0.0, 0.0, 1.0] and ep.reward == 1.0 and ep.success and ep.done_by_env
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant", "user", "assistant",
                                                "user"]
    assert "Guess The Number" in ep.messages[0]["content"]
    feedback = ep.messages[2]["content"]
    assert "the target number is" in feedback and feedback.endswith("Enter your next guess.")
    assert ep.metrics["info/step_counter"] == 3.0
    # GEM's observations are user turns of the chat template, appended after each sampled reply
    for prompt, (start, _) in zip(policy.prompts, ep.turn_spans):
        assert prompt == ep.tokens[:start]
    assert "<|im_start|>user\nAt turn 1" in tokenizer.decode(ep.tokens)


def test_gem_plain_template_renderer(tokenizer):
    builder = make_env_builder(GUESS, {}, seed=0)
    renderer = get_renderer("qwen3_game", tokenizer)
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "no idea"}])
    settings = RolloutSettings(max_turns=4, max_tokens=32, temperature=1.0, timeout=30)
    ep = asyncio.run(run_episode(builder.make("test", 0), Episode("guess", "test", 0, 0), renderer, policy,
                                 settings))
    text = tokenizer.decode(ep.tokens)
    assert text.startswith("<|im_start|>user\nYou are playing language games. Make valid actions to win.\n"
                           "Observation: You are playing Guess The Number.")
    assert ep.step_rewards == [-0.1] and not ep.success  # GEM's format-error reward ends the game


def test_python_tool_wrapper_runs_code_offline():
    builder = make_env_builder(GUESS, {"wrappers": "python_tool"}, seed=0)
    env = builder.make("train", 0)
    obs = asyncio.run(env.reset())
    assert "<python>" in obs.messages[-1]["content"]
    result = asyncio.run(env.step({"role": "assistant", "content": "<python>print(6 * 7)</python>"}))
    assert not result.done and result.messages[0]["content"].startswith("Code execution result: 42")
    assert result.reward == pytest.approx(0.3)  # GEM's tool_reward + tool_success_reward


def test_reward_validation_counts_non_numbers():
    from polyrl.envs.gem_env import GemEnv

    class Fake:
        def reset(self, seed=None):
            return "hello", {}

        def step(self, action):
            return "bye", "1.0", True, False, {}

    builder = make_env_builder(GUESS, {}, seed=0)
    env = GemEnv(builder.spec, Fake(), 1)
    asyncio.run(env.reset())
    result = asyncio.run(env.step({"role": "assistant", "content": "x"}))
    assert result.reward == 0.0 and result.metrics["reward_invalid"] == 1.0 and result.done


def _load(env: dict) -> TrainConfig:
    return load_config(None, [], base={"model_name": "m", "environments": {"g": env}})


def test_what_gem_cannot_do_here_is_a_config_error(monkeypatch):
    cases = [
        ({"type": "gem:game:GuessTheNumber-v9"}, "did you mean game:GuessTheNumber"),
        ({"type": GUESS, "args": {"wrappers": ["concat"]}}, "'concat' is not supported"),
        ({"type": GUESS, "args": {"wrapper": ["concat"]}}, "unknown arg 'wrapper'"),
        ({"type": GUESS, "args": {"wrappers": ["search_tool"]}}, "SEARCH_URL"),
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("SEARCH_URL", raising=False)
    cases.append(({"type": "gem:math:GSM8K"}, "downloads its data set from the Hugging Face hub"))
    import nltk

    try:
        nltk.data.find("corpora/words")
    except LookupError:
        cases.append(({"type": "gem:game:Wordle-v0-easy"}, "needs the nltk 'words' corpus"))
    for env, message in cases:
        with pytest.raises(ConfigError, match="environments.g.args") as err:
            _load(env)
        assert message in str(err.value) and "\n" not in str(err.value)
    assert _load({"type": GUESS, "args": {"wrappers": "episode_tracking"}}).environments["g"].type == GUESS


@pytest.mark.slow
def test_gem_trains_two_steps(tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=8,
                      save_every=0, log_path=str(tmp_path / "run"),
                      local={"store_dir": str(tmp_path / "store")}, renderer="qwen3_game",
                      environments={"guess": {"type": GUESS, "num_rollouts": 3, "max_turns": 4,
                                              "args": {"wrappers": ["episode_tracking"]}}})
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episodes/count"] == 6 and r["rollouts/failed"] == 0
        assert -0.1 <= r["env/guess/reward/mean"] <= 1.0
    for step in (0, 1):
        path = tmp_path / "run" / "trajectories" / f"step_{step:06d}.jsonl"
        traj = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(traj) == 6
        for t in traj:
            assert t["error"] is None and t["env"] == "guess"
            assert t["messages"][0]["role"] == "user" and "Guess The Number" in t["messages"][0]["content"]
            assert len(t["step_rewards"]) == t["num_turns"] >= 1
            assert t["reward"] == pytest.approx(sum(t["step_rewards"]))
            assert all(r == -0.1 or 0.0 <= r <= 1.0 for r in t["step_rewards"])  # GEM's reward scale
            assert "<|im_start|>user\nYou are playing language games" in "".join(t["token_text"])


def test_gem_visual_math_observations_carry_their_images(tmp_path, monkeypatch, vl_tokenizer):
    """GEM's visual math environment (``math:Geometry3K``) on a local data set in the hub one's format:
    its ``{"problem", "images"}`` observation becomes image parts and the problem's text; a Qwen3-VL
    renderer renders each image, and the grader rewards the right answer."""
    import datasets
    from PIL import Image
    from tinker import types

    rows = {"problem": [f"What is {a} + {a}?" for a in range(4)],
            "images": [[Image.new("RGB", (64, 64), (40 * a, 90, 200))] for a in range(4)],
            "answer": [str(2 * a) for a in range(4)]}
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.Sequence(datasets.Image())})
    (tmp_path / "geo" / "data").mkdir(parents=True)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(
        str(tmp_path / "geo" / "data" / "train-00000-of-00001.parquet"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = {"env_kwargs": {"dataset_name": str(tmp_path / "geo"), "use_mp": False}}
    builder = make_env_builder("gem:math:Geometry3K", args, seed=0)
    obs = asyncio.run(builder.make("train", 0).reset())
    content = obs.messages[-1]["content"]
    assert [p["type"] for p in content] == ["image", "text"] and content[1]["text"].startswith("What is ")
    answer = 2 * int(content[1]["text"].split()[2])
    renderer = get_renderer("qwen3_vl_instruct", vl_tokenizer)

    class Sampler:
        async def sample(self, prompt, num_samples, params):
            assert [c.expected_tokens for c in prompt.chunks if c.type == "image"] == [4]
            tokens = vl_tokenizer.encode(f"\\boxed{{{answer}}}", add_special_tokens=False)
            tokens.append(vl_tokenizer.convert_tokens_to_ids("<|im_end|>"))
            return types.SampleResponse(sequences=[types.SampledSequence(
                stop_reason="stop", sequence_id="s", tokens_np=np.array(tokens, np.int32),
                logprobs_np=np.zeros(len(tokens), np.float32))])

    settings = RolloutSettings(max_turns=1, max_tokens=16, temperature=1.0, timeout=60)
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("geo", "train", 0, 0), renderer, Sampler(),
                                 settings))
    assert ep.error is None and ep.reward == 1.0 and len(ep.images) == 1
    assert ep.messages[0]["content"][0]["image"] == ep.images[0].name
