"""``polyrl.envs.verifiers_chat``: the harness polyrl runs verifiers environments in by default.

A verifiers (0.4) harness is the program that plays a seat: it talks to the model through the
interception endpoint verifiers gives it and to the task's tools over MCP. This one runs the chat loop
verifiers ships for its ``null`` harness (a plain chat loop that offers the task's MCP tools and calls
them, until a reply without tool calls) with the Python that runs polyrl, in the ``subprocess``
runtime. verifiers' own ``null`` and ``bash`` harnesses run the same loop in an environment ``uv``
creates per script (installing ``uv`` first when it is missing), which needs the network and the
package index; polyrl's venv already holds everything the loop imports, so this needs neither, and
(unlike ``bash``) the model gets no shell on the training machine.

verifiers resolves a harness id to a top-level module (``polyrl-chat`` -> ``polyrl_chat``), so the
verifiers adapter registers this module under that name: ``agent: {harness: {id: polyrl-chat}}``
selects it (polyrl's default for a taskset that ships no harness of its own).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, PEP_723_END

from polyrl.envs.verifiers_env import HARNESS_ID

__all__ = ["PolyrlChatHarness"]


class PolyrlChatHarnessConfig(HarnessConfig):
    id: str = HARNESS_ID


class PolyrlChatHarness(Harness[PolyrlChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    def _script(self) -> str:
        # the loop's source without its PEP 723 header (the header only tells uv what to install)
        return CHAT_PROGRAM_SOURCE.split(PEP_723_END, 1)[1]

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url: str | None = None) -> Any:
        if runtime.type != "subprocess":
            raise ValueError(f"harness {HARNESS_ID} runs in the subprocess runtime only, not "
                             f"{runtime.type!r} (pick a harness of verifiers' own for other runtimes)")
        system_prompt, prompt = self.resolve_prompt(data)
        args = [f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}"]
        if tool_interception_url:
            args.append(f"--tool-interception-url={tool_interception_url}")
        if system_prompt:
            args.append(f"--system-prompt={system_prompt}")
        if mcp_urls:
            timeout = self.config.tool_timeout
            servers = {name: {"url": url, "timeout": timeout} for name, url in mcp_urls.items()}
            args.append("--mcp-config=" + json.dumps({"mcpServers": servers}))
        if isinstance(prompt, str):
            args.append(f"--prompt={prompt}")
        elif prompt is not None:
            path = f".vf-initial-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt]).encode())
            args.append(f"--initial-messages-file={path}")
        script = f".polyrl-chat-{trace.id}.py"
        await runtime.write(script, self._script().encode())
        return await runtime.run([sys.executable, script, *args], dict(self.config.resolved_env))
