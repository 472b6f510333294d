"""``module:`` environments: a step-based module loaded by file path and a dataset + rubric module
with ``build(sampling_client)`` loaded by dotted path (tests/fixtures), config-load errors, reward
shapes and non-numeric rewards, and a whole ``polyrl train`` run over both."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scripted import ScriptedSampler

from polyrl.cli import main as cli_main
from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.base import StepResult
from polyrl.envs.module_env import ModuleBuilder, RewardCoercion, parse_rubric, parse_step
from polyrl.envs.registry import get_env_builder, make_env_builder
from polyrl.renderers import get_renderer
from polyrl.rl.episode import Episode, RolloutSettings, run_episode

REPO = Path(__file__).resolve().parents[1]
STEP_FILE = "tests/fixtures/module_step_env.py"
RUBRIC_MODULE = "tests.fixtures.module_rubric_env"


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root with it on sys.path (file paths and dotted paths both resolve)."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))


def _settings(**kw):
    return RolloutSettings(**{"max_turns": 4, "max_tokens": 32, "temperature": 1.0, "timeout": 30, **kw})


# ---------------------------------------------------------------------------- config load
@pytest.mark.parametrize("entry,field,needle", [
    ({"type": "module:"}, "type", "module:<dotted.module or path/file.py>"),
    ({"type": "module:no_such_pkg.envs"}, "type", "module 'no_such_pkg.envs' not found"),
    ({"type": "module:json"}, "type", "json has neither a load_environment() function nor an EnvBuilder"),
    ({"type": "module:tests/fixtures/missing_env.py"}, "type", "environment file not found"),
    ({"type": f"module:{STEP_FILE}:no_such_name"}, "type", "has no 'no_such_name'"),
    ({"type": f"module:{STEP_FILE}", "args": {"max_turns": 3}}, "args", "unknown arg 'max_turns'"),
])
def test_module_problems_fail_at_config_load(in_repo, tmp_path, entry, field, needle):
    """A module that cannot be found is the entry's type's fault; args its loader refuses, the args'."""
    (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": {"mine": entry}}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.yaml")
    assert needle in str(err.value) and str(err.value).startswith(f"environments.mine.{field}:")


def test_objects_of_the_wrong_shape_fail_before_the_run(tmp_path):
    (tmp_path / "shapeless.py").write_text("def load_environment():\n    return object()\n")
    with pytest.raises(ValueError, match="neither initial_observation"):
        make_env_builder(f"module:{tmp_path / 'shapeless.py'}", {}, seed=0)
    (tmp_path / "badrubric.py").write_text(
        "class E:\n    dataset = [{'question': 'q'}]\n    rubric = [(len, 'heavy')]\n"
        "def load_environment():\n    return E()\n")
    with pytest.raises(ValueError, match="weight of 'len' must be a number"):
        make_env_builder(f"module:{tmp_path / 'badrubric.py'}", {}, seed=0)
    (tmp_path / "norows.py").write_text(
        "class E:\n    dataset = [{'text': 'q'}]\n    rubric = [len]\n"
        "def load_environment():\n    return E()\n")
    with pytest.raises(ValueError, match="need a 'prompt' or a 'question'"):
        make_env_builder(f"module:{tmp_path / 'norows.py'}", {}, seed=0)


USER_ENV = """
import random
from polyrl.envs.base import SingleTurnEnv

WORDS = ["cat", "dog", "sun", "map", "pen"]


def upper_match(completion, answer):
    return float(completion.strip() == answer)


def score(response, answer):
    return float(response == answer)


def verdict(completion, expected):
    return completion == expected


def lenient(completion="", answer=""):
    return 1.0


def load_environment(num_test: int = 2, seed: int = 0, reward: str = "upper_match", rubric: bool = True,
                     success: bool = False):
    if num_test < 1 or num_test >= len(WORDS):
        raise ValueError(f"num_test must be in 1..{len(WORDS) - 1}, got {num_test}")
    rows = [{"question": w, "answer": w.upper()} for w in WORDS]
    random.Random(seed).shuffle(rows)
    kwargs = {"rubric": globals()[reward]} if rubric else {}
    if success:
        kwargs["success"] = verdict
    return SingleTurnEnv(dataset=rows[num_test:], eval_dataset=rows[:num_test], **kwargs)
"""

