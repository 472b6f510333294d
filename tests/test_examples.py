"""``examples/``: every file there is an example a user copies, or part of one.

Each example is run the way its header says, through the real command line: its own form (a polyrl
YAML, a Minds RL TOML, GEM's command line in a shell script) is what is read. It validates with
``--print-config`` (the loader ``polyrl train`` uses, with the checks that need environments, renderers
and models), and a slow test runs one or two steps of it on a tiny model, with overrides that shrink it
(``model_name``, batch, tokens) and keep its files in a temporary directory. An example needing a
server (OpenReward's ORS) gets its own server script started on 127.0.0.1.

A file added to ``examples/`` without an entry in :data:`EXAMPLES` fails
:func:`test_every_file_in_examples_is_an_example_or_part_of_one`, and the docs' Examples section must
list every example.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "examples"
CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json", ".sh")


@dataclass(frozen=True)
class Example:
    """How an example runs: ``command`` as its header documents it (run from ``cwd``, relative to the
    repository root), the files it brings along, and what a short run of it must log."""

    command: tuple[str, ...]
    cwd: str = "."
    files: tuple[str, ...] = ()  # other files of examples/ it uses
    steps: int = 1
    logs: tuple[str, ...] = ()  # metric keys its steps must log
    server: str | None = None  # a server script it needs, started on 127.0.0.1 for the run
    needs: str | None = None  # the optional package it needs (skipped without it)
    stage_of: str | None = None  # the pipeline script that runs it, with the paths earlier stages wrote
    stages: tuple[str, ...] = ()  # a pipeline script's stages (it has a test of its own)

    @property
    def documented(self) -> str:
        """A pattern of the command line the example's header must show (TEACHER: any argument)."""
        return r"\s+".join(r"\S+" if part == TEACHER else re.escape(part) for part in self.command)


TEACHER = "{teacher}"  # polyrl distill's argument: a checkpoint of the tiny model in the tests

