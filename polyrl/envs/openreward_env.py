"""``openreward:Org/EnvName`` (or just ``Org/EnvName``): environments served by OpenReward, or by any
server speaking its Open Reward Standard (ORS), through the ``openreward`` SDK.

``args``:

- ``splits``: OpenReward split names for polyrl's ``train`` / ``test`` splits (default ``train``, and
  ``test``, else ``validation``, whichever the environment has);
- ``variant``: the environment variant (default: none);
- ``base_url``: the environment server (default: OpenReward's own); e.g. a self-hosted ORS server
  ``http://127.0.0.1:8080``.

The API key comes from ``OPENREWARD_API_KEY`` (never from the config, so it stays out of run files).

One SDK session per episode (``env.session(split=..., index=...)``), closed on every path. The prompt
is the session's ``get_messages`` (which falls back to ``get_prompt``), the tools its ``list_tools``,
converted to chat-completions function specs. Each tool call the renderer parsed becomes
``call_tool``; its ``ToolOutput`` comes back as a ``tool`` message, its reward is the step's reward and
``finished`` ends the episode. A reply without tool calls goes to the environment's terminal tool
(``@terminal``) when it has one and ends the episode; without one it ends the episode unrewarded
(metric ``no_tool_call``). Malformed calls and ``ToolCallError`` (unknown tool, invalid input) go
back to the model as tool errors; ``ToolFailed`` and terminated sessions make the rollout fail.

Images: ORS carries them as ``ImageBlock`` s (base64 ``data`` and a ``mimeType``). In the prompt the SDK's
``openai`` messages already hold them as ``image_url`` parts (``data:`` URIs); in a tool's output each
becomes an image part of the tool message (``{"type": "image", "image": "data:<mime>;base64,..."}``)
beside its text, so a vision-language model sees them (a text-only renderer refuses them).

The SDK is synchronous (it runs its own event loop in a thread): every call runs in a worker thread
(``asyncio.to_thread``), so episodes stay concurrent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from polyrl.envs.base import Env, EnvBuilder, Message, Observation, StepResult, register_env
from polyrl.errors import RunStoppedError
from polyrl.renderers.base import message_text

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'polyrl[openreward]'"
ALLOWED_ARGS = ("splits", "variant", "base_url")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)?$")


def environment_name(type_name: str) -> str:
    """``openreward:Org/Env`` or ``Org/Env`` -> ``Org/Env``."""
    return type_name.split(":", 1)[1].strip() if type_name.startswith("openreward:") else type_name.strip()


def chat_tool_spec(tool: dict) -> dict:
    """An OpenReward ``format="openai"`` tool (the flat Responses-API shape) as a chat-completions
    function spec; specs already nested are kept."""
    if isinstance(tool.get("function"), dict):
        return tool
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": tool["name"],
                                             "description": tool.get("description") or "",
                                             "parameters": params}}


def blocks_text(blocks: Any) -> str:
    parts = []
    for block in blocks or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'block')}]")
    return "\n".join(parts)


def blocks_content(blocks: Any) -> str | list[dict]:
    """A tool output's blocks as message content: the text when there is no image, else content parts
    (each ``ImageBlock`` an image part holding its ``data:`` URI, each text block a text part)."""
    blocks = list(blocks or [])
    if not any(getattr(b, "type", None) == "image" for b in blocks):
        return blocks_text(blocks)
    parts: list[dict] = []
    for block in blocks:
        if getattr(block, "type", None) == "image":
            mime = str(getattr(block, "mimeType", "") or "image/png")
            parts.append({"type": "image", "image": f"data:{mime};base64,{block.data}"})
        else:
            text = getattr(block, "text", None)
            parts.append({"type": "text", "text": text if isinstance(text, str) else f"[{block.type}]"})
    return parts


def _sdk():
    try:
        import openreward  # noqa: F401
        from openreward.api.errors import SessionTerminatedError, ToolCallError, ToolFailed  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"OpenReward environments need the openreward package ({INSTALL_HINT})") from exc
    return openreward


class OpenRewardEnv(Env):
    """One episode: one OpenReward session."""

    def __init__(self, builder: "OpenRewardBuilder", split: str, index: int):
        self.builder, self.split, self.index = builder, split, index
        self.session = None
        self.terminal = None
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0}

    async def reset(self) -> Observation:
        session = self.builder.env.session(split=self.split, index=self.index)
        await asyncio.to_thread(session.__enter__)
        self.session = session
        messages = await asyncio.to_thread(session.get_messages, "openai")
        tools = await asyncio.to_thread(session.list_tools, "openai")
        self.terminal = await asyncio.to_thread(session.terminal_tool)
        return Observation([dict(m) for m in messages], [chat_tool_spec(t) for t in tools])

    async def _call(self, fn, *args) -> tuple[Any, str | None]:
        """(ToolOutput, None) or (None, error text) for a ToolCallError; other errors propagate."""
        from openreward.api.errors import ToolCallError

        try:
            return await asyncio.to_thread(fn, *args), None
        except ToolCallError as exc:
            return None, (exc.reason if exc.reason == "episode_finished"
                          else f"Error ({exc.reason}): {exc.detail}")

    async def step(self, action: Message) -> StepResult:
        out: list[Message] = []
        reward, done = 0.0, False
        calls = action.get("tool_calls") or []
        errors = action.get("tool_call_errors") or []
        for k, error in enumerate(errors):
            self.counts["tool_errors"] += 1
            out.append({"role": "tool", "tool_call_id": f"invalid_{k}", "content": f"Error: {error}"})
        for call in calls:
            name, args = call["function"]["name"], call["function"].get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            self.counts["tool_calls"] += 1
            result, error = await self._call(self.session.call_tool, name, args)
            if error == "episode_finished":
                done = True
                break
            if error is not None:
                self.counts["tool_errors"] += 1
                out.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                            "content": error})
                continue
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                        "content": blocks_content(result.blocks)})
            reward += float(result.reward or 0.0)
            if result.finished:
                done = True
                break
        metrics = dict(self.counts)
        if not calls and not errors:
            done = True
            if self.terminal is not None:
                result, error = await self._call(self.session.call_terminal_tool, message_text(action))
                content = blocks_content(result.blocks) if result is not None else error
                out.append({"role": "tool", "tool_call_id": "terminal", "name": self.terminal.name,
                            "content": content or ""})
                reward += float(result.reward or 0.0) if result is not None else 0.0
            else:
                metrics["no_tool_call"] = 1.0
        return StepResult(out, reward, done, metrics)

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                await asyncio.to_thread(session.__exit__, None, None, None)
            except Exception as exc:  # noqa: BLE001 - closing a dead session is best effort
                logger.debug("closing OpenReward session failed: %s", exc)


@register_env("openreward:")
class OpenRewardBuilder(EnvBuilder):
    """Environments of one OpenReward environment (see the module docstring)."""

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        name = environment_name(type_name)
        if not name or not _NAME.match(name):
            raise ValueError("OpenReward environments are named 'Org/EnvName' "
                             f"(or 'openreward:Org/EnvName'), not {name!r}")
        unknown = sorted(set(args) - set(ALLOWED_ARGS))
        if unknown:
            raise ValueError(f"unknown OpenReward args {unknown} (allowed: {', '.join(ALLOWED_ARGS)})")
        splits = args.get("splits", {})
        if not isinstance(splits, dict) or not all(k in ("train", "test") and isinstance(v, str) and v
                                                   for k, v in splits.items()):
            raise ValueError("args.splits maps 'train' / 'test' to OpenReward split names, "
                             "e.g. {test: validation}")
        if args.get("variant") is not None and not isinstance(args["variant"], str):
            raise ValueError("args.variant must be a string")
        base_url = args.get("base_url")
        if base_url is not None and not (isinstance(base_url, str) and re.match(r"^https?://", base_url)):
            raise ValueError(f"args.base_url must be an http(s) URL, not {base_url!r}")
        _sdk()

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str = ""):
        super().__init__(args, seed, type_name)
        self.validate_args(type_name, self.args)
        from openreward import OpenReward

        self.openreward_environment = environment_name(type_name)
        self.openreward_variant = self.args.get("variant")
        from openreward.api.errors import TransportError

        self.client = OpenReward()
        self.env = self.client.environments.get(self.openreward_environment, variant=self.openreward_variant,
                                                base_url=self.args.get("base_url"))
        try:
            available = self.env.list_splits()  # the SDK retries with backoff before it gives up
        except TransportError as exc:
            where = self.args.get("base_url") or "OpenReward"
            reason = " ".join(str(exc).split())[:300]
            raise RunStoppedError(f"OpenReward environment {self.openreward_environment} at {where} is "
                                  f"unreachable: {reason}") from None
        wanted = dict(self.args.get("splits") or {})
        self.split_names = {"train": wanted.get("train", "train"),
                            "test": wanted.get("test") or ("test" if "test" in available else "validation")}
        if self.split_names["train"] not in available:
            raise ValueError(f"OpenReward environment {self.openreward_environment} has no split "
                             f"{self.split_names['train']!r} (it has {', '.join(available)}); "
                             "set args.splits.train")
        self.available_splits = available
        self._num: dict[str, int] = {}

    def split_name(self, split: str) -> str:
        name = self.split_names.get(split, split)
        if name not in self.available_splits:
            raise ValueError(f"OpenReward environment {self.openreward_environment} has no split {name!r} "
                             f"for polyrl's {split!r} split (it has {', '.join(self.available_splits)}); "
                             f"set args.splits.{split}")
        return name

    def num_tasks(self, split: str) -> int | None:
        if split not in self._num:
            self._num[split] = int(self.env.num_tasks(self.split_name(split)))
        return self._num[split]

    def make(self, split: str, index: int) -> Env:
        return OpenRewardEnv(self, self.split_name(split), index)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.client.close)
