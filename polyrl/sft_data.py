"""Conversation files for ``polyrl sft --data``: JSONL in the OpenAI chat fine-tuning format.

Each line is one conversation::

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...,
                   "tool_calls": [...], "tool_call_id": ...}, ...],
     "tools": [{"type": "function", "function": {"name", "description", "parameters"}}, ...]}

or TRL's prompt-completion form, ``{"prompt": [messages] | "text", "completion": [messages] | "text"}``
(the completion follows the prompt; plain text is a user message and an assistant reply). A content may
be a string or a list of OpenAI text parts; tool-call arguments may be a JSON string (as OpenAI writes
them) or an object. The model learns every assistant message (loss weight 1 on its tokens, 0 on the
rest), exactly as :meth:`polyrl.renderers.base.Renderer.render_supervised` renders it, except one with
``"weight": 0`` (OpenAI's key for an assistant message to keep as context only).

Preference pairs for ``polyrl dpo --data`` are TRL's preference format, one pair a line::

    {"prompt": [messages] | "text", "chosen": [messages] | "text", "rejected": [messages] | "text",
     "tools": [...]}

(text: a user message, and an assistant reply for chosen and rejected), or the implicit-prompt form
``{"chosen": [messages], "rejected": [messages]}``, whose common leading messages are the prompt. The
model learns the assistant messages of chosen and rejected; those of the prompt are context.

A problem with a line is a :class:`polyrl.errors.UserInputError` naming ``file:line`` and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.envs.base import Message, ToolSpec
from polyrl.errors import UserInputError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One line of a data file: its messages and tool specs, and where it came from (``file:line``)."""

    messages: list[Message]
    tools: list[ToolSpec]
    where: str
    assistant_weights: tuple[float, ...] = ()  # one per assistant message, in order: 1 learned, 0 context


@dataclass(frozen=True)
class Pair:
    """One line of a preference file: a prompt, the answer preferred and the one rejected."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    tools: list[ToolSpec]
    where: str

    def conversation(self, side: str) -> Conversation:
        """The prompt followed by the ``chosen`` or ``rejected`` answer, learned on that answer only."""
        answer = self.chosen if side == "chosen" else self.rejected
        weights = tuple(0.0 for m in self.prompt if m["role"] == "assistant")
        weights += tuple(1.0 for m in answer if m["role"] == "assistant")
        return Conversation([*self.prompt, *answer], self.tools, f"{self.where} ({side})", weights)


def read_conversations(paths: list[str]) -> list[Conversation]:
    """Every conversation of the JSONL files ``paths``, in order; blank lines are skipped."""
    return _read_lines(paths, parse_line, "conversations")


def read_pairs(paths: list[str]) -> list[Pair]:
    """Every preference pair of the JSONL files ``paths``, in order; blank lines are skipped."""
    return _read_lines(paths, parse_pair, "preference pairs")


def _read_lines(paths: list[str], parse, what: str) -> list:
    out: list = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserInputError(f"data file not found: {path}") from None
        except UnicodeDecodeError as exc:
            raise UserInputError(f"{path}: not UTF-8 text (offset {exc.start}); save it as UTF-8") from None
        except OSError as exc:
            raise UserInputError(f"{path}: cannot read the data file ({exc.strerror or exc})") from None
        found = 0
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                out.append(parse(line, f"{path}:{number}"))
                found += 1
        if not found:
            raise UserInputError(f"{path}: no {what} (one JSON object per line expected)")
    return out


def _json_object(line: str, bad) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise bad(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise bad(f"expected a JSON object, got {type(row).__name__}")
    return row


def parse_line(line: str, where: str) -> Conversation:
    """One JSONL line as a conversation; a :class:`UserInputError` starting with ``where`` if it is not."""
    def bad(problem: str) -> UserInputError:
        return UserInputError(f"{where}: {problem}")

    row = _json_object(line, bad)
    if "messages" in row:
        raw = row["messages"]
    elif "prompt" in row and "completion" in row:
        raw = [*_turns(row["prompt"], "user", bad), *_turns(row["completion"], "assistant", bad)]
    else:
        raise bad('no messages: expected {"messages": [...]} or {"prompt": ..., "completion": ...}')
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list of {role, content} objects")
    messages = [_message(m, i, bad) for i, m in enumerate(raw)]
    weights = tuple(_weight(m, i, bad) for i, m in enumerate(raw) if m["role"] == "assistant")
    if not weights:
        raise bad("no assistant message: nothing to learn from this conversation")
    if not any(weights):
        raise bad("every assistant message has weight 0: nothing to learn from this conversation")
    return Conversation(messages, _tools(row.get("tools"), bad), where, weights)


def parse_pair(line: str, where: str) -> Pair:
    """One JSONL line as a preference pair; a :class:`UserInputError` starting with ``where`` if it is
    not one."""
    def bad(problem: str) -> UserInputError:
        return UserInputError(f"{where}: {problem}")

    row = _json_object(line, bad)
    if "chosen" not in row or "rejected" not in row:
        raise bad('not a preference pair: expected {"prompt": ..., "chosen": ..., "rejected": ...}')
    sides = {}
    for side in ("chosen", "rejected"):
        raw = _turns(row[side], "assistant", bad)
        if not raw:
            raise bad(f"{side} is empty")
        sides[side] = [_message(m, i, bad) for i, m in enumerate(raw)]
    if "prompt" in row:
        prompt = [_message(m, i, bad) for i, m in enumerate(_turns(row["prompt"], "user", bad))]
    else:  # implicit prompt: the messages both sides begin with
        n = 0
        while (n < min(len(sides["chosen"]), len(sides["rejected"])) - 1
               and sides["chosen"][n] == sides["rejected"][n]):
            n += 1
        prompt, sides = sides["chosen"][:n], {k: v[n:] for k, v in sides.items()}
    for side, messages in sides.items():
        if not any(m["role"] == "assistant" for m in messages):
            raise bad(f"{side} has no assistant message: nothing to compare")
    if sides["chosen"] == sides["rejected"]:
        raise bad("chosen and rejected are the same answer")
    return Pair(prompt, sides["chosen"], sides["rejected"], _tools(row.get("tools"), bad), where)


def _weight(m: dict, i: int, bad) -> float:
    weight = m.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise bad(f"message {i}: weight must be 0 (context only) or 1 (learned), got {weight!r}")
    return float(weight)


def _turns(value: Any, role: str, bad) -> list[Any]:
    """TRL's prompt or completion: a list of messages, or plain text as one message of ``role``."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise bad(f"prompt and completion must be text or lists of messages, got {type(value).__name__}")


