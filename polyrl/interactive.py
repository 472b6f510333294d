"""``polyrl chat`` and ``polyrl play``: a person at the terminal in the places a rollout has.

Both run the rollout code itself (:func:`polyrl.rl.episode.run_episode`), so what is shown is what
training does: one growing token sequence, rendered once and extended with exactly the sampled
tokens and the rendered replies.

- ``chat``: the person is the environment. Each line they type is the next user turn; the policy
  (a checkpoint or a base model) answers through the run's renderer.
- ``play``: the person is the policy (or watches one). Before each assistant turn the screen shows
  the new tokens the policy is given, as text with every special token; the person types the
  assistant's reply (or the checkpoint samples it), and the environment's reply, reward and ``done``
  follow.

Images: ``play`` shows each image the policy is given in place of its tokens, as its size, token count
and the file it is saved to (``--images_dir``); ``chat`` attaches an image to the next message with
``/image PATH`` (or ``--image PATH`` for the first).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from polyrl import images
from polyrl.envs.base import Env, Message, Observation, StepResult, call_env
from polyrl.errors import UserInputError
from polyrl.renderers.base import Renderer, message_text
from polyrl.rl.episode import Episode, RolloutContext, RolloutSettings, run_episode

if TYPE_CHECKING:  # the command line builds its parser from this module: keep its import light
    from tinker import types


class Quit(Exception):
    """The person typed /quit (or closed the input)."""


class Screen:
    """Terminal output, printed as is (never read as markup) with a little colour, and line input."""

    def __init__(self, ask: Callable[[str], str] | None = None):
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True, emoji=False)
        self._ask = ask or input
        try:  # line editing and history for input() where the platform has it
            import readline  # noqa: F401
        except ImportError:  # pragma: no cover
            pass

    def text(self, text: str, style: str | None = None) -> None:
        self.console.print(text, style=style, markup=False)

    def rule(self, title: str) -> None:
        self.console.print(f"── {title} ──", style="bold cyan", markup=False)

    def ask(self, prompt: str) -> str:
        """A line from the person; /quit or end of input raises :class:`Quit`."""
        try:
            line = self._ask(prompt)
        except EOFError:
            raise Quit from None
        if line.strip() == "/quit":
            raise Quit
        return line


def show_message(screen: Screen, message: Message, prefix: str) -> None:
    """A parsed message: thinking, text, tool calls and malformed-call errors."""
    if message.get("reasoning_content"):
        screen.text(f"(thinking) {message['reasoning_content']}", style="dim")
    screen.text(f"{prefix}{message_text(message)}")
    for part in images.image_parts([message]):
        screen.text(f"  {describe_image(part)}", style="magenta")
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        screen.text(f"  tool call: {fn.get('name')}({json.dumps(fn.get('arguments'), ensure_ascii=False)})",
                    style="magenta")
    for error in message.get("tool_call_errors") or []:
        screen.text(f"  malformed tool call: {error}", style="red")


def describe_image(part: dict) -> str:
    """One line for an image part: its size and where it is (a path, or what the environment gave)."""
    source = images.part_source(part)
    if isinstance(source, str) and not source.startswith("data:"):
        size = f"{part['width']} x {part['height']} px, " if "width" in part else ""
        return f"[image {size}{source}]"
    try:
        width, height = images.read_image(source).size
    except images.ImageError as e:
        return f"[image: {e}]"
    return f"[image {width} x {height} px]"


# ---------------------------------------------------------------------------------------------- chat
_RESET = object()


class ChatUser(Env):
    """The person at the terminal as the environment of a conversation: every line is a user turn;
    ``/image PATH`` attaches an image to the next one."""

    def __init__(self, screen: Screen, system: str | None, image_paths: list[str] | None = None):
        self.screen = screen
        self.system = system
        self.attached: list[str] = []
        for path in image_paths or []:
            self._attach(path)

    def _attach(self, path: str) -> None:
        try:
            width, height = images.read_image(path).size
        except images.ImageError as e:
            self.screen.text(f"error: {e}", style="red")
            return
        self.attached.append(path)
        self.screen.text(f"(image {path}: {width} x {height} px, sent with your next message)", style="dim")

    def _read(self) -> Any:
        while True:
            line = self.screen.ask("you> ")
            if line.strip() == "/reset":
                return _RESET
            if line.strip().startswith("/image"):
                path = line.strip()[len("/image"):].strip()
                if path:
                    self._attach(path)
                else:
                    self.screen.text("usage: /image PATH (a PNG or JPEG file)", style="red")
                continue
            if line.strip():
                return line

    def _user(self, line: str) -> Message:
        if not self.attached:
            return {"role": "user", "content": line}
        parts = [{"type": "image", "image": path} for path in self.attached]
        self.attached = []
        return {"role": "user", "content": [*parts, {"type": "text", "text": line}]}

    async def reset(self) -> Observation:
        line = self._read()
        while line is _RESET:  # nothing to reset yet
            line = self._read()
        system = [{"role": "system", "content": self.system}] if self.system else []
        return Observation(system + [self._user(line)])

    async def step(self, action: Message) -> StepResult:
        show_message(self.screen, action, "assistant> ")
        line = self._read()
        if line is _RESET:
            return StepResult(done=True)
        return StepResult([self._user(line)])


async def chat_loop(sampler: Any, renderer: Renderer, screen: Screen, temperature: float, max_tokens: int,
                    system: str | None = None, image_paths: list[str] | None = None) -> None:
    """Conversations until /quit; /reset starts a new one (a fresh token sequence). A message the model
    cannot take (an image for a text-only model, a broken image file) ends its conversation with an
    ``error:`` line, not the chat."""
    settings = RolloutSettings(max_turns=1 << 62, max_tokens=max_tokens, temperature=temperature,
                               timeout=math.inf)
    user = ChatUser(screen, system, image_paths)
    while True:
        try:
            await run_episode(user, Episode("chat", "chat", 0, 0), renderer, sampler, settings)
        except Quit:
            return
        except (UserInputError, images.ImageError) as e:
            screen.text(f"error: {e}", style="red")
        screen.text("(new conversation)", style="dim")


# ---------------------------------------------------------------------------------------------- play
class WatchedEnv(Env):
    """An environment that shows the terminal its tools and each reply, reward and ``done``."""

    def __init__(self, env: Env, screen: Screen):
        self.env = env
        self.screen = screen

    def _show(self, messages: list[Message]) -> None:
        for m in messages:
            self.screen.text(f"[{m.get('role')}] {message_text(m)}")
            for part in images.image_parts([m]):
                self.screen.text(f"  {describe_image(part)}", style="magenta")

    async def reset(self) -> Observation:
        obs = await call_env(self.env.reset)
        for tool in obs.tools:
            fn = tool.get("function", tool)
            params = ", ".join((fn.get("parameters") or {}).get("properties", {}))
            self.screen.text(f"tool: {fn.get('name')}({params}): {fn.get('description', '')}",
                             style="magenta")
        return obs

    async def step(self, action: Message) -> StepResult:
        result = await call_env(self.env.step, action)
        self.screen.rule("environment")
        self._show(result.messages)
        metrics = "".join(f" · {k} {v:g}" for k, v in sorted(result.metrics.items()))
        self.screen.text(f"reward {result.reward:g} · done {'yes' if result.done else 'no'}{metrics}",
                         style="bold")
        return result

    async def close(self) -> None:
        await call_env(self.env.close)


class ShownPolicy:
    """Stands where a rollout's sampling client does. Shows the tokens the policy is given (those new
    since its last turn, decoded with every special token) and then answers: the person at the
    terminal types the assistant's reply, or ``sampler`` samples it and the reply is shown."""

    def __init__(self, renderer: Renderer, screen: Screen, sampler: Any = None, pause: bool = False,
                 images_dir: str | Path | None = None):
        self.renderer = renderer
        self.screen = screen
        self.sampler = sampler
        self.pause = pause
        self.images_dir = Path(images_dir or Path(tempfile.gettempdir()) / "polyrl-play")
        self.seen: list[int] = []  # the last sequence shown, prompt and reply

    def _show_tokens(self, tokens: list[int], spans: list[images.ImageSpan], start: int) -> None:
        """``tokens[start:]`` as text, each image as its size, token count and the file it is saved to."""
        at = start
        for span in [s for s in spans if s.start >= start]:
            if span.start > at:
                self.screen.text(self.renderer.decode(tokens[at:span.start]), style="green")
            path = self.images_dir / span.name
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(span.data)
            width, height = span.size()
            self.screen.text(f"[image {width} x {height} px, {span.length} tokens: {path}]", style="magenta")
            at = span.end
        if at < len(tokens):
            self.screen.text(self.renderer.decode(tokens[at:]), style="green")

    def _end_of_turn(self) -> list[int]:
        stops = self.renderer.stop_sequences()
        return [stops[0]] if isinstance(stops[0], int) else self.renderer.encode(stops[0])

    async def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
                     **kwargs: Any) -> types.SampleResponse:
        import numpy as np
        from tinker import types

        tokens, spans = images.flatten(prompt.chunks, self.renderer.image_placeholder_id or 0)
        continues = tokens[: len(self.seen)] == self.seen  # else another conversation (a workflow's role)
        self.screen.rule("what the policy sees" + ("" if continues else " (another conversation)"))
        self._show_tokens(tokens, spans, len(self.seen) if continues else 0)
        if self.sampler is None:
            self.screen.rule("your move: type the assistant's reply (/quit ends)")
            sampled = self.renderer.encode(self.screen.ask("move> ")) + self._end_of_turn()
            response = types.SampleResponse(sequences=[types.SampledSequence(
                stop_reason="stop", sequence_id=uuid.uuid4().hex,
                tokens_np=np.asarray(sampled, dtype=np.int32),
                logprobs_np=np.zeros(len(sampled), dtype=np.float32))])
        else:
            if self.pause:
                self.screen.ask("(Enter: the policy's turn, /quit ends) ")
            response = await self.sampler.sample(prompt, num_samples, sampling_params, **kwargs)
            sampled = list(response.sequences[0].tokens)
            self.screen.rule("the policy's reply")
            self.screen.text(self.renderer.decode(sampled), style="yellow")
        self.seen = tokens + sampled
        return response


