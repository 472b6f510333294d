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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tinker import types

from polyrl.backend import make_service_client
from polyrl.config import EnvConfig, LrSchedule, _Problems, local_model_problems, scheduled_lr
from polyrl.renderers import resolve_renderer
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles, atomic_write_text


class SFTConfig(BaseModel):
    """Supervised fine-tuning on demonstrations (``polyrl sft``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    backend: Literal["local", "tinker"] = Field("local", description="Training service: in-process engine or Tinker.")
    base_url: str | None = Field(None, description="Tinker-compatible server URL (backend tinker).")
    model_name: str = Field(..., description="Base model: hub id or local directory.")
    lora_rank: int = Field(32, gt=0, description="LoRA rank.")
    renderer: str | None = Field(None, description="Chat format; inferred from the model when null.")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    lr_schedule: LrSchedule = Field("linear", description="Learning-rate schedule over max_steps.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per optimizer step.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    seed: int = Field(0, description="Seed of the LoRA init and the data order.")
    log_path: str = Field("runs/sft", description="Directory for metrics.jsonl and sft.json.")
    save_name: str = Field("sft", description="Checkpoint name; the state path is printed and written to sft.json.")
    device: str = Field("auto", description="Local engine device.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Local engine dtype.")
    store_dir: str | None = Field(None, description="Local engine checkpoint store.")
    micro_batch_tokens: int = Field(4096, ge=1, description="Local engine: tokens per forward/backward pass.")
    gradient_checkpointing: Literal["auto", True, False] = Field(
        "auto", description="Local engine: recompute activations in backward (auto: on from 300M parameters).")
    environments: dict[str, EnvConfig] = Field(
        ..., description="Environments whose demonstrations to learn; splits.train.num_samples = demonstrations each."
    )

    @model_validator(mode="after")
    def _check_model(self) -> SFTConfig:
        if problems := local_model_problems(self.backend, self.model_name):
            raise _Problems(problems)
        return self


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
            tokens, weights = renderer.supervised(messages, tools or None)
            datums.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                                "weights": types.TensorData(data=weights[1:], dtype="float32")},
            ))
    return datums


async def sft_async(config: SFTConfig, console: ConsoleLog | None = None) -> str:
    """Train and return the saved state path (``tinker://.../weights/<save_name>``)."""
    console = console or ConsoleLog()
    files = RunFiles(config.log_path)
    files.write_config(config.model_dump())
    service = make_service_client(config)
    training = await service.create_lora_training_client(base_model=config.model_name, rank=config.lora_rank,
                                                          seed=config.seed)
    tokenizer = training.get_tokenizer()
    renderer = resolve_renderer(config.renderer, config.model_name, tokenizer)
    datums = demonstration_datums(config, renderer)
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
    atomic_write_text(files.root / "sft.json", json.dumps({"state_path": state.path, "sampler_path": sampler.path}))
    console.info(f"sft checkpoint: {state.path}")
    return state.path


def sft(config: SFTConfig, console: ConsoleLog | None = None) -> str:
    return asyncio.run(sft_async(config, console))