def _message(m: Any, i: int, bad) -> Message:
    """Message ``i`` in polyrl's form (see :mod:`polyrl.envs.base`): content a string or text parts,
    tool-call arguments decoded."""
    if not isinstance(m, dict):
        raise bad(f"message {i} is not an object")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"message {i}: unknown role {role!r} (expected {', '.join(ROLES)})")
    if "weight" in m and role != "assistant":
        raise bad(f"message {i}: only assistant messages take a weight")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f'message {i}: content parts must be text parts ({{"type": "text", "text": ...}})')
    elif not isinstance(content, str):
        raise bad(f"message {i}: content must be text, got {type(content).__name__}")
    out: Message = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant":
            raise bad(f"message {i}: only assistant messages make tool calls")
        out["tool_calls"] = [_tool_call(c, i, j, bad) for j, c in enumerate(_as_list(calls, i, bad))]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _as_list(value: Any, i: int, bad) -> list[Any]:
    if not isinstance(value, list):
        raise bad(f"message {i}: tool_calls must be a list")
    return value


def _tool_call(call: Any, i: int, j: int, bad) -> dict[str, Any]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"message {i}: tool call {j} needs a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise bad(f"message {i}: tool call {j}'s arguments are not JSON") from None
    if not isinstance(args, dict):
        raise bad(f"message {i}: tool call {j}'s arguments must be a JSON object")
    return {"id": call.get("id") or f"call_{j}", "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def _tools(tools: Any, bad) -> list[ToolSpec]:
    """OpenAI function specs; a bare ``{"name", "parameters", ...}`` is wrapped as one."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools must be a list of function specs")
    out = []
    for k, tool in enumerate(tools):
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad(f"tool {k} needs a name ({{\"type\": \"function\", \"function\": {{\"name\": ...}}}})")
        out.append({"type": "function", "function": spec})
    return out
