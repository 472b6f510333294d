"""When ``polyrl train`` evaluates on the test splits: with ``eval_every`` set, once before the first step
(the row of step -1 in ``metrics.jsonl``), every ``eval_every`` steps and after the last step; a resumed
run does not evaluate its start again; ``eval_every: 0`` never evaluates. The final line of ``polyrl
train`` holds the held-out scores after the run and before it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from polyrl.cli import main
from polyrl.report import data as D
from polyrl.report import summary as S
from polyrl.rl.train import evaluate_before_training
from polyrl.tracking.files import RunFiles

SMALL = ("lora_rank=4", "batch_size=2", "max_tokens=4", "save_every=1", "outputs.report=false",
         "outputs.metrics_json=true", "environments.arithmetic.num_rollouts=2",
         "environments.arithmetic.splits.test.num_samples=2")


def _train(model: str, root, *overrides: str) -> dict:
    """``polyrl train`` on arithmetic (two test tasks) in-process; returns its final printed line."""
    return _cli(["train", "--overrides", f"model_name={model}", f"log_path={root / 'run'}",
                 f"local.store_dir={root / 'store'}", *SMALL, *overrides])


def _cli(argv: list[str]) -> dict:
    from contextlib import redirect_stdout
    from io import StringIO

    out = StringIO()
    with redirect_stdout(out):
        main(argv)
    return json.loads(out.getvalue().strip().splitlines()[-1])


def _rows(root) -> list[dict]:
    return RunFiles(root / "run").metrics()


def _tested(row: dict) -> bool:
    return "test/arithmetic/pass@1" in row


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # peft and transformers
def test_a_run_evaluates_before_its_first_step_and_after_its_last_and_a_resume_keeps_the_first(
        tiny_model_dir, tmp_path):
    line = _train(tiny_model_dir, tmp_path, "max_steps=2", "eval_every=5")
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [-1, 0, 1]
    before, first, last = rows
    assert set(before) == {"step"} | {k for k in last if k.startswith("test/")}  # an evaluation, no step
    assert _tested(before) and not _tested(first) and _tested(last)  # eval_every 5: the last step's only
    # the final line: the scores after the run beside those before it
    assert line["test/arithmetic/pass@1"] == last["test/arithmetic/pass@1"]
    assert line["test/arithmetic/reward"] == last["test/arithmetic/reward"]
    assert line["before/test/arithmetic/pass@1"] == before["test/arithmetic/pass@1"]
    assert line["before/test/pass@1"] == before["test/pass@1"]
    # Minds RL's metrics.json has the steps only
    assert [r["step"] for r in json.loads((tmp_path / "run" / "metrics.json").read_text())] == [0, 1]
    # the report: held-out scores from before training to the last step; the 2 steps done, as steps
    table = D.metric_table(D.read_metrics(tmp_path / "run"))
    config = D.read_config(tmp_path / "run")
    headline = S.headline(table, config, ["arithmetic"])
    held_out = headline["rows"][0]["held_out"]
    assert (held_out["first_step"], held_out["last_step"], held_out["points"]) == (-1, 1, 2)
    assert held_out["first"] == before["test/arithmetic/pass@1"] and headline["steps_done"] == 2
    for banner in S.banners(table, config, ["arithmetic"]):
        if banner["kind"] == "no_update":  # the tiny model's rewards may all be equal
            assert banner["title"].startswith(("No step", "1 of 2 steps")), banner

    # a relaunch with more steps continues from the checkpoint of step 1: no second evaluation before it
    line = _train(tiny_model_dir, tmp_path, "max_steps=3", "eval_every=5")
    again = _rows(tmp_path)
    assert [r["step"] for r in again] == [-1, 0, 1, 2]
    assert again[0] == before and again[1:3] == [first, last] and _tested(again[3])
    assert line["before/test/pass@1"] == before["test/pass@1"]


def test_a_run_without_eval_every_does_not_evaluate_before_training():
    config = SimpleNamespace(eval_every=0)  # nothing else is there to evaluate with
    assert asyncio.run(evaluate_before_training(SimpleNamespace(config=config))) == {}


def test_a_run_that_starts_over_forgets_its_evaluation_before_training_and_a_resume_keeps_it(tmp_path):
    files = RunFiles(tmp_path / "run")
    for row in ({"step": -1, "test/pass@1": 0.5}, {"step": 0, "reward/mean": 1.0}, {"step": 1}):
        files.log_metrics(row)
    files.truncate_from(1)  # a resume from the checkpoint after step 0
    assert files.metrics() == [{"step": -1, "test/pass@1": 0.5}, {"step": 0, "reward/mean": 1.0}]
    files.truncate_from(0)  # no checkpoint: the run starts over, its evaluation before training too
    assert files.metrics() == []