EXAMPLES: dict[str, Example] = {
    "builtin_smollm2.yaml": Example(("polyrl", "train", "--config_path", "examples/builtin_smollm2.yaml")),
    "async.yaml": Example(("polyrl", "train", "--config_path", "examples/async.yaml"), steps=2,
                          logs=("async/staleness_mean", "async/staleness_max", "async/stale_dropped")),
    "kl_penalty.yaml": Example(("polyrl", "train", "--config_path", "examples/kl_penalty.yaml"),
                               logs=("kl/reference", "kl_policy_base")),
    "distill.yaml": Example(("polyrl", "distill", TEACHER, "--config_path", "examples/distill.yaml"),
                            logs=("kl/teacher", "teacher_kl")),
    "solver_judge.yaml": Example(("polyrl", "train", "--config_path", "examples/solver_judge.yaml"),
                                 logs=("env/solver_judge/solver_accuracy",
                                       "env/solver_judge/judge_accuracy")),
    "openreward/train.yaml": Example(("polyrl", "train", "--config_path", "examples/openreward/train.yaml"),
                                     files=("openreward/server.py",), server="examples/openreward/server.py",
                                     needs="openreward"),
    "minds_rl/configs/train.toml": Example(
        ("polyrl", "train", "--config_path", "configs/train.toml"), cwd="examples/minds_rl",
        files=("minds_rl/environments/shout/__init__.py", "minds_rl/environments/shout/shout.py")),
    "gem_guess_the_number.sh": Example(("sh", "examples/gem_guess_the_number.sh"), needs="gem"),
    "envs/reverse.yaml": Example(("polyrl", "train", "--config_path", "examples/envs/reverse.yaml"),
                                 files=("envs/reverse.py",), logs=("env/reverse/reward/reversed_word",)),
    "envs/guess.yaml": Example(("polyrl", "train", "--config_path", "examples/envs/guess.yaml"), steps=2,
                               files=("envs/guess.py",), logs=("env/guess/tries",)),
    "own_task/train.yaml": Example(("polyrl", "train", "--config_path", "examples/own_task/train.yaml"),
                                   files=("own_task/last_word.py", "own_task/make_demos.py"),
                                   logs=("env/last_word/reward/exact_match",)),
    "judge/train.yaml": Example(("polyrl", "train", "--config_path", "examples/judge/train.yaml"),
                                files=("judge/rule_judge.py", "judge/tasks.jsonl", "judge/held_out.jsonl"),
                                server="examples/judge/rule_judge.py",
                                logs=("env/letters/judge/score", "judge/calls", "judge/parse_failures")),
    "selfplay.yaml": Example(("polyrl", "train", "--config_path", "examples/selfplay.yaml"),
                             logs=("env/tictactoe/reward/mean",), needs="textarena"),
    "judge/pairwise.yaml": Example(("polyrl", "train", "--config_path", "examples/judge/pairwise.yaml"),
                                   files=("judge/rule_judge.py", "judge/tasks.jsonl"),
                                   server="examples/judge/rule_judge.py",
                                   logs=("env/letters/judge/score", "judge/calls")),
    "partner.yaml": Example(("polyrl", "train", "--config_path", "examples/partner.yaml"),
                            logs=("env/tictactoe/partner_moves",), needs="textarena"),
    "dpo/dpo.yaml": Example(("polyrl", "dpo", "--config_path", "examples/dpo/dpo.yaml"), steps=2,
                            files=("dpo/make_pairs.py", "dpo/pairs.jsonl", "dpo/held_out.jsonl"),
                            logs=("dpo/loss", "dpo/accuracy", "dpo/margin")),
    "rlhf/rlhf.sh": Example(("sh", "examples/rlhf/rlhf.sh"),
                            files=("rlhf/make_demos.py", "rlhf/demos.jsonl", "dpo/pairs.jsonl",
                                   "dpo/held_out.jsonl"),
                            stages=("rlhf/sft.yaml", "rlhf/reward_model.yaml", "rlhf/train.yaml")),
    "rlhf/sft.yaml": Example(("polyrl", "sft", "--config_path", "examples/rlhf/sft.yaml"),
                             stage_of="rlhf/rlhf.sh"),
    "rlhf/reward_model.yaml": Example(("polyrl", "reward-model", "--config_path",
                                       "examples/rlhf/reward_model.yaml"), stage_of="rlhf/rlhf.sh"),
    "rlhf/train.yaml": Example(("polyrl", "train", "--config_path", "examples/rlhf/train.yaml"),
                               stage_of="rlhf/rlhf.sh"),
}


