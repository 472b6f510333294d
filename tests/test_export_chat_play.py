"""Using what was trained: `polyrl export` (PEFT adapter, merged model) against the engine's own greedy
samples, and `polyrl chat` / `polyrl play` driven in a real terminal (tmux)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tinker import types

from polyrl.errors import UserInputError
from polyrl.export import export_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12
CONVERSATION = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "the answer is 42"},
    {"role": "user", "content": "and again"},
    {"role": "assistant", "content": "still 42"},
]


@dataclass
class Trained:
    model_dir: str
    store_dir: str
    path: str  # tinker://.../sampler_weights/chatty
    state_path: str  # tinker://.../weights/chatty
    renderer: object
    sampler: object
    base_sampler: object

    def greedy(self, tokens: list[int], sampler=None, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
        params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                      stop=self.renderer.stop_sequences())
        seq = (sampler or self.sampler).sample(types.ModelInput.from_ints(tokens), 1,
                                               params).result().sequences[0]
        return list(seq.tokens), seq.stop_reason


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory) -> Trained:
    """A LoRA adapter trained a few supervised steps (through the engine's Tinker interface) to hold a
    two-turn conversation, so its greedy replies differ from the base model's."""
    from polyrl.local import ServiceClient
    from polyrl.renderers import get_renderer

    store = tmp_path_factory.mktemp("store")
    service = ServiceClient(store_dir=store, device="cpu")
    training = service.create_lora_training_client(base_model=tiny_model_dir, rank=8, seed=0)
    renderer = get_renderer("qwen3", training.get_tokenizer())
    tokens, weights = renderer.supervised(CONVERSATION)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(tokens[1:])),
                        "weights": types.TensorData.from_torch(torch.tensor(weights[1:]))},
    )
    for _ in range(40):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    state_path = training.save_state("chatty").result().path
    path = training.save_weights_for_sampler("chatty").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    base_sampler = service.create_sampling_client(base_model=tiny_model_dir).result()
    return Trained(tiny_model_dir, str(store), path, state_path, renderer, sampler, base_sampler)


def _prompts(trained: Trained) -> list[list[int]]:
    """The first turn, a second turn continuing the first's greedy reply, and an unseen prompt."""
    r = trained.renderer
    first = r.initial_prompt(CONVERSATION[:1])
    reply, _ = trained.greedy(first)
    second = first + reply + r.continuation(CONVERSATION[2:3])
    return [first, second, r.initial_prompt([{"role": "user", "content": "What is 12 * 34?"}])]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, top_p=None,
                         top_k=None)
    return out[0, len(prompt):].tolist()


def test_trained_adapter_differs_from_base(trained):
    first = trained.renderer.initial_prompt(CONVERSATION[:1])
    reply, stop = trained.greedy(first)
    assert trained.renderer.parse_response(reply)["content"] == "the answer is 42" and stop == "stop"
    assert trained.greedy(first, trained.base_sampler)[0] != reply


# ------------------------------------------------------------------------------------------- export
# The module names vLLM's LoRA loader accepts for a Qwen3 model (its linear layers and, as an
# embedding module, lm_head); every tensor must be named base_model.model.<module>.lora_A|lora_B.weight.
VLLM_QWEN3_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                           "lm_head"}


def test_export_adapter_is_a_peft_directory_with_the_engines_greedy_output(trained, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(trained.path, tmp_path / "adapter", store_dir=trained.store_dir)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and not config["use_dora"]
    assert config["base_model_name_or_path"] == str(Path(trained.model_dir).resolve())
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    modules: dict[str, set[str]] = {}
    for key, shape in shapes.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B)\.weight", key)
        assert m, f"{key} is not a PEFT LoRA tensor name"
        assert m.group(1).rsplit(".", 1)[-1] in VLLM_QWEN3_LORA_MODULES, key
        assert (shape[0] if m.group(2) == "lora_A" else shape[1]) == config["r"]
        modules.setdefault(m.group(1), set()).add(m.group(2))
    assert modules and all(v == {"lora_A", "lora_B"} for v in modules.values())
    assert "lm_head" in modules  # the unembedding is trained too, as the engine does by default

    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    for prompt in _prompts(trained):
        assert _hf_greedy(model, prompt) == trained.greedy(prompt)[0]