async def play_episode(runtime: Any, split: str, task: int, renderer: Renderer, screen: Screen,
                       sampler: Any = None, seed: int | None = 0, pause: bool = False,
                       images_dir: str | Path | None = None) -> list[Episode]:
    """Play task ``task`` of ``split`` of a configured environment (a :class:`polyrl.rl.rollouts.EnvRuntime`)
    once, by hand (``sampler`` None) or watching ``sampler``; returns the episode(s), [] on /quit."""
    builder = runtime.builder
    n = builder.num_tasks(split)
    if task < 0 or (n is not None and task >= n):
        known = f"tasks 0..{n - 1}" if n is not None else "tasks numbered from 0"
        raise UserInputError(f"--task {task}: the {split} split of {runtime.name} has {known}")
    policy = ShownPolicy(renderer, screen, sampler, pause, images_dir)
    try:
        if builder.drives_rollouts:
            ctx = RolloutContext(runtime.name, split, task, 0, policy, renderer, runtime.settings, seed)
            episodes = list(await builder.rollout(ctx))
        else:
            env = WatchedEnv(builder.make(split, task), screen)
            episode = Episode(runtime.name, split, task, 0)
            episodes = [await run_episode(env, episode, renderer, policy, runtime.settings, seed)]
    except Quit:
        screen.text("(stopped)", style="dim")
        return []
    finally:
        await builder.aclose()
    for ep in episodes:
        role = f"{ep.role}: " if ep.role else ""
        ending = "" if ep.done_by_env else f" (cut off after {ep.num_turns} turns)"
        screen.text(f"episode over: {role}reward {ep.reward:g} · success {'yes' if ep.success else 'no'} · "
                    f"turns {ep.num_turns}{ending}", style="bold")
    return episodes


