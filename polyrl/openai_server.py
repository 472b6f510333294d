"""An OpenAI-compatible chat endpoint served from a Tinker sampling client, on 127.0.0.1.

Frameworks that drive the model themselves over HTTP (verifiers, agent harnesses) talk to the policy
being trained through it: ``POST /v1/chat/completions`` renders the request's messages with polyrl's
renderer, samples with the current sampling client and answers in the chat-completions shape, plus
the token data a trainer needs, in vLLM's extra fields:

- ``prompt_token_ids`` (top level): the exact prompt tokens that were sampled from;
- ``choices[0].token_ids``: the sampled tokens; ``choices[0].logprobs.content[i].logprob`` their
  sampler logprobs (always returned).

``stream: true`` is answered with server-sent events: the whole reply in one chunk (message as the
delta, the same token fields), then ``[DONE]`` (harnesses whose chat loops always stream need it).

Token-exact multi-turn: when a request's conversation extends an earlier exchange of the same
session (its messages, then the assistant reply this server gave, then new messages), the prompt is
that exchange's prompt + sampled tokens + the renderer's ``continuation`` of the new messages, the
way polyrl's own rollouts build it, instead of a re-render of the whole history. Every exchange is
recorded on its :class:`ChatSession`, with the request's ``X-Session-ID`` header when it has one (the
client's name for the conversation: a session serving several agents tells their turns apart by it).

Sessions: ``open_session(sampler, ...)`` gives a session with its own base URL
(``http://127.0.0.1:PORT/s/<key>/v1``), sampler, defaults and seed, so concurrent rollouts of
different steps never mix; ``/v1`` itself serves the sampler set with :meth:`OpenAIServer.set_sampler`.

The server runs uvicorn in a daemon thread; sampling calls are sent to the event loop that started
the server (the trainer's), so the sampling client is only used from its own loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from polyrl.renderers.base import Message, Renderer, ToolSpec, message_text

logger = logging.getLogger(__name__)

DEFAULT_HISTORY = 256  # exchanges kept on the default (non-session) route for continuation
CONVERSATION_HEADER = "x-session-id"  # recorded on each exchange (clients name a rollout's turns with it)


@dataclass
class Exchange:
    """One chat completion: the request's conversation and tools, the reply, and its tokens."""

    messages: list[Message]
    tools: list[ToolSpec]
    reply: Message
    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    extends: int | None = None  # index of the exchange whose tokens this prompt continues
    response_id: str = ""
    # the client's name for the conversation (the X-Session-ID header; verifiers sends its trace's id)
    conversation: str | None = None


@dataclass
class ChatSession:
    """A sampler plus request defaults behind its own base URL; records every exchange."""

    key: str
    sampler: Any
    max_tokens: int
    temperature: float
    seed: int | None = None
    base_url: str = ""
    exchanges: list[Exchange] = field(default_factory=list)
    history: int | None = None  # keep only the last N exchanges (None = all)

    def record(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)
        if self.history is not None and len(self.exchanges) > self.history:
            drop = len(self.exchanges) - self.history
            del self.exchanges[:drop]
            for ex in self.exchanges:
                ex.extends = None if ex.extends is None or ex.extends < drop else ex.extends - drop


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# ------------------------------------------------------------------------------------ messages


