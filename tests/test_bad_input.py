"""Bad input gets one ``error: ...`` line and exit code 2, never a traceback, a silent acceptance or
a run that dies minutes later: unreadable configs, duplicate keys, non-finite numbers, sizes no
machine can hold, unusable log paths and command-line mistakes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyrl.config.files import load_config
from polyrl.config.schema import MAX_EPISODES_PER_STEP
from polyrl.sft import SFTConfig

BASE = {"model_name": "tiny", "environments": {"arithmetic": {}}}


from test_config import error_of  # noqa: E402 - the shared one-line config error helper


def run_all(cases: list[tuple[list[str], str]], cwd: Path, timeout: float = 180) -> None:
    """Run ``python -m polyrl.cli ARGS`` for every case at once; each must exit 2 with one
    ``error: ...`` line on stderr containing the case's text, and no traceback."""
    procs = [subprocess.Popen([sys.executable, "-m", "polyrl.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _ in cases]
    failures = []
    for proc, (args, expected) in zip(procs, cases):
        _, err = proc.communicate(timeout=timeout)
        lines = err.strip().splitlines()
        if not (proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
                and expected in lines[0]):
            failures.append(f"{args}: exit {proc.returncode}, stderr:\n{err[-1500:]}")
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------------------------- config files


def test_config_that_is_not_utf8_is_one_line_error(tmp_path):
    (tmp_path / "bad.yaml").write_bytes(b"model_name: caf\xe9\nenvironments: {arithmetic: {}}\n")
    (tmp_path / "bad.toml").write_bytes(b'model_name = "caf\xe9"\n')
    assert "not UTF-8" in error_of(tmp_path / "bad.yaml") and "bad.yaml" in error_of(tmp_path / "bad.yaml")
    assert "not UTF-8" in error_of(tmp_path / "bad.toml")
    run_all([(["train", "--config_path", "bad.yaml"], "not UTF-8")], tmp_path)


def test_duplicate_yaml_keys_are_rejected(tmp_path):
    (tmp_path / "run.yaml").write_text("model_name: tiny\nlearning_rate: 1e-4\nbatch_size: 4\n"
                                       "learning_rate: 1e-2\n"
                                       "environments:\n  arithmetic: {num_rollouts: 2, num_rollouts: 4}\n")
    message = error_of(tmp_path / "run.yaml")
    assert "duplicate key 'learning_rate'" in message and "line 4" in message and "line 2" in message
    (tmp_path / "nested.yaml").write_text("model_name: tiny\nenvironments:\n"
                                          "  arithmetic: {num_rollouts: 2, num_rollouts: 4}\n")
    assert "duplicate key 'num_rollouts'" in error_of(tmp_path / "nested.yaml")
    (tmp_path / "run.json").write_text('{"model_name": "a", "model_name": "b", '
                                       '"environments": {"arithmetic": {}}}')
    assert "duplicate key 'model_name'" in error_of(tmp_path / "run.json")
    (tmp_path / "ok.yaml").write_text("base: &b {num_rollouts: 2}\n")  # anchors and merges stay legal
    (tmp_path / "merge.yaml").write_text("model_name: tiny\nenvironments:\n  arithmetic:\n"
                                         "    <<: {num_rollouts: 2, max_turns: 3}\n"
                                         "    num_rollouts: 4\n")
    assert load_config(tmp_path / "merge.yaml").environments["arithmetic"].num_rollouts == 4


@pytest.mark.parametrize("override", [
    "learning_rate=.inf", "learning_rate=.nan", "optimizer.eps=.inf", "optimizer.grad_clip_norm=.inf",
    "optimizer.weight_decay=.nan",
    "environments.arithmetic.temperature=.inf", "environments.arithmetic.timeout=.inf",
    "environments.arithmetic.nonterminal_reward=-.inf", "environments.arithmetic.weight=.inf",
    "loss_fn=ppo", "optimizer.beta1=.nan",
])
def test_non_finite_numbers_are_rejected(override):
    overrides = ([override] if override != "loss_fn=ppo"
                 else [override, "loss_fn_config.clip_high_threshold=.inf"])
    message = error_of(None, overrides, base=BASE)
    key = overrides[-1].split("=")[0]
    assert message.startswith(key) and "finite" in message, message


def test_sft_learning_rate_must_be_finite():
    assert "finite" in error_of(None, ["learning_rate=.inf"], base=BASE, model=SFTConfig)


# ---------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("overrides, key", [
    (["batch_size=1e9"], "batch_size"),
    (["environments.arithmetic.num_rollouts=100000"], "environments.arithmetic.num_rollouts"),
    (["eval_num_samples=100000"], "eval_num_samples"),
    (["batch_size=4096", "environments.arithmetic.num_rollouts=32"], "batch_size"),
])
def test_sizes_no_machine_can_hold_are_rejected_at_load(overrides, key):
    start = time.monotonic()
    message = error_of(None, overrides, base=BASE)
    assert time.monotonic() - start < 5
    assert message.startswith(key) and str(MAX_EPISODES_PER_STEP) in message, message


def test_large_but_plausible_sizes_are_accepted():
    cfg = load_config(None, ["batch_size=1024", "environments.arithmetic.num_rollouts=64"], base=BASE)
    assert cfg.batch_size * cfg.environments["arithmetic"].num_rollouts == MAX_EPISODES_PER_STEP
    two = {"a": {"type": "arithmetic", "num_rollouts": 64}, "b": {"type": "arithmetic", "num_rollouts": 2}}
    assert load_config(None, ["batch_size=1024"], base={**BASE, "environments": two}).batch_size == 1024


# ---------------------------------------------------------------------------------- command line


def test_command_line_mistakes_exit_2_with_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    run_all([
        (["train"], "--config_path"),
        (["report", "no_such_run"], "no_such_run"),
        (["report", "a_file"], "a_file"),
        (["tiny-model", "out", "--size", "huge"], "huge"),
        (["tiny-model", "a_file"], "a_file"),
    ], tmp_path)
    assert not (tmp_path / "out").exists()


def _unwritable_dir(tmp_path: Path) -> str:
    """A directory this process cannot create anything in (root ignores permission bits)."""
    if os.geteuid() == 0:
        return "/sys/polyrl-cannot-write-here"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return str(locked / "run")


def test_unusable_log_path_is_one_line_error(tiny_model_dir, tmp_path):
    (tmp_path / "a_file").write_text("x")
    common = (f"model_name: {tiny_model_dir}\nlocal: {{store_dir: {tmp_path / 'store'}}}\n"
              "environments: {arithmetic: {}}\n")
    (tmp_path / "file.yaml").write_text(common + "log_path: a_file\n")
    (tmp_path / "under_file.yaml").write_text(common + "log_path: a_file/run\n")
    (tmp_path / "locked.yaml").write_text(common + f"log_path: {_unwritable_dir(tmp_path)}\n")
    (tmp_path / "nul.yaml").write_text(common + 'log_path: "run\\0x"\n')
    run_all([
        (["train", "--config_path", "file.yaml"], "log_path"),
        (["train", "--config_path", "under_file.yaml"], "log_path"),
        (["train", "--config_path", "locked.yaml"], "log_path"),
        (["train", "--config_path", "nul.yaml"], "log_path"),
    ], tmp_path)


# ---------------------------------------------------------------------------------- what a config may hold


def test_yaml_alias_bomb_is_refused_at_load(tmp_path, tiny_model_dir):
    """A "billion laughs" under an environment's args: nine aliases of nine, nine levels deep, would
    expand to 9^9 strings when validated, redacted or dumped. It is refused as soon as it is read."""
    levels = ['      a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"      a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = (f"model_name: {tiny_model_dir}\nenvironments:\n  arithmetic:\n    args:\n" + "\n".join(levels)
            + "\n")
    (tmp_path / "bomb.yaml").write_text(bomb)
    message = error_of(tmp_path / "bomb.yaml")
    assert "YAML aliases expand the document by more than 10,000 nodes" in message, message
    (tmp_path / "loop.yaml").write_text("model_name: tiny\n"
                                        "environments: &e {arithmetic: {args: {again: *e}}}\n")
    assert "recursive alias" in error_of(tmp_path / "loop.yaml")
    run_all([(["train", "--config_path", "bomb.yaml"], "alias bomb")], tmp_path, timeout=60)
    # anchors and merges of ordinary size stay legal
    (tmp_path / "shared.yaml").write_text("model_name: tiny\nbase: &b {num_rollouts: 2, max_turns: 3}\n"
                                          "environments:\n  one: {<<: *b, type: arithmetic}\n"
                                          "  two: {<<: *b, type: arithmetic, args: {same: [*b, *b, *b]}}\n")
    assert "base: unknown key" in error_of(tmp_path / "shared.yaml")  # read, then validated as usual


@pytest.mark.parametrize("returned", ["42", "None", "'a string'"])
def test_module_environment_returning_no_environment_is_one_line(tmp_path, tiny_model_dir, returned):
    (tmp_path / "env.py").write_text(f"def load_environment():\n    return {returned}\n")
    (tmp_path / "run.yaml").write_text(f"model_name: {tiny_model_dir}\nlocal: {{store_dir: store}}\n"
                                       "outputs: {report: false}\n"
                                       f"environments:\n  mine: {{type: 'module:{tmp_path / 'env.py'}'}}\n")
    run_all([(["train", "--config_path", "run.yaml"], f"load_environment() returned {returned}")], tmp_path)


# ---------------------------------------------------------------------------------- model names


def test_a_missing_model_directory_is_named_and_an_uncached_hub_id_offline_is_one_line(tmp_path):
    """``models/tinyy`` next to a ``models/`` folder is a mistyped directory, not a hub id (it took half a
    minute of the hub client's retries, then a traceback); a hub id that is not in the local cache, with the
    hub out of reach (here ``HF_HUB_OFFLINE``, as in every test), is one line before anything loads."""
    from polyrl.errors import UserInputError
    from polyrl.models import resolve_model_path

    (tmp_path / "models").mkdir()
    (tmp_path / "typo.yaml").write_text("model_name: models/tinyy\nenvironments: {arithmetic: {}}\n")
    (tmp_path / "hub.yaml").write_text("model_name: nobody/no-such-model\nenvironments: {arithmetic: {}}\n"
                                       "max_steps: 1\n")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    run_all([(["train", "--config", "typo.yaml"], "model 'models/tinyy': no such model directory"),
             (["train", "--config", "typo.yaml", "--print-config"], "no such model directory"),
             (["train", "--config", "hub.yaml"], "model 'nobody/no-such-model' is not a local directory, "
                                                 "nor in the Hugging Face cache, and HF_HUB_OFFLINE is set")],
            tmp_path)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        with pytest.raises(UserInputError, match="no such model directory"):
            resolve_model_path("models/tinyy")
        assert resolve_model_path("nobody/no-such-model") == "nobody/no-such-model"  # a hub id, as given
    finally:
        os.chdir(cwd)


def test_a_typo_in_a_built_in_environments_args_is_a_config_error(tmp_path):
    """The built-in environments check their args when the config loads (``--print-config`` too), naming the
    entry's ``args``, instead of failing seconds into the run."""
    run_all([(["train", "--overrides", "model_name=tiny", "environments.arithmetic.args.max_valu=9", *extra],
              "environments.arithmetic.args: arithmetic: unknown arg 'max_valu' (known: demo_error_rate, "
              "max_value, min_value, ops)") for extra in ([], ["--print-config"])]
            + [(["train", "--overrides", "model_name=tiny", "environments.countdown.args.num_numbers=9"],
                "environments.countdown.args: countdown: num_numbers must be at most 6, got 9")], tmp_path)
