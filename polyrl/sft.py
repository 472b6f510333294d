"""``polyrl sft``: supervised warm start on environment demonstrations with ``cross_entropy``.

Each environment's builder renders expert conversations (``EnvBuilder.demonstration``); the renderer
turns them into tokens with weight 1 on what the assistant says, built the same way rollouts build
prompts, so what is learned here is exactly what sampling will see.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from pydantic import Field
from tinker import types

from polyrl.backend import ending_session, service_url
from polyrl.config import EnvConfig, LrSchedule, PolicyConfig, scheduled_lr
from polyrl.images import next_token_inputs
from polyrl.policy import OpenPolicy, open_policy
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
    environments: dict[str, EnvConfig] = Field(
        ..., description="Environments whose demonstrations to learn; splits.train.num_samples = "
        "demonstrations each."
    )


def demonstration_datums(config: SFTConfig, renderer) -> list[types.Datum]:
    from polyrl.rollouts import EnvRuntime

    datums = []
    for name, env_cfg in config.environments.items():
        rt = EnvRuntime.create(name, env_cfg, config.seed, max_tokens=1)
        n = rt.num_tasks("train")
        if n is None:
            raise ValueError(f"environments.{name}.splits.train.num_samples must be set for sft")
        for i in range(n):
            demo = rt.builder.demonstration("train", rt.task_index("train", i))
            if demo is None:
                raise ValueError(f"environment {name!r} has no demonstrations")
            messages, tools = demo
            rendered, weights = renderer.render_supervised(messages, tools or None)
            model_input, targets = next_token_inputs(rendered.tokens, rendered.images)
            datums.append(types.Datum(
                model_input=model_input,
                loss_fn_inputs={"target_tokens": types.TensorData(data=targets, dtype="int64"),
                                "weights": types.TensorData(data=weights[1:], dtype="float32")},
            ))
    return datums


async def sft_async(config: SFTConfig, console: ConsoleLog | None = None) -> str:
    """Train and return the saved state path (``tinker://.../weights/<save_name>``)."""
    console = console or ConsoleLog()
    files = RunFiles(config.log_path)
    files.write_config(config.model_dump())
    policy = await open_policy(config, lambda service: service.create_lora_training_client(
        base_model=config.model_name, rank=config.lora_rank, seed=config.seed))
    async with ending_session(policy.service, service_url(config)):
        return await _train(config, policy, files, console)


async def _train(config: SFTConfig, policy: OpenPolicy, files: RunFiles, console: ConsoleLog) -> str:
    """The SFT steps on ``policy``'s training client, then its state and sampler checkpoints."""
    training = policy.client
    datums = demonstration_datums(config, policy.renderer)
    rng = random.Random(config.seed)
    order: list[int] = []
    log_every = max(1, config.max_steps // 10)  # plain lines when stderr is not a terminal
    with console.progress("sft", config.max_steps, loss="-") as progress:
        for step in range(config.max_steps):
            t0 = time.monotonic()
            batch = []
            while len(batch) < config.batch_size:
                if not order:
                    order = list(range(len(datums)))
                    rng.shuffle(order)
                batch.append(datums[order.pop()])
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
                      json.dumps({"state_path": state.path, "sampler_path": sampler.path}))
    console.info(f"sft checkpoint: {state.path}")
    return state.path


def sft(config: SFTConfig, console: ConsoleLog | None = None) -> str:
    return asyncio.run(sft_async(config, console))