# ----------------------------------------------------------------------------------- command line
def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="tinker://<run>/sampler_weights/<name>, a checkpoint directory, a "
                                      "run's log_path, or a base model directory / hub id")
    p.add_argument("--store_dir", "--store-dir", dest="store_dir",
                   help="local checkpoint store for tinker:// paths")
    p.add_argument("--renderer", help="chat format; default: the run's, else inferred from the model")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max_tokens", "--max-tokens", dest="max_tokens", type=int, default=256,
                   help="tokens sampled per reply")
    p.add_argument("--system", help="a system prompt for every conversation")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image (PNG, JPEG) sent with the first message (repeatable); later: /image PATH")
    _engine_arguments(p)


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--sampler-dtype", "--sampler_dtype", dest="sampler_dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype sampling computes in (auto: bfloat16 on GPUs and on CPUs with native bfloat16 "
                        "arithmetic, else --dtype's)")


def run_chat(args: argparse.Namespace, screen: Screen | None = None) -> None:
    from polyrl.rl.policy import open_trained, resolve_policy

    _check_sampling(args.temperature, args.max_tokens)
    screen = screen or Screen()
    policy = resolve_policy(args.checkpoint, args.store_dir)
    screen.text(f"loading {policy.label} ...", style="dim")
    opened = open_trained(policy, args.device, args.dtype, args.renderer, args.sampler_dtype)
    sampler, renderer = opened.client, opened.renderer
    screen.text(f"chat with {policy.label} (renderer {renderer.name}); /reset starts over, /quit ends",
                style="bold")
    try:
        asyncio.run(chat_loop(sampler, renderer, screen, args.temperature, args.max_tokens, args.system,
                              getattr(args, "image", None)))
    except KeyboardInterrupt:
        screen.text("")


