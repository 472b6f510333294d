"""Writing an environment: the two forms a user writes (an ``EnvBuilder`` with its ``Env``s, and the
dataset + reward short form), the ways polyrl finds them (a file, a module, an installed package's
``polyrl.environments`` entry point, ``@register_env`` in a module the config loads), the checks at
config load and the field each error names, the success rule, and demonstrations of module
environments. The guide's snippets (docs/guides/environments.md) run here too."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
from scripted import ScriptedSampler

from polyrl.cli import main
from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, EnvConfig
from polyrl.envs.base import ENV_TYPES, StepResult
from polyrl.envs.registry import entry_points, env_types, get_env_builder, make_env_builder
from polyrl.renderers import get_renderer
from polyrl.rl.episode import Episode, RolloutSettings, finalize_reward, run_episode
from polyrl.rl.rollouts import EnvRuntime

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guides" / "environments.md"

ECHO = '''
from polyrl.envs.base import Env, EnvBuilder, Observation, StepResult


class EchoEnv(Env):
    def __init__(self, word):
        self.word = word

    async def reset(self):
        return Observation([{"role": "user", "content": f"Say {self.word}."}])

    async def step(self, action):
        return StepResult(reward=float(action["content"].strip() == self.word), done=True)


class EchoBuilder(EnvBuilder):
    def __init__(self, args, seed=0):
        super().__init__(args, seed)
        unknown = sorted(set(self.args) - {"words"})
        if unknown:
            raise ValueError(f"unknown arg {unknown[0]!r} (known: words)")
        self.words = self.args.get("words", ["hi", "yo"])

    def num_tasks(self, split):
        return len(self.words)

    def make(self, split, index):
        return EchoEnv(self.words[index])
'''

WORDS = '''
from polyrl.envs.base import SingleTurnEnv


def load_environment(word="z"):
    return SingleTurnEnv(dataset=[{"question": "Say a word.", "answer": word, "completion": word}],
                         rubric=lambda completion, answer: float(completion == answer))
'''


@pytest.fixture(autouse=True)
def registry_restored():
    """Names a test's own modules register are forgotten afterwards (polyrl's adapters, registered once
    when first imported, stay)."""
    before = set(ENV_TYPES)
    yield
    for name in set(ENV_TYPES) - before:
        if not ENV_TYPES[name].__module__.startswith("polyrl."):
            del ENV_TYPES[name]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def play(env, replies: list[str]) -> list[StepResult]:
    async def run():
        await env.reset()
        results = []
        for text in replies:
            results.append(await env.step({"role": "assistant", "content": text}))
            if results[-1].done:
                break
        await env.close()
        return results

    return asyncio.run(run())


def config_error(tmp_path: Path, environments: dict) -> str:
    (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": environments}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.yaml")
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------------------- loading
def test_an_env_builder_loads_from_its_file_with_or_without_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "echo_env.py", ECHO)
    for type_name in ("module:./echo_env.py", "module:./echo_env.py:EchoBuilder",
                      "module:echo_env.py:EchoBuilder", "module:./echo_env:EchoBuilder"):
        assert get_env_builder(type_name).__name__ == "EchoBuilder"
        builder = make_env_builder(type_name, {"words": ["a", "b"]}, seed=0)
        assert builder.num_tasks("train") == 2 and builder.type_name == type_name
        assert [r.reward for r in play(builder.make("train", 1), ["b"])] == [1.0]
        assert [r.reward for r in play(builder.make("train", 1), ["a"])] == [0.0]


def test_a_module_names_a_builder_a_loader_function_or_holds_one_builder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write(tmp_path / "userpkg" / "__init__.py", "")
    write(tmp_path / "userpkg" / "echo.py", ECHO)
    write(tmp_path / "userpkg" / "words.py", WORDS.replace("def load_environment", "def make_task"))
    assert get_env_builder("module:userpkg.echo:EchoBuilder").__name__ == "EchoBuilder"
    assert get_env_builder("module:userpkg.echo").__name__ == "EchoBuilder"  # its only EnvBuilder
    builder = make_env_builder("module:userpkg.words:make_task", {"word": "z"}, seed=0)
    assert builder.kind == "dataset" and builder.num_tasks("train") == 1
    assert [r.reward for r in play(builder.make("train", 0), ["z"])] == [1.0]


def test_an_installed_packages_entry_point_names_a_type(tmp_path, monkeypatch):
    """An installed package, as importlib.metadata sees one: a module and a dist-info directory whose
    entry_points.txt declares the ``polyrl.environments`` group (what pip writes from pyproject's
    ``[project.entry-points."polyrl.environments"]``)."""
    site = tmp_path / "site"
    write(site / "echo_pkg.py", ECHO)
    write(site / "words_pkg.py", WORDS)
    dist = site / "echo_pkg-1.0.dist-info"
    write(dist / "METADATA", "Metadata-Version: 2.1\nName: echo-pkg\nVersion: 1.0\n")
    write(dist / "entry_points.txt", "[polyrl.environments]\necho_words = echo_pkg:EchoBuilder\n"
                                     "say_word = words_pkg\nbroken_env = no_such_module_here:Thing\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    assert {"echo_words", "say_word", "broken_env"} <= set(entry_points()) <= set(env_types())

    load_config(None, base={"model_name": "m", "environments": {
        "mine": {"type": "echo_words", "args": {"words": ["x"]}}, "say_word": {"args": {"word": "q"}}}})
    builder = make_env_builder("echo_words", {"words": ["x"]}, seed=0)
    assert [r.reward for r in play(builder.make("train", 0), ["x"])] == [1.0]
    words = make_env_builder("say_word", {"word": "q"}, seed=0)  # a module with load_environment
    assert [r.reward for r in play(words.make("train", 0), ["q"])] == [1.0]

    error = config_error(tmp_path, {"mine": {"type": "echo_words", "args": {"wrds": ["x"]}}})
    assert error == "environments.mine.args: unknown arg 'wrds' (known: words)"
    error = config_error(tmp_path, {"mine": {"type": "broken_env"}})
    assert error.startswith("environments.mine.type: environment type 'broken_env' (entry point "
                            "'no_such_module_here:Thing'") and "failed to load: ModuleNotFoundError" in error
    error = config_error(tmp_path, {"mine": {"type": "echo_wrds"}})
    assert error.startswith("environments.mine.type: unknown environment type 'echo_wrds'")
    assert "echo_words" in error  # the installed names are among those listed


def test_a_name_registered_by_a_module_the_config_loads_names_other_entries(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "registering.py", ECHO.replace("class EchoBuilder", "@register_env('echo_registered')\n"
                                                    "class EchoBuilder").replace(
        "StepResult\n", "StepResult, register_env\n", 1))
    # the entry that loads the module comes after the one that uses its name
    config = load_config(None, base={"model_name": "m", "environments": {
        "named": {"type": "echo_registered", "args": {"words": ["a"]}},
        "loader": {"type": "module:./registering.py"}}})
    assert list(config.environments) == ["named", "loader"]
    assert get_env_builder("echo_registered").__name__ == "EchoBuilder"


def test_print_config_names_the_field_at_fault(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "echo_env.py", ECHO)
    write(tmp_path / "one.py", ECHO + "\n\nclass OtherBuilder(EchoBuilder):\n    pass\n")
    cases = [({"type": "module:./echo_env.py", "args": {"wrds": 1}},
              "environments.mine.args: unknown arg 'wrds' (known: words)"),
             ({"type": "module:my_envs.reverse:ReverseBuilder"},
              "environments.mine.type: environment module 'my_envs.reverse' not found"),
             ({"type": "module:./one.py"},
              "environments.mine.type: module:./one.py defines several EnvBuilders (EchoBuilder, "
              "OtherBuilder): name one, as in module:./one.py:EchoBuilder"),
             ({"type": "module:./echo_env.py:Nothing"},
              "environments.mine.type: ./echo_env.py has no 'Nothing'")]
    for entry, expected in cases:
        (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": {"mine": entry}}))
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--config_path", "run.yaml", "--print-config"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {expected}"), err


# ---------------------------------------------------------------------------- success
def success(step_rewards: list[float], metrics: dict | None = None, **settings) -> bool:
    ep = Episode("e", "train", 0, 0)
    ep.step_rewards, ep.metrics, ep.done_by_env = step_rewards, dict(metrics or {}), True
    finalize_reward(ep, RolloutSettings(max_turns=4, max_tokens=8, temperature=1.0, timeout=30, **settings))
    return ep.success


def test_success_is_full_marks_the_environments_verdict_or_the_entrys_threshold():
    assert not success([0.5]) and not success([0.0]) and success([1.0]) and success([0.5, 0.5])
    assert success([0.5], success_threshold=0.5) and not success([0.4], success_threshold=0.5)
    assert success([0.5], {"success": 1.0}) and not success([1.0], {"success": 0.0})  # the verdict wins
    assert not success([1.0], {"success": 1.0}, success_threshold=2.0)  # a threshold always decides
    assert EnvConfig().success_threshold is None


def test_partial_credit_through_a_run_of_the_reverse_example(tokenizer, monkeypatch):
    """The threshold reaches the episodes through the entry's config; the dataset form's ``success``
    function gives a verdict."""
    monkeypatch.chdir(REPO)
    renderer = get_renderer("qwen3", tokenizer)

    def episode(runtime: EnvRuntime, reply: str) -> Episode:
        builder = runtime.builder
        answer = builder.rows("train")[0]["answer"]
        text = answer if reply == "exact" else answer[1:] + answer[0]
        policy = ScriptedSampler(renderer, [{"role": "assistant", "content": text}])
        return asyncio.run(run_episode(builder.make("train", 0), Episode("reverse", "train", 0, 0), renderer,
                                       policy, runtime.settings))

    def runtime(**entry) -> EnvRuntime:
        return EnvRuntime.create("reverse", EnvConfig(type="module:examples/envs/reverse.py", **entry), 0, 8)

    plain = runtime()
    partial = episode(plain, "shuffled")
    assert partial.reward == 0.5 and not partial.success
    assert episode(plain, "exact").success
    lenient = episode(runtime(success_threshold=0.5), "shuffled")
    assert lenient.reward == 0.5 and lenient.success


def test_a_dataset_environments_success_function_is_its_verdict(tmp_path, tokenizer):
    write(tmp_path / "verdict.py", '''
        from polyrl.envs.base import SingleTurnEnv

        def load_environment():
            return SingleTurnEnv(dataset=[{"question": "Any anagram of ab?", "answer": "ab"}],
                                 rubric=lambda completion, answer: 1.0 if completion == answer else 0.5,
                                 success=lambda completion, answer: sorted(completion) == sorted(answer))
    ''')
    builder = make_env_builder(f"module:{tmp_path / 'verdict.py'}", {}, seed=0)
    renderer = get_renderer("qwen3", tokenizer)
    settings = RolloutSettings(max_turns=1, max_tokens=8, temperature=1.0, timeout=30)
    results = {}
    for reply in ("ba", "xy"):
        policy = ScriptedSampler(renderer, [{"role": "assistant", "content": reply}])
        results[reply] = asyncio.run(run_episode(builder.make("train", 0), Episode("v", "train", 0, 0),
                                                 renderer, policy, settings))
    assert results["ba"].reward == 0.5 and results["ba"].success and results["ba"].metrics["success"] == 1.0
    assert results["xy"].reward == 0.5 and not results["xy"].success


# ---------------------------------------------------------------------------- demonstrations
def test_module_environments_give_demonstrations(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    reverse = make_env_builder("module:examples/envs/reverse.py", {}, seed=0)
    messages, tools = reverse.demonstration("train", 0)
    row = reverse.rows("train")[0]
    assert messages == [{"role": "user", "content": row["question"]},
                        {"role": "assistant", "content": row["answer"]}] and tools == []
    guess = make_env_builder("module:examples/envs/guess.py:GuessBuilder", {}, seed=0)
    messages, _ = guess.demonstration("test", 3)
    assert [r.reward for r in play(guess.make("test", 3), [messages[-1]["content"]])] == [1.0]

    write(tmp_path / "stepdemo.py", '''
        class Say:
            def initial_observation(self, index):
                return f"Say {index}."

            def step(self, text):
                return 1.0

            async def demonstration(self, index):
                return None if index == 2 else str(index)

        def load_environment():
            return Say()
    ''')
    step = make_env_builder(f"module:{tmp_path / 'stepdemo.py'}", {}, seed=0)
    assert step.demonstration("train", 7) == ([{"role": "user", "content": "Say 7."},
                                               {"role": "assistant", "content": "7"}], [])
    assert step.demonstration("train", 2) is None
    write(tmp_path / "trl.py", '''
        from polyrl.envs.base import SingleTurnEnv

        def load_environment():  # TRL-style rows: prompt and completion messages
            row = {"prompt": [{"role": "user", "content": "q"}],
                   "completion": [{"role": "assistant", "content": "a"}]}
            return SingleTurnEnv(dataset=[row], rubric=lambda completion: 0.0)
    ''')
    assert make_env_builder(f"module:{tmp_path / 'trl.py'}", {}, seed=0).demonstration("train", 0) == (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], [])
    write(tmp_path / "nodemo.py", "from polyrl.envs.base import SingleTurnEnv\n"
                                  "def load_environment():\n"
                                  "    return SingleTurnEnv(dataset=[{'question': 'q'}],\n"
                                  "                         rubric=lambda completion: 0.0)\n")
    assert make_env_builder(f"module:{tmp_path / 'nodemo.py'}", {}, seed=0).demonstration("train", 0) is None


# ---------------------------------------------------------------------------- the guide
def guide_blocks() -> list[tuple[str, str]]:
    """The guide's fenced blocks as (language, text)."""
    return re.findall(r"^```(\w+)\n(.*?)^```", GUIDE.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)


