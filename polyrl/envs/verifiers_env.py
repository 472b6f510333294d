"""``verifiers:<module>``: environments written with the verifiers library (classic API).

verifiers drives its own rollouts: it formats the prompt, calls the model over an OpenAI-compatible
chat endpoint, runs its environment turns and scores the result with its rubric. polyrl therefore
serves the policy being trained on 127.0.0.1 (:mod:`polyrl.openai_server`), one session per rollout
bound to the current sampling client, and runs ``env.run_rollout`` against it.

The endpoint returns the exact prompt and sampled token ids and the sampler logprobs (vLLM's extra
fields), which verifiers' chat client passes through into the rollout's trajectory. Those become the
episode's tokens, token-exact, when each turn's prompt extends the previous prompt and reply (the
endpoint builds multi-turn prompts that way). Otherwise (a client that drops the token fields, or a
rewritten history) the conversation is re-tokenized with the renderer and its logprobs recomputed with
the sampling client; such episodes log a warning and carry the metric ``retokenized`` = 1.

``<module>`` is a module name (``pkg.my_env``) or a ``.py`` file path; its
``load_environment(**args)`` returns the environment, as ``vf.load_environment`` expects. The
environment's ``dataset`` is the train split, its ``eval_dataset`` (else ``dataset``) the test split.
Not supported, refused before the run starts: verifiers >= 0.4 without the classic API, rubrics
with group reward functions, completion-format (non-chat) environments.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from polyrl.envs.base import EnvBuilder, register_env
from polyrl.envs.module_env import check_load_environment, import_target
from polyrl.openai_server import OpenAIServer, incoming_message
from polyrl.rl.episode import Episode, RolloutContext, SamplerError, finalize_reward

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'polyrl[verifiers]'"


def _vf():
    """The classic verifiers API (``verifiers.legacy`` in 0.3.x, the package root before)."""
    try:
        import verifiers  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"verifiers environments need the verifiers package ({INSTALL_HINT})") from exc
    try:
        vf = importlib.import_module("verifiers.legacy")
    except ImportError:
        vf = importlib.import_module("verifiers")
    try:
        env_cls = vf.Environment
    except Exception:  # noqa: BLE001 - 0.4's root forwards to a legacy package it does not ship
        env_cls = None
    if env_cls is None or not hasattr(env_cls, "run_rollout"):
        version = getattr(importlib.import_module("verifiers"), "__version__", "?")
        raise ValueError(f"verifiers {version} has no classic Environment.run_rollout API; polyrl's adapter "
                         f"needs verifiers 0.3.x (pip install 'verifiers<0.4')")
    return vf


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _tool_spec(tool: Any) -> dict:
    return {"type": "function",
            "function": {"name": _get(tool, "name"), "description": _get(tool, "description") or "",
                         "parameters": _get(tool, "parameters") or {"type": "object", "properties": {}}}}


@register_env("verifiers:")
class VerifiersBuilder(EnvBuilder):
    """Runs a verifiers environment's own rollouts against polyrl's OpenAI-compatible endpoint."""

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        target = type_name.partition(":")[2].strip()
        if not target:
            raise ValueError("verifiers environments are named 'verifiers:<module or file.py>'")
        _vf()
        check_load_environment(target, args, what="verifiers environment")

    def __init__(self, args: dict[str, Any], seed: int = 0, type_name: str = ""):
        super().__init__(args, seed, type_name)
        self.validate_args(type_name, self.args)
        vf = _vf()
        self.target = type_name.partition(":")[2].strip()
        self.env = import_target(self.target, what="verifiers environment").load_environment(**self.args)
        if not isinstance(self.env, vf.Environment):
            raise ValueError(f"{self.target}.load_environment() returned {type(self.env).__name__}, "
                             f"not a verifiers Environment")
        if getattr(self.env, "message_type", "chat") != "chat":
            raise ValueError(f"{self.target}: only chat environments are supported, not "
                             f"message_type={self.env.message_type!r}")
        if getattr(self.env, "requires_group_rollouts", False):
            raise ValueError(f"{self.target}: rubrics with group reward functions are not supported "
                             f"(polyrl runs and scores each rollout on its own)")
        self._datasets: dict[str, Any] = {}
        self.server = None
        self.retokenized = 0

    # -- tasks -----------------------------------------------------------------------------------------

    def dataset(self, split: str):
        if split not in self._datasets:
            has_eval = (self.env.eval_dataset is not None
                        or getattr(self.env, "eval_dataset_source", None) is not None)
            self._datasets[split] = (self.env.get_eval_dataset() if split == "test" and has_eval
                                     else self.env.get_dataset())
        return self._datasets[split]

    def num_tasks(self, split: str) -> int | None:
        return len(self.dataset(split))

    def make(self, split: str, index: int):
        raise NotImplementedError("verifiers environments run their own rollouts (EnvBuilder.rollout)")

    # -- rollouts ----------------------------------------------------------------------------------------

    def _ensure_server(self, renderer):
        if self.server is None or self.server.renderer is not renderer or not self.server.running:
            if self.server is not None:
                self.server.stop()
            self.server = OpenAIServer(renderer)
            self.server.start()
        return self.server

    async def rollout(self, ctx: RolloutContext) -> list[Episode]:
        from openai import AsyncOpenAI

        vf = _vf()

        server = self._ensure_server(ctx.renderer)
        server.set_sampler(ctx.sampler)
        session = server.open_session(ctx.sampler, ctx.settings.max_tokens, ctx.settings.temperature,
                                      ctx.seed)
        row = dict(self.dataset(ctx.split)[ctx.task_index])
        sampling_args = {k: v for k, v in (self.env.sampling_args or {}).items() if k not in ("n",)}
        sampling_args.update(temperature=ctx.settings.temperature, max_tokens=ctx.settings.max_tokens)
        native = AsyncOpenAI(base_url=session.base_url, api_key="polyrl-local", max_retries=0,
                             timeout=ctx.settings.timeout)
        client = vf.OpenAIChatCompletionsClient(native)
        try:
            output = await self.env.run_rollout(row, client, "polyrl", sampling_args,
                                                state_columns=["trajectory"])
        finally:
            server.close_session(session)
            await native.close()
        return [await self._episode(ctx, output, session)]

    async def _episode(self, ctx: RolloutContext, output: dict, session) -> Episode:
        ep = ctx.episode()
        error = output.get("error")
        empty_reply = bool(error) and "EmptyModelResponseError" in str(error.get("error_chain_str", error))
        if error and not empty_reply:
            raise RuntimeError("verifiers rollout failed: "
                               f"{error.get('error_chain_repr') or error.get('message')}")
        prompt = [incoming_message(m) for m in output.get("prompt") or []]
        completion = [incoming_message(m) for m in output.get("completion") or []]
        tools = [_tool_spec(t) for t in output.get("tool_defs") or []]
        ep.messages, ep.tools = prompt + completion, tools

        turns = []  # (prompt ids, completion ids, logprobs, stop reason) per sampled turn
        for step in output.get("trajectory") or []:
            tokens = _get(step, "tokens")
            if tokens is None:
                turns = None
                break
            finish = _get(_get(_get(step, "response"), "message"), "finish_reason")
            turns.append((list(_get(tokens, "prompt_ids")), list(_get(tokens, "completion_ids")),
                          [float(x) for x in _get(tokens, "completion_logprobs")],
                          "length" if finish == "length" or _get(step, "is_truncated") else "stop"))
        if empty_reply and turns is not None and session.exchanges:
            # The empty reply never reached the trajectory; its exchange is the session's last one.
            seen = {_get(_get(s, "response"), "id") for s in output.get("trajectory") or []}
            last = session.exchanges[-1]
            if last.response_id not in seen:
                turns.append((last.prompt_tokens, last.completion_tokens, last.logprobs, last.stop_reason))
                ep.messages.append({"role": "assistant", "content": ""})
            ep.metrics["empty_reply"] = 1.0

        exact = turns is not None and bool(turns) and self._append_exact(ep, turns)
        if not exact:
            await self._append_retokenized(ep, ctx)
        ep.metrics["retokenized"] = 0.0 if exact else 1.0
        for key, value in (output.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                ep.metrics[key] = float(value)
        reward = output.get("reward")
        reward = float(reward) if isinstance(reward, (int, float)) else 0.0
        ep.step_rewards = [0.0] * max(0, ep.num_turns - 1) + [reward]
        ep.done_by_env = not output.get("is_truncated", False)
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
            logger.warning("%s: rollout tokens were not passed through (or the history was rewritten); "
                           "re-tokenizing the conversation (%d episodes so far, metric 'retokenized')",
                           self.target, self.retokenized)
        tokens, weights = ctx.renderer.supervised(ep.messages, ep.tools or None)
        if not any(weights):
            raise RuntimeError("the verifiers rollout has no assistant turn to train on")
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
        if self.server is not None:
            self.server.stop()
            self.server = None
