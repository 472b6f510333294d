"""OpenReward adapter, end to end with the real SDK and no network: an environment written here is
served by the SDK's own ORS ``Server`` on 127.0.0.1 and reached through ``OpenReward``'s client;
rollout uploads go to a local capture endpoint (``OPENREWARD_API_URL``)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from scripted import ScriptedSampler

openreward = pytest.importorskip("openreward")

from fastapi import FastAPI, Request  # noqa: E402
from openreward.environments import (  # noqa: E402
    Environment,
    ImageBlock,
    Server,
    TextBlock,
    ToolOutput,
    terminal,
    tool,
)
from pydantic import BaseModel  # noqa: E402

from polyrl.config.files import load_config  # noqa: E402
from polyrl.config.schema import ConfigError, TrainConfig  # noqa: E402
from polyrl.envs.openreward_env import OpenRewardBuilder, chat_tool_spec  # noqa: E402
from polyrl.envs.registry import get_env_builder, make_env_builder  # noqa: E402
from polyrl.renderers import get_renderer  # noqa: E402
from polyrl.rl.episode import Episode, RolloutSettings, run_episode  # noqa: E402
from polyrl.rl.rollouts import run_group  # noqa: E402

SECRET = "or-secret-key-value-4242"


# ---------------------------------------------------------------------------- the ORS environment
class Text(BaseModel):
    text: str


class Answer(BaseModel):
    answer: str


class LetterQuest(Environment):
    """Write a word containing the task's letter. ``count`` is a helper tool, ``explode`` a broken
    one, and the hidden terminal tool ``answer`` grades the final reply."""

    LETTERS = "eaoistnr"

    def __init__(self, task_spec: dict = {}, secrets: dict = {}):  # noqa: B006 - the SDK's signature
        super().__init__(task_spec, secrets)
        self.letter = task_spec["letter"]

    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str):
        n = 6 if split == "train" else 3
        offset = 0 if split == "train" else 3
        return [{"letter": cls.LETTERS[(i + offset) % len(cls.LETTERS)], "id": i} for i in range(n)]

    def get_prompt(self):
        return [TextBlock(text=f"Write a word that contains the letter {self.letter}.")]

    @tool
    async def count(self, params: Text) -> ToolOutput:
        """Count the task's letter in a text."""
        return ToolOutput(blocks=[TextBlock(text=str(params.text.count(self.letter)))], reward=0.0,
                          finished=False)

    @tool
    def explode(self) -> ToolOutput:
        """A tool that always fails."""
        raise RuntimeError("the tool broke")

    @terminal
    @tool
    def answer(self, params: Answer) -> ToolOutput:
        """Grade the final answer."""
        ok = self.letter in params.answer
        return ToolOutput(blocks=[TextBlock(text="correct" if ok else "wrong")], reward=1.0 if ok else 0.0,
                          finished=True)


def _png_base64(colour: tuple[int, int, int], size: tuple[int, int]) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


class PicturePuzzle(Environment):
    """An environment with images: the prompt shows a picture (an ``ImageBlock``), the ``look`` tool
    answers with another one beside its text, the terminal tool grades the colour named."""

    def __init__(self, task_spec: dict = {}, secrets: dict = {}):  # noqa: B006 - the SDK's signature
        super().__init__(task_spec, secrets)

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"id": 0}]

    def get_prompt(self):
        return [ImageBlock(data=_png_base64((220, 30, 30), (64, 64)), mimeType="image/png"),
                TextBlock(text="What colour is the picture? Look closer with the look tool.")]

    @tool
    def look(self) -> ToolOutput:
        """A closer look."""
        return ToolOutput(blocks=[TextBlock(text="closer:"),
                                  ImageBlock(data=_png_base64((200, 20, 20), (96, 96)),
                                             mimeType="image/png")],
                          reward=0.0, finished=False)

    @terminal
    @tool
    def answer(self, params: Answer) -> ToolOutput:
        """Grade the final answer."""
        ok = "red" in params.answer
        return ToolOutput(blocks=[TextBlock(text="correct" if ok else "wrong")], reward=1.0 if ok else 0.0,
                          finished=True)


def _serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def ors():
    """The SDK's ORS Server hosting LetterQuest on 127.0.0.1 (yields the Server and its URL)."""
    import logging

    import structlog

    # quiet server logs
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    ors_server = Server([LetterQuest, PicturePuzzle])
    server, thread, url = _serve(ors_server.app)
    yield ors_server, url
    server.should_exit = True
    thread.join(10)
    structlog.reset_defaults()


