"""``polyrl dpo``: Direct Preference Optimization on preference pairs.

The pairs come from JSONL files (``data``, ``--data``; TRL's preference format, see
:mod:`polyrl.sft_data`). Each side of a pair is rendered as ``polyrl sft`` renders a conversation, weight
1 on the answer's assistant tokens, and the loss of a pair is DPO's

    -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))

where ``log pi(x)`` sums the policy's logprobs over the answer's tokens. The reference is the policy as it
starts (the base model, or ``load_checkpoint``, such as ``polyrl sft``'s state): its logprobs are computed
once, by the same learner before the first step, so the first loss is ln 2 exactly. The loss runs through
the training client's ``forward_backward_custom``, on the local engine and on Tinker alike.

Held-out pairs (``eval_data``) are scored every ``eval_every`` steps and at the end: ``eval/accuracy`` is
the share whose implicit reward ranks chosen above rejected (a tie counts half), ``eval/margin`` the mean
of ``beta`` times the log-ratio difference, ``eval/loss`` the mean DPO loss.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

from pydantic import Field, field_validator, model_validator
from tinker import types

from polyrl.backend import ending_session, service_url
from polyrl.config.schema import LrSchedule, PolicyConfig, scheduled_lr
from polyrl.rl.policy import open_policy
from polyrl.sft import context_length, data_datums
from polyrl.sft_data import Pair, read_pairs
from polyrl.tracking.console import ConsoleLog
from polyrl.tracking.files import RunFiles, atomic_write_text

FORWARD_PAIRS = 32  # pairs per forward pass when scoring (reference and held-out)


class PairsConfig(PolicyConfig):
    """What training on preference pairs takes (``polyrl dpo``, ``polyrl reward-model``); the policy's
    fields are train's."""

    data: list[str] = Field(default_factory=list, description="JSONL files of preference pairs, one per "
                            'line: {"prompt": ..., "chosen": ..., "rejected": ...} (TRL\'s preference '
                            "format; messages or text). --data sets it.")
    eval_data: list[str] = Field(default_factory=list, description="JSONL files of held-out pairs, scored "
                                 "every eval_every steps and at the end (eval/accuracy, eval/margin, "
                                 "eval/loss). --eval-data sets it.")
    load_checkpoint: str | None = Field(
        None, description="Weights to start from, a 'tinker://.../weights/<name>' state path (polyrl sft "
        "prints one). null = the base model.")
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    lr_schedule: LrSchedule = Field("linear", description="Learning-rate schedule over max_steps.")
    batch_size: int = Field(16, ge=1, description="Pairs per optimizer step.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    eval_every: int = Field(10, ge=0, description="Score eval_data every this many steps (0: at the start "
                            "and end only).")
    seed: int = Field(0, description="Seed of the LoRA init and the data order.")
    log_path: str = Field("runs/dpo", description="Directory for metrics.jsonl and the summary (dpo.json, "
                          "reward_model.json).")
    save_name: str = Field("dpo", description="Checkpoint name; the state path is printed and written to "
                                              "the summary.")

    @field_validator("data", "eval_data", mode="before")
    @classmethod
    def _one_file(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _some_data(self):
        if not self.data:
            raise ValueError("no preference pairs to learn: give data (--data FILE.jsonl)")
        return self


class DPOConfig(PairsConfig):
    """Direct Preference Optimization on preference pairs (``polyrl dpo``); the reference is the policy as
    it starts (the base model, or load_checkpoint)."""

    beta: float = Field(0.1, gt=0, description="DPO's beta: how far the policy may move from the reference "
                        "(smaller: further).")


async def forward_sums(training, datums: list[types.Datum]) -> list[float]:
    """The summed answer logprobs of ``datums`` under the training client's current weights (no
    gradient)."""
    out: list[float] = []
    for start in range(0, len(datums), 2 * FORWARD_PAIRS):
        chunk = datums[start:start + 2 * FORWARD_PAIRS]
        result = await training.forward(chunk, "cross_entropy")
        out += [float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
                for o, d in zip(result.loss_fn_outputs, chunk)]
    return out


def preference_stats(policy: list[float], reference: list[float], beta: float) -> dict[str, float]:
    """DPO's loss, accuracy (a tie counts half) and margin, means over the pairs of ``policy`` and
    ``reference`` (summed logprobs, chosen and rejected alternating)."""
    margins = [beta * ((policy[i] - reference[i]) - (policy[i + 1] - reference[i + 1]))
               for i in range(0, len(policy), 2)]
    n = max(len(margins), 1)
    return {"loss": sum(_softplus(-m) for m in margins) / n,
            "accuracy": sum(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins) / n,
            "margin": sum(margins) / n}


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def dpo_loss(reference: list[float], beta: float, stats: dict[str, float], kind: str = "dpo"):
    """The custom loss for ``forward_backward_custom`` on a batch laid out chosen, rejected, ...:
    ``reference`` has the batch's reference sums; ``stats`` receives the batch's chosen and rejected
    implicit rewards and accuracy, as ``<kind>/...``. With ``reference`` zeros and ``beta`` 1 it is the
    Bradley-Terry loss of the sums as scores (a reward model's)."""
    import torch
    import torch.nn.functional as F

    def loss_fn(data: list[types.Datum], logprobs: list[torch.Tensor]):
        sums = torch.stack([(lp * d.loss_fn_inputs["weights"].to_torch().to(lp)).sum()
                            for d, lp in zip(data, logprobs)])
        ref = torch.tensor(reference, dtype=sums.dtype, device=sums.device)
        rewards = beta * (sums - ref)
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        loss = -F.logsigmoid(margin).mean()
        with torch.no_grad():
            ties = (margin == 0).float()
            stats.update({f"{kind}/chosen_reward": float(chosen.mean()),
                          f"{kind}/rejected_reward": float(rejected.mean()),
                          f"{kind}/margin": float(margin.mean()),
                          f"{kind}/accuracy": float(((margin > 0).float() + 0.5 * ties).mean())})
        return loss, {}

    return loss_fn


async def dpo_async(config: DPOConfig, console: ConsoleLog | None = None) -> str:
    """Train and return the saved state path (``tinker://.../weights/<save_name>``)."""

    def datums(pairs: list[Pair], renderer, context: int | None) -> list[types.Datum]:
        sides = [p.conversation(s) for p in pairs for s in ("chosen", "rejected")]
        return data_datums(sides, renderer, context)

    return await train_on_pairs(config, datums, "dpo", config.beta, reference=True, console=console)


async def train_on_pairs(config: PairsConfig, datums, kind: str, beta: float, reference: bool,
                         console: ConsoleLog | None = None) -> str:
    """The pairs of ``config.data`` as Datums (``datums(pairs, renderer, context)``: chosen, rejected,
    ...), trained with :func:`dpo_loss` against the starting policy's sums (``reference``) or zeros;
    held-out pairs scored before, during and after; the state and sampler checkpoints saved and the
    summary written to ``<kind>.json``. Returns the state path."""
    console = console or ConsoleLog()
    pairs = read_pairs(config.data)  # a bad line is said before the model loads
    held_out = read_pairs(config.eval_data) if config.eval_data else []
    files = RunFiles(config.log_path)
    files.write_config(config.model_dump())

    def connect(service):
        if config.load_checkpoint:
            return service.create_training_client_from_state(config.load_checkpoint)
        return service.create_lora_training_client(base_model=config.model_name, rank=config.lora_rank,
                                                   seed=config.seed)

    policy = await open_policy(config, connect)
    async with ending_session(policy.service, service_url(config)):
        context = await context_length(policy.service, config.model_name)
        train_D = datums(pairs, policy.renderer, context)
        eval_D = datums(held_out, policy.renderer, context)
        return await _train(config, policy.client, train_D, eval_D, files, console, kind, beta, reference)


async def _train(config: PairsConfig, training, train_D: list[types.Datum], eval_D: list[types.Datum],
                 files: RunFiles, console: ConsoleLog, kind: str, beta: float, reference: bool) -> str:
    pairs, held_out = len(train_D) // 2, len(eval_D) // 2
    console.info(f"{kind}: {pairs} pairs to learn, {held_out} held out")
    if reference:  # the starting policy is the reference
        sums = await forward_sums(training, train_D + eval_D)
    else:
        sums = [0.0] * (len(train_D) + len(eval_D))
    train_ref, eval_ref = sums[:len(train_D)], sums[len(train_D):]

    async def evaluate(step: int) -> dict[str, float]:
        if not eval_D:
            return {}
        stats = preference_stats(await forward_sums(training, eval_D), eval_ref, beta)
        row = {"step": step, **{f"eval/{k}": v for k, v in stats.items()}}
        files.log_metrics(row)
        console.info(f"{kind} held out after step {step}: accuracy {stats['accuracy']:.3f}, "
                     f"margin {stats['margin']:.4f}, loss {stats['loss']:.4f}")
        return stats

    first_eval = await evaluate(-1)
    rng = random.Random(config.seed)
    order: list[int] = []
    log_every = max(1, config.max_steps // 10)
    last_eval = first_eval
    with console.progress(kind, config.max_steps, loss="-") as progress:
        for step in range(config.max_steps):
            t0 = time.monotonic()
            chosen_pairs: list[int] = []
            while len(chosen_pairs) < config.batch_size:
                if not order:
                    order = list(range(pairs))
                    rng.shuffle(order)
                chosen_pairs.append(order.pop())
            batch = [train_D[2 * i + side] for i in chosen_pairs for side in (0, 1)]
            batch_ref = [train_ref[2 * i + side] for i in chosen_pairs for side in (0, 1)]
            stats: dict[str, float] = {}
            lr = scheduled_lr(config.learning_rate, config.lr_schedule, step, config.max_steps)
            fwd = training.forward_backward_custom(batch, dpo_loss(batch_ref, beta, stats, kind))
            opt = training.optim_step(types.AdamParams(learning_rate=lr))
            result, _ = await fwd, await opt
            row = {"step": step, f"{kind}/loss": result.metrics["loss:sum"], **stats, "optim/lr": lr,
                   "time/total": time.monotonic() - t0}
            files.log_metrics(row)
            progress.update(progress.task_ids[0], advance=1, loss=f"{row[f'{kind}/loss']:.4f}")
            if not console.is_terminal and (step % log_every == 0 or step + 1 == config.max_steps):
                console.info(f"{kind} step {step}: loss {row[f'{kind}/loss']:.4f}, "
                             f"accuracy {row[f'{kind}/accuracy']:.3f}")
            if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.max_steps:
                last_eval = await evaluate(step)
    last_eval = await evaluate(config.max_steps - 1) or last_eval
    state = await training.save_state(config.save_name)
    sampler = await training.save_weights_for_sampler(config.save_name)
    summary = {"state_path": state.path, "sampler_path": sampler.path, "steps": config.max_steps,
               "pairs": pairs, "held_out": held_out, "beta": beta}
    if last_eval:
        summary["held_out_before"] = first_eval
        summary["held_out_after"] = last_eval
    atomic_write_text(files.root / f"{kind}.json", json.dumps(summary))
    console.info(f"{kind} checkpoint: {state.path}")
    return state.path


def dpo(config: DPOConfig, console: ConsoleLog | None = None) -> str:
    return asyncio.run(dpo_async(config, console))
