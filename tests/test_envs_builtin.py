"""The built-in offline environments: determinism, held-out test split, rewards, tool flow, demos."""

from __future__ import annotations

import asyncio

import pytest

from polyrl.envs.base import EnvBuilder, StepResult
from polyrl.envs.builtin import (
    CALCULATOR_TOOL,
    ExpressionError,
    answer_value,
    arithmetic_mistake,
    evaluate_expression,
    extract_answer,
    parse_number,
)
from polyrl.envs.registry import get_env_builder

ENV_NAMES = ["arithmetic", "countdown", "guess_number", "calculator"]


def build(name: str, seed: int = 0, **args) -> EnvBuilder:
    return get_env_builder(name)(args, seed)


def assistant(content: str = "", **extra) -> dict:
    return {"role": "assistant", "content": content, **extra}


def tool_call(expression, name: str = "calculator", call_id: str = "c1") -> dict:
    function = {"name": name, "arguments": {"expression": expression}}
    return {"id": call_id, "type": "function", "function": function}


def play(builder: EnvBuilder, split: str, index: int, actions: list[dict]) -> list[StepResult]:
    """Reset a fresh env and step it with ``actions`` until done; the step results."""

    async def run() -> list[StepResult]:
        env = builder.make(split, index)
        try:
            await env.reset()
            results = []
            for action in actions:
                results.append(await env.step(action))
                if results[-1].done:
                    break
            return results
        finally:
            await env.close()

    return asyncio.run(run())


def prompt(builder: EnvBuilder, split: str, index: int) -> str:
    return asyncio.run(builder.make(split, index).reset()).messages[-1]["content"]


# ---------------------------------------------------------------------------------------------- helpers


def test_extract_answer_prefers_last_box_then_last_number():
    assert extract_answer("first \\boxed{12} then \\boxed{57}") == "57"
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # nested braces
    assert extract_answer("12 - 5 = 7.") == "7"
    assert extract_answer("12-5") == "5"  # a minus glued to a digit is an operator
    assert extract_answer("it is -42") == "-42"
    assert extract_answer("total 1,234 apples") == "1,234"
    assert extract_answer("Put it in \\boxed{}. 9") == "9"  # empty boxes are ignored
    assert extract_answer("no digits") is None
    assert extract_answer("") is None and extract_answer(None) is None


def test_parse_number():
    assert parse_number("57") == 57 and isinstance(parse_number("57"), int)
    assert parse_number(" -3 ") == -3
    assert parse_number("1,234") == 1234
    assert parse_number("$12.") == 12
    assert parse_number("2.5") == 2.5
    assert parse_number("\u22127") == -7
    for bad in ("", "abc", "1_000", "5 6", "1,2", None):
        assert parse_number(bad) is None, bad
    assert answer_value("\\boxed{x = 57}") == 57


def test_evaluate_expression_is_exact_and_safe():
    value, literals = evaluate_expression("(3+5)*2")
    assert value == 16 and literals == [3, 5, 2]
    assert evaluate_expression("7/2")[0] * 2 == 7  # exact fractions
    for bad in ("__import__('os')", "2**10", "0x10", "1_000", "3.5", "-3", "1/0", "", "(1+", "9" * 300):
        with pytest.raises(ExpressionError):
            evaluate_expression(bad)
    assert evaluate_expression("-1.5*2", allow_decimals=True, allow_unary=True)[0] == -3


# ---------------------------------------------------------------------------------------------- builders


def tasks(builder: EnvBuilder, split: str, n: int = 10) -> list:
    """What identifies the first ``n`` tasks: the prompt, or the secret (which the prompt hides)."""
    if hasattr(builder, "secret"):
        return [builder.secret(split, i) for i in range(n)]
    return [prompt(builder, split, i) for i in range(n)]


@pytest.mark.parametrize("name", ENV_NAMES)
def test_tasks_are_deterministic_and_splits_differ(name):
    a, b = build(name), build(name)
    assert tasks(a, "train") == tasks(b, "train")
    assert tasks(a, "train") != tasks(a, "test")
    assert tasks(a, "train") != tasks(build(name, seed=1), "train")
    assert a.demonstration("train", 3) == b.demonstration("train", 3)


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "calculator"])
def test_test_split_is_held_out(name):
    builder = build(name)
    train = {prompt(builder, "train", i) for i in range(300)}
    test = {prompt(builder, "test", i) for i in range(100)}
    assert len(test) > 50  # the test split is not degenerate
    assert not train & test