def incoming_message(m: Any) -> Message:
    """A request message as a polyrl message: tool-call arguments decoded to dicts when they are
    JSON objects, ``reasoning`` read as ``reasoning_content``. Pydantic messages are dumped first."""
    if hasattr(m, "model_dump"):
        m = m.model_dump(exclude_none=True)
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(400, f"each message needs a role: {str(m)[:200]}")
    out: Message = {"role": m["role"], "content": m.get("content") if m.get("content") is not None else ""}
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if isinstance(reasoning, str):
        out["reasoning_content"] = reasoning
    calls = []
    for call in m.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                decoded = json.loads(args)
                args = decoded if isinstance(decoded, dict) else args
            except json.JSONDecodeError:
                pass
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": fn.get("name", ""), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _message_key(m: Message) -> tuple:
    """What must match for a sent-back message to be the one recorded (ids and reasoning excluded:
    clients rewrite the former and drop the latter)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in m.get("tool_calls") or []
    )
    return m.get("role"), message_text(m).strip(), calls


def _tools_key(tools: list[ToolSpec]) -> str:
    return json.dumps(tools, sort_keys=True)


def outgoing_tool_calls(message: Message, prefix: str) -> list[dict]:
    return [
        {"id": f"{prefix}_{k}", "type": "function",
         "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
        for k, c in enumerate(message.get("tool_calls") or [])
    ]


def stream_events(result: dict) -> bytes:
    """A completion as the server-sent events of ``stream=true``: the whole reply in one chunk (its
    message as the delta, tool calls indexed), with the token fields and usage, then ``[DONE]``."""
    choice = result["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(delta["tool_calls"])]
    chunk = {**{k: v for k, v in result.items() if k != "choices"}, "object": "chat.completion.chunk",
             "choices": [{**{k: v for k, v in choice.items() if k != "message"}, "delta": delta}]}
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


# -------------------------------------------------------------------------------------- server


class OpenAIServer:
    """``/v1/chat/completions`` over a sampling client; see the module docstring."""

    def __init__(self, renderer: Renderer, model_name: str = "polyrl", host: str = "127.0.0.1", port: int = 0,
                 max_tokens: int = 256, temperature: float = 1.0):
        self.renderer = renderer
        self.model_name = model_name
        self.host, self.port = host, port
        self.default = ChatSession("", None, max_tokens, temperature, history=DEFAULT_HISTORY)
        self.sessions: dict[str, ChatSession] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._warned_untempered = False

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the default route (``.../v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> str:
        """Serve in a daemon thread; returns the base URL. Sampling runs on the event loop running
        here, if any (call from the trainer's loop), else on the server's own loop."""
        if self.running:
            return self.url
        import uvicorn

        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", loop="asyncio",
                                access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="polyrl-openai-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI-compatible endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = self._server = None

    def set_sampler(self, sampler: Any) -> None:
        """The sampling client the default ``/v1`` route uses from now on."""
        self.default.sampler = sampler

    def open_session(self, sampler: Any, max_tokens: int | None = None, temperature: float | None = None,
                     seed: int | None = None) -> ChatSession:
        key = uuid.uuid4().hex[:16]
        session = ChatSession(key, sampler, max_tokens or self.default.max_tokens,
                              self.default.temperature if temperature is None else temperature, seed,
                              base_url=f"http://{self.host}:{self.port}/s/{key}/v1")
        with self._lock:
            self.sessions[key] = session
        return session

    def close_session(self, session: ChatSession) -> None:
        with self._lock:
            self.sessions.pop(session.key, None)

    # -- HTTP ----------------------------------------------------------------------------------------

    def app(self):
        """The ASGI app (Starlette, which FastAPI and uvicorn bring along)."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                                status_code=status)

        async def completions(request) -> JSONResponse:
            key = request.path_params.get("key")
            session = self.default if key is None else self.sessions.get(key)
            if session is None:
                return error(404, f"unknown session {key!r}")
            try:
                body = await request.json()
            except Exception:  # noqa: BLE001
                return error(400, "the request body is not JSON")
            try:
                result = await self._on_main_loop(self.complete(session, body,
                                                                request.headers.get(CONVERSATION_HEADER)))
            except RequestError as exc:
                return error(exc.status, exc.message)
            if isinstance(body, dict) and body.get("stream"):
                return Response(stream_events(result), media_type="text/event-stream")
            return JSONResponse(result)

        async def models(request) -> JSONResponse:
            return JSONResponse({"object": "list",
                                 "data": [{"id": self.model_name, "object": "model", "owned_by": "polyrl"}]})

        return Starlette(routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/s/{key}/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/s/{key}/v1/models", models, methods=["GET"]),
        ])

    async def _on_main_loop(self, coro):
        loop = self._loop
        if loop is None or loop is asyncio.get_running_loop() or loop.is_closed():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    # -- one completion ------------------------------------------------------------------------------

    def prompt_for(self, session: ChatSession, messages: list[Message],
                   tools: list[ToolSpec]) -> tuple[list[int], int | None]:
        """Prompt tokens for a conversation: the continuation of an earlier exchange it extends, else
        the renderer's initial prompt. Returns (tokens, index of the extended exchange or None)."""
        keys = [_message_key(m) for m in messages]
        tools_key = _tools_key(tools)
        for i in range(len(session.exchanges) - 1, -1, -1):
            ex = session.exchanges[i]
            n = len(ex.messages)
            if (len(messages) > n and keys[n] == _message_key(ex.reply) and _tools_key(ex.tools) == tools_key
                    and keys[:n] == [_message_key(m) for m in ex.messages]):
                finished = ex.stop_reason == "stop"
                tail = self.renderer.continuation(messages[n + 1:], assistant_finished=finished)
                return ex.prompt_tokens + ex.completion_tokens + tail, i
        return self.renderer.initial_prompt(messages, tools or None), None

    async def complete(self, session: ChatSession, body: Any, conversation: str | None = None) -> dict:
        from tinker import types  # here, so that loading the verifiers adapter does not import the SDK

        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        if session.sampler is None:
            raise RequestError(503, "no sampling client yet")
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, "only n=1 is supported")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise RequestError(400, "messages must be a non-empty list")
        messages = [incoming_message(m) for m in raw]
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
        prompt, extends = self.prompt_for(session, messages, tools)

        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = min(int(requested), session.max_tokens) if requested else session.max_tokens
        temperature = body.get("temperature")
        temperature = session.temperature if temperature is None else float(temperature)
        stops: list = list(self.renderer.stop_sequences())
        extra_stops = body.get("stop")
        if extra_stops:
            extra_stops = [extra_stops] if isinstance(extra_stops, str) else list(extra_stops)
            stops = [self.renderer.decode([s]) if isinstance(s, int) else s for s in stops] + extra_stops
        seed = body.get("seed")
        if seed is None and session.seed is not None:
            seed = (session.seed * 1009 + len(session.exchanges)) % (2**31)
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stops, seed=seed,
                                      **({"top_p": float(body["top_p"])} if body.get("top_p") is not None
                                         else {}))
        if (params.temperature != 1.0 or params.top_p != 1.0) and not self._warned_untempered:
            self._warned_untempered = True
            logger.warning("a client samples with temperature %g, top_p %g: the sampler's logprobs are the "
                           "model's own at temperature 1 (as in Tinker), so the importance ratio compares "
                           "against a distribution that was not sampled", params.temperature, params.top_p)
        response = await session.sampler.sample(types.ModelInput.from_ints(prompt), 1, params)
        seq = response.sequences[0]
        tokens = [int(t) for t in seq.tokens]
        if seq.logprobs is None or len(seq.logprobs) != len(tokens):
            raise RequestError(502, "the sampler returned no logprobs for the sampled tokens; "
                                    "training needs them")
        logprobs = [float(x) for x in seq.logprobs]
        reply = self.renderer.parse_response(tokens)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        tool_calls = outgoing_tool_calls(reply, f"call_{len(session.exchanges)}")
        recorded = {k: v for k, v in reply.items() if k != "tool_call_errors"}
        if tool_calls:  # what the client will send back
            recorded["tool_calls"] = [{**c, "function": {**c["function"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
                                      for c in tool_calls]
        session.record(Exchange(messages, tools, recorded, prompt, tokens, logprobs, seq.stop_reason, extends,
                                response_id, conversation))

        message: dict[str, Any] = {"role": "assistant",
                                   "content": reply.get("content") or ("" if not tool_calls else None)}
        if reply.get("reasoning_content"):
            message["reasoning_content"] = reply["reasoning_content"]
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else ("length" if seq.stop_reason == "length" else "stop")
        pieces = [self.renderer.decode([t]) for t in tokens]
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [{
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")),
                                          "top_logprobs": []} for p, lp in zip(pieces, logprobs)]},
                "token_ids": tokens,
            }],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
            "prompt_token_ids": prompt,
        }
