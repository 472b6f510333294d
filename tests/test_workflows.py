"""Multi-agent workflows: ``solver_judge`` on countdown."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
from tinker import types

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, EnvConfig, TrainConfig
from polyrl.renderers import get_renderer
from polyrl.rl import advantages as adv
from polyrl.rl.episode import Episode
from polyrl.rl.rollouts import EnvRuntime, run_group, split_roles


class _Policy:
    """A sampling client: solvers answer ``solve(prompt, seed)``, the judge ``judge``; records seeds."""

    def __init__(self, renderer, solve, judge):
        self.renderer, self.solve, self.judge = renderer, solve, judge
        self.calls: list[tuple[str, int | None]] = []

    async def sample(self, prompt, num_samples, params):
        text = self.renderer.decode(prompt.to_ints())
        is_judge = "candidate solutions" in text
        self.calls.append(("judge" if is_judge else "solver", params.seed))
        reply = self.judge if is_judge else self.solve(text, params.seed)
        tokens = self.renderer.assistant_tokens({"role": "assistant", "content": reply})
        seq = types.SampledSequence(stop_reason="stop", sequence_id="s",
                                    tokens_np=np.array(tokens, dtype=np.int32),
                                    logprobs_np=np.full(len(tokens), -0.5, dtype=np.float32))
        return types.SampleResponse(sequences=[seq])


def _runtime(**args) -> EnvRuntime:
    cfg = EnvConfig(type="solver_judge", num_rollouts=2, args=args, splits={"test": {"num_samples": 2}})
    return EnvRuntime.create("sj", cfg, 0, 32)


def _solution(builder, split, index) -> str:
    return builder.demonstration(split, index)[0][-1]["content"]  # the countdown expert's \\boxed{expr}


def test_solvers_and_judge_get_their_own_trajectories_and_rewards(tokenizer):
    rt = _runtime(num_solvers=3)
    builder = rt.builder
    assert builder.drives_rollouts
    right = _solution(builder, "train", 7)
    answers = iter([right, "\\boxed{1+1}", right])
    renderer = get_renderer("qwen3", tokenizer)
    policy = _Policy(renderer, lambda text, seed: next(answers), "Candidate 2 looks wrong; \\boxed{3}")
    eps = asyncio.run(run_group(builder, [Episode("sj", "train", 7, 0)], renderer, policy, rt.settings,
                                [11]))
    assert [e.role for e in eps] == ["solver", "solver", "solver", "judge"]
    assert ([e.reward for e in eps] == [1.0, 0.0, 1.0, 1.0]
            and [e.success for e in eps] == [True, False, True, True])
    assert all(e.error is None and e.num_turns == 1 and e.done_by_env for e in eps)
    seeds = [seed for _, seed in policy.calls]
    assert len(set(seeds)) == 4  # every call of the rollout samples on its own seed stream
    judge = eps[-1]
    prompt = judge.messages[0]["content"]
    assert "Candidate 1:" in prompt and "Candidate 3:" in prompt and "\\boxed{1+1}" in prompt
    assert judge.messages[-1]["role"] == "assistant"
    for e in eps:
        assert e.metrics == {"solver_accuracy": pytest.approx(2 / 3), "judge_accuracy": 1.0,
                             "judge_valid_choice": 1.0, "any_solver_correct": 1.0}
        assert e.tokens[: e.turn_spans[0][0]] == renderer.initial_prompt(e.messages[:1])


def test_judge_is_rewarded_only_for_picking_a_correct_candidate(tokenizer):
    renderer = get_renderer("qwen3", tokenizer)
    rt = _runtime(num_solvers=2, judge_sees="answer")
    right = _solution(rt.builder, "train", 2)
    for verdict, reward, valid in [("\\boxed{2}", 0.0, 1.0), ("\\boxed{5}", 0.0, 0.0), ("none", 0.0, 0.0),
                                   ("\\boxed{1}", 1.0, 1.0)]:
        answers = iter([right, "I think 3*4"])
        policy = _Policy(renderer, lambda text, seed: next(answers), verdict)
        eps = asyncio.run(run_group(rt.builder, [Episode("sj", "train", 2, 0)], renderer, policy,
                                    rt.settings, [1]))
        judge = eps[-1]
        assert (judge.reward, judge.metrics["judge_valid_choice"]) == (reward, valid), verdict
        assert "Candidate 2:\n3*4" in judge.messages[0]["content"]  # judge_sees: answer shows the expressions


def test_advantages_are_grouped_per_role(tokenizer):
    renderer = get_renderer("qwen3", tokenizer)
    rt = _runtime(num_solvers=2)
    right = _solution(rt.builder, "train", 0)
    policy = _Policy(renderer, lambda text, seed: right if seed % 3 else "\\boxed{0}", "\\boxed{1}")
    eps = asyncio.run(run_group(rt.builder, [Episode("sj", "train", 0, 0) for _ in range(4)], renderer,
                                policy, rt.settings, [1, 2, 3, 4]))
    groups = split_roles([eps])
    assert ([{e.role for e in g} for g in groups] == [{"solver"}, {"judge"}]
            and [len(g) for g in groups] == [8, 4])
    adv.record_advantages(groups, adv.compute_advantages(groups, "grpo"))  # as the training step does
    for g in groups:
        mean = sum(e.reward for e in g) / len(g)
        for e in g:
            assert e.turn_advantages == [pytest.approx(e.reward - mean)]  # baseline: the role's own group


def test_evaluation_reports_each_role_and_the_judges_pick_as_the_answer(tokenizer):
    from polyrl.evaluate import evaluate_sampler

    renderer = get_renderer("qwen3", tokenizer)
    rt = _runtime(num_solvers=2)

    def solve(text, seed):  # every solver is right
        index = next(i for i in range(2)
                     if rt.builder.countdown.make("test", i).reset_sync().messages[0]["content"] in text)
        return _solution(rt.builder, "test", index)

    policy = _Policy(renderer, solve, "\\boxed{9}")  # the judge never gives a valid pick
    out = asyncio.run(evaluate_sampler(policy, renderer, {"sj": rt}, num_samples=2, seed=0))
    assert out["test/sj/solver/pass@1"] == 1.0 and out["test/sj/solver/pass@2"] == 1.0
    assert out["test/sj/judge/pass@1"] == 0.0
    assert out["test/sj/pass@1"] == 0.0 and out["test/sj/pass@2"] == 0.0 and out["test/pass@1"] == 0.0


def test_workflow_config_errors():
    cases = [({"task": "sudoku"}, "task must be 'countdown'"), ({"num_solvers": 0}, "num_solvers must be"),
             ({"task_args": {"num_numbers": 9}}, "num_numbers must be at most 6"),
             ({"judge": 1}, "unknown arg 'judge'")]
    for args, message in cases:
        with pytest.raises(ConfigError, match="environments.sj.args") as err:
            load_config(None, [], base={"model_name": "m",
                                        "environments": {"sj": {"type": "solver_judge", "args": args}}})
        assert message in str(err.value)


@pytest.mark.slow
def test_solver_judge_trains_and_evaluates(tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=8,
                      save_every=0, log_path=str(tmp_path / "run"),
                      local={"store_dir": str(tmp_path / "store")},
                      eval_every=2,
                      eval_num_samples=2,
                      environments={"sj": {"type": "solver_judge", "num_rollouts": 2,
                                           "args": {"num_solvers": 3},
                                           "splits": {"test": {"num_samples": 2}}}})
    train(cfg, ConsoleLog(enabled=False))
    before, *rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert before["step"] == -1 and {"test/sj/pass@1", "test/sj/judge/pass@1"} <= set(before)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["episodes/count"] == 2 * 2 * 4 and r["rollouts/failed"] == 0
        assert {"env/sj/solver_accuracy", "env/sj/judge_accuracy", "env/sj/judge_valid_choice"} <= set(r)
    assert {"test/sj/pass@1", "test/sj/pass@2", "test/sj/solver/pass@2",
            "test/sj/judge/pass@1"} <= set(rows[-1])
    traj = [json.loads(x)
            for x in (tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert [t["role"] for t in traj].count("solver") == 12 and [t["role"] for t in traj].count("judge") == 4
    for t in traj:
        assert t["reward"] in (0.0, 1.0) and len(t["advantages"]) == 1 and t["num_turns"] == 1
        if t["role"] == "judge":
            assert "candidate solutions" in t["messages"][0]["content"]
    final = [json.loads(x) for x in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()][-1]
    (tmp_path / "run.json").write_text(json.dumps(cfg.model_dump()))
    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "eval", "--config_path",
                          str(tmp_path / "run.json"), "--checkpoint", final["sampler_path"]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = dict(line.split() for line in out.stdout.strip().splitlines())
    expected = {"test/sj/pass@1", "test/sj/pass@2", "test/sj/judge/pass@2", "test/sj/solver/pass@2",
                "test/pass@1"}
    assert expected <= set(printed), out.stdout
    assert float(printed["test/sj/failed"]) == 0.0  # the checkpoint loads and samples in a fresh process
