"""``verifiers:`` environments and polyrl's OpenAI-compatible endpoint.

The endpoint is checked on its own (token ids, logprobs, tool calls, token-exact continuation of a
multi-turn conversation, errors); then verifiers' own environments (tests/fixtures/vf_letter_env.py,
built with verifiers' SingleTurnEnv / MultiTurnEnv / Rubric over in-memory datasets) are trained with
``polyrl train``: verifiers drives the rollouts against the endpoint, offline."""

from __future__ import annotations

import asyncio
import importlib.util
import json
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
VF_ENV = "verifiers:tests.fixtures.vf_letter_env"


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


# ---------------------------------------------------------------------------- config load
needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="needs the verifiers package (polyrl[verifiers])")


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))


@needs_verifiers
@pytest.mark.parametrize("entry,needle", [
    ({"type": "verifiers:"}, "'verifiers:<module or file.py>'"),
    ({"type": "verifiers:no_such_vf_env"}, "not found"),
    ({"type": VF_ENV, "args": {"flavour": "x"}}, "does not take these args"),
])
def test_verifiers_problems_fail_at_config_load(in_repo, tmp_path, entry, needle):
    (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": {"vf": entry}}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.yaml")
    assert needle in str(err.value) and str(err.value).startswith("environments.vf.args")


@needs_verifiers
def test_group_reward_rubrics_are_refused_before_the_run(in_repo):
    from polyrl.envs.registry import make_env_builder

    with pytest.raises(ValueError, match="group reward functions are not supported"):
        make_env_builder(VF_ENV, {"kind": "group"}, seed=0)
    builder = make_env_builder("verifiers:tests/fixtures/vf_letter_env.py", {"num_train": 5, "num_eval": 2},
                               seed=0)
    assert builder.num_tasks("train") == 5 and builder.num_tasks("test") == 2 and builder.drives_rollouts


# ---------------------------------------------------------------------------- polyrl train
@needs_verifiers
@pytest.mark.slow
def test_train_verifiers_environments_through_the_endpoint(in_repo, tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(
        model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=6, save_every=0,
        learning_rate=1e-3, log_path=str(tmp_path / "run"), local={"store_dir": str(tmp_path / "store")},
        seed=4, outputs={"report": False},
        environments={
            "vfmulti": {"type": VF_ENV, "num_rollouts": 3, "args": {"kind": "multi"}},
            "vfrewrite": {"type": VF_ENV, "num_rollouts": 2, "args": {"kind": "rewrite"}},
        })
    train(cfg, ConsoleLog(enabled=False))

    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["rollouts/failed"] == 0 for r in rows)
    from transformers import AutoTokenizer

    renderer = get_renderer("qwen3", AutoTokenizer.from_pretrained(tiny_model_dir))
    for step, row in enumerate(rows):
        assert row["env/vfmulti/retokenized"] == 0.0 and row["env/vfrewrite/retokenized"] == 1.0
        # trained == sampled: sampler and learner logprobs agree (exact tokens, or recomputed ones)
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3
        traj = [json.loads(x)
                for x in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert sorted(t["env"] for t in traj) == ["vfmulti"] * 3 + ["vfrewrite"] * 2
        for t in traj:
            m = t["metrics"]
            assert t["error"] is None and t["num_turns"] == 2 and m["num_turns"] == 2.0
            assert t["reward"] == pytest.approx(m["has_letter"] + 0.5 * m["short_reply"])
            assert t["step_rewards"] == [0.0, t["reward"]]
            roles = [msg["role"] for msg in t["messages"]]
            assert roles == ["system", "user", "assistant", "user", "assistant"]
            assert t["messages"][3]["content"] == "Now another one."
            prompt_end = t["turn_spans"][0][0]
            assert t["tokens"][:prompt_end] == renderer.initial_prompt(t["messages"][:2])
            if t["env"] == "vfmulti":  # the sampled tokens themselves, each turn continuing the last
                assert t["stop_reasons"] == ["length", "length"]
                first_end = t["turn_spans"][0][1]
                second_start = t["turn_spans"][1][0]
                assert t["tokens"][first_end:second_start] == renderer.continuation(
                    [t["messages"][3]], assistant_finished=False)
            else:  # history rewritten by the environment: re-tokenized from the messages
                assert t["messages"][2]["content"].startswith("Earlier: ")