class Capture:
    """The platform API's rollout route, recording what the SDK uploads (served by uvicorn, as the
    SDK's uploader expects a keep-alive HTTP/1.1 peer)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        app = FastAPI()

        @app.get("/{path:path}")
        async def lookup(path: str):  # environment id lookups
            return [] if path.endswith("/variants") else {"id": "env_letterquest"}

        @app.post("/{path:path}")
        async def record(path: str, request: Request):
            body = await request.json()
            if path == "v1/rollouts":
                self.bodies.append(body)
                self.headers.append(dict(request.headers))
            return {"ok": True}

        self.server, self.thread, self.url = _serve(app)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)

    def events(self) -> list[dict]:
        return [e for b in self.bodies for e in b["events"]]


@pytest.fixture
def openreward_env(monkeypatch):
    monkeypatch.setenv("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
    monkeypatch.setenv("OPENREWARD_API_KEY", SECRET)
    capture = Capture()
    monkeypatch.setenv("OPENREWARD_API_URL", capture.url)
    yield capture
    capture.close()


def _wait_closed(ors_server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while ors_server._active_envs and time.monotonic() < deadline:
        time.sleep(0.05)
    return not ors_server._active_envs


def _call(name, args, i=0):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": f"call_{i}", "type": "function",
                            "function": {"name": name, "arguments": args}}]}


# ---------------------------------------------------------------------------- unit checks
def test_names_resolve_and_flat_tool_specs_are_nested():
    assert get_env_builder("Org/EnvName") is OpenRewardBuilder
    assert get_env_builder("openreward:Org/EnvName") is OpenRewardBuilder
    cfg = TrainConfig(model_name="m",
                      environments={"Org/EnvName": {"args": {"base_url": "http://127.0.0.1:9"}}})
    assert cfg.environments["Org/EnvName"].type == "Org/EnvName"  # validated without contacting anything
    flat = {"type": "function", "name": "count", "description": "d", "parameters": {"type": "object"}}
    assert chat_tool_spec(flat) == {"type": "function", "function": {"name": "count", "description": "d",
                                                                      "parameters": {"type": "object"}}}
    assert chat_tool_spec({"type": "function", "name": "x", "parameters": None})["function"]["parameters"] \
        == {"type": "object", "properties": {}}


@pytest.mark.parametrize("entry,needle", [
    ({"type": "openreward:Org/Env", "args": {"split": "x"}}, "unknown OpenReward args ['split']"),
    ({"type": "Org/Env", "args": {"splits": {"validation": "v"}}}, "args.splits maps"),
    ({"type": "openreward:a/b/c"}, "named 'Org/EnvName'"),
    ({"type": "Org/Env", "args": {"base_url": "localhost:1"}}, "http(s) URL"),
])
def test_unsupported_args_fail_at_config_load(tmp_path, entry, needle):
    (tmp_path / "run.yaml").write_text(json.dumps({"model_name": "m", "environments": {"or": entry}}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "run.yaml")
    assert needle in str(err.value) and "environments.or.args" in str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- episodes
def test_tool_calls_errors_and_terminal_answer_through_the_sdk(ors, openreward_env, tokenizer):
    ors_server, url = ors
    renderer = get_renderer("qwen3", tokenizer)
    builder = make_env_builder("openreward:Polyrl/LetterQuest", {"base_url": url}, seed=0)
    assert builder.num_tasks("train") == 6 and builder.num_tasks("test") == 3
    replies = [
        _call("count", {"text": "hello there"}, 0),
        _call("count", {"txt": 3}, 1),  # input validation error
        _call("nope", {}, 2),  # unknown tool
        {"role": "assistant", "content": "<tool_call>\n{not json}\n</tool_call>"},  # unparsable call
        {"role": "assistant", "content": "pebble"},  # plain reply -> terminal tool
    ]
    policy = ScriptedSampler(renderer, replies)
    settings = RolloutSettings(max_turns=8, max_tokens=64, temperature=1.0, timeout=60)
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("or", "train", 0, 0), renderer, policy,
                                 settings))
    asyncio.run(builder.aclose())

    assert ep.done_by_env and ep.num_turns == 5
    assert ep.step_rewards == [0.0, 0.0, 0.0, 0.0, 1.0] and ep.reward == 1.0 and ep.success
    assert ep.messages[0] == {"role": "user", "content": "Write a word that contains the letter e."}
    names = sorted(t["function"]["name"] for t in ep.tools)
    assert names == ["count", "explode"]  # the terminal tool is hidden from the model
    assert ep.tools[0]["type"] == "function" and "parameters" in ep.tools[0]["function"]
    tool_msgs = [m for m in ep.messages if m["role"] == "tool"]
    assert tool_msgs[0]["content"] == "3" and tool_msgs[0]["tool_call_id"] == "call_0"
    assert tool_msgs[1]["content"].startswith("Error (input_validation)")
    assert tool_msgs[2]["content"].startswith("Error (not_found)")
    assert tool_msgs[3]["content"].startswith("Error: <tool_call> block 0: invalid JSON")
    assert tool_msgs[4] == {"role": "tool", "tool_call_id": "terminal", "name": "answer",
                            "content": "correct"}
    assert ep.metrics["tool_calls"] == 3.0 and ep.metrics["tool_errors"] == 3.0
    # the model saw the tools in the chat template's format, and each turn continued the last
    assert policy.prompts[0] == renderer.initial_prompt(ep.messages[:1], ep.tools)
    for prompt, (start, _) in zip(policy.prompts, ep.turn_spans):
        assert prompt == ep.tokens[:start]
    assert _wait_closed(ors_server)


def test_failing_tool_fails_the_rollout_and_every_session_is_closed(ors, openreward_env, tokenizer):
    ors_server, url = ors
    renderer = get_renderer("qwen3", tokenizer)
    builder = make_env_builder("Polyrl/LetterQuest", {"base_url": url, "splits": {"test": "test"}}, seed=0)
    policy = ScriptedSampler(renderer, [_call("explode", {})] + [{"role": "assistant", "content": "tea"}] * 2)
    settings = RolloutSettings(max_turns=4, max_tokens=64, temperature=1.0, timeout=60)
    eps = [Episode("or", "test", i, 0) for i in range(3)]
    eps = asyncio.run(run_group(builder, eps, renderer, policy, settings, [None] * 3))
    asyncio.run(builder.aclose())
    errors = [ep.error for ep in eps]
    assert sum(e is not None and "ToolFailed" in e and "the tool broke" in e for e in errors) == 1
    ok = [ep for ep in eps if ep.error is None]
    assert len(ok) == 2 and all(ep.done_by_env and ep.messages[-1]["name"] == "answer" for ep in ok)
    assert _wait_closed(ors_server)


# ---------------------------------------------------------------------------- polyrl train
@pytest.mark.slow
def test_train_against_an_ors_server_uploads_every_episode(ors, openreward_env, tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    ors_server, url = ors
    capture = openreward_env
    cfg = TrainConfig(
        model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=6, save_every=0,
        eval_every=2, learning_rate=1e-3, log_path=str(tmp_path / "run"),
        local={"store_dir": str(tmp_path / "store")}, seed=1, outputs={"report": False},
        openreward_run_name="polyrl-test-run",
        environments={"letters": {"type": "openreward:Polyrl/LetterQuest", "num_rollouts": 3, "max_turns": 2,
                                  "args": {"base_url": url}}})
    train(cfg, ConsoleLog(enabled=False))

    run = tmp_path / "run"
    before, *rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert before["step"] == -1 and "test/letters/pass@1" in before  # evaluated before training too
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["rollouts/failed"] == 0 for r in rows)
    assert "test/letters/pass@1" in rows[-1]
    trajectories = []
    for step in range(2):
        trajectories += [json.loads(x)
                         for x in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert len(trajectories) == 12
    for t in trajectories:
        letter = LetterQuest.LETTERS[t["task_index"]]
        assert t["messages"][0]["content"] == f"Write a word that contains the letter {letter}."
        assert t["done_by_env"] and t["error"] is None
        if t["messages"][-1]["role"] == "tool":  # a plain reply went to the terminal tool
            last = t["messages"][-1]
            assert last["name"] == "answer"
            expected = 1.0 if letter in t["messages"][-2]["content"] else 0.0
            assert t["reward"] == expected and last["content"] == ("correct" if expected else "wrong")
        assert sum(t["action_mask"]) > 0 and len(t["logprobs"]) == len(t["tokens"])
    assert _wait_closed(ors_server)

    # uploads: one rollout per training episode, with run info, metadata and the conversation
    events = capture.events()
    starts = [e for e in events if e["eventType"] == "rollout"]
    messages = [e for e in events if e["eventType"] == "message"]
    assert len(starts) == 12
    assert {s["runName"] for s in starts} == {"polyrl-test-run"}
    assert {s["environment"] for s in starts} == {"Polyrl/LetterQuest"} and starts[0]["split"] == "train"
    info = starts[0]["run_info"]
    assert info["model_name"] == tiny_model_dir and info["peft_rank"] == 4
    assert info["rl_algorithm"] == "grpo/importance_sampling" and info["framework"] == "polyrl"
    losses = {r["step"]: r.get("optim/loss") for r in rows}
    uploaded = sorted((s["metadata"]["step"], s["metadata"]["task_index"], s["metadata"]["reward"])
                      for s in starts)
    assert uploaded == sorted((t["step"], t["task_index"], t["reward"]) for t in trajectories)
    for s in starts:
        assert s["metadata"]["loss"] == losses[s["metadata"]["step"]]
        own = [m for m in messages if m["rolloutEventId"] == s["eventId"]]
        kinds = [m["type"] for m in own]
        assert kinds[0] == "user_message" and "assistant_message" in kinds
        finished = [m for m in own if m.get("isFinished")]
        assert len(finished) == 1 and finished[0]["reward"] == s["metadata"]["reward"]
        assert finished[0]["type"] == "tool_result"
    assert all(h.get("x-api-key") == SECRET for h in capture.headers)
    # the API key itself never lands in the run directory
    for f in run.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".jsonl", ".html", ".txt", ""):
            assert SECRET not in f.read_text(errors="ignore"), f
    assert not any(SECRET in json.dumps(b) for b in capture.bodies)


def test_missing_split_is_a_clear_error_before_the_run(ors, openreward_env):
    _, url = ors
    with pytest.raises(ValueError, match="has no split 'training'"):
        make_env_builder("Polyrl/LetterQuest", {"base_url": url, "splits": {"train": "training"}}, seed=0)


def test_upload_needs_the_package_only_when_set(tmp_path):
    cfg = TrainConfig(model_name="m", environments={"arithmetic": {}}, openreward_run_name="x")
    assert cfg.openreward_run_name == "x"  # the package is installed here: accepted
    assert Path(openreward.__file__).exists()


def test_images_from_ors_prompts_and_tool_outputs_reach_a_vision_language_model(ors, openreward_env,
                                                                                 vl_tokenizer):
    """ORS image blocks (in the prompt, and beside text in a tool's output) become image parts that the
    Qwen3-VL format renders as ImageChunks; the episode keeps references, not base64."""
    import numpy as np
    from tinker import types

    ors_server, url = ors
    renderer = get_renderer("qwen3_vl_instruct", vl_tokenizer)
    builder = make_env_builder("openreward:Polyrl/PicturePuzzle",
                               {"base_url": url, "variant": "picturepuzzle"}, seed=0)
    inputs = []
    replies = ['<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>', "red"]

    class Sampler:
        async def sample(self, prompt, num_samples, params):
            inputs.append(prompt)
            tokens = vl_tokenizer.encode(replies.pop(0), add_special_tokens=False)
            tokens.append(vl_tokenizer.convert_tokens_to_ids("<|im_end|>"))
            return types.SampleResponse(sequences=[types.SampledSequence(
                stop_reason="stop", sequence_id="s", tokens_np=np.array(tokens, np.int32),
                logprobs_np=np.zeros(len(tokens), np.float32))])

    settings = RolloutSettings(max_turns=4, max_tokens=64, temperature=1.0, timeout=60)
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("or", "train", 0, 0), renderer, Sampler(),
                                 settings))
    asyncio.run(builder.aclose())
    assert ep.error is None and ep.reward == 1.0 and ep.num_turns == 2
    assert [[c.expected_tokens for c in i.chunks if c.type == "image"] for i in inputs] == [[4], [4, 9]]
    prompt_image = ep.messages[0]["content"][0]
    assert prompt_image["type"] == "image" and prompt_image["image"] == ep.images[0].name
    tool = next(m for m in ep.messages if m["role"] == "tool")
    assert [p["type"] for p in tool["content"]] == ["text", "image"] and tool["content"][1]["width"] == 96
    assert "base64" not in json.dumps(ep.messages)
    assert _wait_closed(ors_server)
