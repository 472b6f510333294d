"""``verifiers:`` environments (verifiers 0.4) and polyrl's OpenAI-compatible endpoint.

The endpoint is checked on its own (token ids, logprobs, tool calls, token-exact continuation of a
multi-turn conversation, streaming, errors). Then two verifiers tasksets (tests/fixtures/vf_tasksets,
a package installed the way an environment from the hub is, and loaded by name) are trained with
``polyrl train``: verifiers runs each episode (its harness program, its MCP tool server, its rubric
judge) against the endpoint, offline."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from scripted import ScriptedSampler

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.openai_server import OpenAIServer
from polyrl.renderers import get_renderer

REPO = Path(__file__).resolve().parents[1]
FIXTURE_PROJECT = REPO / "tests" / "fixtures" / "vf_tasksets"


# ---------------------------------------------------------------------------- the endpoint
def test_endpoint_returns_tokens_logprobs_and_continues_conversations_token_exactly(tokenizer):
    renderer = get_renderer("qwen3", tokenizer)
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "assistant", "content": "It is 3."},
                                        {"role": "assistant", "content": "", "tool_calls": [call]}],
                             logprobs=lambda n: np.linspace(-0.1, -1.0, n))
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]

    async def scenario():
        server = OpenAIServer(renderer, max_tokens=40, temperature=0.7)
        server.start()
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.post(server.url + "/chat/completions",
                                    json={"model": "m", "messages": messages})
                assert r.status_code == 503  # no sampler yet
                session = server.open_session(policy, max_tokens=16, temperature=0.5, seed=11)
                url = session.base_url + "/chat/completions"
                first = (await http.post(url, json={"model": "m", "messages": messages, "tools": tools,
                                                    "max_tokens": 99},
                                         headers={"X-Session-ID": "trace-1"})).json()
                reply = first["choices"][0]["message"]
                follow = messages + [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                             "content": "3"}]
                second = (await http.post(url, json={"model": "m", "messages": follow, "tools": tools,
                                                     "temperature": 0.0})).json()
                streamed = await http.post(url, json={"model": "m", "messages": messages, "tools": tools,
                                                      "stream": True})
                errors = [(await http.post(url, json=body)).status_code for body in (
                    {"messages": messages, "n": 2}, {"messages": []})]
                missing = await http.post(server.url.replace("/v1", "/s/nope/v1") + "/chat/completions",
                                          json={"messages": messages})
                models = (await http.get(session.base_url + "/models")).json()
            return session, first, second, streamed, errors, missing.status_code, models
        finally:
            server.stop()

    session, first, second, streamed, errors, missing, models = asyncio.run(scenario())
    choice = first["choices"][0]
    assert first["prompt_token_ids"] == renderer.initial_prompt(messages, tools)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert choice["token_ids"] == renderer.assistant_tokens(
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]})
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert choice["logprobs"]["content"][0]["logprob"] == pytest.approx(-0.1)
    assert first["usage"]["completion_tokens"] == len(choice["token_ids"])
    # the second turn continues the first one's exact tokens instead of re-rendering the history
    assert second["prompt_token_ids"] == (first["prompt_token_ids"] + choice["token_ids"]
                                          + renderer.continuation([{"role": "tool", "content": "3"}]))
    assert (second["choices"][0]["message"]["content"] == "It is 3."
            and second["choices"][0]["finish_reason"] == "stop")
    assert [ex.extends for ex in session.exchanges] == [None, 0, None]
    # the client's conversation name (verifiers' trace id) is recorded with its exchange
    assert [ex.conversation for ex in session.exchanges] == ["trace-1", None, None]
    # stream=true: one chunk with the whole reply as its delta (tool calls indexed), then [DONE]
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and len(events) == 2
    chunk = json.loads(events[0])
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["prompt_token_ids"] == first["prompt_token_ids"]
    delta = chunk["choices"][0]["delta"]
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["function"]["name"] == "add"
    assert chunk["choices"][0]["finish_reason"] == "tool_calls" and chunk["choices"][0]["token_ids"]
    # request values win over the session's defaults, max_tokens capped by the session's budget
    assert (policy.params[0].max_tokens, policy.params[0].temperature) == (16, 0.5)
    assert policy.params[1].temperature == 0.0
    assert policy.params[0].seed != policy.params[1].seed  # seeded per (session seed, turn)
    assert errors == [400, 400] and missing == 404 and models["data"][0]["id"] == "polyrl"


# ---------------------------------------------------------------------------- verifiers 0.4 tasksets
needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="needs the verifiers package (polyrl[verifiers])")


@pytest.fixture(scope="module")
def vf_site(tmp_path_factory) -> str:
    """The fixture tasksets' package, built and installed (pip, no deps) into a directory of its own."""
    root = tmp_path_factory.mktemp("vf-pkg")
    shutil.copytree(FIXTURE_PROJECT, root / "src")
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(root / "src")], check=True, capture_output=True)
    return str(site)