STEP_ENV = """
class Task:
    def initial_observation(self):
        return "say hi"

    def step(self, text):
        return float(text == "hi")


def load_environment(turns: int = 1):
    if turns != 1:
        raise ValueError(f"only one turn, not {turns}")
    return Task()
"""


@pytest.mark.parametrize("entry,expected", [
    ({"args": {"num_test": 40}},
     "environments.upper.args: num_test must be in 1..4, got 40 (user_env.py.load_environment() raised "
     "ValueError)"),
    ({"args": {"num_test": "x"}}, "environments.upper.args: '<' not supported between instances of 'str' and "
                                  "'int' (user_env.py.load_environment() raised TypeError)"),
    ({"args": {"rubric": False}}, "environments.upper.args: SingleTurnEnv.__init__() missing 1 required "
                                  "positional argument: 'rubric' (user_env.py.load_environment() raised "
                                  "TypeError)"),
    ({"args": {"nm_test": 3}}, "environments.upper.args: user_env.py.load_environment does not take these "
                               "args: unknown arg 'nm_test' (did you mean num_test?) (known: num_test, seed, "
                               "reward, rubric, success)"),
    ({"args": {"reward": "score"}},
     "environments.upper.type: module:user_env.py: reward function 'score' has a parameter 'response', which "
     "polyrl does not pass: it is called with those it names among completion, prompt, messages, answer, "
     "row, info, index, split, sampling_client (or all, given **kwargs)"),
    ({"args": {"success": True}}, "environments.upper.type: module:user_env.py: function 'success' has a "
                                  "parameter 'expected', which polyrl does not pass"),
    ({"type": "module:user_env.py:upper_match"},
     "environments.upper.type: module:user_env.py:upper_match: upper_match(completion, answer) looks like a "
     "reward function, not an environment: a module: type names a load_environment(**args)-like function"),
    ({"type": "module:user_env.py:lenient"},
     "environments.upper.type: module:user_env.py:lenient: lenient() returned 1.0 (type float) with neither "
     "initial_observation() and step(text) nor a dataset and a rubric"),
    ({"type": "module:step_env.py", "args": {"turns": 2}},
     "environments.upper.args: only one turn, not 2 (step_env.py.load_environment() raised ValueError)"),
])
def test_what_the_users_load_environment_raises_is_one_line_at_config_load(tmp_path, monkeypatch, capsys,
                                                                           entry, expected):
    """load_environment runs when the config loads (dataset and step-based alike): what its code raises
    names the args, an object or a function that is no environment names the type; `polyrl train` stops
    there with one line and exit 2, before a run file is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_env.py").write_text(USER_ENV)
    (tmp_path / "step_env.py").write_text(STEP_ENV)
    config = {"model_name": "m", "log_path": "runs/x",
              "environments": {"upper": {"type": "module:user_env.py", **entry}}}
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    for extra in (["--print-config"], []):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["train", "--config_path", "run.yaml", *extra])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {expected}"), err
    assert not (tmp_path / "runs").exists()
    good = {**config, "environments": {"upper": {"type": "module:user_env.py", "args": {"num_test": 3}}}}
    assert load_config(None, base=good).environments["upper"].args == {"num_test": 3}


def test_a_mistyped_entry_name_in_an_override_is_suggested(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_env.py").write_text(USER_ENV)
    (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": {
        "upper": {"type": "module:user_env.py"}}}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.yaml", ["environments.uper.num_rollouts=4"])
    assert str(err.value) == ("environments.uper.type: unknown environment type 'uper' (did you mean upper? "
                              "An entry without a type takes its name as the type)")


def test_dotted_module_names_are_found_under_the_working_directory(tmp_path, monkeypatch):
    """As `python -m` finds them: `module:envs.user_env` is envs/user_env.py of the working directory."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "user_env_dotted.py").write_text(USER_ENV)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    config = load_config(None, base={"model_name": "m", "environments": {
        "upper": {"type": "module:envs.user_env_dotted", "args": {"num_test": 3}}}})
    assert make_env_builder(config.environments["upper"].type, {"num_test": 3}).num_tasks("test") == 3


