"""``polyrl sft --data FILE.jsonl``: OpenAI-format conversations as a warm start, alone or mixed with
environment demonstrations; each bad line is one error naming ``file:line``; the checkpoint starts RL."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from test_bad_input import run_all  # noqa: E402 - one error line, exit 2, no traceback
from tinker import types

from polyrl.config.files import load_config
from polyrl.errors import UserInputError
from polyrl.images import next_token_inputs
from polyrl.sft import SFTConfig
from polyrl.sft_data import parse_line, read_conversations

SYSTEM = {"role": "system", "content": "Reply with the last word."}
CONVERSATIONS = [
    {"messages": [SYSTEM, {"role": "user", "content": "apple river stone"},
                  {"role": "assistant", "content": "stone"}]},
    {"messages": [SYSTEM, {"role": "user", "content": "cloud tiger"},
                  {"role": "assistant", "content": "tiger"}]},
    {"prompt": [SYSTEM, {"role": "user", "content": "lemon piano chair"}],
     "completion": [{"role": "assistant", "content": "chair"}]},
    {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function",
                       "function": {"name": "calculator", "arguments": "{\"expression\": \"2 + 3\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "5"},
                  {"role": "assistant", "content": "\\boxed{5}"}],
     "tools": [{"type": "function", "function": {
         "name": "calculator", "description": "Evaluate an expression.",
         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------------- reading lines


def test_openai_and_trl_lines_become_polyrl_messages(tmp_path):
    path = write_jsonl(tmp_path / "demos.jsonl", [CONVERSATIONS[0], "", CONVERSATIONS[2], CONVERSATIONS[3]])
    first, trl, tools = read_conversations([str(path)])
    assert first.messages == CONVERSATIONS[0]["messages"] and first.where == f"{path}:1"
    assert trl.where == f"{path}:3"  # blank line 2 skipped, numbering kept
    assert [m["role"] for m in trl.messages] == ["system", "user", "assistant"]
    call = tools.messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": {"expression": "2 + 3"}}  # JSON decoded
    assert tools.messages[1]["content"] == "" and tools.messages[2]["tool_call_id"] == "c1"
    assert tools.tools[0]["function"]["name"] == "calculator"
    plain = parse_line(json.dumps({"prompt": "hi", "completion": "hello"}), "x:1")
    assert plain.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_data_is_a_list_of_files_and_something_must_be_learned():
    config = load_config(None, ["model_name=m", "data=one.jsonl"], model=SFTConfig)
    assert config.data == ["one.jsonl"] and config.environments == {}
    with pytest.raises(UserInputError, match="nothing to learn"):
        load_config(None, ["model_name=m"], model=SFTConfig)


BAD_LINES = [
    ("{not json", "not JSON"),
    (json.dumps({"text": "hello"}), "no messages"),
    (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}), "unknown role 'bot'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                 "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}),
     "arguments are not JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "hi", "weight": 0},
                              {"role": "assistant", "content": "hello"}]}),
     "only assistant messages take a weight"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello", "weight": 0.5}]}),
     "weight must be 0"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello", "weight": 0}]}),
     "every assistant message"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_a_bad_line_names_its_file_line_and_problem(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "demos.jsonl", [CONVERSATIONS[0], line])
    with pytest.raises(UserInputError) as info:
        read_conversations([str(path)])
    assert str(info.value).startswith(f"{path}:2: ") and problem in str(info.value)


def cli_error(argv: list[str], capsys) -> str:
    """The one ``error:`` line of ``polyrl ARGV`` run as the ``polyrl`` script runs it; exit code 2."""
    from polyrl.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_bad_data_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "good.jsonl", CONVERSATIONS)
    model = ["--overrides", "model_name=any"]
    for k, (line, problem) in enumerate(BAD_LINES):
        write_jsonl(tmp_path / f"bad{k}.jsonl", [CONVERSATIONS[1], line])
        error = cli_error(["sft", "--data", "good.jsonl", f"bad{k}.jsonl", *model], capsys)
        assert error.startswith(f"error: bad{k}.jsonl:2: ") and problem in error
    error = cli_error(["sft", "--data", "good.jsonl", "--data", "missing.jsonl", *model], capsys)
    assert error == "error: data file not found: missing.jsonl"  # --data repeats; every file is read
    assert "nothing to learn" in cli_error(["sft", *model], capsys)
    # and in a process of its own, as a user runs it: one line, no traceback
    run_all([(["sft", "--data", "bad0.jsonl", *model], "bad0.jsonl:2: not JSON")], tmp_path)


NO_DEMOS_ENV = '''
def reward(completion, answer):
    return float(completion.strip() == answer)


class Task:
    dataset = [{"question": "Say yes.", "answer": "yes"}]
    rubric = [reward]


def load_environment():
    return Task()
'''


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_too_long_conversation_and_environment_without_demonstrations_are_one_line(
        tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "long.jsonl", [CONVERSATIONS[1], {"messages": [
        {"role": "user", "content": "word " * 5000}, {"role": "assistant", "content": "word"}]}])
    (tmp_path / "say_yes.py").write_text(NO_DEMOS_ENV)
    common = [f"model_name={tiny_model_dir}", "lora_rank=2", f"log_path={tmp_path}/run",
              f"local.store_dir={tmp_path}/store"]
    error = cli_error(["sft", "--data", "long.jsonl", "--overrides", *common], capsys)
    assert re.fullmatch(r"error: long\.jsonl:2: the conversation is \d+ tokens, longer than the model's "
                        r"context of 4096; shorten or drop it", error), error
    error = cli_error(["sft", "--overrides", *common, "environments.say_yes.type=module:say_yes.py",
                       "environments.say_yes.splits.train.num_samples=2"], capsys)
    assert error.startswith("error: environment 'say_yes' has no demonstrations to learn: give conversations "
                            "to imitate with polyrl sft --data FILE.jsonl"), error


# ----------------------------------------------------------------------------------- learning


def assistant_nll(service, model: str, sampler_path: str | None, conversations) -> float:
    """Mean negative log-likelihood of the assistant tokens of ``conversations`` under a checkpoint (or
    the base model), as the sampling client computes it."""
    from polyrl.renderers import resolve_renderer

    sampler = service.create_sampling_client(**({"model_path": sampler_path} if sampler_path
                                                else {"base_model": model}))
    renderer = resolve_renderer(None, model, sampler.get_tokenizer())
    total = count = 0.0
    for c in conversations:
        rendered, weights = renderer.render_supervised(c.messages, c.tools or None)
        logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(rendered.tokens)).result()
        for lp, w in zip(logprobs[1:], weights[1:]):
            total -= lp * w
            count += w
    return total / count


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_sft_on_data_and_an_environment_lowers_the_loss_on_that_data(tmp_path, tiny_model_dir):
    from polyrl.local import ServiceClient
    from polyrl.sft import sft
    from polyrl.tracking.console import ConsoleLog

    path = write_jsonl(tmp_path / "demos.jsonl", CONVERSATIONS)
    store = tmp_path / "store"
    config = load_config(None, [
        f"model_name={tiny_model_dir}", f"data={path}", "lora_rank=4", "max_steps=12", "batch_size=6",
        "learning_rate=1e-2", f"log_path={tmp_path / 'sft'}", f"local.store_dir={store}",
        "environments.arithmetic.splits.train.num_samples=2"], model=SFTConfig)
    state_path = sft(config, ConsoleLog(enabled=False))
    saved = json.loads((tmp_path / "sft" / "sft.json").read_text())
    assert saved["state_path"] == state_path

    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    assert rows[-1]["optim/loss"] < rows[0]["optim/loss"]  # each batch is the whole mix (4 + 2)

    conversations = read_conversations([str(path)])
    service = ServiceClient(store_dir=store)
    before = assistant_nll(service, tiny_model_dir, None, conversations)
    after = assistant_nll(service, tiny_model_dir, saved["sampler_path"], conversations)
    assert math.isfinite(before) and after < before - 0.5, (before, after)


def test_the_supervised_datum_weighs_only_assistant_tokens(tokenizer, tiny_model_dir):
    from polyrl.renderers import resolve_renderer
    from polyrl.sft import supervised_datum

    renderer = resolve_renderer(None, tiny_model_dir, tokenizer)
    conversation = parse_line(json.dumps(CONVERSATIONS[0]), "x:1")
    datum = supervised_datum(renderer, conversation.messages, [], None, "x:1")
    weights = datum.loss_fn_inputs["weights"].tolist()
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    learned = tokenizer.decode([t for t, w in zip(targets, weights) if w])
    assert learned.startswith("stone") and "apple" not in learned and "Reply" not in learned
    tokens, _ = renderer.supervised(conversation.messages)
    assert next_token_inputs(tokens, [])[1] == targets
    with pytest.raises(UserInputError, match="x:1: the conversation is .* than the model's context of 8"):
        supervised_datum(renderer, conversation.messages, [], 8, "x:1")


def test_an_assistant_message_of_weight_0_is_context_only(tokenizer, tiny_model_dir):
    from polyrl.renderers import resolve_renderer
    from polyrl.sft import supervised_datum

    renderer = resolve_renderer(None, tiny_model_dir, tokenizer)
    line = {"messages": [{"role": "user", "content": "apple river"},
                         {"role": "assistant", "content": "river", "weight": 0},
                         {"role": "user", "content": "cloud tiger"},
                         {"role": "assistant", "content": "tiger"}]}

    def learned(row) -> str:
        c = parse_line(json.dumps(row), "x:1")
        datum = supervised_datum(renderer, c.messages, c.tools, None, c.where, c.assistant_weights)
        targets, weights = (datum.loss_fn_inputs[k].tolist() for k in ("target_tokens", "weights"))
        return tokenizer.decode([t for t, w in zip(targets, weights) if w])

    assert parse_line(json.dumps(line), "x:1").assistant_weights == (0.0, 1.0)
    assert "tiger" in learned(line) and "river" not in learned(line)
    both = {"messages": [{k: v for k, v in m.items() if k != "weight"} for m in line["messages"]]}
    assert "tiger" in learned(both) and "river" in learned(both)
