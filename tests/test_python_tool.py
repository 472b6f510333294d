"""The ``python_tool`` environment and its sandbox: a right tool-using episode earns 1, every attack
comes back to the model as a tool error (and leaves no trace outside the sandbox), and a training
run plays it through the trainer."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from scripted import ScriptedSampler
from tinker import types

from polyrl.envs.python_tool import PYTHON_TOOL, tool_reply
from polyrl.envs.registry import make_env_builder
from polyrl.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_layers
from polyrl.renderers import get_renderer
from polyrl.rl.episode import Episode, RolloutSettings, run_episode

try:
    LAYERS = sandbox_layers()
except SandboxUnavailable as exc:  # pragma: no cover - machines without Landlock
    pytest.skip(str(exc), allow_module_level=True)

LIMITS = SandboxLimits(timeout_s=2, memory_mb=128, max_output_bytes=1024)
# every attack is tried with and without the namespace layer: landlock, seccomp and the limits
# must hold on their own (kernels without unprivileged user namespaces get only those)
WITH_AND_WITHOUT_NAMESPACES = pytest.mark.parametrize("namespaces", [True, False],
                                                      ids=["namespaces", "no-namespaces"])


def _call(code: str) -> dict:
    return {"id": "call_0", "type": "function", "function": {"name": "python", "arguments": {"code": code}}}


def _reply(code: str, namespaces: bool) -> str:
    """What the model would see (``tool_reply``), with or without the namespace layer."""
    result = run_python(code, LIMITS, namespaces=namespaces)
    reason = result.error(LIMITS)
    return result.output if reason is None else f"error: {reason}\n{result.output}"


def test_the_sandbox_reports_its_layers():
    assert LAYERS["landlock_abi"] >= 1 and LAYERS["seccomp"] == "on" and LAYERS["capabilities"] == "none"


# ---------------------------------------------------------------------------- a right episode
def test_a_right_tool_using_episode_gets_reward_1(tokenizer):
    builder = make_env_builder("python_tool", {"tasks": ["math"]}, seed=0)
    messages, tools = builder.demonstration("train", 0)
    assert tools == [PYTHON_TOOL]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "python"
    answer = messages[2]["content"].strip()
    assert messages[3]["content"] == f"\\boxed{{{answer}}}" and answer.isdigit()
    renderer = get_renderer("qwen3", tokenizer)
    policy = ScriptedSampler(renderer, [m for m in messages if m["role"] == "assistant"])
    settings = RolloutSettings(max_turns=4, max_tokens=256, temperature=1.0, timeout=60)
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("python_tool", "train", 0, 0), renderer,
                                 policy, settings))
    assert ep.reward == 1.0 and ep.success and ep.num_turns == 2 and ep.done_by_env
    assert ep.messages[2] == {"role": "tool", "tool_call_id": "call_0", "name": "python",
                              "content": answer + "\n"}
    assert ep.metrics == {"success": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}

    # the same task answered wrongly gets 0; the designed mistakes are wrong
    policy = ScriptedSampler(renderer, [{"role": "assistant", "content": f"\\boxed{{{int(answer) + 1}}}"}])
    ep = asyncio.run(run_episode(builder.make("train", 0), Episode("python_tool", "train", 0, 0), renderer,
                                 policy, settings))
    assert ep.reward == 0.0
    wrong = make_env_builder("python_tool", {"tasks": ["math"], "demo_error_rate": 1.0}, seed=0)
    assert wrong.demonstration("train", 0)[0][3]["content"] != messages[3]["content"]


def test_final_expression_value_and_tracebacks_are_shown():
    assert tool_reply("x = 6 * 7\nx", LIMITS) == "42\n"
    assert tool_reply("import fractions\nprint(fractions.Fraction(2, 6))", LIMITS) == "1/3\n"
    reply = tool_reply("def f():\n    return 1 / 0\nf()", LIMITS)
    assert reply.startswith("error: exit status 1") and "ZeroDivisionError: division by zero" in reply
    assert 'File "<python>", line 2, in f' in reply and "sandbox_child" not in reply  # only the code's frames
    assert tool_reply("", LIMITS) == "(no output)"


# ---------------------------------------------------------------------------- attacks
@WITH_AND_WITHOUT_NAMESPACES
def test_fork_bomb(namespaces):
    reply = _reply("import os\nwhile True:\n    os.fork()", namespaces)
    assert reply.startswith("error: exit status 1") and "PermissionError" in reply
    reply = _reply("import subprocess\nsubprocess.run(['true'])", namespaces)
    assert "PermissionError" in reply
    # threads are not processes: they still work
    assert _reply("import threading\nt = threading.Thread(target=print, args=('hi',))\nt.start(); t.join()",
                  namespaces) == "hi\n"


@WITH_AND_WITHOUT_NAMESPACES
def test_infinite_loop(namespaces):
    start = time.monotonic()
    assert _reply("while True:\n    pass", namespaces).startswith("error: timed out after 2 s")
    assert time.monotonic() - start < 10


@WITH_AND_WITHOUT_NAMESPACES
def test_huge_output(namespaces):
    start = time.monotonic()
    reply = _reply("while True:\n    print('x' * 1000)", namespaces)
    assert reply.startswith("error: output exceeded 1024 bytes (truncated)")
    assert len(reply) < 1200 and time.monotonic() - start < 10


@WITH_AND_WITHOUT_NAMESPACES
def test_memory_bomb(namespaces):
    reply = _reply("blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))", namespaces)
    assert reply.startswith("error: exit status 1") and "MemoryError" in reply
    assert "MemoryError" in _reply("x = bytearray(2**33)", namespaces)


@WITH_AND_WITHOUT_NAMESPACES
def test_network(namespaces):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('connected')")
    reply = _reply(code, namespaces)
    assert reply.startswith("error:") and "connected" not in reply and "Operation not permitted" in reply
    reply = _reply("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
                   namespaces)
    assert reply.startswith("error:") and "URLError" in reply
    with pytest.raises(socket.timeout):
        server.accept()  # nothing ever reached the listener
    server.close()


@WITH_AND_WITHOUT_NAMESPACES
def test_file_system_escapes(namespaces, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("api key")
    outside = tmp_path / "written.txt"
    attacks = {
        "read /etc/passwd": "print(open('/etc/passwd').read())",
        "read a file of the trainer": f"print(open({str(secret)!r}).read())",
        "list the root": "import os\nprint(os.listdir('/'))",
        "write outside": f"open({str(outside)!r}, 'w').write('x')",
        "symlink out, read": f"import os\nos.symlink({str(secret)!r}, 'link')\nprint(open('link').read())",
        "symlink out, write": f"import os\nos.symlink({str(tmp_path)!r}, 'dir')\n"
                              "open('dir/written.txt', 'w')",
        "the trainer's environment": f"print(open('/proc/{os.getpid()}/environ').read())",
        "climb out": "import os\nos.chdir('..')\nprint(os.listdir('.'))",
    }
    for what, code in attacks.items():
        reply = _reply(code, namespaces)
        assert reply.startswith("error: exit status 1"), what
        assert re.search(r"PermissionError|Permission denied", reply), (what, reply)
        assert "api key" not in reply and "root:" not in reply, what
    assert not outside.exists() and secret.read_text() == "api key"
    # its own directory is usable
    assert _reply("open('a.txt', 'w').write('hello')\nprint(open('a.txt').read())", namespaces) == "hello\n"


@WITH_AND_WITHOUT_NAMESPACES
def test_signals_and_tracing_of_other_processes(namespaces):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reply = _reply(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)", namespaces)
        assert reply.startswith("error:") and "PermissionError" in reply
        time.sleep(0.2)
        assert victim.poll() is None  # still alive
    finally:
        victim.kill()
        victim.wait()


def test_the_trainer_is_untouched_by_many_attacks_at_once():
    """Concurrent attacks from worker threads (as concurrent episodes run them): each gets its
    error, and the process running them goes on as before."""
    codes = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(2**33)",
             "while True: print('y' * 4096)", "print(open('/etc/passwd').read())", "print(6 * 7)"]
    replies: list[str] = [""] * len(codes)

    def attack(i: int) -> None:
        replies[i] = tool_reply(codes[i], LIMITS)

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(len(codes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r.startswith("error:") for r in replies[:-1]) and replies[-1] == "42\n"
    assert tool_reply("print('still fine')", LIMITS) == "still fine\n"


def test_malformed_calls_and_the_call_budget():
    builder = make_env_builder("python_tool", {"tasks": ["countdown"], "max_tool_calls": 2}, seed=0)
    env = builder.make("train", 1)
    asyncio.run(env.reset())
    bad = {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": {"cmd": "ls"}}}
    result = asyncio.run(env.step({"role": "assistant", "content": "", "tool_calls": [bad, _call("1 +")]}))
    assert not result.done
    assert result.messages[0]["content"] == "error: unknown tool 'shell'; the only tool is python"
    syntax_error = result.messages[1]["content"]
    assert syntax_error.startswith("error: exit status 1") and "SyntaxError" in syntax_error
    result = asyncio.run(env.step({"role": "assistant", "content": "", "tool_calls": [_call("print(1)")]}))
    assert result.done and result.reward == 0.0 and result.metrics["tool_calls"] == 3.0


def test_bad_args_are_config_errors():
    from polyrl.config.files import load_config
    from polyrl.config.schema import ConfigError, TrainConfig

    for args, needle in [({"tasks": ["poetry"]}, "tasks must be a non-empty list"),
                         ({"timeout": 0}, "timeout must be a number of seconds"),
                         ({"shell": True}, "unknown arg 'shell'")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [f"model_name={TrainConfig.__name__}",
                               "environments.py.type=python_tool",
                               f"environments.py.args={json.dumps(args)}"])


# ---------------------------------------------------------------------------- through the trainer
@pytest.mark.slow
def test_a_training_run_uses_the_tool(tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """``polyrl train`` on python_tool with the real engine and the real sandbox; only the policy's
    choice of tokens is scripted (a random tiny model never writes a tool call): on half the
    episodes it runs the task's right program, on the other half a wrong one, then boxes what the
    tool printed."""
    from polyrl.config.schema import TrainConfig
    from polyrl.local import service
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    builder = make_env_builder("python_tool", {"tasks": ["math"]}, seed=0)
    programs = {builder.task("train", i)[1].question: builder.task("train", i)[1].code for i in range(64)}
    renderer = get_renderer("qwen3", tokenizer)

    async def policy(self, prompt, num_samples, sampling_params):
        text = tokenizer.decode(prompt.to_ints())
        outputs = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if outputs:
            message = {"role": "assistant", "content": f"\\boxed{{{outputs[-1].strip()}}}"}
        else:
            question = next(q for q in programs if q in text)
            right = random.Random(sampling_params.seed).random() < 0.5
            message = {"role": "assistant", "content": "",
                       "tool_calls": [_call(programs[question] if right else "print(0)")]}
        tokens = renderer.assistant_tokens(message)
        seq = types.SampledSequence(stop_reason="stop", sequence_id="s",
                                    tokens_np=np.array(tokens, dtype=np.int32),
                                    logprobs_np=np.full(len(tokens), -1.0, dtype=np.float32))
        return types.SampleResponse(sequences=[seq])

    monkeypatch.setattr(service.SamplingClient, "sample", policy)
    env = {"num_rollouts": 2, "max_turns": 3, "args": {"tasks": ["math"]}, "splits": {"test": None}}
    config = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=4, max_steps=2, max_tokens=256,
                         save_every=0, outputs={"report": False}, log_path=str(tmp_path / "run"),
                         local={"store_dir": str(tmp_path / "store")}, environments={"python_tool": env})
    train(config, ConsoleLog(enabled=False))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["env/python_tool/tool_calls"] == 1.0 for r in rows)
    assert sum(r["optim/datums"] for r in rows) > 0  # groups with right and wrong answers were trained on
    episodes = [json.loads(line) for f in sorted((tmp_path / "run" / "trajectories").iterdir())
                for line in f.read_text().splitlines()]
    assert {ep["reward"] for ep in episodes} == {0.0, 1.0}
    for ep in episodes:
        tool_output = ep["messages"][2]["content"].strip()
        assert ep["messages"][2]["role"] == "tool" and tool_output.isdigit()
        assert ep["reward"] == float(tool_output != "0")