# ---------------------------------------------------------------------------- shapes
def test_step_results_rubrics_and_reward_coercion(caplog):
    coerce = RewardCoercion("module:x")
    assert parse_step(0.5, coerce) == StepResult([], 0.5, True, {})
    r = parse_step({"reward": 1, "observation": "again", "metrics": {"n": 2}}, coerce)
    assert (r.messages, r.reward, r.done, r.metrics) == ([{"role": "user", "content": "again"}], 1.0, False,
                                                         {"n": 2.0})
    assert parse_step({"reward": 2, "observation": "bye", "done": True}, coerce).done
    r = parse_step(("next", 0.25, False, False, {"k": 1}), coerce)
    assert (r.messages[0]["content"], r.reward, r.done, r.metrics) == ("next", 0.25, False, {"k": 1.0})
    assert parse_step(("end", 1.0, True), coerce).messages == []
    assert parse_step(np.float32(0.75), coerce).reward == 0.75
    with caplog.at_level(logging.WARNING, logger="polyrl.envs.module_env"):
        for bad in ("1.0", None, float("nan"), [1]):
            r = parse_step({"reward": bad, "done": True}, coerce)
            assert r.reward == 0.0 and r.metrics == {"non_numeric_reward": 1.0}
    assert coerce.count == 4 and "is not a number; counted as 0" in caplog.text

    def f(completion):
        return 1.0

    class VfStyle:
        funcs, weights = [f, len], [2.0, 0.5]

    assert [(n, w) for n, _, w in parse_rubric(VfStyle(), "x")] == [("f", 2.0), ("len", 0.5)]
    assert [(n, w) for n, _, w in parse_rubric({"a": f, "b": (f, 3)}, "x")] == [("a", 1.0), ("b", 3.0)]
    assert [(n, w) for n, _, w in parse_rubric(f, "x")] == [("f", 1.0)]


def test_step_module_by_file_path_plays_multi_turn_episodes(in_repo, tokenizer, caplog):
    assert get_env_builder(f"module:{STEP_FILE}") is ModuleBuilder
    builder = make_env_builder(f"module:{STEP_FILE}", {"max_tries": 3}, seed=0)
    assert builder.kind == "step" and not builder.drives_rollouts
    assert builder.num_tasks("train") == 5 and builder.num_tasks("test") == 2
    renderer = get_renderer("qwen3", tokenizer)
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "xyz"},
                                        {"role": "assistant", "content": "banana"}])
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("m", "train", 0, 0), renderer, policy,
                                 _settings()))
    assert ep.messages[0] == {"role": "user", "content": "Reply with a word containing the letter a."}
    assert ep.messages[2] == {"role": "user", "content": "No. Try again."}
    assert (ep.step_rewards == [0.0, 1.0] and ep.reward == 1.0 and ep.done_by_env
            and ep.metrics["tries"] == 2.0)
    # every episode gets a fresh object: a second episode starts over
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "xyz"}] * 3)
    ep = asyncio.run(run_episode(builder.make("train", 1), Episode("m", "train", 1, 0), renderer, policy,
                                 _settings()))
    assert ep.step_rewards == [0.0, 0.0, 0.0] and ep.done_by_env and ep.num_turns == 3

    bad = make_env_builder(f"module:{STEP_FILE}", {"bad_reward": True}, seed=0)
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "anything"}])
    with caplog.at_level(logging.WARNING, logger="polyrl.envs.module_env"):
        ep = asyncio.run(run_episode(bad.make("train", 2), Episode("m", "train", 2, 0), renderer, policy,
                                     _settings()))
    assert (ep.reward == 0.0 and ep.metrics["non_numeric_reward"] == 1.0
            and "'lots' is not a number" in caplog.text)