def test_export_merged_is_a_standard_model_with_tokenizer_and_the_engines_greedy_output(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cli = [sys.executable, "-m", "polyrl.cli", "export", trained.path, str(out), "--merged", "--store_dir",
           trained.store_dir]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out)
    assert not (out / "adapter_config.json").exists() and not (out / ".adapter").exists()

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(trained.model_dir)
    # the trained unembedding was untied from the input embedding, which the adapter never changed
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = tokenizer.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert list(chat) == trained.renderer.initial_prompt(CONVERSATION[:1])
    for prompt in _prompts(trained):
        assert _hf_greedy(model, prompt) == trained.greedy(prompt)[0]

    # an existing OUT_DIR is refused with one line and left as it was
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: output directory")
    assert "already exists" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_export_errors_and_atomicity(trained, tmp_path):
    with pytest.raises(UserInputError, match="not found"):
        export_checkpoint(trained.path.replace("chatty", "nope"), tmp_path / "a", store_dir=trained.store_dir)
    with pytest.raises(UserInputError, match="not found"):
        export_checkpoint(str(tmp_path / "missing"), tmp_path / "a")
    with pytest.raises(UserInputError, match="not a checkpoint"):
        export_checkpoint(trained.model_dir, tmp_path / "a")  # a base model has nothing to export
    assert not (tmp_path / "a").exists()

    # a training-state checkpoint directory exports too (its optimizer state stays behind)
    from polyrl.local.checkpoints import CheckpointPath, Store

    state_dir = Store(trained.store_dir).directory(CheckpointPath.parse(trained.state_path))
    out = export_checkpoint(str(state_dir), tmp_path / "from-dir")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    # a corrupt adapter fails the merge: no OUT_DIR and no temporary directory is left behind
    broken = tmp_path / "broken"
    shutil.copytree(state_dir, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    parent = tmp_path / "exports"
    parent.mkdir()
    with pytest.raises(Exception):
        export_checkpoint(str(broken), parent / "merged", merged=True)
    assert list(parent.iterdir()) == []


def test_store_refuses_tinker_paths_that_leave_it(trained, tmp_path):
    """A run id or name of '..' (or any name the store would not write) is refused before it becomes a
    directory: `polyrl export` exits 2 with one line, and the store API raises UserInputError, even
    where a checkpoint sits at the place the path points to."""
    from polyrl.local.checkpoints import CheckpointPath, Store

    store = tmp_path / "store"
    store.mkdir()
    outside = tmp_path / "weights" / "x"  # where tinker://../weights/x lands: beside the store, not in it
    shutil.copytree(Store(trained.store_dir).directory(CheckpointPath.parse(trained.state_path)), outside)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for path, problem in [("tinker://../weights/x", "run id '..'"),
                          ("tinker://run/weights/..", "checkpoint name '..'"),
                          ("tinker://.hidden/weights/x", "run id '.hidden'")]:
        p = subprocess.run([sys.executable, "-m", "polyrl.cli", "export", path, str(tmp_path / "out"),
                            "--store_dir", str(store)], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2, (path, p.stderr[-2000:])
        assert p.stderr.strip().splitlines() == [p.stderr.strip()] and problem in p.stderr, p.stderr
        assert not (tmp_path / "out").exists()
        with pytest.raises(UserInputError, match=problem.split()[0]):
            Store(store).resolve(path)
    with pytest.raises(UserInputError, match="run id"):
        CheckpointPath.parse("tinker://a%2F..%2F..%2Fb/weights/x")  # percent-encoded or not, '/' is no id


# --------------------------------------------------------------------------------- naming a policy
def test_a_run_directory_names_its_latest_checkpoint_and_its_renderer(trained, tmp_path):
    from polyrl.rl.policy import open_sampler, renderer_for, resolve_policy

    run = tmp_path / "run"
    run.mkdir()
    config = {"backend": "local", "store_dir": trained.store_dir, "renderer": "chatml",
              "model_name": trained.model_dir}
    (run / "config.json").write_text(json.dumps(config))
    rows = [{"name": "000002", "sampler_path": "tinker://gone/sampler_weights/000002"},
            {"name": "final", "state_path": trained.state_path, "sampler_path": trained.path}]
    (run / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    policy = resolve_policy(str(run))
    assert (policy.tinker_path, policy.renderer, policy.base_model) == (trained.path, "chatml",
                                                                        trained.model_dir)
    tokenizer = trained.renderer.tokenizer
    assert renderer_for(policy, tokenizer).name == "chatml"
    assert renderer_for(policy, tokenizer, "qwen3").name == "qwen3"
    with pytest.raises(UserInputError, match="unknown renderer 'nope'"):
        renderer_for(policy, tokenizer, "nope")
    # a run written with the engine's settings in their section (local.store_dir) is found the same way
    config = {**{k: v for k, v in config.items() if k != "store_dir"},
              "local": {"store_dir": trained.store_dir}}
    (run / "config.json").write_text(json.dumps(config))
    assert resolve_policy(str(run)).tinker_path == trained.path

    # the checkpoint's own directory: the store around it is found, so it samples like its tinker:// path
    by_dir = resolve_policy(str(policy.checkpoint_dir))
    assert (by_dir.tinker_path == trained.path
            and by_dir.store_dir.resolve() == Path(trained.store_dir).resolve())
    prompt = trained.renderer.initial_prompt(CONVERSATION[:1])
    assert trained.greedy(prompt, open_sampler(by_dir, device="cpu")) == trained.greedy(prompt)

    # a base model directory is a policy for chat and play, not for export
    assert resolve_policy(trained.model_dir).checkpoint_dir is None

    (run / "checkpoints.jsonl").write_text("")
    with pytest.raises(UserInputError, match="no checkpoint yet"):
        resolve_policy(str(run))
    (run / "checkpoints.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    (run / "config.json").write_text(json.dumps({**config, "backend": "tinker"}))
    with pytest.raises(UserInputError, match="trained on a Tinker service"):
        resolve_policy(str(run))


# ---------------------------------------------------------------------------------- play, in-process
class Typed:
    """Lines typed at the prompts, in order; records the prompts asked."""

    def __init__(self, *lines: str):
        self.lines, self.prompts = list(lines), []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)


def _play_args(**kw):
    import argparse

    from polyrl.interactive import add_play_arguments

    p = argparse.ArgumentParser()
    add_play_arguments(p)
    argv = [kw.pop("env")]
    for k, v in kw.items():
        argv += ([f"--{k}", *([str(x) for x in v] if isinstance(v, list) else [str(v)])] if v is not True
                 else [f"--{k}"])
    return p.parse_args(argv)


def test_play_from_a_config_file_by_hand(trained, tmp_path, capsys):
    from polyrl.envs.registry import make_env_builder
    from polyrl.interactive import Screen, run_play

    config = tmp_path / "run.yaml"
    config.write_text(f"model_name: {trained.model_dir}\nseed: 3\nenvironments:\n"
                      "  guessing:\n    type: guess_number\n    max_turns: 2\n    args: {low: 1, high: 4}\n")
    secret = make_env_builder("guess_number", {"low": 1, "high": 4}, seed=3).secret("test", 1)
    wrong = 1 if secret != 1 else 2
    typed = Typed(str(wrong), str(secret))
    episodes = run_play(_play_args(env="guessing", config_path=config, split="test", task=1), Screen(typed))
    shown = capsys.readouterr().out
    assert typed.prompts == ["move> ", "move> "]
    assert "Guess my secret number between 1 and 4." in shown
    assert ("Higher." if secret > wrong else "Lower.") in shown
    assert "reward 1 · done yes" in shown and "episode over: reward 1 · success yes · turns 2" in shown
    assert episodes[0].reward == 1.0 and episodes[0].success

    with pytest.raises(UserInputError, match="has no environment 'nope'"):
        run_play(_play_args(env="nope", config_path=config), Screen(Typed()))
    with pytest.raises(UserInputError, match="has tasks numbered from 0"):
        run_play(_play_args(env="arithmetic", model=trained.model_dir, task=-1), Screen(Typed()))
    with pytest.raises(UserInputError, match="unknown arg 'colour'"):
        run_play(_play_args(env="arithmetic", model=trained.model_dir, args=["colour=red"]), Screen(Typed()))
    with pytest.raises(UserInputError, match="unknown environment type"):
        run_play(_play_args(env="no_such_env", model=trained.model_dir), Screen(Typed()))
    with pytest.raises(UserInputError, match="needs --model"):
        run_play(_play_args(env="guess_number"), Screen(Typed()))


# ------------------------------------------------------------------------------- in a real terminal
def _ensure_tmux() -> None:
    """tmux, installed here when missing (as root, Debian's package); skip otherwise."""
    why = "not root or no apt-get"
    if not shutil.which("tmux"):
        if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "tmux"]):
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
                why = f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[-300:]}"
        if not shutil.which("tmux"):
            pytest.skip(f"tmux is missing and could not be installed: {why}")


