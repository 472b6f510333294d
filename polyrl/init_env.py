"""``polyrl init-env NAME [DIR]``: a new environment as a package of its own.

It writes, into a new (or empty) directory:

- ``<module>.py``: the environment, in the single-turn short form (a dataset and a reward function,
  :class:`polyrl.envs.base.SingleTurnEnv`), with demonstrations for ``polyrl sft``;
- ``test_<module>.py``: its checks, without a model (``pytest`` in the directory runs them);
- ``pyproject.toml``: the package, declaring the environment under ``NAME`` in the
  ``polyrl.environments`` entry-point group, so ``type: NAME`` finds it once it is installed;
- ``train.yaml``: a run config that trains on it as written, loading it from its file;
- ``sft.yaml``: a ``polyrl sft`` config that warm-starts the model on its demonstrations, for
  ``train.yaml``'s ``resume_from``;
- ``README.md``: what to change and how to run it.
"""

from __future__ import annotations

import re
from pathlib import Path

from polyrl.errors import UserInputError

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

ENVIRONMENT = '''"""{name}: a polyrl environment in the single-turn short form: a dataset and a reward.

Replace WORDS and ``rows`` with your prompts and ``reward`` with your scoring. A row holds a
``question`` (or a ``prompt``: a string or chat messages), what the reward reads (``answer``) and,
for ``polyrl sft`` warm starts, the expert's reply (``completion``). A multi-turn environment
subclasses polyrl.envs.base.EnvBuilder instead (polyrl's docs: guides/environments.md).
"""

from __future__ import annotations

from polyrl.envs.base import SingleTurnEnv

WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "honey", "ocean",
         "maple", "sugar", "candle", "forest", "silver", "winter"]


def rows(words: list[str]) -> list[dict]:
    return [{{"question": f"Write the word '{{w}}' in capital letters. Reply with the word only.",
             "answer": w.upper(), "completion": w.upper()}} for w in words]


def reward(completion: str, answer: str) -> float:
    """1.0 for the answer exactly; 0.5 (partial credit, not a success) when only the case differs."""
    reply = completion.strip().strip(".")
    if reply == answer:
        return 1.0
    return 0.5 if reply.lower() == answer.lower() else 0.0


def load_environment(num_test: int = 4) -> SingleTurnEnv:
    """The config entry's ``args`` arrive here as keyword arguments."""
    return SingleTurnEnv(dataset=rows(WORDS[num_test:]), eval_dataset=rows(WORDS[:num_test]), rubric=reward)
'''

TEST = '''"""Checks of {name} without a model: run ``pytest`` in this directory."""

from __future__ import annotations

import asyncio

import {module}
from polyrl.envs.registry import make_env_builder


def test_the_reward_gives_full_marks_partial_credit_and_nothing():
    assert {module}.reward("APPLE", "APPLE") == 1.0
    assert {module}.reward("apple", "APPLE") == 0.5
    assert {module}.reward("pear", "APPLE") == 0.0


def test_polyrl_loads_it_and_its_demonstrations_earn_full_marks():
    builder = make_env_builder("module:{module}", {{"num_test": 4}}, seed=0)
    assert builder.num_tasks("train") > 0 and builder.num_tasks("test") == 4
    for split in ("train", "test"):
        messages, _ = builder.demonstration(split, 0)

        async def play():
            env = builder.make(split, 0)
            observation = await env.reset()
            assert observation.messages == messages[:-1]
            return await env.step(messages[-1])

        result = asyncio.run(play())
        assert result.done and result.reward == 1.0
'''

PYPROJECT = '''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "{name}: an environment for polyrl"
requires-python = ">=3.10"
dependencies = ["polyrl"]

# Installed (pip install -e .), the environment is `type: {name}` in any polyrl config.
[project.entry-points."polyrl.environments"]
{name} = "{module}:load_environment"

[tool.setuptools]
py-modules = ["{module}"]
'''

CONFIG = '''# Train on {name}, from this directory: polyrl train --config_path train.yaml
# To start from a warm start on the rows' completions instead (sft.yaml says more):
#   START=$(polyrl sft --config_path sft.yaml)
#   polyrl train --config_path train.yaml --overrides resume_from=$START
# model_name: a local model directory (polyrl tiny-model DIR builds a tiny one for a first try) or a
# Hugging Face id. Expect a console row per step (reward, success, ...), runs/{name}/metrics.jsonl,
# and held-out pass@1 (test/{name}/pass@1) every 10 steps.
model_name: {model}
lora_rank: 16
batch_size: 8
learning_rate: 5e-4
max_steps: 50
max_tokens: 16
eval_every: 10
log_path: runs/{name}
environments:
  {name}:
    type: module:{module}.py    # its file; once the package is installed, `type: {name}` works too
    num_rollouts: 8
    args: {{num_test: 4}}         # load_environment(num_test=4)
'''

SFT_CONFIG = '''# Warm-start the model on {name}'s demonstrations (the rows' completions), from this
# directory:
#   START=$(polyrl sft --config_path sft.yaml)
#   polyrl train --config_path train.yaml --overrides resume_from=$START
# polyrl sft prints the checkpoint it saves (also in runs/{name}-sft/sft.json); resume_from starts RL
# from it. Keep model_name and lora_rank the same as train.yaml's.
model_name: {model}
lora_rank: 16
batch_size: 8
learning_rate: 1e-3
max_steps: 50
log_path: runs/{name}-sft
environments:
  {name}:
    type: module:{module}.py
    args: {{num_test: 4}}
'''

README = '''# {name}

An environment for polyrl: a dataset of prompts and a reward function, in `{module}.py`.

- `pytest` runs its checks (`test_{module}.py`), without a model.
- `polyrl train --config_path train.yaml` trains on it (set `model_name` there first).
- `START=$(polyrl sft --config_path sft.yaml)` warm-starts the model on the rows' completions (set
  `model_name` there too) and prints the checkpoint; then
  `polyrl train --config_path train.yaml --overrides resume_from=$START` trains from it.
- `pip install -e .` makes it `type: {name}` in any polyrl config (the `polyrl.environments` entry point
  in `pyproject.toml`).
'''


def module_name(name: str) -> str:
    """The Python module of environment ``name`` (``word-case`` -> ``word_case``)."""
    return name.replace("-", "_")


def init_env(name: str, directory: str | Path | None = None, model: str = DEFAULT_MODEL) -> str:
    """Write the package of a new environment ``name`` into ``directory`` (default: ``./NAME``), which
    must be new or empty; returns what was written and what to do next."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
        raise UserInputError(f"environment name {name!r}: use letters, digits, '-' and '_', starting with a "
                             "letter (it becomes a Python module and a config type)")
    module = module_name(name)
    out = Path(directory if directory is not None else name)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserInputError(f"{out} already exists and is not an empty directory; give a new one")
    files = {f"{module}.py": ENVIRONMENT, f"test_{module}.py": TEST, "pyproject.toml": PYPROJECT,
             "train.yaml": CONFIG, "sft.yaml": SFT_CONFIG, "README.md": README}
    out.mkdir(parents=True, exist_ok=True)
    for filename, template in files.items():
        (out / filename).write_text(template.format(name=name, module=module, model=model), encoding="utf-8")
    return "\n".join([f"wrote {out}/: {', '.join(files)}",
                      f"  cd {out} && pytest                                # its checks",
                      f"  cd {out} && polyrl train --config_path train.yaml  # train on it",
                      f"  pip install -e {out}                              # then `type: {name}` anywhere"])
