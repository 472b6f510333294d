"""``polyrl sft``: supervised warm start with ``cross_entropy`` on conversations to imitate.

They come from JSONL files (``data``, ``--data``: OpenAI-format conversations, see
:mod:`polyrl.sft_data`) and/or from environments' demonstrations (``EnvBuilder.demonstration``); both
together are mixed. The renderer turns each into tokens with weight 1 on what the assistant says, built
the same way rollouts build prompts, so what is learned here is exactly what sampling will see. The
checkpoint it saves is where ``polyrl train`` starts from (``resume_from``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from pydantic import Field, field_validator, model_validator
from tinker import types

from polyrl.backend import ending_session, service_url
from polyrl.config.schema import EnvConfig, LrSchedule, PolicyConfig, scheduled_lr
from polyrl.errors import UserInputError
from polyrl.images import next_token_inputs
from polyrl.rl.policy import OpenPolicy, open_policy
from polyrl.sft_data import Conversation, read_conversations
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles, atomic_write_text


class SFTConfig(PolicyConfig):
    """Supervised fine-tuning on demonstrations (``polyrl sft``); the policy's fields are train's."""

    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    lr_schedule: LrSchedule = Field("linear", description="Learning-rate schedule over max_steps.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per optimizer step.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    seed: int = Field(0, description="Seed of the LoRA init and the data order.")
    log_path: str = Field("runs/sft", description="Directory for metrics.jsonl and sft.json.")
    save_name: str = Field("sft", description="Checkpoint name; the state path is printed and written to "
                                              "sft.json.")
    data: list[str] = Field(
        default_factory=list, description="JSONL files of conversations to learn, one per line: "
        '{"messages": [...], "tools": [...]} (OpenAI chat format) or {"prompt": ..., "completion": ...}; '
        "the loss is on assistant messages (except those with \"weight\": 0). polyrl sft --data sets it.",
    )
    environments: dict[str, EnvConfig] = Field(
        default_factory=dict, description="Environments whose demonstrations to learn; "
        "splits.train.num_samples = demonstrations each."
    )

    @field_validator("data", mode="before")
    @classmethod
    def _one_file(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _something_to_learn(self):
        if not self.data and not self.environments:
            raise ValueError("nothing to learn: give data (JSONL conversations, --data FILE.jsonl) and/or "
                             "environments with demonstrations")
        return self


def demonstration_datums(config: SFTConfig, renderer, context: int | None = None,
                         sources: list[dict] | None = None) -> list[types.Datum]:
    """Each environment's demonstrations as Datums; ``sources`` gets ``{environment, demonstrations}``
    for each."""
    from polyrl.rl.rollouts import EnvRuntime

    datums = []
    for name, env_cfg in config.environments.items():
        rt = EnvRuntime.create(name, env_cfg, config.seed, max_tokens=1)
        n = rt.num_tasks("train")
        if n is None:
            raise UserInputError(f"environments.{name}.splits.train.num_samples must be set for sft "
                                 "(how many demonstrations to learn)")
        for i in range(n):
            demo = rt.builder.demonstration("train", rt.task_index("train", i))
            if demo is None:
                raise UserInputError(
                    f"environment {name!r} has no demonstrations to learn: give conversations to imitate "
                    "with polyrl sft --data FILE.jsonl (and leave the environment out), or make the "
                    "environment give demonstrations (a dataset row's completion, or a demonstration() "
                    "method)")
            messages, tools = demo
            where = f"environment {name!r}, demonstration {i}"
            datums.append(supervised_datum(renderer, messages, tools, context, where))
        if sources is not None:
            sources.append({"environment": name, "demonstrations": n})
    return datums


def supervised_datum(renderer, messages, tools, context: int | None, where: str,
                     assistant_weights: tuple[float, ...] = ()) -> types.Datum:
    """One conversation as a cross-entropy Datum, weight 1 on the assistant's tokens (those of an
    assistant message whose ``assistant_weights`` entry is 0 excepted); a :class:`UserInputError` naming
    ``where`` if it does not fit the model's ``context``."""
    rendered, weights = renderer.render_supervised(messages, tools or None)
    if 0 in assistant_weights:
        weights = weigh_turns(weights, assistant_weights, where)
    if context is not None and len(rendered.tokens) > context:
        raise UserInputError(f"{where}: the conversation is {len(rendered.tokens)} tokens, longer than the "
                             f"model's context of {context}; shorten or drop it")
    model_input, targets = next_token_inputs(rendered.tokens, rendered.images)
    return types.Datum(
        model_input=model_input,
        loss_fn_inputs={"target_tokens": types.TensorData(data=targets, dtype="int64"),
                        "weights": types.TensorData(data=weights[1:], dtype="float32")},
    )