@pytest.mark.parametrize("name", ENV_NAMES)
def test_bad_args_are_rejected_by_name(name):
    with pytest.raises(ValueError, match="bogus"):
        build(name, bogus=1)
    with pytest.raises(ValueError, match="demo_error_rate"):
        build(name, demo_error_rate=1.5)
    with pytest.raises(ValueError, match="split"):
        build(name).make("validation", 0)


def test_arg_validation_names_the_arg():
    with pytest.raises(ValueError, match="ops"):
        build("arithmetic", ops=["%"])
    with pytest.raises(ValueError, match="min_value"):
        build("arithmetic", min_value=10, max_value=5)
    with pytest.raises(ValueError, match="num_numbers"):
        build("countdown", num_numbers=9)
    with pytest.raises(ValueError, match="kinds"):
        build("calculator", kinds=["pow"])
    with pytest.raises(ValueError, match="max_guesses"):
        build("guess_number", max_guesses=0)


# ---------------------------------------------------------------------------------------------- arithmetic


def test_arithmetic_rewards():
    builder = build("arithmetic", ops=["+", "-", "*", "/"], min_value=2, max_value=30)
    for i in range(20):
        task = builder.task("train", i)
        assert f"What is {task.a} {task.op} {task.b}?" in prompt(builder, "train", i)
        assert eval(f"{task.a} {task.op} {task.b}") == task.answer  # test-side check of the generator
        for reply, reward, fmt in [
            (f"\\boxed{{{task.answer}}}", 1.0, 1.0),
            (f"So it is {task.answer}.", 1.0, 1.0),
            (f"\\boxed{{{task.answer + 1}}}", 0.0, 1.0),
            (f"\\boxed{{{task.answer}}} no wait \\boxed{{{task.answer + 10}}}", 0.0, 1.0),
            ("I don't know", 0.0, 0.0),
        ]:
            (result,) = play(builder, "train", i, [assistant(reply)])
            assert result.done and result.reward == reward, reply
            assert result.metrics == {"success": reward, "format_ok": fmt}


def test_arithmetic_mistake_drops_carry_and_is_always_wrong():
    assert arithmetic_mistake(48, "+", 35, 83) == 73
    assert arithmetic_mistake(95, "+", 17, 112) == 102
    assert arithmetic_mistake(52, "-", 17, 35) == 45
    assert arithmetic_mistake(17, "-", 52, -35) == -45
    assert arithmetic_mistake(12, "+", 34, 46) != 46  # no carry: off by 10 instead
    builder = build("arithmetic", ops=["+", "-", "*", "/"])
    for i in range(200):
        t = builder.task("train", i)
        assert arithmetic_mistake(t.a, t.op, t.b, t.answer) != t.answer


# ---------------------------------------------------------------------------------------------- countdown


def test_countdown_tasks_are_solvable_and_graded():
    builder = build("countdown", num_numbers=4)
    for i in range(20):
        task = builder.task("train", i)
        assert len(task.numbers) == 4 and all(1 <= n <= 10 for n in task.numbers)
        messages, _ = builder.demonstration("train", i)
        solution = messages[-1]["content"][len("\\boxed{") : -1]
        value, literals = evaluate_expression(solution)
        assert value == task.target and sorted(literals) == sorted(task.numbers)
        (result,) = play(builder, "train", i, [assistant(f"\\boxed{{{solution}}}")])
        assert result.reward == 1.0 and result.metrics == {"success": 1.0, "format_ok": 1.0}
        (result,) = play(builder, "train", i, [assistant(f"{solution} = {task.target}")])
        assert result.reward == 1.0  # an unboxed expression with an "= target" suffix still counts


def test_countdown_rejects_wrong_reused_missing_numbers_and_code():
    builder = build("countdown")
    task = builder.task("train", 0)
    a, b, c = task.numbers
    cases = {
        f"\\boxed{{{task.target}}}": 1.0,  # just the target: valid arithmetic, numbers not used
        f"\\boxed{{{a}+{b}}}": 1.0,  # a number missing
        f"\\boxed{{{a}+{b}+{c}+{c}}}": 1.0,  # a number used twice
        f"\\boxed{{{a}+{b}+{c}+1}}": 1.0,  # an extra number
        "\\boxed{__import__('os').system('true')}": 0.0,
        "\\boxed{2**3}": 0.0,
        f"\\boxed{{{a}/0+{b}+{c}}}": 0.0,
        "no idea": 0.0,
    }
    for reply, fmt in cases.items():
        (result,) = play(builder, "train", 0, [assistant(reply)])
        assert result.done and result.reward == 0.0, reply
        assert result.metrics["format_ok"] == fmt, reply


