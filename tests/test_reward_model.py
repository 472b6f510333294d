"""``polyrl reward-model``: a Bradley-Terry reward model trained on preference pairs ranks held-out pairs
above chance, and ``polyrl train`` with ``judge: {mode: reward_model}`` raises its score: the RLHF
pipeline (pairs, reward model, RL against it) on a tiny model and the example's local pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from polyrl.config.files import load_config
from polyrl.config.schema import TrainConfig
from polyrl.renderers import get_renderer
from polyrl.reward_model import RewardModelConfig, reward_model, score_datum
from polyrl.rl.judge import QUESTION, scored_tokens, yes_token
from polyrl.sft_data import read_pairs
from polyrl.tracking.console import ConsoleLog

REPO = Path(__file__).resolve().parent.parent
PAIRS = REPO / "examples" / "dpo"


def test_the_head_is_the_logprob_of_yes_after_the_question(tokenizer):
    renderer = get_renderer("chatml", tokenizer)
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    yes = yes_token(tokenizer)
    tokens, _ = scored_tokens(renderer, messages, None, QUESTION, yes)
    text = tokenizer.decode(tokens)
    assert text.index("5") < text.index(QUESTION) and text.endswith("assistant\n" + tokenizer.decode([yes]))
    datum = score_datum(renderer, messages, None, QUESTION, yes, None, "here")
    weights = datum.loss_fn_inputs["weights"].tolist()
    assert sum(weights) == 1.0 and weights[-1] == 1.0  # one target: Yes, at the end
    assert datum.loss_fn_inputs["target_tokens"].tolist()[-1] == yes


def test_the_rlhf_pipeline_a_reward_model_then_rl_against_it(tiny_model_dir, tmp_path):
    from polyrl.rl.train import train

    store = tmp_path / "store"
    config = load_config(None, [
        f"model_name={tiny_model_dir}", f"data={PAIRS / 'pairs.jsonl'}",
        f"eval_data={PAIRS / 'held_out.jsonl'}", "lora_rank=8", "learning_rate=3e-3", "max_steps=16",
        "batch_size=8", "eval_every=0",
        f"log_path={tmp_path / 'rm'}", f"local.store_dir={store}"], model=RewardModelConfig)
    reward_model(config, ConsoleLog(enabled=False))
    summary = json.loads((tmp_path / "rm" / "reward_model.json").read_text())
    before, after = summary["held_out_before"], summary["held_out_after"]
    assert after["accuracy"] >= 0.9 and after["loss"] < 0.3 < before["loss"], (before, after)
    assert after["margin"] > before["margin"] + 1.0  # chosen's score pulled above rejected's
    rows = [json.loads(x) for x in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward_model/loss" in r]
    assert trained[-1]["reward_model/loss"] < trained[0]["reward_model/loss"]
    assert all(math.isfinite(r["reward_model/loss"]) for r in trained)

    # RL on the pairs' questions, rewarded by the reward model (its sampler checkpoint, same engine)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": pair.prompt}) + "\n"
                             for pair in read_pairs([str(PAIRS / "pairs.jsonl")])))
    rl = TrainConfig(model_name=tiny_model_dir, lora_rank=8, batch_size=4, max_steps=12, max_tokens=6,
                     learning_rate=3e-2, save_every=0, eval_every=0, log_path=str(tmp_path / "rl"),
                     local={"store_dir": str(store)}, outputs={"report": False},
                     environments={"sums": {"type": "prompts", "num_rollouts": 8, "splits": {"test": None},
                                            "args": {"path": str(tasks)},
                                            "judge": {"mode": "reward_model",
                                                      "model": summary["sampler_path"]}}})
    train(rl, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["env/sums/judge/score"] for r in rows]
    assert all(r["rollouts/failed"] == 0 and r["judge/calls"] == 32 for r in rows)
    assert all(s <= 0 for s in scores) and sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.3, scores
    episode = json.loads((tmp_path / "rl" / "trajectories" / "step_000000.jsonl").read_text().splitlines()[0])
    record = episode["judge"][0]
    assert record["score"] == record["raw_score"] < 0 and record["prompt"] == QUESTION


def test_a_reward_model_judge_needs_its_checkpoint():
    from polyrl.config.env import JudgeConfig

    with pytest.raises(ValueError, match="mode reward_model needs model"):
        JudgeConfig(mode="reward_model")
    with pytest.raises(ValueError, match="mode reward_model needs model"):
        JudgeConfig(mode="reward_model", model="rm", base_url="http://127.0.0.1:1/v1")