def add_play_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("env", help="an environment type (guess_number, calculator, module:..., ...) or, with "
                               "--config_path, the name of one of the config's environments")
    p.add_argument("--checkpoint", help="watch this policy play (as for `polyrl chat`); default: you play")
    p.add_argument("--model", help="playing by hand: the model whose tokenizer renders what the policy sees "
                                   "(default: the config's model_name)")
    p.add_argument("--config_path", "--config", dest="config_path",
                   help="a run config; ENV names one of its environments (type, args, limits, renderer)")
    p.add_argument("--args", nargs="*", default=[], metavar="KEY=VALUE",
                   help="environment args (values as YAML, e.g. low=1 high=10), or one JSON object")
    p.add_argument("--split", default="train", choices=["train", "test"])
    p.add_argument("--task", type=int, default=0, help="task index within the split")
    p.add_argument("--seed", type=int, default=None,
                   help="run seed (task generation, sampling); default: the config's or 0")
    p.add_argument("--renderer",
                   help="chat format; default: the config's or run's, else inferred from the model")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature when watching; default: the environment's")
    p.add_argument("--max_tokens", "--max-tokens", dest="max_tokens", type=int, help="tokens per turn")
    p.add_argument("--max_turns", "--max-turns", dest="max_turns", type=int,
                   help="assistant turns before the episode is cut")
    p.add_argument("--pause", action="store_true",
                   help="when watching, wait for Enter before each policy turn")
    p.add_argument("--images_dir", "--images-dir", dest="images_dir",
                   help="where the images the policy is given are saved to be looked at (default: "
                        "<temp dir>/polyrl-play/images)")
    p.add_argument("--store_dir", "--store-dir", dest="store_dir",
                   help="local checkpoint store for tinker:// paths")
    _engine_arguments(p)


def parse_env_args(items: list[str]) -> dict[str, Any]:
    """``--args``: ``key=value`` pairs (values parsed as YAML) or a single JSON/YAML object."""
    from polyrl.config.files import parse_scalar

    if len(items) == 1 and items[0].lstrip().startswith("{"):
        value = parse_scalar(items[0])
        if not isinstance(value, dict):
            raise UserInputError(f"--args {items[0]!r} is not a JSON object")
        return value
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserInputError(f"--args {item!r}: expected key=value")
        out[key.strip()] = parse_scalar(text)
    return out


