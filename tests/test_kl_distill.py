"""Learning signals from other policies: the KL penalty against a reference and on-policy distillation
from a teacher -- the per-token math (by hand and against tinker-cookbook's own functions), the
logprobs a reference or teacher sampler gives (the engine's forward pass), the same run in process and
through ``polyrl serve``, and a student that reaches its teacher's success."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from polyrl.backend import ServiceGuard
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.base import EnvBuilder, Observation, StepResult, register_env
from polyrl.rl import advantages as adv
from polyrl.rl.episode import Episode
from polyrl.rl.scoring import Scorer, TokenSignals, open_scorer


class _WordEnv:
    """Reward 1 when the reply contains an 'e' (so groups carry some reward signal too)."""

    def reset(self):
        return Observation([{"role": "user", "content": "Write a word."}])

    def step(self, action):
        return StepResult(reward=float("e" in action["content"]), done=True)

    def close(self):
        return None


@register_env("kl_test_word")
class _WordBuilder(EnvBuilder):
    def make(self, split, index):
        return _WordEnv()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Torch on one thread: these tiny matrices gain nothing from more, and on a busy machine a second
    thread waiting for the first made these tests up to ten times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _episode(parts: list[tuple[list[int], list[float] | None]], advantages: list[float]) -> Episode:
    """An episode from (tokens, sampler logprobs or None for prompt/environment tokens) parts."""
    ep = Episode("e", "train", 0, 0)
    for tokens, logprobs in parts:
        ep.append(tokens, logprobs)
    ep.turn_advantages = advantages
    return ep


# ---------------------------------------------------------------------------------- the math, by hand
def _two_episodes() -> tuple[list[Episode], list[list[float | None]]]:
    # episode a: prompt [1 2], sampled [3 4], environment [5], sampled [6];
    # episode b: prompt [1], sampled [7 8]
    a = _episode([([1, 2], None), ([3, 4], [-1.0, -2.0]), ([5], None), ([6], [-0.5])], [0.5, 0.5])
    b = _episode([([1], None), ([7, 8], [-0.2, -0.4])], [-0.5])
    other_a = [None, -9.0, -1.5, -3.0, -7.0, -0.5]  # prompt and environment entries must not matter
    other_b = [None, -1.2, -0.1]
    return [a, b], [other_a, other_b]


def test_reference_kl_penalty_by_hand():
    (a, b), reference = _two_episodes()
    # d = sampler - reference on sampled tokens: a: 0.5, 1.0, 0.0; b: 1.0, -0.3; mean over 5 tokens = 2.2 / 5
    mean = 0.44
    terms, got_mean = adv.reference_kl_terms([a, b], reference, coef=0.1)
    assert got_mean == pytest.approx(mean)
    assert terms[0] == pytest.approx([0, 0, 0.1 * (mean - 0.5), 0.1 * (mean - 1.0), 0, 0.1 * mean])
    assert terms[1] == pytest.approx([0, 0.1 * (mean - 1.0), 0.1 * (mean + 0.3)])

    # discounted: each sampled token gets its own term plus 0.5^k of the terms k tokens later (the
    # environment token counts as a step but keeps no advantage of its own)
    t3, t4, t6 = 0.1 * (mean - 0.5), 0.1 * (mean - 1.0), 0.1 * mean
    discounted, _ = adv.reference_kl_terms([a, b], reference, coef=0.1, discount=0.5)
    assert discounted[0] == pytest.approx([0, 0, t3 + 0.5 * t4 + 0.125 * t6, t4 + 0.25 * t6, 0, t6])

    # the datum: the turn advantage plus the token's term, shifted like the targets, zero elsewhere
    datum = adv.to_datum(a, "importance_sampling", terms[0])
    assert datum.loss_fn_inputs["advantages"].tolist() == pytest.approx([0, 0.5 + t3, 0.5 + t4, 0, 0.5 + t6])
    assert adv.to_datum(a).loss_fn_inputs["advantages"].tolist() == pytest.approx([0, 0.5, 0.5, 0, 0.5])


def test_teacher_advantage_is_the_negative_reverse_kl_by_hand():
    (a, b), teacher = _two_episodes()
    terms, gaps = adv.teacher_kl_terms([a, b], teacher, coef=2.0)
    assert gaps[0] == pytest.approx([0, 0, 0.5, 1.0, 0, 0.0]) and gaps[1] == pytest.approx([0, 1.0, -0.3])
    assert terms[0] == pytest.approx([0, 0, -1.0, -2.0, 0, 0]) and terms[1] == pytest.approx([0, -2.0, 0.6])
    assert adv.mean_gap([a, b], gaps) == pytest.approx(0.44)
    discounted, _ = adv.teacher_kl_terms([b], [teacher[1]], coef=2.0, discount=0.5)
    assert discounted[0] == pytest.approx([0, -2.0 + 0.5 * 0.6, 0.6])
    with pytest.raises(ValueError, match="3 logprobs for an episode of 6 tokens"):
        adv.logprob_gaps(a, teacher[1])


# ------------------------------------------------------------------ the same as tinker-cookbook's code
def _config(model_dir: str, tmp_path: Path, **over) -> TrainConfig:
    data = dict(model_name=model_dir, lora_rank=4, batch_size=2, max_steps=3, max_tokens=5, save_every=0,
                learning_rate=3e-3, log_path=str(tmp_path / "run"),
                local={"store_dir": str(tmp_path / "store")},
                seed=3, outputs={"report": False},
                environments={"word": {"type": "kl_test_word", "num_rollouts": 4, "max_turns": 1}})
    data.update(over)
    return TrainConfig(**data)


def _trained_checkpoint(service, base_model: str, tokenizer, name: str = "teacher") -> str:
    """A checkpoint (state and sampler weights) one cross-entropy step away from the base model, the
    same on every service; returns its sampler path."""
    training = service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    tokens = tokenizer.encode("the answer is 42, the answer is 42")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    training.save_state(name).result()
    return training.save_weights_for_sampler(name).result().path


def _sampled_episodes(sampler, tokenizer, n: int = 3) -> list[Episode]:
    """Episodes of real sampled tokens (two sampled turns around an environment message)."""
    episodes = []
    for i in range(n):
        ep = Episode("word", "train", i, 0)
        ep.append(tokenizer.encode(f"write word number {i}:"))
        for turn in range(2):
            params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=10 * i + turn)
            seq = sampler.sample(types.ModelInput.from_ints(ep.tokens), 1, params).result().sequences[0]
            ep.append(list(seq.tokens), list(seq.logprobs))
            if turn == 0:
                ep.append(tokenizer.encode(" and then"))
        ep.turn_advantages = [0.25 * (i - 1)] * ep.num_turns
        episodes.append(ep)
    return episodes


def test_terms_equal_tinker_cookbooks_incorporate_kl_penalty(tiny_model_dir, tokenizer, tmp_path):
    """polyrl's datums equal the ones tinker-cookbook's RL loop (KL penalty) and on-policy distillation
    recipe build from the same episodes with the same sampler as reference and teacher."""
    from tinker_cookbook.distillation.train_on_policy import incorporate_kl_penalty as cookbook_distill
    from tinker_cookbook.rl.metrics import incorporate_kl_penalty as cookbook_kl

    from polyrl.local import ServiceClient

    service = ServiceClient(store_dir=tmp_path / "store")
    other = service.create_sampling_client(
        model_path=_trained_checkpoint(service, tiny_model_dir, tokenizer)).result()
    policy = service.create_sampling_client(base_model=tiny_model_dir).result()
    episodes = _sampled_episodes(policy, tokenizer)

    def cookbook_datums() -> list[types.Datum]:
        data = [adv.to_datum(ep) for ep in episodes]
        for d, ep in zip(data, episodes):
            d.loss_fn_inputs["mask"] = types.TensorData(data=[float(m) for m in ep.action_mask[1:]],
                                                        dtype="float32")
        return data

    for discount in (0.0, 0.9):
        config = _config(tiny_model_dir, tmp_path, kl={"penalty_coef": 0.3, "discount_factor": discount},
                         teacher={"model": tiny_model_dir, "kl_coef": 0.7, "kl_discount_factor": discount,
                                  "reward_weight": 1.0})
        for which in ("reference", "teacher"):
            scorer = Scorer(which, "a checkpoint", other)
            signals = TokenSignals(config, reference=scorer if which == "reference" else None,
                                   teacher=scorer if which == "teacher" else None)
            terms, metrics = asyncio.run(signals.terms(episodes))
            ours = [adv.to_datum(ep, "importance_sampling", t) for ep, t in zip(episodes, terms)]
            theirs = cookbook_datums()
            if which == "reference":
                their_metrics, _ = asyncio.run(cookbook_kl(theirs, other, 0.3, discount))
                assert metrics["kl/reference"] == metrics["kl_policy_base"] == pytest.approx(
                    their_metrics["kl_policy_base"], rel=1e-5)
            else:
                their_metrics = asyncio.run(cookbook_distill(theirs, [other] * len(theirs), [0] * len(theirs),
                                                             0.7, discount))
                assert metrics["kl/teacher"] == metrics["teacher_kl"] == pytest.approx(
                    their_metrics["teacher_kl"], rel=1e-5)
                assert metrics["env/word/kl/teacher"] == pytest.approx(metrics["kl/teacher"])
            for d_ours, d_theirs, ep in zip(ours, theirs, episodes):
                a, b = (d.loss_fn_inputs["advantages"].to_numpy() for d in (d_ours, d_theirs))
                sampled = np.array(ep.action_mask[1:], dtype=bool)
                np.testing.assert_allclose(a[sampled], b[sampled], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{which} {discount}")
                # the cookbook's discounted sums also land on prompt and environment tokens; polyrl's do not
                assert np.all(a[~sampled] == 0) and (discount == 0) == np.all(b[~sampled] == 0)

        # both at once: the terms add up
        both = TokenSignals(config, reference=Scorer("kl_reference", "", other),
                            teacher=Scorer("teacher", "", other))
        ref_terms, _ = adv.reference_kl_terms(episodes,
                                              [other.compute_logprobs(types.ModelInput.from_ints(ep.tokens))
                                               .result() for ep in episodes], 0.3, discount)
        teacher_terms, _ = adv.teacher_kl_terms(episodes,
                                                [other.compute_logprobs(types.ModelInput.from_ints(ep.tokens))
                                                 .result() for ep in episodes], 0.7, discount)
        for total, r, t in zip(asyncio.run(both.terms(episodes))[0], ref_terms, teacher_terms):
            assert total == pytest.approx([x + y for x, y in zip(r, t)])


# ------------------------------------------------------- reference logprobs are the engine's forward pass
def _forward_logprobs(training, tokens: list[int]) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")})
    return training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _check_scorers_match_forward(service, config: TrainConfig, tokenizer, checkpoint: str) -> None:
    base_model = config.model_name
    fresh = service.create_lora_training_client(base_model=base_model, rank=4, seed=1).result()  # LoRA B = 0
    policy = fresh.save_weights_and_get_sampling_client().result()
    episodes = _sampled_episodes(policy, tokenizer, n=2)
    guard = ServiceGuard(None, 10)

    async def scored(source):
        scorer = await open_scorer("kl_reference", source, config, service, guard, policy, tokenizer, print)
        return await scorer.logprobs(episodes)

    # the base model: what a LoRA adapter that is still zero computes
    for ep, lps in zip(episodes, asyncio.run(scored(None))):
        assert lps[0] is None and len(lps) == len(ep.tokens)
        np.testing.assert_allclose(lps[1:], _forward_logprobs(fresh, ep.tokens), atol=1e-4)
    # a checkpoint: what a training client holding the same weights computes
    trained = service.create_training_client_from_state(
        checkpoint.replace("sampler_weights", "weights")).result()
    for ep, lps in zip(episodes, asyncio.run(scored(checkpoint))):
        np.testing.assert_allclose(lps[1:], _forward_logprobs(trained, ep.tokens), atol=1e-4)
        # it is another policy
        assert not np.allclose(lps[1:], _forward_logprobs(fresh, ep.tokens), atol=1e-3)


def test_reference_logprobs_equal_the_engines_forward_pass(tiny_model_dir, tokenizer, tmp_path):
    from polyrl.local import ServiceClient

    service = ServiceClient(store_dir=tmp_path / "store")
    checkpoint = _trained_checkpoint(service, tiny_model_dir, tokenizer)
    _check_scorers_match_forward(service, _config(tiny_model_dir, tmp_path), tokenizer, checkpoint)


# ------------------------------------------------------------------------------- through polyrl serve
@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from test_serve import Served

    server = Served(tiny_model_dir, tmp_path_factory.mktemp("kl-serve-store"))
    yield server
    server.stop()


@pytest.mark.slow
def test_reference_logprobs_through_serve_equal_the_engines_forward_pass(served, tiny_model_dir, tokenizer,
                                                                         tmp_path):
    from test_serve import KEY

    service = served.sdk(KEY)
    checkpoint = _trained_checkpoint(service, tiny_model_dir, tokenizer)
    config = _config(tiny_model_dir, tmp_path, backend="tinker", base_url=served.url, local={})
    _check_scorers_match_forward(service, config, tokenizer, checkpoint)


@pytest.mark.slow
def test_kl_penalty_and_teacher_through_serve_match_in_process(served, tiny_model_dir, tokenizer, tmp_path,
                                                               monkeypatch):
    """The same run -- a KL penalty against the base model, a checkpoint as teacher, rewards mixed in --
    gives the same numbers in process and through polyrl serve with the official SDK."""
    from test_serve import KEY

    from polyrl.local import ServiceClient
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    monkeypatch.setenv("TINKER_API_KEY", KEY)

    def run(name, service, **over):
        teacher = _trained_checkpoint(service, tiny_model_dir, tokenizer)
        config = _config(tiny_model_dir, tmp_path, log_path=str(tmp_path / name), kl={"penalty_coef": 0.2},
                         teacher={"model": teacher, "kl_coef": 0.5, "reward_weight": 1.0}, **over)
        train(config, ConsoleLog(enabled=False))
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    local = run("local", ServiceClient(store_dir=tmp_path / "store"))
    remote = run("remote", served.sdk(KEY), backend="tinker",
                 base_url=served.url, local={})
    assert [r["step"] for r in remote] == [0, 1, 2]
    assert abs(local[0]["kl/reference"]) < 1e-5  # a LoRA adapter that is still zero is the base model
    assert abs(local[0]["kl/teacher"]) > 0.01  # the teacher is another policy
    for a, b in zip(local, remote):
        keys = {k for k in a if not k.startswith("time/")}
        assert keys == {k for k in b if not k.startswith("time/")}
        assert {"kl/reference", "kl_policy_base", "kl/teacher", "teacher_kl", "env/word/kl/teacher"} <= keys
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["step"], key)


# ----------------------------------------------------------------------------------- config and errors
def test_settings_without_effect_and_missing_models_are_config_errors(tiny_model_dir, tmp_path):
    from polyrl.config.files import load_config

    def _config(model_dir, tmp_path, **over):  # as a config file would be loaded: one ConfigError line
        return load_config(None, base=dict(model_name=model_dir,
                                           environments={"word": {"type": "kl_test_word"}}, **over))

    # a reference or a discount without a penalty: the penalty is what is missing
    with pytest.raises(ConfigError, match="kl.penalty_coef: Field required"):
        _config(tiny_model_dir, tmp_path, kl={"reference": tiny_model_dir})
    with pytest.raises(ConfigError, match="kl.penalty_coef: Field required"):
        _config(tiny_model_dir, tmp_path, kl={"discount_factor": 0.9})
    with pytest.raises(ConfigError, match="teacher.model: .*no-such-model"):
        _config(tiny_model_dir, tmp_path, teacher={"model": str(tmp_path / "no-such-model")})
    with pytest.raises(ConfigError, match="kl.reference: .*no-such-model"):
        _config(tiny_model_dir, tmp_path,
                kl={"penalty_coef": 0.1, "reference": str(tmp_path / "no-such-model")})
    with pytest.raises(ConfigError,
                       match="advantages.remove_constant_reward_groups: .*teacher.reward_weight is 0"):
        _config(tiny_model_dir, tmp_path, teacher={"model": tiny_model_dir},
                advantages={"remove_constant_reward_groups": True})
    with pytest.raises(ConfigError, match="teacher.kl_coef: Input should be greater than 0"):
        _config(tiny_model_dir, tmp_path, teacher={"model": tiny_model_dir, "kl_coef": 0})
    ok = _config(tiny_model_dir, tmp_path, kl={"penalty_coef": 0.1},
                 teacher={"model": "tinker://run/sampler_weights/t"})
    assert ok.teacher.reward_weight == 0 and ok.teacher.kl_coef == 1.0 and ok.kl.reference is None


def test_a_missing_teacher_or_one_with_another_tokenizer_is_refused_at_start(tiny_model_dir, small_model_dir,
                                                                              tmp_path):
    from polyrl.rl.run import open_run

    config = _config(tiny_model_dir, tmp_path, teacher={"model": small_model_dir})
    with pytest.raises(ConfigError, match="teacher.model: .* does not share the tokenizer of"):
        asyncio.run(open_run(config))
    config = _config(tiny_model_dir, tmp_path,
                     kl={"penalty_coef": 0.1, "reference": "tinker://r/sampler_weights/x"})
    with pytest.raises(ConfigError,
                       match=r"kl\.reference: checkpoint tinker://r/sampler_weights/x not found"):
        asyncio.run(open_run(config))


# ------------------------------------------------------------------ a student reaches its teacher's success
GUESS = {"low": 1, "high": 7, "max_guesses": 3}  # bisection always wins; the linear search rarely


def _guess_number(split: str, demo_error_rate: float = 0.0, group: int = 1) -> dict:
    splits = {"train": {"num_samples": 256}, "test": None} if split == "demos" else \
        {"train": None, "test": {"num_samples": 32}} if split == "test" else {"train": {}, "test": None}
    return {"guess_number": {"args": {**GUESS, "demo_error_rate": demo_error_rate}, "max_turns": 3,
                             "max_tokens": 3, "num_rollouts": group, "splits": splits}}


@pytest.mark.slow
def test_distilled_student_reaches_its_teachers_success(tmp_path):
    """A teacher warm-started on bisection demonstrations and a student warm-started on demonstrations
    half of which search linearly (it learned both habits); ``polyrl distill`` from the teacher's
    checkpoint, with no reward in the advantage, makes the student search like its teacher in 16 steps.
    (Seeds 1..14 in pairs all took the student from 0.71-0.77 to 0.96-1.0, the teacher's 1.0.)"""
    from polyrl.evaluate import evaluate_checkpoint
    from polyrl.models.tiny import build_tiny_model
    from polyrl.sft import SFTConfig, sft_async
    from polyrl.tracking.console import ConsoleLog

    model = str(build_tiny_model(tmp_path / "model", "quickstart-cpu", seed=0))
    common = {"model_name": model, "lora_rank": 16, "local": {"store_dir": str(tmp_path / "store")}}

    async def warm_start(name: str, demo_error_rate: float, steps: int, seed: int) -> None:
        config = SFTConfig(**common, learning_rate=1e-2, batch_size=16, max_steps=steps, seed=seed,
                           log_path=str(tmp_path / name),
                           environments=_guess_number("demos", demo_error_rate))
        await sft_async(config, ConsoleLog(enabled=False))

    def success(sampler_path: str) -> float:
        config = TrainConfig(**common, eval_num_samples=4, environments=_guess_number("test"))
        return asyncio.run(evaluate_checkpoint(config, sampler_path))["test/guess_number/pass@1"]

    asyncio.run(warm_start("teacher", 0.0, 250, seed=1))
    asyncio.run(warm_start("student", 0.5, 500, seed=2))  # long enough to know both habits well
    teacher, student = (json.loads((tmp_path / name / "sft.json").read_text())
                        for name in ("teacher", "student"))
    teacher_success, student_success = success(teacher["sampler_path"]), success(student["sampler_path"])
    assert teacher_success >= 0.9 and student_success <= teacher_success - 0.15, \
        (teacher_success, student_success)

    config = {**common, "resume_from": student["state_path"], "learning_rate": 1e-3, "batch_size": 16,
              "max_steps": 16, "max_tokens": 3, "save_every": 0, "outputs": {"report": False},
              "log_path": str(tmp_path / "distill"),
              "environments": _guess_number("train", group=8)}
    (tmp_path / "distill.yaml").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}

    def distill(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "polyrl.cli", "distill", *args, "--config",
                               str(tmp_path / "distill.yaml")], capture_output=True, text=True, env=env,
                              timeout=600)

    refused = distill()
    assert refused.returncode == 2 and refused.stderr.strip().startswith("error: distill needs a teacher"), \
        refused.stderr
    done = distill(teacher["sampler_path"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert (json.loads((tmp_path / "distill" / "config.json").read_text())["teacher"]["model"]
            == teacher["sampler_path"])
    kl = [r["kl/teacher"] for r in rows]
    assert sum(kl[-3:]) / 3 < kl[0] / 4, kl
    final = json.loads((tmp_path / "distill" / "checkpoints.jsonl").read_text().splitlines()[-1])
    after = success(final["sampler_path"])
    assert after >= teacher_success - 0.08, (student_success, after, teacher_success)