def test_the_guide_shows_the_example_files_as_they_are():
    """The guide reads whole raw (no include directives): each block after "`examples/...`:" is that
    file, so the two cannot drift; it sends the reader to no source file of polyrl's."""
    text = GUIDE.read_text(encoding="utf-8")
    assert "--8<--" not in text and "polyrl/" not in text
    shown = re.findall(r"`(examples/[^`]+)`:\n\n```\w+\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert sorted(name for name, _ in shown) == ["examples/envs/guess.py", "examples/envs/guess.yaml",
                                                 "examples/envs/reverse.py"]
    for name, code in shown:
        assert code == (REPO / name).read_text(encoding="utf-8"), f"{GUIDE.name} shows {name} as it was"


def run_polyrl(line: str, cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.chdir(cwd)
    capsys.readouterr()  # what came before is not the command's
    code = 0
    try:
        main(shlex.split(line)[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_guides_code_runs(tmp_path, monkeypatch, capsys):
    """Every block of docs/guides/environments.md is real: python runs, YAML is a config that loads, the
    TOML's entry point loads the example it names once installed, each polyrl command runs (a text block
    after it is what it prints)."""
    blocks = guide_blocks()
    assert {lang for lang, _ in blocks} == {"python", "yaml", "toml", "sh", "text"}
    for i, (lang, code) in enumerate(blocks):
        if lang == "python":
            monkeypatch.chdir(REPO)
            exec(compile(code, f"{GUIDE}:block{i}", "exec"), {"__name__": f"guide_block{i}"})  # noqa: S102
        elif lang == "yaml":
            monkeypatch.chdir(REPO)
            (tmp_path / f"block{i}.yaml").write_text(code)
            assert load_config(tmp_path / f"block{i}.yaml").environments
        elif lang == "toml":
            points = tomllib.loads(code)["project"]["entry-points"]["polyrl.environments"]
            listed = "".join(f"{k} = {v}\n" for k, v in points.items())
            dist = write(tmp_path / "site" / "guess_env-0.1.0.dist-info" / "entry_points.txt",
                         "[polyrl.environments]\n" + listed).parent
            write(dist / "METADATA", "Metadata-Version: 2.1\nName: guess-env\nVersion: 0.1.0\n")
            monkeypatch.syspath_prepend(str(tmp_path / "site"))
            monkeypatch.syspath_prepend(str(REPO / "examples" / "envs"))  # the package's module
            monkeypatch.delitem(sys.modules, "guess", raising=False)
            builder = make_env_builder("guess", {"high": 4}, seed=0)
            assert play(builder.make("train", 0), [str(builder.secret("train", 0))])[0].reward == 1.0
        elif lang == "sh":
            for line in code.splitlines():
                assert line.startswith("polyrl "), line
                where = tmp_path if " init-env " in line else REPO
                status, output = run_polyrl(line, where, monkeypatch, capsys)
                expected = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None
                if expected is not None:
                    assert output == expected, output
                else:
                    assert status == 0, output
    assert (tmp_path / "runs" / "guide" / "word-case" / "train.yaml").is_file()  # init-env wrote its package