def play_runtime(args: argparse.Namespace):
    """(the environment's :class:`polyrl.rl.rollouts.EnvRuntime`, the run config or None) from the options."""
    from polyrl.config.files import load_config
    from polyrl.config.schema import EnvConfig
    from polyrl.envs.registry import get_env_builder
    from polyrl.rl.rollouts import EnvRuntime

    extra = parse_env_args(args.args)
    config = None
    if args.config_path:
        config = load_config(args.config_path)
        for line in config.renamed_warnings:
            print(f"warning: {line}", file=sys.stderr)
        if args.env not in config.environments:
            raise UserInputError(f"{args.config_path} has no environment {args.env!r} "
                                 f"(it has: {', '.join(config.environments)})")
        cfg = config.environments[args.env]
        cfg = cfg.model_copy(update={"args": {**cfg.args, **extra}})
        seed, max_tokens = config.seed, config.max_tokens
    else:
        try:
            get_env_builder(args.env).validate_args(args.env, extra)
        except KeyError as e:
            raise UserInputError(str(e.args[0] if e.args else e)) from None
        except ValueError as e:
            raise UserInputError(f"--args: {e}") from None
        cfg, seed, max_tokens = EnvConfig(type=args.env, args=extra), 0, 256
    seed = args.seed if args.seed is not None else seed
    try:
        runtime = EnvRuntime.create(args.env, cfg, seed, max_tokens)
    except ValueError as e:
        raise UserInputError(f"environment {args.env}: {e}") from None
    changes = {k: getattr(args, k) for k in ("temperature", "max_tokens", "max_turns")
               if getattr(args, k) is not None}
    runtime.settings = dataclasses.replace(runtime.settings, **changes)
    _check_sampling(runtime.settings.temperature, runtime.settings.max_tokens, runtime.settings.max_turns)
    return runtime, config


def run_play(args: argparse.Namespace, screen: Screen | None = None) -> list[Episode]:
    from polyrl.models import resolve_model_path
    from polyrl.renderers import resolve_renderer
    from polyrl.rl.policy import open_trained, resolve_policy

    screen = screen or Screen()
    runtime, config = play_runtime(args)
    renderer_name = args.renderer or (config.renderer if config else None)
    sampler = None
    if args.checkpoint:
        store_dir = args.store_dir or (config.local.store_dir if config else None)
        policy = resolve_policy(args.checkpoint, store_dir)
        screen.text(f"loading {policy.label} ...", style="dim")
        opened = open_trained(policy, args.device, args.dtype, renderer_name, args.sampler_dtype)
        sampler, renderer = opened.client, opened.renderer
        who = policy.label
    else:
        model = args.model or (config.model_name if config else None)
        if not model:
            raise UserInputError("playing by hand needs --model (its tokenizer renders what the policy "
                                 "sees), --config_path, or --checkpoint to watch a policy")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
        except OSError as e:
            raise UserInputError(f"model {model!r}: no tokenizer could be loaded ({e})") from None
        renderer = resolve_renderer(renderer_name, model, tokenizer)
        who = "you"
    settings = runtime.settings
    screen.text(f"play {runtime.name} ({args.split} task {args.task}) · policy: {who} · renderer "
                f"{renderer.name} · max {settings.max_turns} turns of {settings.max_tokens} tokens",
                style="bold")
    seed = args.seed if args.seed is not None else runtime.run_seed
    try:
        return asyncio.run(play_episode(runtime, args.split, args.task, renderer, screen, sampler, seed,
                                        args.pause, getattr(args, "images_dir", None)))
    except KeyboardInterrupt:
        screen.text("")
        return []


def _check_sampling(temperature: float, max_tokens: int, max_turns: int = 1) -> None:
    if temperature < 0:
        raise UserInputError(f"--temperature must be >= 0, got {temperature:g}")
    if max_tokens < 1 or max_turns < 1:
        raise UserInputError("--max_tokens and --max_turns must be >= 1")