# ---------------------------------------------------------------------------------------------- guess_number


def test_guess_number_feedback_and_success():
    builder = build("guess_number")
    secret = builder.secret("train", 0)
    assert 1 <= secret <= 16
    low_guess, high_guess = secret - 1, secret + 1
    results = play(builder, "train", 0, [assistant(str(low_guess)), assistant(f"\\boxed{{{high_guess}}}"),
                                         assistant("pass"), assistant(str(secret))])
    assert [r.messages for r in results[:3]] == [
        [{"role": "user", "content": "Higher."}],
        [{"role": "user", "content": "Lower."}],
        [{"role": "user", "content": "Reply with one number."}],
    ]
    assert [r.done for r in results] == [False, False, False, True]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
    assert results[-1].metrics == {"success": 1.0, "num_guesses": 4.0}


def test_guess_number_runs_out_of_guesses():
    builder = build("guess_number", max_guesses=3)
    secret = builder.secret("train", 1)
    wrong = assistant(str(secret + 100))
    results = play(builder, "train", 1, [wrong] * 5)
    assert len(results) == 3 and results[-1].done
    assert [r.reward for r in results] == [0.0, 0.0, 0.0]
    assert results[-1].metrics == {"success": 0.0, "num_guesses": 3.0}
    assert results[-1].messages == []


def test_env_refuses_steps_after_done():
    async def run():
        env = build("arithmetic").make("train", 0)
        await env.reset()
        await env.step(assistant("1"))
        with pytest.raises(RuntimeError):
            await env.step(assistant("1"))

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------- calculator


def test_calculator_tool_flow():
    builder = build("calculator")
    obs = asyncio.run(builder.make("train", 0).reset())
    assert obs.tools == [CALCULATOR_TOOL]
    task = builder.task("train", 0)
    results = play(
        builder,
        "train",
        0,
        [
            assistant(tool_calls=[tool_call(task.expression, call_id="a"), tool_call("1/0", call_id="b")]),
            assistant(content=None, tool_calls=[tool_call("x", name="search", call_id="c")],
                      tool_call_errors=["could not parse JSON"]),
            assistant(f"\\boxed{{{task.answer}}}"),
        ],
    )
    first, second, final = results
    assert first.messages == [
        {"role": "tool", "tool_call_id": "a", "name": "calculator", "content": str(task.answer)},
        {"role": "tool", "tool_call_id": "b", "name": "calculator", "content": "error: division by zero"},
    ]
    assert (first.reward, first.done, second.reward, second.done) == (0.0, False, 0.0, False)
    assert second.messages[0]["role"] == "tool" and "unknown tool" in second.messages[0]["content"]
    assert second.messages[0]["name"] == "search"  # named as called: harmony writes the reply's author
    assert second.messages[1]["role"] == "user" and "could not parse JSON" in second.messages[1]["content"]
    assert final.done and final.reward == 1.0
    assert final.metrics == {"success": 1.0, "tool_calls": 4.0}


def test_calculator_bad_arguments_do_not_crash():
    weird_calls = [
        {"id": "1", "type": "function", "function": {"name": "calculator", "arguments": {}}},
        {"id": "2", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}},  # JSON string
        {"id": "3", "type": "function", "function": {"name": "calculator", "arguments": "not json"}},
        {"id": "4", "type": "function", "function": {"name": "calculator", "arguments": {"expression": [1]}}},
    ]
    builder = build("calculator", max_tool_calls=10)
    (result,) = play(builder, "train", 0, [assistant(tool_calls=weird_calls)])
    contents = [m["content"] for m in result.messages]
    assert contents[1] == "6"
    assert all(c.startswith("error:") for i, c in enumerate(contents) if i != 1)
    assert not result.done