def example_files() -> set[str]:
    return {p.relative_to(EXAMPLES_DIR).as_posix() for p in EXAMPLES_DIR.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def configs() -> list[str]:
    """The examples found on disk: every config, command line or script under examples/."""
    return sorted(p for p in example_files() if p.endswith(CONFIG_SUFFIXES))


def standalone() -> list[str]:
    """The examples that run on their own (a pipeline script and its stages have a test of their own)."""
    return [name for name in configs() if not (example(name).stage_of or example(name).stages)]


def example(name: str) -> Example:
    assert name in EXAMPLES, f"examples/{name} has no entry in tests/test_examples.py EXAMPLES: add one"
    return EXAMPLES[name]


def header(name: str) -> str:
    """The example's leading comment block (or a script's docstring)."""
    text = (EXAMPLES_DIR / name).read_text(encoding="utf-8")
    if name.endswith(".py"):
        return text.split('"""')[1]
    return "".join(line[1:] for line in text.splitlines(keepends=True)[:60] if line.startswith("#"))


# ---------------------------------------------------------------------------- the files and the docs
def test_every_file_in_examples_is_an_example_or_part_of_one():
    claimed = set(EXAMPLES) | {f for ex in EXAMPLES.values() for f in ex.files}
    assert example_files() == claimed, "examples/ and EXAMPLES in tests/test_examples.py differ"
    assert set(configs()) == set(EXAMPLES)


@pytest.mark.parametrize("name", configs())
def test_example_header_says_what_how_and_what_to_expect(name):
    ex = example(name)
    for part in ("What it trains:", "Run", "Expect:"):
        assert re.search(rf"^\s*{part}", header(name), re.MULTILINE), (
            f"examples/{name}: no '{part}' in its header")
    text = " ".join(header(name).split())
    assert re.search(ex.documented, text), (
        f"examples/{name}: its header should show how to run it: {ex.command}")
    for path in ex.files:
        if path.endswith(".jsonl"):  # data, which the example's header or its script's names
            named_in = [f for f in [name, *ex.files] if not f.endswith(".jsonl")]
            assert any(path.split("/")[-1] in header(f) for f in named_in), path
        else:
            assert header(path).strip(), f"examples/{path} needs a docstring"
    if ex.server:
        assert f"python {ex.server}" in header(ex.server.removeprefix("examples/")), "how to start the server"


def test_the_docs_examples_section_lists_every_example():
    page = (ROOT / "docs" / "getting-started" / "first-config.md").read_text(encoding="utf-8")
    section = page.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    for name in EXAMPLES:
        assert f"`examples/{name}`" in section, (
            f"the Examples section of docs/getting-started/first-config.md does not list examples/{name}")


# ---------------------------------------------------------------------------- running them
@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of examples/ under ``tmp_path`` (what a run writes stays there) and a ``polyrl`` command
    on PATH that runs this checkout's polyrl."""
    shutil.copytree(EXAMPLES_DIR, tmp_path / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "polyrl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m polyrl.cli "$@"\n')
    (bin_dir / "polyrl").chmod(0o755)
    return tmp_path


def environ(checkout: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "TINKER" not in k and not k.startswith("OPENREWARD")}
    env.update(PYTHONPATH=str(ROOT), PATH=f"{checkout / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               OPENREWARD_DISABLE_UPDATE_CHECK="1")
    return env


def command(ex: Example, teacher: str) -> list[str]:
    return [teacher if part == TEACHER else part for part in ex.command]


def print_config(ex: Example, checkout: Path, teacher: str, monkeypatch) -> tuple[str, str, int]:
    """``--print-config`` of the example's command: (stdout, stderr, exit code). ``polyrl`` commands
    run in this process (``polyrl.cli.main``, as the ``polyrl`` script does), others as subprocesses."""
    argv = command(ex, teacher) + ["--print-config"]
    cwd = checkout / ex.cwd
    if argv[0] != "polyrl":
        out = subprocess.run(argv, check=False, cwd=cwd, env=environ(checkout), capture_output=True,
                             text=True, timeout=300)
        return out.stdout, out.stderr, out.returncode
    from polyrl.cli import main

    monkeypatch.chdir(cwd)
    for key in [k for k in os.environ if "TINKER" in k]:
        monkeypatch.delenv(key)
    stdout, stderr, code = StringIO(), StringIO(), 0
    saved = dict(os.environ)  # a translation may export an API key
    try:
        with redirect_stdout(stdout), redirect_stderr(stderr):
            main(argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return stdout.getvalue(), stderr.getvalue(), code


def trained_checkpoint(store: Path, model: str) -> str:
    """A teacher for ``polyrl distill``: a checkpoint of ``model`` one cross-entropy step away from it,
    in the local store ``store``; returns its sampler path (as a run's checkpoints.jsonl gives it)."""
    from tinker import types
    from transformers import AutoTokenizer

    from polyrl.local import ServiceClient

    tokens = AutoTokenizer.from_pretrained(model).encode("the answer is 42, the answer is 42")
    service = ServiceClient(store_dir=store)
    training = service.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training.save_weights_for_sampler("teacher").result().path


@pytest.mark.parametrize("name", standalone())
def test_example_validates(name, checkout, tiny_model_dir, monkeypatch):
    ex = example(name)
    if ex.needs:
        pytest.importorskip(ex.needs)
    stdout, stderr, code = print_config(ex, checkout, tiny_model_dir, monkeypatch)
    assert code == 0, stderr
    assert "warning:" not in stderr, f"examples/{name} uses a deprecated key: {stderr}"
    config = yaml.safe_load(stdout)
    assert config["model_name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["data"] if "dpo" in ex.command else config["environments"]


def run_overrides(config: dict, run: Path, model: str, steps: int, server_url: str | None) -> list[str]:
    """Overrides that make an example's run one or two quick steps on ``model``, its files under ``run``."""
    if "environments" not in config:  # polyrl dpo: pairs, no environments
        return [f"model_name={model}", f"max_steps={steps}", "batch_size=2", "lora_rank=4",
                f"log_path={run / 'run'}", f"local.store_dir={run / 'store'}"]
    overrides = [f"model_name={model}", f"max_steps={steps}", "batch_size=2", "max_tokens=8", "lora_rank=4",
                 f"log_path={run / 'run'}", f"local.store_dir={run / 'store'}", "outputs.report=false",
                 "save_every=0", "eval_num_samples=1"]
    if config["off_policy"]["stream_minibatches"]:
        overrides.append("off_policy.stream_minibatches=1")
    for name, env in config["environments"].items():
        key = f"environments.{name}"
        overrides += [f"{key}.num_rollouts=2", f"{key}.max_turns={min(env['max_turns'], 2)}"]
        if "test" in env["splits"]:
            overrides.append(f"{key}.splits.test.num_samples=2")
        if server_url is not None and env.get("judge"):  # a stand-in judge: a rule, not a model
            overrides += [f"{key}.judge.model=rule", f"{key}.judge.base_url={server_url}/v1"]
            if env["judge"]["mode"] == "yes_no":  # read from a model's logprobs: a rule writes a score
                overrides.append(f"{key}.judge.mode=score")
        elif server_url is not None:
            overrides.append(f"{key}.args.base_url={server_url}")
    return overrides


def start_server(script: str, checkout: Path) -> tuple[subprocess.Popen, str]:
    """``python SCRIPT --port 0`` from the checkout; returns the process and the URL it reports."""
    proc = subprocess.Popen([sys.executable, script, "--port", "0"], cwd=checkout, env=environ(checkout),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"{script} did not report its URL: {''.join(seen)[-2000:]}") from None
        seen.append(line)
        if match := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
            return proc, match.group(1)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # peft and transformers
@pytest.mark.parametrize("name", standalone())
def test_example_runs_on_a_tiny_model(name, checkout, tiny_model_dir, monkeypatch):
    ex = example(name)
    if ex.needs:
        pytest.importorskip(ex.needs)
    teacher = trained_checkpoint(checkout / "store", tiny_model_dir) if TEACHER in ex.command else ""
    stdout, stderr, code = print_config(ex, checkout, teacher, monkeypatch)
    assert code == 0, stderr
    config = yaml.safe_load(stdout)
    server, url = start_server(ex.server, checkout) if ex.server else (None, None)
    try:
        argv = command(ex, teacher) + ["--overrides", *run_overrides(config, checkout, tiny_model_dir,
                                                                         ex.steps, url)]
        out = subprocess.run(argv, check=False, cwd=checkout / ex.cwd, env=environ(checkout),
                             capture_output=True, text=True, timeout=600)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    assert out.returncode == 0, out.stderr[-3000:]

    run = checkout / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if "dpo" in ex.command:  # the held-out pairs scored before the first step and after the last
        held_out = [r for r in rows if "eval/accuracy" in r]
        assert [r["step"] for r in held_out] == [-1, ex.steps - 1], held_out
        assert held_out[0]["eval/loss"] == pytest.approx(0.6931, abs=1e-3)  # the reference is the start
        rows = [r for r in rows if "dpo/loss" in r]
        assert [r["step"] for r in rows] == list(range(ex.steps))
        assert all(set(ex.logs) <= set(r) for r in rows), rows
        assert out.stdout.strip().splitlines()[-1].startswith("tinker://")
        return
    if config["eval_every"]:  # evaluated before the first step: the row of step -1
        before, *rows = rows
        assert before["step"] == -1 and any(k.endswith("/pass@1") for k in before), before
    assert [r["step"] for r in rows] == list(range(ex.steps))
    for row in rows:
        assert row["episodes/count"] > 0 and row["rollouts/failed"] == 0, row
        assert set(ex.logs) <= set(row), f"{name}: {sorted(set(ex.logs) - set(row))} not logged"
    if config["eval_every"]:  # evaluated before the run and at its end, on every test split
        tested = [n for n, env in config["environments"].items() if "test" in env["splits"]]
        assert all(f"test/{n}/pass@1" in before and f"test/{n}/pass@1" in rows[-1] for n in tested), \
            sorted(rows[-1])
    if "distill" in ex.command:
        assert all(r["kl/teacher"] != 0 for r in rows)  # the teacher is another policy
    if config["outputs"]["metrics_json"]:  # Minds RL's metrics.json beside polyrl's files
        assert [r["step"] for r in json.loads((run / "metrics.json").read_text())] == list(range(ex.steps))
    if name.startswith("judge/"):  # every episode was graded by the rule judge, its verdict kept with it
        episodes = [json.loads(line) for line in
                    (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()]
        verdicts = [ep["judge"][0]["verdict"] if ep["judge"] else "" for ep in episodes]
        assert episodes and all("<score>" in v or "<preferred>" in v for v in verdicts), verdicts
    elif ex.server:  # every episode came from the server
        first_step = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
        episodes = [json.loads(line) for line in first_step]
        assert episodes and all(ep["messages"][0]["content"].startswith("Write a word of at least")
                                for ep in episodes)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # peft and transformers
def test_the_rlhf_example_runs_its_three_stages(checkout, tiny_model_dir):
    """examples/rlhf/rlhf.sh as its header says, with overrides for every stage: SFT, then a reward model,
    then RL from the SFT state scored by that reward model, each stage finding the paths the one before
    wrote."""
    for stage in example("rlhf/rlhf.sh").stages:
        assert example(stage).stage_of == "rlhf/rlhf.sh"
        assert f"({stage.split('/')[1]})" in header("rlhf/rlhf.sh")  # the script names each stage
    out = checkout / "run"
    argv = ["sh", "examples/rlhf/rlhf.sh", f"model_name={tiny_model_dir}", "max_steps=2", "batch_size=2",
            "lora_rank=4", f"local.store_dir={checkout / 'store'}"]
    done = subprocess.run(argv, check=False, cwd=checkout, env={**environ(checkout), "OUT": str(out)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    def rows(stage: str) -> list[dict]:
        return [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]

    sft = json.loads((out / "sft" / "sft.json").read_text())
    assert [r["step"] for r in rows("sft") if "optim/loss" in r] == [0, 1]
    reward_model = json.loads((out / "reward_model" / "reward_model.json").read_text())
    assert reward_model["held_out_before"]["accuracy"] == pytest.approx(0.5, abs=0.5)  # scored, 32 pairs
    assert [r["step"] for r in rows("reward_model") if "reward_model/loss" in r] == [0, 1]
    assert f"initialized weights from {sft['state_path']}" in done.stderr  # RL starts from the SFT state
    rl = rows("rl")
    assert [r["step"] for r in rl] == [-1, 0, 1]
    assert all(r["judge/calls"] + r["judge/cached"] == 16 and r["rollouts/failed"] == 0 for r in rl[1:])
    assert all(r["env/arithmetic/judge/score"] <= 0 for r in rl[1:])  # the logprob of "Yes"
    assert "test/arithmetic/judge_score" in rl[0] and "test/arithmetic/judge_score" in rl[-1]
    episode = json.loads((out / "rl" / "trajectories" / "step_000000.jsonl").read_text().splitlines()[0])
    assert episode["judge"][0]["prompt"].startswith("Is the assistant's last reply a good one?")
    assert reward_model["sampler_path"].startswith("tinker://")
