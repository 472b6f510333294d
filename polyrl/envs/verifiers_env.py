"""``verifiers:<taskset>``: environments written with the verifiers library, version 0.4.

verifiers 0.4 environments are tasksets (``verifiers.v1``): a package exporting a ``Taskset`` that
yields tasks, each scoring its trace with ``@reward`` methods and plugged judges (an LLM judge over a
rubric: ``judges: [{id: rubric, ...}]``), with tools served over MCP by the taskset's or task's
``Toolset``. An agent (a harness program in a runtime) plays each task; verifiers runs the episode and
scores it. polyrl serves the policy being trained on 127.0.0.1 (:mod:`polyrl.openai_server`), one
session per rollout bound to the current sampling client, and runs ``env.run_episode`` against it.

``<taskset>`` is a taskset id as verifiers resolves it: an installed package (``my-env``, imported as
``my_env``; a hub id ``owner/name@version`` names the package ``name``) or a dotted module, found
among the installed modules and under the working directory. ``args`` is verifiers' environment
config (the ``[env]`` table of its TOML: ``taskset``, ``agent``, an env ``id`` such as ``best-of-n``,
``timeout``, ...) without ``taskset.id``; ``test_taskset`` (polyrl's) is merged over ``taskset`` for
the ``test`` split (without it the test split is the train tasks). Each agent seat defaults to the
``subprocess`` runtime and, for a taskset that bundles no harness, to the ``polyrl-chat`` harness
(:mod:`polyrl.envs.verifiers_chat`: verifiers' chat loop with MCP tools, run by polyrl's own Python);
the entry's ``max_turns`` becomes each seat's ``max_turns``. Set any of them in ``args`` to override.

Tokens: every request to the endpoint is recorded with its exact prompt and sampled tokens and the
sampler logprobs, under the trace it belongs to (verifiers names the trace in a header). They become
the episode's tokens, token-exact, when each turn's prompt extends the previous prompt and reply (the
endpoint builds multi-turn prompts that way). Otherwise (a history the harness rewrote) the
conversation is re-tokenized with the renderer and its logprobs recomputed with the sampling client;
such episodes log a warning and carry the metric ``retokenized`` = 1. A verifiers episode gives one
polyrl episode per trainable agent run: one for a single-agent taskset; for a multi-agent env (an env
``id`` such as ``best-of-n``, or one the taskset exports) each with its agent's name as the role.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import importlib.util
import logging
import sys
from typing import Any

from polyrl.envs.base import EnvBuilder, register_env
from polyrl.envs.module_env import load_module
from polyrl.openai_server import OpenAIServer, incoming_message
from polyrl.rl.episode import Episode, RolloutContext, SamplerError, finalize_reward

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'polyrl[verifiers]'"
SUPPORTED = ((0, 4), (0, 5))  # [lowest, first unsupported)
TEST_TASKSET = "test_taskset"
NO_KEY_VAR = "POLYRL_LOCAL_ENDPOINT_KEY"  # an unset variable: the local endpoint needs no key
HARNESS_ID = "polyrl-chat"  # polyrl's harness (polyrl/envs/verifiers_chat.py)
MODULE_ALIAS = "polyrl_chat"  # the module name verifiers imports for HARNESS_ID


def _vf():
    """``verifiers.v1`` of a supported verifiers release, else a one-line ``ValueError``."""
    try:
        import verifiers
    except ImportError as exc:
        raise ValueError(f"verifiers environments need the verifiers package ({INSTALL_HINT})") from exc
    version = getattr(verifiers, "__version__", "0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= parts < SUPPORTED[1]:
        raise ValueError(f"verifiers {version} is installed; polyrl runs verifiers 0.4 environments "
                         f"(pip install 'verifiers>=0.4,<0.5')")
    import verifiers.v1 as vf

    # verifiers imports a harness id as a top-level module: make polyrl's harness answer to its id (loaded
    # here, as a plug-in, since it subclasses verifiers' Harness at its top)
    sys.modules.setdefault(MODULE_ALIAS, importlib.import_module("polyrl.envs.verifiers_chat"))
    return vf


def _one_line(exc: BaseException) -> str:
    """A pydantic ValidationError (or any exception) as one line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                             for e in errors())
        except Exception:  # noqa: BLE001 - not a pydantic error after all
            pass
    return " ".join(str(exc).split())


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if nested else value
    return out


