"""Uploading every training episode to OpenReward as a rollout (``openreward_run_name`` set).

Each episode of a step becomes ``client.rollout.create(run_name, environment=..., split=...)`` with
its messages logged in order through the SDK's own event types: system / user / assistant messages,
reasoning, tool calls and tool results. Each assistant turn's step reward rides on the last event of
that turn (its tool results, or the assistant message), ``is_finished`` on the episode's last event
when the environment ended it. The run's info (model, LoRA rank, loss and advantage estimator,
batch size, learning rate) is the client's ``RunInfo``; each rollout's metadata carries the
episode's reward, success, advantages, error, metrics and the step's loss.

OpenReward environments upload under their ``Org/EnvName`` and variant; any other environment under
its polyrl name. The SDK batches uploads in a background thread (``OPENREWARD_API_URL`` points it
at another platform API); rollouts are created in a small thread pool, so training never waits on
the network, and :meth:`OpenRewardUploader.close` flushes everything at the end of the run.
Everything uploaded is passed through :func:`polyrl.secrets.redact` first.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from polyrl.renderers.base import message_text
from polyrl.secrets import redact, redact_text

logger = logging.getLogger(__name__)


def episode_events(ep: Any) -> list[tuple[Any, float | None, bool]]:
    """``(SDK event, reward, is_finished)`` for each logged item of an episode's messages."""
    from openreward import AssistantMessage, ReasoningItem, SystemMessage, ToolCall, ToolResult, UserMessage

    events: list[list[Any]] = []  # [event, turn]
    turn = -1
    for m in ep.messages:
        role = m.get("role")
        text = redact_text(message_text(m))
        if role == "system":
            events.append([SystemMessage(text), turn])
        elif role == "user":
            events.append([UserMessage(text), turn])
        elif role == "assistant":
            turn += 1
            if m.get("reasoning_content"):
                events.append([ReasoningItem(content=redact_text(m["reasoning_content"])), turn])
            calls = m.get("tool_calls") or []
            if text or not calls:
                events.append([AssistantMessage(text), turn])
            for call in calls:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                events.append([ToolCall(name=fn.get("name", ""), content=redact_text(args),
                                        call_id=str(call.get("id", ""))), turn])
        elif role == "tool":
            events.append([ToolResult(content=text,
                                      call_id=str(m.get("tool_call_id") or m.get("name") or "")), turn])
    last_of_turn = {t: i for i, (_, t) in enumerate(events) if t >= 0}
    out: list[tuple[Any, float | None, bool]] = []
    final = len(ep.step_rewards) - 1
    for i, (event, t) in enumerate(events):
        if t >= 0 and last_of_turn[t] == i and t < len(ep.step_rewards):
            out.append((event, float(ep.step_rewards[t]), bool(t == final and ep.done_by_env)))
        else:
            out.append((event, None, False))
    return out


class OpenRewardUploader:
    """Uploads a run's episodes; ``upload_step`` after each step's trajectories, ``close`` at the end."""

    def __init__(self, config: Any, runtimes: dict[str, Any], start_step: int = 0, client: Any = None):
        from openreward import OpenReward, RunInfo

        import polyrl

        self.config = config
        self.run_name = config.openreward_run_name
        run_info = RunInfo(
            model_name=config.model_name, run_type="train", training_stage="rl", initial_step=start_step,
            checkpoint=config.resume_from, peft_type="lora", peft_rank=config.lora_rank,
            rl_algorithm=f"{config.advantages.estimator}/{config.loss_fn}", batch_size=config.batch_size,
            lr=config.learning_rate, optimizer="adam", framework="polyrl",
            framework_version=getattr(polyrl, "__version__", None),
        )
        self.client = client or OpenReward(run_info=run_info)
        if client is not None:
            self.client.run_info = run_info
        # The SDK creates its background sender lazily and without a lock: create it here, once, so the
        # upload threads below cannot race into two senders (one of them never flushed by close()).
        self.rollouts = self.client.rollout
        self.targets = {}
        for name, rt in runtimes.items():
            builder = rt.builder
            self.targets[name] = (getattr(builder, "openreward_environment", None) or name,
                                  getattr(builder, "openreward_variant", None))
        self.settings = {name: rt.settings for name, rt in runtimes.items()}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openreward-upload")
        self._futures: list[Future] = []
        self.uploaded = 0
        self.failed = 0

    def upload_step(self, step: int, episodes: list[Any], metrics: dict[str, float],
                    dropped: set[int] | None = None) -> None:
        """Queue every episode of ``step`` (``dropped``: ids of episodes left out of the update)."""
        step_info = {"step": step, "loss": metrics.get("optim/loss"), "loss_fn": self.config.loss_fn}
        for ep in episodes:
            info = dict(step_info, dropped=dropped is not None and id(ep) in dropped)
            self._futures.append(self._pool.submit(self._upload, ep, info))
        self._futures = [f for f in self._futures if not f.done()]

    def _upload(self, ep: Any, info: dict) -> None:
        from openreward import RolloutInfo

        try:
            environment, variant = self.targets.get(ep.env_name, (ep.env_name, None))
            settings = self.settings.get(ep.env_name)
            metadata = redact({
                **info, "env": ep.env_name, "task_index": ep.task_index, "group": ep.group_id,
                "role": ep.role, "reward": ep.reward, "success": ep.success, "step_rewards": ep.step_rewards,
                "advantages": ep.turn_advantages, "num_turns": ep.num_turns, "done_by_env": ep.done_by_env,
                "error": ep.error, "metrics": ep.metrics,
            })
            rollout = self.rollouts.create(
                self.run_name,
                rollout_name=f"step{info['step']}-{ep.env_name}-t{ep.task_index}-g{ep.group_id}",
                environment=environment, variant=variant, split=ep.split, metadata=metadata)
            rollout_info = RolloutInfo(
                task_index=ep.task_index, current_step=info["step"], duration_ms=int(ep.duration_s * 1000),
                temperature=settings.temperature if settings else None,
                max_tokens=settings.max_tokens if settings else None, harness="polyrl")
            for i, (event, reward, finished) in enumerate(episode_events(ep)):
                rollout.log(event, reward=reward, is_finished=finished,
                            rollout_info=rollout_info if i == 0 else None)
            self.uploaded += 1
        except Exception as exc:  # noqa: BLE001 - uploads never stop training
            self.failed += 1
            if self.failed == 1 or self.failed % 100 == 0:
                logger.warning("OpenReward upload failed (%d so far): %s", self.failed, redact_text(str(exc)))

    def close(self) -> None:
        """Wait for queued uploads and flush the SDK's background sender."""
        self._pool.shutdown(wait=True)
        try:
            self.rollouts.close()
        finally:
            close = getattr(self.client, "close", None)
            if callable(close):
                close()