def test_calculator_wrong_final_answer_and_tool_cap():
    builder = build("calculator", max_tool_calls=2)
    task = builder.task("test", 5)
    (result,) = play(builder, "test", 5, [assistant(f"\\boxed{{{task.answer + 1}}}")])
    assert result.done and result.reward == 0.0 and result.metrics == {"success": 0.0, "tool_calls": 0.0}
    call = assistant(tool_calls=[tool_call(task.expression)])
    results = play(builder, "test", 5, [call, call, call, assistant(f"\\boxed{{{task.answer}}}")])
    assert [r.done for r in results] == [False, False, True]  # the third call is over the cap
    assert results[-1].reward == 0.0 and results[-1].metrics == {"success": 0.0, "tool_calls": 3.0}


# -------------------------------------------------------------------------------- demonstrations


def replay(builder: EnvBuilder, split: str, index: int) -> tuple[float, list[dict]]:
    """Feed a demonstration's assistant messages to a fresh env; total reward and the env replies
    (which must match the demonstration's own env messages)."""
    messages, tools = builder.demonstration(split, index)
    obs = asyncio.run(builder.make(split, index).reset())
    assert messages[: len(obs.messages)] == obs.messages and tools == obs.tools
    actions = [m for m in messages if m["role"] == "assistant"]
    results = play(builder, split, index, actions)
    assert len(results) == len(actions) and results[-1].done
    assert messages[-1]["role"] == "assistant"
    replayed = list(obs.messages)
    for action, result in zip(actions, results):
        replayed += [action, *result.messages]
    assert replayed == messages
    return sum(r.reward for r in results), messages


@pytest.mark.parametrize("name", ENV_NAMES)
def test_expert_demonstrations_earn_full_reward(name):
    builder = build(name)
    for split in ("train", "test"):
        for i in range(25):
            reward, _ = replay(builder, split, i)
            assert reward == 1.0, (split, i)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_mistaken_demonstrations_earn_nothing(name):
    builder = build(name, demo_error_rate=1.0)
    for i in range(25):
        reward, _ = replay(builder, "train", i)
        assert reward == 0.0, i


@pytest.mark.parametrize("name", ENV_NAMES)
def test_demo_error_rate_is_a_fraction_fixed_per_task(name):
    builder = build(name, demo_error_rate=0.3)
    rewards = [replay(builder, "train", i)[0] for i in range(200)]
    assert 0.2 < rewards.count(0.0) / len(rewards) < 0.4
    assert rewards[:20] == [replay(build(name, demo_error_rate=0.3), "train", i)[0] for i in range(20)]


def test_demonstration_shapes():
    calc = build("calculator").demonstration("train", 0)[0]
    assert [m["role"] for m in calc] == ["user", "assistant", "tool", "assistant"]
    assert calc[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert calc[3]["content"] == f"\\boxed{{{calc[2]['content']}}}"
    for kinds in (["add3"], ["mul"]):  # the mistake: the call leaves out the last operand
        builder = build("calculator", kinds=kinds, demo_error_rate=1.0)
        wrong_calc, task = builder.demonstration("train", 0)[0], builder.task("train", 0)
        assert [m["role"] for m in wrong_calc] == ["user", "assistant", "tool", "assistant"]
        sent = wrong_calc[1]["tool_calls"][0]["function"]["arguments"]["expression"]
        assert (task.expression.startswith(sent + " ")
                and len(sent.split()) == len(task.expression.split()) - 2)
        assert wrong_calc[3]["content"] == f"\\boxed{{{wrong_calc[2]['content']}}}"
    # where leaving the operand out changes nothing, the mistake skips the tool and misses by one
    zeros = build("calculator", kinds=["add3"], min_value=0, max_value=0, demo_error_rate=1.0)
    skipped = zeros.demonstration("train", 0)[0]
    assert [m["role"] for m in skipped] == ["user", "assistant"] and skipped[1]["content"] == "\\boxed{1}"

    arith = build("arithmetic").demonstration("train", 0)[0]
    assert arith[-1]["content"].startswith("\\boxed{") and len(arith) == 2

    guesses = build("guess_number").demonstration("train", 0)[0]
    assert len([m for m in guesses if m["role"] == "assistant"]) <= 5  # binary search on 1..16
    assert guesses[1]["content"] == "8"
    linear = build("guess_number", demo_error_rate=1.0).demonstration("train", 0)[0]
    linear_guesses = [int(m["content"]) for m in linear if m["role"] == "assistant"]
    steps = {b - a for a, b in zip(linear_guesses, linear_guesses[1:])}
    assert len(linear_guesses) == 6 and steps in ({1}, {-1})