def _module_name(target: str) -> str:
    """The module verifiers imports for a taskset id (hub ``owner/name@version`` -> ``name``)."""
    return target.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _import_taskset(vf, target: str) -> None:
    """Import the taskset's module the way polyrl imports ``module:`` targets (installed, or under the
    working directory), so a missing or broken one is a one-line error, and check it is a taskset."""
    if target.endswith(".py") or target.startswith((".", "/", "~")):
        raise ValueError(f"verifiers:{target}: verifiers 0.4 loads a taskset by name, not by path; install "
                         f"its package (pip install -e <dir>) and write verifiers:<name>")
    name = _module_name(target)
    if "." in name:
        raise ValueError(f"verifiers:{target}: verifiers 0.4 names a taskset by its package (a top-level "
                         f"module such as my_env, installed or in the working directory), not a dotted path")
    builtin = f"verifiers.v1.tasksets.{name}"
    module = (importlib.import_module(builtin) if importlib.util.find_spec(builtin) is not None
              else load_module(name, what="verifiers taskset"))
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())]
    if not any(isinstance(obj, type) and issubclass(obj, vf.Taskset) for obj in exported):
        legacy = " (a load_environment module of verifiers < 0.4, which polyrl no longer runs)" \
            if hasattr(module, "load_environment") else ""
        raise ValueError(f"verifiers:{target}: module {module.__name__!r} exports no verifiers.v1 Taskset "
                         f"through __all__{legacy}")


def env_config(target: str, args: dict[str, Any], max_turns: int | None = None):
    """verifiers' environment config for ``verifiers:<target>`` with ``args`` (see the module docstring),
    each agent seat given polyrl's defaults (and ``max_turns``, when given). A one-line ``ValueError``
    for anything wrong."""
    vf = _vf()
    _import_taskset(vf, target)
    raw = copy.deepcopy({k: v for k, v in args.items() if k != TEST_TASKSET})
    taskset = raw.get("taskset") or {}
    if not isinstance(taskset, dict) or "id" in taskset:
        raise ValueError(f"verifiers:{target}: args.taskset must be a mapping of the taskset's config, "
                         f"without an id (the taskset is the one named in the type)")
    raw["taskset"] = {**taskset, "id": target}
    try:
        cls = vf.env_config_type(target, str(raw.get("id") or ""))
        bundled = vf.default_harness_id(target) != "bash"
        for name, field in cls.model_fields.items():
            author = field.default
            if not isinstance(author, vf.AgentConfig):
                continue
            seat = raw.get(name)
            if seat is None:
                seat = {}
            if not isinstance(seat, dict):
                raise ValueError(f"args.{name} must be a mapping (the {name!r} agent's config)")
            pinned = author.model_fields_set
            if "runtime" not in seat and "runtime" not in pinned:
                seat["runtime"] = {"type": "subprocess"}
            if "harness" not in seat and author.harness is None and not bundled:
                seat["harness"] = {"id": HARNESS_ID}
            if max_turns is not None and "max_turns" not in seat and author.max_turns is None:
                seat["max_turns"] = max_turns
            raw[name] = seat
        config = vf.resolve_env_config(raw)
    except ValueError as exc:
        if type(exc) is ValueError and not hasattr(exc, "errors"):
            raise ValueError(f"verifiers:{target}: {_one_line(exc)}") from None
        raise ValueError(f"verifiers:{target} args: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a taskset or harness that fails to load or validate
        raise ValueError(f"verifiers:{target}: {type(exc).__name__}: {_one_line(exc)}") from None
    for name, seat in config:
        ours = (isinstance(seat, vf.AgentConfig) and seat.harness is not None
                and _module_name(seat.harness.id) == MODULE_ALIAS)
        if ours and seat.runtime.type != "subprocess":
            raise ValueError(f"verifiers:{target}: args.{name}: the {HARNESS_ID} harness runs in the "
                             f"subprocess runtime, not {seat.runtime.type!r}")
    return config


def _tool_spec(tool: Any) -> dict:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description or "",
                         "parameters": tool.parameters or {"type": "object", "properties": {}}}}


