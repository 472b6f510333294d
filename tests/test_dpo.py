"""``polyrl dpo --data FILE.jsonl``: TRL's preference pairs, DPO's loss by hand, and training on the local
engine and through the official SDK against ``polyrl serve`` (its ``forward_backward_custom``): the loss
starts at ln 2 (the reference is the starting policy), falls, and held-out pairs come to be ranked right."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_bad_input import run_all  # noqa: E402 - one error line, exit 2, no traceback
from test_sft_data import cli_error, write_jsonl
from tinker import types

from polyrl.config.files import load_config
from polyrl.dpo import DPOConfig, dpo, dpo_loss, preference_stats
from polyrl.errors import UserInputError
from polyrl.sft_data import parse_pair, read_pairs
from polyrl.tracking.console import ConsoleLog

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "dpo"
USER = {"role": "user", "content": "What is 2 + 3?"}


def test_trl_preference_lines_become_pairs():
    explicit = parse_pair(json.dumps({"prompt": [USER], "chosen": [{"role": "assistant", "content": "5"}],
                                      "rejected": [{"role": "assistant", "content": "6"}]}), "f:1")
    assert explicit.prompt == [USER] and explicit.chosen[0]["content"] == "5"
    text = parse_pair(json.dumps({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}), "f:2")
    assert text.prompt == [USER] and text.rejected == [{"role": "assistant", "content": "6"}]
    # implicit prompt: the messages both sides start with are the prompt, assistant turns included
    earlier = [USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2 + 4?"}]
    implicit = parse_pair(json.dumps({"chosen": [*earlier, {"role": "assistant", "content": "6"}],
                                      "rejected": [*earlier, {"role": "assistant", "content": "7"}]}), "f:3")
    assert implicit.prompt == earlier and implicit.chosen == [{"role": "assistant", "content": "6"}]
    chosen = implicit.conversation("chosen")
    assert chosen.messages[-1]["content"] == "6" and chosen.assistant_weights == (0.0, 1.0)


BAD_PAIRS = [
    ("{not json", "not JSON"),
    (json.dumps({"prompt": "q", "chosen": "a"}), "not a preference pair"),
    (json.dumps({"prompt": "q", "chosen": "a", "rejected": "a"}), "the same answer"),
    (json.dumps({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}),
     "chosen has no assistant message"),
    (json.dumps({"prompt": "q", "chosen": "a", "rejected": []}), "rejected is empty"),
    (json.dumps({"prompt": "q", "chosen": [{"role": "robot", "content": "a"}], "rejected": "b"}),
     "unknown role"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_PAIRS)
def test_a_bad_pair_names_its_file_line_and_problem(tmp_path, line, problem):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, line])
    with pytest.raises(UserInputError) as info:
        read_pairs([str(path)])
    assert str(info.value).startswith(f"{path}:2: ") and problem in str(info.value)


def test_bad_pairs_on_the_command_line_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "good.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    write_jsonl(tmp_path / "bad.jsonl", [BAD_PAIRS[2][0]])
    model = ["--overrides", "model_name=any"]
    assert cli_error(["dpo", "--data", "bad.jsonl", *model], capsys).startswith("error: bad.jsonl:1: ")
    error = cli_error(["dpo", "--data", "good.jsonl", "--eval-data", "missing.jsonl", *model], capsys)
    assert error == "error: data file not found: missing.jsonl"
    assert "no preference pairs" in cli_error(["dpo", *model], capsys)
    assert "beta" in cli_error(["dpo", "--data", "good.jsonl", *model, "beta=0"], capsys)
    run_all([(["dpo", "--data", "bad.jsonl", *model], "bad.jsonl:1: chosen and rejected")], tmp_path)


def test_the_loss_is_dpos_and_its_gradient_raises_chosen_and_lowers_rejected():
    """Two pairs, their summed answer logprobs against a reference, by hand."""
    weights = [np.array(w, dtype=np.float32) for w in ([0, 1, 1], [0, 1, 0], [1, 1], [0, 1])]
    data = [types.Datum(model_input=types.ModelInput.from_ints([0] * len(w)), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.zeros(len(w), "int64")),
        "weights": types.TensorData.from_numpy(w)}) for w in weights]
    logprobs = [torch.tensor(x, requires_grad=True) for x in
                ([-9.0, -1.0, -2.0], [-9.0, -1.5, -7.0], [-0.5, -0.5], [-3.0, -0.2])]
    reference = [-4.0, -1.0, -1.0, -0.5]  # chosen, rejected, chosen, rejected
    beta, stats = 0.5, {}
    loss, _ = dpo_loss(reference, beta, stats)(data, logprobs)
    policy = [-3.0, -1.5, -1.0, -0.2]
    margins = [beta * ((policy[0] - reference[0]) - (policy[1] - reference[1])),
               beta * ((policy[2] - reference[2]) - (policy[3] - reference[3]))]
    expected = sum(math.log1p(math.exp(-m)) for m in margins) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert stats["dpo/margin"] == pytest.approx(sum(margins) / 2, rel=1e-6)
    assert stats["dpo/accuracy"] == 0.5  # the first pair ranks chosen first, the second does not
    assert preference_stats(policy, reference, beta)["loss"] == pytest.approx(expected, rel=1e-9)
    untrained = preference_stats(reference, reference, beta)
    assert untrained == {"loss": math.log(2), "accuracy": 0.5, "margin": 0.0}
    loss.backward()
    # descending the loss raises the chosen answers' learned tokens and lowers the rejected ones', and
    # leaves the prompt's (weight 0) alone
    assert logprobs[0].grad[0] == 0 and (logprobs[0].grad[1:] < 0).all() and (logprobs[2].grad < 0).all()
    assert logprobs[1].grad[1] > 0 and logprobs[1].grad[2] == 0 and logprobs[3].grad[1] > 0


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_trained(run: Path, steps: int) -> dict:
    """The run's step rows start at ln 2 and fall; its held-out pairs are ranked better after than before."""
    rows = _rows(run)
    trained = [r for r in rows if "dpo/loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    assert trained[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the reference is the start
    assert trained[-1]["dpo/loss"] < trained[0]["dpo/loss"] - 0.05
    held = [r for r in rows if "eval/accuracy" in r]
    assert held[0]["step"] == -1 and held[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)
    summary = json.loads((run / "dpo.json").read_text())
    assert summary["held_out_before"]["accuracy"] == pytest.approx(0.5, abs=0.05)
    assert summary["held_out_after"]["accuracy"] >= 0.9
    assert summary["held_out_after"]["margin"] > summary["held_out_before"]["margin"] + 0.05
    return summary


def test_the_example_trains_on_the_local_engine_from_an_sft_start(tmp_path, tiny_model_dir, monkeypatch):
    """examples/dpo as its header says (the tiny model for SmolLM2), started from a polyrl sft state: the
    reference is that state, so the first loss is ln 2 again, and the checkpoint ranks held-out pairs."""
    from polyrl.sft import SFTConfig, sft

    shutil.copytree(EXAMPLE, tmp_path / "examples" / "dpo")
    monkeypatch.chdir(tmp_path)  # the example's paths are relative to the checkout
    store = tmp_path / "store"
    demos = write_jsonl(tmp_path / "demos.jsonl", [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}])
    warm = sft(load_config(None, [f"model_name={tiny_model_dir}", f"data={demos}", "lora_rank=8",
                                  "max_steps=2", "batch_size=1", f"log_path={tmp_path / 'sft'}",
                                  f"local.store_dir={store}"], model=SFTConfig), ConsoleLog(enabled=False))
    config = load_config(tmp_path / "examples" / "dpo" / "dpo.yaml", [
        f"model_name={tiny_model_dir}", "lora_rank=8", "learning_rate=2e-3", "max_steps=12", "eval_every=6",
        f"load_checkpoint={warm}", f"log_path={tmp_path / 'runs' / 'dpo'}", f"local.store_dir={store}"],
        model=DPOConfig)
    state = dpo(config, ConsoleLog(enabled=False))
    summary = _check_trained(tmp_path / "runs" / "dpo", 12)
    assert summary["state_path"] == state and summary["pairs"] == 96 and summary["held_out"] == 32
    assert [r["step"] for r in _rows(tmp_path / "runs" / "dpo") if "eval/accuracy" in r] == [-1, 5, 11]


def test_dpo_through_the_sdk_against_polyrl_serve(tmp_path, tiny_model_dir, monkeypatch):
    """``backend: tinker``: the official SDK's forward_backward_custom computes DPO's loss client-side and
    the server trains on its gradient, as it would on Tinker's cluster."""
    from test_serve import KEY, Served

    served = Served(tiny_model_dir, tmp_path / "serve-store")
    try:
        monkeypatch.setenv("TINKER_API_KEY", KEY)
        config = load_config(None, [
            f"model_name={tiny_model_dir}", "backend=tinker", f"base_url={served.url}", "lora_rank=8",
            f"data={EXAMPLE / 'pairs.jsonl'}", f"eval_data={EXAMPLE / 'held_out.jsonl'}",
            "learning_rate=2e-3", "max_steps=10", "eval_every=0", f"log_path={tmp_path / 'run'}"],
            model=DPOConfig)
        state = dpo(config, ConsoleLog(enabled=False))
    finally:
        served.stop()
    assert state.startswith("tinker://")
    _check_trained(tmp_path / "run", 10)