def weigh_turns(weights_T: list[float], assistant_weights: tuple[float, ...], where: str) -> list[float]:
    """``weights_T`` with the k-th run of learned tokens (the k-th assistant message) scaled by
    ``assistant_weights[k]``; an error where the runs are not one per assistant message."""
    starts = {t for t, w in enumerate(weights_T) if w and (t == 0 or not weights_T[t - 1])}
    if len(starts) != len(assistant_weights):
        raise UserInputError(f"{where}: this chat format does not keep the assistant messages apart, so a "
                             "message's weight 0 cannot apply; drop the weight keys or those messages")
    out, k = list(weights_T), -1
    for t, w in enumerate(weights_T):
        if t in starts:
            k += 1
        if w:
            out[t] = w * assistant_weights[k]
    return out


def data_datums(conversations: list[Conversation], renderer, context: int | None) -> list[types.Datum]:
    return [supervised_datum(renderer, c.messages, c.tools, context, c.where, c.assistant_weights)
            for c in conversations]


async def context_length(service, model_name: str) -> int | None:
    """The model's context length as its service reports it; None where it does not say."""
    try:
        capabilities = await service.get_server_capabilities_async()
    except Exception:  # noqa: BLE001 - a service without the call: the engine's own check is the last word
        return None
    lengths = {m.model_name: m.max_context_length for m in capabilities.supported_models}
    return lengths.get(model_name)


async def sft_async(config: SFTConfig, console: ConsoleLog | None = None) -> str:
    """Train and return the saved state path (``tinker://.../weights/<save_name>``)."""
    console = console or ConsoleLog()
    conversations = read_conversations(config.data)  # a bad line is said before the model loads
    files = RunFiles(config.log_path)
    files.write_config(config.model_dump())
    policy = await open_policy(config, lambda service: service.create_lora_training_client(
        base_model=config.model_name, rank=config.lora_rank, seed=config.seed))
    async with ending_session(policy.service, service_url(config)):
        return await _train(config, policy, conversations, files, console)


async def _train(config: SFTConfig, policy: OpenPolicy, conversations: list[Conversation], files: RunFiles,
                 console: ConsoleLog) -> str:
    """The SFT steps on ``policy``'s training client, then its state and sampler checkpoints."""
    training = policy.client
    context = await context_length(policy.service, config.model_name)
    datums_D = data_datums(conversations, policy.renderer, context)
    sources = [{"data": path, "conversations": sum(c.where.rsplit(":", 1)[0] == path for c in conversations)}
               for path in dict.fromkeys(config.data)]  # what the report lists as learned from
    datums_D += demonstration_datums(config, policy.renderer, context, sources)  # both given: mixed
    rng = random.Random(config.seed)
    order: list[int] = []
    log_every = max(1, config.max_steps // 10)  # plain lines when stderr is not a terminal
    with console.progress("sft", config.max_steps, loss="-") as progress:
        for step in range(config.max_steps):
            t0 = time.monotonic()
            batch: list[types.Datum] = []
            while len(batch) < config.batch_size:
                if not order:
                    order = list(range(len(datums_D)))
                    rng.shuffle(order)
                batch.append(datums_D[order.pop()])
            lr = scheduled_lr(config.learning_rate, config.lr_schedule, step, config.max_steps)
            fwd = training.forward_backward(batch, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=lr))
            result, _ = await fwd, await opt
            n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
            row = {"step": step, "optim/loss": result.metrics["loss:sum"] / max(n_tokens, 1.0),
                   "optim/lr": lr, "time/total": time.monotonic() - t0}
            files.log_metrics(row)
            progress.update(progress.task_ids[0], advance=1, loss=f"{row['optim/loss']:.4f}")
            if not console.is_terminal and (step % log_every == 0 or step + 1 == config.max_steps):
                console.info(f"sft step {step}: loss/token {row['optim/loss']:.4f}")
    state = await training.save_state(config.save_name)
    sampler = await training.save_weights_for_sampler(config.save_name)
    atomic_write_text(files.root / "sft.json",
                      json.dumps({"state_path": state.path, "sampler_path": sampler.path,
                                  "steps": config.max_steps, "sources": sources}))
    console.info(f"sft checkpoint: {state.path}")
    return state.path


def sft(config: SFTConfig, console: ConsoleLog | None = None) -> str:
    return asyncio.run(sft_async(config, console))