# ---------------------------------------------------------------------------- polyrl train
@pytest.mark.slow
def test_train_on_a_step_module_and_a_rubric_module_with_build(in_repo, tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(
        model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=6, save_every=0,
        learning_rate=1e-3, log_path=str(tmp_path / "run"), local={"store_dir": str(tmp_path / "store")},
        seed=2, outputs={"report": False},
        environments={
            "letters": {"type": f"module:{STEP_FILE}", "num_rollouts": 3, "max_turns": 2,
                        "args": {"max_tries": 2}},
            "judged": {"type": f"module:{RUBRIC_MODULE}", "num_rollouts": 3, "max_turns": 1,
                       "args": {"letter": "a"}},
        })
    train(cfg, ConsoleLog(enabled=False))

    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollouts/failed"] == 0 for r in rows)
    for step in range(2):
        traj = [json.loads(x)
                for x in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert sorted(t["env"] for t in traj) == ["judged"] * 3 + ["letters"] * 3
        for t in traj:
            replies = [m["content"] for m in t["messages"] if m["role"] == "assistant"]
            assert t["error"] is None and len(replies) == t["num_turns"] and sum(t["action_mask"]) > 0
            if t["env"] == "letters":
                letter = "aeiou"[t["task_index"] % 5]
                hit = [letter in r for r in replies]
                assert t["reward"] == float(any(hit)) and t["done_by_env"]
                assert t["step_rewards"] == [float(h) for h in hit] and 1 <= t["num_turns"] <= 2
            else:
                m = t["metrics"]
                assert t["messages"][0] == {"role": "system", "content": "Answer with one word."}
                assert m["reward/contains_answer"] == float("a" in replies[0])
                assert 0.0 < m["reward/model_confidence"] <= 1.0
                assert m["reward/builds_seen"] == step + 1  # built once per new sampler
                assert math.isclose(t["reward"],
                                    m["reward/contains_answer"] + 0.5 * m["reward/model_confidence"],
                                    rel_tol=1e-6)
        assert rows[step]["env/judged/reward/model_confidence"] > 0


def test_step_module_with_build_gets_the_rollouts_sampler(tmp_path, tokenizer):
    from polyrl.rl.episode import RolloutContext

    (tmp_path / "built.py").write_text(
        "class E:\n"
        "    sampler = None\n"
        "    def build(self, sampling_client):\n        self.sampler = sampling_client\n"
        "    def initial_observation(self):\n"
        "        return {'messages': [{'role': 'user', 'content': 'hi'}]}\n"
        "    async def step(self, message):\n"
        "        return {'reward': 1.0 if self.sampler is not None else -1.0,"
        " 'metrics': {'n': len(message)}}\n"
        "def load_environment():\n    return E()\n")
    builder = make_env_builder(f"module:{tmp_path / 'built'}", {}, seed=0)  # '.py' may be left out
    assert builder.drives_rollouts
    renderer = get_renderer("qwen3", tokenizer)
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "ok"}])
    ctx = RolloutContext("m", "train", 0, 0, policy, renderer, _settings(), None)
    [ep] = asyncio.run(builder.rollout(ctx))
    assert ep.reward == 1.0 and ep.done_by_env and ep.metrics["n"] >= 2  # step got the whole message