@pytest.fixture
def installed(vf_site, monkeypatch):
    """The package importable here and by the processes verifiers starts (its harness, its tool server)."""
    monkeypatch.syspath_prepend(vf_site)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (vf_site, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.chdir(REPO)
    return vf_site


def _judged_response(prompt: str) -> str:
    """The response a rubric judge's prompt shows."""
    return prompt.split("Response:\n```\n", 1)[1].rsplit("\n```\n\nCriteria:", 1)[0]


def _judge_verdicts(prompt: str) -> dict:
    """The rule the test's judge grades by: has_letter when the response holds the task's letter,
    one_word when it is one word."""
    letter = re.search(r"the letter (\w)\.", prompt).group(1)
    response = _judged_response(prompt)
    return {"verdicts": [
        {"name": "has_letter", "reason": "rule", "verdict": "yes" if letter in response else "no"},
        {"name": "one_word", "reason": "rule", "verdict": "yes" if len(response.split()) == 1 else "no"},
    ]}


@pytest.fixture
def rule_judge():
    """A judge model on 127.0.0.1 that answers verifiers' rubric judge by a rule (deterministic)."""
    prompts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][-1]["content"]
            prompts.append(prompt)
            answer = {"role": "assistant", "content": json.dumps(_judge_verdicts(prompt))}
            reply = {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop", "message": answer}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", prompts
    server.shutdown()
    server.server_close()


@needs_verifiers
@pytest.mark.parametrize("entry,needle", [
    ({"type": "verifiers:"}, "'verifiers:<taskset id>'"),
    ({"type": "verifiers:no_such_vf_env"}, "not found"),
    ({"type": "verifiers:tests/fixtures/module_rubric_env.py"}, "by name, not by path"),
    ({"type": "verifiers:tests.fixtures.module_rubric_env"}, "not a dotted path"),
    ({"type": "verifiers:vf-adder", "args": {"taskset": {"num_taskz": 3}}},
     "taskset.num_taskz: Extra inputs"),
    ({"type": "verifiers:vf-adder", "args": {"taskset": {"id": "other"}}}, "without an id"),
    ({"type": "verifiers:vf-adder", "args": {"agent": {"harness": {"id": "no-such-harness"}}}},
     "harness 'no-such-harness' not found"),
    ({"type": "verifiers:vf-adder", "args": {"test_taskset": {"num_tasks": "many"}}}, "taskset.num_tasks"),
    ({"type": "verifiers:vf-adder", "args": {"agent": {"runtime": {"type": "docker"}}}},
     "args.agent: the polyrl-chat harness runs in the subprocess runtime, not 'docker'"),
])
def test_verifiers_problems_fail_at_config_load(installed, tmp_path, entry, needle):
    (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": {"vf": entry}}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.yaml")
    message = str(err.value)
    assert needle in message and message.startswith("environments.vf.args") and "\n" not in message


@needs_verifiers
def test_an_environment_of_verifiers_before_0_4_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "classic_vf_env.py").write_text("def load_environment(**kwargs):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    from polyrl.envs.registry import make_env_builder

    with pytest.raises(ValueError, match=r"exports no verifiers.v1 Taskset through __all__ \(a "
                                         r"load_environment module of verifiers < 0.4"):
        make_env_builder("verifiers:classic-vf-env", {}, seed=0)


def _trajectories(run: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


@needs_verifiers
@pytest.mark.slow
def test_train_a_rubric_judged_taskset_loaded_by_name(installed, rule_judge, tiny_model_dir, tokenizer,
                                                      tmp_path):
    """Single turn, scored by verifiers' rubric judge (a judge model on 127.0.0.1 that grades by a
    rule); the policy samples freely, its tokens and logprobs go to training exactly as sampled."""
    from vf_letter_judge import RUBRIC

    from polyrl.envs.registry import make_env_builder
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    judge_url, judge_prompts = rule_judge
    judge = {"id": "rubric", "path": str(RUBRIC), "view": "last_reply", "base_url": judge_url,
             "model": "rule-judge", "api_key_var": "POLYRL_TEST_JUDGE_KEY"}
    args = {"taskset": {"num_tasks": 4, "task": {"judges": [judge]}}, "test_taskset": {"offset": 2}}
    builder = make_env_builder("verifiers:vf-letter-judge", args, seed=0)
    assert builder.num_tasks("train") == 4 and builder.num_tasks("test") == 4
    assert [builder.task("test", i).data.letter for i in range(2)] == ["o", "x"]  # test_taskset applied

    cfg = TrainConfig(
        model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=6, save_every=0,
        learning_rate=1e-3, log_path=str(tmp_path / "run"), local={"store_dir": str(tmp_path / "store")},
        seed=4, outputs={"report": False},
        environments={"letters": {"type": "verifiers:vf-letter-judge", "num_rollouts": 3, "args": args,
                                  "splits": {"test": None}}})
    train(cfg, ConsoleLog(enabled=False))

    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollouts/failed"] == 0 for r in rows)
    renderer = get_renderer("qwen3", tokenizer)
    episodes = [t for step in range(2) for t in _trajectories(run, step)]
    assert len(episodes) == 12 and len(judge_prompts) == 12  # one judge call per episode
    for row in rows:
        assert row["env/letters/retokenized"] == 0.0
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3  # trained == sampled: the sampler's own logprobs
    for t in episodes:
        letter = "aeoxz"[t["task_index"] % 5]
        assert t["error"] is None and t["num_turns"] == 1
        assert [m["role"] for m in t["messages"]] == ["system", "user", "assistant"]
        assert t["messages"][1]["content"] == f"Write a word with the letter {letter}."
        # the prompt tokens are the renderer's, the reply the tokens the policy sampled
        start, end = t["turn_spans"][0]
        assert t["tokens"][:start] == renderer.initial_prompt(t["messages"][:2]) and end == len(t["tokens"])
        # the reward is the rubric judge's: weighted criteria the judge answered for this reply
        reply = t["messages"][2]["content"].strip()
        has_letter, one_word = float(letter in reply), float(len(reply.split()) == 1)
        m = t["metrics"]
        assert (m["rubric/has_letter"], m["rubric/one_word"]) == (has_letter, one_word)
        assert t["reward"] == pytest.approx((has_letter + 0.5 * one_word) / 1.5) == pytest.approx(m["rubric"])
        assert m["reply_chars"] == len(reply)  # the taskset's own metric
    # the judge saw each reply
    assert sorted(map(_judged_response, judge_prompts)) == sorted(t["messages"][2]["content"].strip()
                                                                  for t in episodes)


class AdderPolicy:
    """A sampler for vf-adder that decides by the prompt: it calls calc_add with the task's numbers (with
    probability ``wrong_rate`` one of them off by one; ``wrong_every`` 2: every second call), then
    answers with what the tool returned."""

    def __init__(self, renderer, wrong_rate: float = 0.0, wrong_every: int = 0):
        self.renderer, self.wrong_rate, self.wrong_every = renderer, wrong_rate, wrong_every
        self.calls = 0

    async def sample(self, prompt, num_samples, params):
        from tinker import types

        text = self.renderer.decode(prompt.to_ints())
        outputs = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if outputs:
            message = {"role": "assistant", "content": f"The sum is {outputs[-1].strip()}."}
        else:
            a, b = (int(x) for x in re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1])
            self.calls += 1
            if (np.random.default_rng(params.seed).random() < self.wrong_rate
                    or (self.wrong_every and self.calls % self.wrong_every == 0)):
                b += 1
            message = {"role": "assistant", "content": "",
                       "tool_calls": [{"id": "c", "type": "function",
                                       "function": {"name": "calc_add", "arguments": {"a": a, "b": b}}}]}
        tokens = self.renderer.assistant_tokens(message)
        seq = types.SampledSequence(stop_reason="stop", sequence_id="s",
                                    tokens_np=np.array(tokens, dtype=np.int32),
                                    logprobs_np=np.full(len(tokens), -1.0, dtype=np.float32))
        return types.SampleResponse(sequences=[seq])


@needs_verifiers
@pytest.mark.slow
def test_a_multi_agent_env_gives_one_episode_per_agent_run(installed, tokenizer):
    """verifiers' best-of-n env plays the task twice at once through one endpoint session (one run
    adds right, the other wrong): each run's turns are told apart by the trace they belong to, so each
    episode holds its own run's tokens, reward and metrics."""
    from polyrl.envs.registry import make_env_builder
    from polyrl.rl.episode import RolloutContext, RolloutSettings

    renderer = get_renderer("qwen3", tokenizer)
    builder = make_env_builder("verifiers:vf-adder", {"id": "best-of-n", "n": 2}, seed=0)
    settings = RolloutSettings(max_turns=3, max_tokens=64, temperature=1.0, timeout=120)

    policy = AdderPolicy(renderer, wrong_every=2)

    async def play():
        try:
            ctx = RolloutContext("adder", "train", 4, 0, policy, renderer, settings, seed=7)
            return await builder.rollout(ctx)
        finally:
            await builder.aclose()

    episodes = asyncio.run(play())
    assert [ep.role for ep in episodes] == ["agent", "agent"]
    assert sorted(ep.reward for ep in episodes) == [0.0, 1.0]
    for ep in episodes:
        assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
        assert ep.messages[0]["content"] == "What is 14 + 12? Use the calc_add tool."
        args = ep.messages[1]["tool_calls"][0]["function"]["arguments"]
        assert ep.messages[2]["content"] == str(args["a"] + args["b"])
        assert ep.messages[3]["content"] == f"The sum is {ep.messages[2]['content']}."
        assert ep.reward == float(ep.messages[2]["content"] == "26")
        m = ep.metrics
        assert m["retokenized"] == 0.0 and m["best"] == ep.reward and m["pass_at_n"] == 1.0
        (s0, e0), (s1, e1) = ep.turn_spans
        assert ep.tokens[:s0] == renderer.initial_prompt(ep.messages[:1], ep.tools)
        assert ep.tokens[e0:s1] == renderer.continuation([ep.messages[2]]) and e1 == len(ep.tokens)


@needs_verifiers
@pytest.mark.slow
def test_train_a_multi_turn_tool_taskset(installed, tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """Multi-turn with a tool: verifiers' chat loop (polyrl-chat harness) calls the taskset's MCP tool
    server between the policy's turns. The real engine trains; only the policy's choice of tokens is
    scripted (a random tiny model never writes a tool call): it calls calc_add with the task's numbers
    (or, on half the episodes, wrong ones), then answers with what the tool returned."""
    from polyrl.local import service
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    renderer = get_renderer("qwen3", tokenizer)
    policy = AdderPolicy(renderer, wrong_rate=0.5)
    monkeypatch.setattr(service.SamplingClient, "sample",
                        lambda self, prompt, num_samples, params: policy.sample(prompt, num_samples, params))
    cfg = TrainConfig(
        model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=64, save_every=0,
        learning_rate=1e-3, log_path=str(tmp_path / "run"), local={"store_dir": str(tmp_path / "store")},
        seed=2, outputs={"report": False},
        environments={"adder": {"type": "verifiers:vf-adder", "num_rollouts": 2, "max_turns": 3,
                                "splits": {"test": None}}})
    train(cfg, ConsoleLog(enabled=False))

    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollouts/failed"] == 0 for r in rows)
    assert all(r["env/adder/retokenized"] == 0.0 and r["env/adder/tool_calls"] == 1.0 for r in rows)
    episodes = [t for step in range(2) for t in _trajectories(run, step)]
    assert len(episodes) == 8 and {t["reward"] for t in episodes} == {0.0, 1.0}
    for t in episodes:
        assert t["error"] is None and t["num_turns"] == 2 and t["done_by_env"]
        assert [m["role"] for m in t["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert [tool["function"]["name"] for tool in t["tools"]] == ["calc_add"]
        args = t["messages"][1]["tool_calls"][0]["function"]["arguments"]
        result = t["messages"][2]["content"]
        assert result == str(args["a"] + args["b"])  # computed by the taskset's MCP server
        a, b = (int(x) for x in re.findall(r"What is (\d+) \+ (\d+)\?", t["messages"][0]["content"])[0])
        assert t["reward"] == float(result == str(a + b)) and t["metrics"]["correct"] == t["reward"]
        # token-exact: the tool result sits between the two sampled turns as the renderer continues it
        (s0, e0), (s1, e1) = t["turn_spans"]
        assert t["tokens"][:s0] == renderer.initial_prompt(t["messages"][:1], t["tools"])
        assert t["tokens"][e0:s1] == renderer.continuation([t["messages"][2]])
        assert t["tokens"][s0:e0] == renderer.assistant_tokens(t["messages"][1]) and e1 == len(t["tokens"])