class Terminal:
    """A polyrl command in its own tmux server (a private socket): type lines, read the screen."""

    def __init__(self, *polyrl_args: str):
        _ensure_tmux()
        self.socket = f"polyrl-test-{uuid.uuid4().hex[:8]}"
        env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "TERM": "xterm-256color"}
        command = " ".join(["env", *(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                            shlex.quote(sys.executable), "-m", "polyrl.cli", *map(shlex.quote, polyrl_args)])
        # the pane outlives the command, so its last screen and exit status can be read
        script = f'{command}; echo "[exited $?]"; sleep 3600'
        self._tmux("new-session", "-d", "-s", "t", "-x", "220", "-y", "60", script)
        self._tmux("set-option", "-t", "t", "history-limit", "10000")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True,
                              text=True).stdout

    def screen(self) -> str:
        """Everything printed so far, wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def type(self, line: str) -> None:
        self._tmux("send-keys", "-t", "t", "-l", line)
        self._tmux("send-keys", "-t", "t", "Enter")

    def wait_for(self, text: str, count: int = 1, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if screen.count(text) >= count:
                return screen
            if "[exited" in screen and text not in screen:
                break
            time.sleep(0.3)
        raise AssertionError(f"{text!r} (x{count}) never appeared on the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, check=False)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []
    yield lambda *args: opened.append(Terminal(*args)) or opened[-1]
    for t in opened:
        t.close()


@pytest.mark.slow
def test_chat_in_a_terminal_replies_as_the_engine_samples_greedily(trained, terminals):
    r = trained.renderer
    first = r.initial_prompt(CONVERSATION[:1])
    reply1, stop1 = trained.greedy(first)
    second = first + reply1 + r.continuation(CONVERSATION[2:3], assistant_finished=stop1 == "stop")
    reply2, _ = trained.greedy(second)
    text1, text2 = r.parse_response(reply1)["content"], r.parse_response(reply2)["content"]
    assert text1 == "the answer is 42"

    term = terminals("chat", trained.path, "--store_dir", trained.store_dir, "--temperature", "0",
                     "--max_tokens", str(MAX_TOKENS))
    term.wait_for("you> ")
    term.type("hello")
    term.wait_for(f"assistant> {text1}\n")
    term.type("and again")  # the second turn continues the first's tokens
    term.wait_for(f"assistant> {text2}\n")
    term.type("/reset")
    term.wait_for("(new conversation)")
    term.type("hello")
    screen = term.wait_for(f"assistant> {text1}\n", count=2)
    assert "renderer qwen3" in screen
    term.type("/quit")
    term.wait_for("[exited 0]")


@pytest.mark.slow
def test_play_by_hand_in_a_terminal_shows_what_the_policy_sees(trained, terminals):
    from polyrl.envs.registry import make_env_builder

    builder = make_env_builder("calculator", {"kinds": ["mul"]}, seed=0)
    task = builder.task("train", 0)
    obs = builder.make("train", 0).reset_sync()
    prompt_text = trained.renderer.decode(trained.renderer.initial_prompt(obs.messages, obs.tools))

    term = terminals("play", "calculator", "--model", trained.model_dir, "--args", "kinds=[mul]")
    screen = term.wait_for("move> ")
    assert prompt_text.rstrip("\n") in screen  # the rendered prompt, special tokens and tool specs included
    call = {"name": "calculator", "arguments": {"expression": task.expression}}
    term.type(f"<tool_call>{json.dumps(call)}</tool_call>")
    term.wait_for(f"[tool] {task.answer}\nreward 0 · done no")
    screen = term.wait_for("move> ", count=2)
    assert f"<tool_response>\n{task.answer}\n</tool_response>" in screen  # the reply as the policy sees it
    term.type(f"\\boxed{{{task.answer}}}")
    screen = term.wait_for("[exited 0]")
    assert "reward 1 · done yes · success 1 · tool_calls 1" in screen
    assert "episode over: reward 1 · success yes · turns 2" in screen


@pytest.mark.slow
def test_watching_a_checkpoint_play_in_a_terminal(trained, terminals):
    import asyncio

    from polyrl.config.schema import EnvConfig
    from polyrl.rl.episode import Episode, run_episode
    from polyrl.rl.rollouts import EnvRuntime

    runtime = EnvRuntime.create("guess_number", EnvConfig(type="guess_number"), 0, 256)
    settings = runtime.settings.__class__(max_turns=2, max_tokens=MAX_TOKENS, temperature=0.0, timeout=60)
    episode = asyncio.run(run_episode(runtime.builder.make("train", 0),
                                      Episode("guess_number", "train", 0, 0),
                                      trained.renderer, trained.sampler, settings, seed=0))
    turns = [trained.renderer.decode(episode.tokens[a:b]) for a, b in episode.turn_spans]

    term = terminals("play", "guess_number", "--checkpoint", trained.path, "--store_dir", trained.store_dir,
                     "--temperature", "0", "--max_turns", "2", "--max_tokens", str(MAX_TOKENS))
    screen = term.wait_for("[exited 0]")
    for text in turns:
        assert f"── the policy's reply ──\n{text}\n── environment ──" in screen
    assert f"episode over: reward {episode.reward:g} · success {'yes' if episode.success else 'no'}" in screen