# ---------------------------------------------------------------------------- package directories
def test_package_directories_load_as_packages(tmp_path, monkeypatch):
    """``module:./environments/my_task`` (Minds RL's layout: relative imports inside the package) and
    a project directory holding ``name/__init__.py`` both load; a directory without either is a
    one-line error."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(REPO / "tests/fixtures/minds/environments", tmp_path / "environments")
    project = tmp_path / "environments" / "proj_task" / "proj_task"
    project.mkdir(parents=True)
    (project.parent / "pyproject.toml").write_text("[project]\nname = 'proj-task'\n")
    (project / "__init__.py").write_text("from .game import load_environment\n")
    (project / "game.py").write_text("from .rules import REWARD\n\nclass G:\n"
                                     "    def initial_observation(self):\n        return 'go'\n"
                                     "    def step(self, text):\n        return REWARD\n\n"
                                     "def load_environment():\n    return G()\n")
    (project / "rules.py").write_text("REWARD = 0.5\n")

    builder = make_env_builder("module:./environments/my_task", {"word": "z"}, seed=0)
    env = builder.make("train", 0)
    obs = asyncio.run(env.reset())
    assert obs.messages == [{"role": "user", "content": "Reply with the letter z."}]
    assert asyncio.run(env.step({"role": "assistant", "content": "z!"})).reward == 1.0
    unfixed = make_env_builder("module:environments/my_task/", {}, seed=0).make("train", 2)
    assert asyncio.run(unfixed.reset()).messages[0]["content"] == "Reply with the letter c."

    env = make_env_builder("module:./environments/proj_task", {}, seed=0).make("train", 0)
    asyncio.run(env.reset())
    assert asyncio.run(env.step({"role": "assistant", "content": "x"})).reward == 0.5

    (tmp_path / "environments" / "empty").mkdir()
    (tmp_path / "run.yaml").write_text(json.dumps(
        {"model_name": "m", "environments": {"e": {"type": "module:./environments/empty"}}}))
    with pytest.raises(ConfigError, match="environment directory ./environments/empty has no __init__.py"):
        load_config(tmp_path / "run.yaml")


def test_dataset_rows_with_images_and_step_modules_with_image_parts(tmp_path, vl_tokenizer):
    """A dataset row's ``image`` goes before its question as an image part; a step module's observation
    may hold image parts (here a file path); both reach a vision-language renderer as images."""
    from PIL import Image

    Image.new("RGB", (64, 64), (0, 0, 255)).save(tmp_path / "blue.png")
    (tmp_path / "pictures.py").write_text(
        "from PIL import Image\n"
        "class E:\n"
        "    dataset = [{'question': 'Colour?', 'image': Image.new('RGB', (64, 64), (255, 0, 0)),"
        " 'answer': 'red'}]\n"
        "    rubric = [lambda completion, answer: float(answer in completion)]\n"
        "def load_environment():\n    return E()\n")
    (tmp_path / "steps.py").write_text(
        "class E:\n"
        f"    def initial_observation(self):\n"
        "        return {'role': 'user', 'content': "
        f"[{{'type': 'image', 'image': {str(tmp_path / 'blue.png')!r}}},\n"
        "                                             {'type': 'text', 'text': 'Colour?'}]}\n"
        "    def step(self, text):\n        return float('blue' in text)\n"
        "def load_environment():\n    return E()\n")
    renderer = get_renderer("qwen3_vl_instruct", vl_tokenizer)
    for name, reply in (("pictures.py", "red"), ("steps.py", "blue")):
        builder = make_env_builder(f"module:{tmp_path / name}", {}, seed=0)
        sampler = _VlSampler(vl_tokenizer, reply)
        ep = asyncio.run(run_episode(builder.make("train", 0), Episode("m", "train", 0, 0), renderer, sampler,
                                     _settings()))
        assert ep.error is None and ep.reward == 1.0, (name, ep.error)
        assert [[c.expected_tokens for c in i.chunks if c.type == "image"] for i in sampler.inputs] == [[4]]
        assert ep.messages[0]["content"][0] == {"type": "image", "image": ep.images[0].name, "width": 64,
                                                "height": 64}


class _VlSampler:
    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.inputs = tokenizer, reply, []

    async def sample(self, prompt, num_samples, params):
        from tinker import types

        self.inputs.append(prompt)
        tokens = self.tokenizer.encode(self.reply, add_special_tokens=False)
        tokens.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return types.SampleResponse(sequences=[types.SampledSequence(
            stop_reason="stop", sequence_id="s", tokens_np=np.array(tokens, np.int32),
            logprobs_np=np.zeros(len(tokens), np.float32))])