@register_env("verifiers:")
class VerifiersBuilder(EnvBuilder):
    """Runs a verifiers 0.4 environment's episodes against polyrl's OpenAI-compatible endpoint."""

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str = ""):
        super().__init__(args, seed, type_name)
        self.target = type_name.partition(":")[2].strip()
        if not self.target:
            raise ValueError("verifiers environments are named 'verifiers:<taskset id>' (an installed "
                             "package or module exporting a verifiers Taskset)")
        test = self.args.get(TEST_TASKSET)
        if test is not None and not isinstance(test, dict):
            raise ValueError(f"verifiers:{self.target}: args.{TEST_TASKSET} must be a mapping of the "
                             f"taskset's config")
        self.config = env_config(self.target, self.args)
        self._test_args = _merge(self.args, {"taskset": test}) if test else None
        if self._test_args is not None:
            env_config(self.target, self._test_args)  # a bad test_taskset fails at config load too
        # by split: (the tasks so far, the stream of an infinite taskset, the taskset)
        self._tasks: dict[str, tuple[list, Any, Any]] = {}
        self._env = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._env_lock: asyncio.Lock | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self.server: OpenAIServer | None = None
        self.retokenized = 0

    # -- tasks -----------------------------------------------------------------------------------------

    def _taskset(self, split: str):
        key = "test" if split == "test" and self._test_args else "train"  # test: train's tasks by default
        if key not in self._tasks:
            vf = _vf()
            config = env_config(self.target, self._test_args) if key == "test" else self.config
            taskset = vf.load_taskset(config.taskset)
            self._tasks[key] = ([], iter(taskset) if not taskset.bounded else None, taskset)
        return self._tasks[key]

    def task(self, split: str, index: int):
        tasks, stream, taskset = self._taskset(split)
        if stream is None and not tasks:
            tasks.extend(taskset)
        while stream is not None and len(tasks) <= index:
            tasks.append(next(stream))
        return tasks[index]

    def num_tasks(self, split: str) -> int | None:
        tasks, stream, taskset = self._taskset(split)
        if stream is not None:
            return None  # an infinite taskset
        if not tasks:
            tasks.extend(taskset)
        return len(tasks)

    def make(self, split: str, index: int):
        raise NotImplementedError("verifiers environments run their own rollouts (EnvBuilder.rollout)")

    # -- rollouts ----------------------------------------------------------------------------------------

    async def _ready_env(self, ctx: RolloutContext):
        """The environment, built with the entry's max_turns and serving (its shared tool servers and
        interception up) from the first rollout until :meth:`aclose`."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # (another event loop: what served the last one is gone with it)
            self._loop, self._env_lock, self._env, self._serving = loop, asyncio.Lock(), None, None
            if self.server is not None:
                self.server.stop()
                self.server = None
        assert self._env_lock is not None
        async with self._env_lock:
            if self._env is None:
                vf = _vf()
                env = vf.load_environment(env_config(self.target, self.args, ctx.settings.max_turns))
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                self._env, self._serving = env, stack
        return self._env

    def _ensure_server(self, renderer) -> OpenAIServer:
        if self.server is None or self.server.renderer is not renderer or not self.server.running:
            if self.server is not None:
                self.server.stop()
            self.server = OpenAIServer(renderer)
            self.server.start()
        return self.server

    async def rollout(self, ctx: RolloutContext) -> list[Episode]:
        vf = _vf()
        env = await self._ready_env(ctx)
        task = self.task(ctx.split, ctx.task_index)
        server = self._ensure_server(ctx.renderer)
        server.set_sampler(ctx.sampler)
        settings = ctx.settings
        session = server.open_session(ctx.sampler, settings.max_tokens, settings.temperature, ctx.seed)
        model = vf.ModelContext(
            model=server.model_name,
            client=vf.EvalClientConfig(base_url=session.base_url, api_key_var=NO_KEY_VAR),
            sampling=vf.SamplingConfig(temperature=settings.temperature, max_tokens=settings.max_tokens))
        try:
            result = await env.run_episode(task, model)
        finally:
            server.close_session(session)
        problems = [f"{e.type}: {e.message}" for e in result.errors]
        problems += [f"{e.type}: {e.message}" for t in result.traces for e in t.errors]
        if problems or not result.ok:
            detail = " ".join(problems[-1].split())[:2000] if problems else "it did not complete"
            raise RuntimeError(f"verifiers episode failed: {detail}")
        traces = [t for t in result.traces if t.agent.trainable]
        if not traces:
            raise RuntimeError("the verifiers episode has no trainable agent run")
        multi = not isinstance(env, vf.SingleAgentEnv)  # roles by agent name (the same in every rollout)
        return [await self._episode(ctx, trace, session, trace.agent.name if multi else "")
                for trace in traces]

    async def _episode(self, ctx: RolloutContext, trace, session, role: str) -> Episode:
        from verifiers.v1.dialects.chat import message_to_wire

        ep = ctx.episode(role)
        ep.messages = [incoming_message(message_to_wire(m)) for m in trace.messages]
        ep.tools = [_tool_spec(t) for t in trace.tools]
        tagged = any(ex.conversation for ex in session.exchanges)
        exchanges = [ex for ex in session.exchanges if not tagged or ex.conversation == trace.id]
        turns = [(ex.prompt_tokens, ex.completion_tokens, ex.logprobs, ex.stop_reason) for ex in exchanges]
        exact = bool(turns) and len(turns) == trace.num_turns and self._append_exact(ep, turns)
        if not exact:
            await self._append_retokenized(ep, ctx)
        ep.metrics["retokenized"] = 0.0 if exact else 1.0
        for name, reward in trace.rewards.items():
            if reward is not None:
                ep.metrics[name] = float(reward.score)
        for name, value in trace.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                ep.metrics[name] = float(value)
        reward = float(trace.reward)
        ep.step_rewards = [0.0] * max(0, ep.num_turns - 1) + [reward]
        ep.done_by_env = not (trace.is_truncated or trace.is_timeout)
        finalize_reward(ep, ctx.settings)
        return ep

    @staticmethod
    def _append_exact(ep, turns) -> bool:
        prefix: list[int] = []
        for prompt, completion, logprobs, _ in turns:
            if prompt[: len(prefix)] != prefix or len(logprobs) != len(completion):
                for part in (ep.tokens, ep.logprobs, ep.action_mask, ep.sampler_steps, ep.turn_spans,
                             ep.sequence_runs):
                    part.clear()
                return False
            ep.append(prompt[len(prefix):])
            ep.append(completion, logprobs)
            prefix = prompt + completion
        ep.stop_reasons = [t[3] for t in turns]
        return True

    async def _append_retokenized(self, ep: Episode, ctx: RolloutContext) -> None:
        from tinker import types

        self.retokenized += 1
        if self.retokenized == 1 or self.retokenized % 100 == 0:
            logger.warning("%s: the turns' tokens do not continue each other (the harness rewrote the "
                           "history); re-tokenizing the conversation (%d episodes so far, metric "
                           "'retokenized')",
                           self.target, self.retokenized)
        tokens, weights = ctx.renderer.supervised(ep.messages, ep.tools or None)
        if not any(weights):
            raise RuntimeError("the verifiers episode has no assistant turn to train on")
        try:
            logprobs = await ctx.sampler.compute_logprobs(types.ModelInput.from_ints(tokens))
        except Exception as exc:  # noqa: BLE001 - a sampler without compute_logprobs
            raise SamplerError("re-tokenized turns need the sampler's logprobs, but compute_logprobs "
                               f"failed: {type(exc).__name__}: {exc}") from None
        if any(logprobs[i] is None for i, w in enumerate(weights) if w):
            raise SamplerError("compute_logprobs returned no logprob for some sampled tokens")
        logprobs = [0.0 if x is None else float(x) for x in logprobs]  # None only before the first token
        start = 0
        while start < len(tokens):
            end = start
            while end < len(tokens) and bool(weights[end]) == bool(weights[start]):
                end += 1
            if weights[start]:
                ep.append(tokens[start:end], logprobs[start:end])
                ep.stop_reasons.append("stop")
            else:
                ep.append(tokens[start:end])
            start = end

    async def aclose(self) -> None:
        if self._serving is not None:
            stack, self._serving, self._env = self._serving, None, None
            await stack.aclose()
        if self.server is not None:
            self.server.stop()
            self.server = None
