"""``polyrl reward-model``: a reward model trained on preference pairs, for ``polyrl train`` to use as its
reward (``judge: {mode: reward_model, model: <its sampler checkpoint>}``).

The model is a LoRA on the base, and its scalar head is the base's own output layer read at one place:
after the conversation and a question (``question``: "Is the assistant's last reply a good one? Answer
Yes or No."), the score of a reply is the log-probability the model gives ``Yes`` as the first token of
its answer. Trained with the Bradley-Terry loss ``-log sigmoid(score(chosen) - score(rejected))`` through
``forward_backward_custom`` (the local engine and Tinker alike), it ranks replies; as a reward it gives
the score itself (at most 0): what Bradley-Terry learns is the differences between scores, which group
advantages are made of, not their level.

Reading the head this way needs nothing a Tinker service does not have: training is a custom loss on
the logprob of one target token, and scoring is ``compute_logprobs`` of one sequence.
"""

from __future__ import annotations

import asyncio

from pydantic import Field
from tinker import types

from polyrl.dpo import PairsConfig, train_on_pairs
from polyrl.errors import UserInputError
from polyrl.images import next_token_inputs
from polyrl.rl.judge import QUESTION, scored_tokens, yes_token
from polyrl.sft_data import Pair
from polyrl.tracking.console import ConsoleLog


class RewardModelConfig(PairsConfig):
    """A reward model trained on preference pairs (``polyrl reward-model``); the policy's fields are
    train's."""

    question: str = Field(QUESTION, description="What the reward model is asked after the conversation; the "
                          "score is the logprob of 'Yes' as the first token of its answer. polyrl train's "
                          "judge (mode reward_model) asks the same (its template).")
    learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    log_path: str = Field("runs/reward_model", description="Directory for metrics.jsonl and "
                          "reward_model.json.")
    save_name: str = Field("reward_model", description="Checkpoint name; polyrl train's judge takes its "
                           "sampler path (in reward_model.json).")


def score_datum(renderer, messages: list, tools: list | None, question: str, yes: int,
                context: int | None, where: str) -> types.Datum:
    """A Datum whose one weighted target is ``Yes`` after the question."""
    tokens, images = scored_tokens(renderer, messages, tools, question, yes)
    if context is not None and len(tokens) > context:
        raise UserInputError(f"{where}: the conversation is {len(tokens)} tokens, longer than the model's "
                             f"context of {context}; shorten or drop it")
    model_input, targets = next_token_inputs(tokens, images)
    weights = [0.0] * (len(targets) - 1) + [1.0]
    return types.Datum(model_input=model_input,
                       loss_fn_inputs={"target_tokens": types.TensorData(data=targets, dtype="int64"),
                                       "weights": types.TensorData(data=weights, dtype="float32")})


async def reward_model_async(config: RewardModelConfig, console: ConsoleLog | None = None) -> str:
    """Train and return the saved state path; ``reward_model.json`` in ``log_path`` has the sampler path
    the judge takes."""

    def datums(pairs: list[Pair], renderer, context: int | None) -> list[types.Datum]:
        yes = yes_token(renderer.tokenizer)
        out = []
        for pair in pairs:
            for side in ("chosen", "rejected"):
                conversation = pair.conversation(side)
                out.append(score_datum(renderer, conversation.messages, conversation.tools, config.question,
                                       yes, context, conversation.where))
        return out

    return await train_on_pairs(config, datums, "reward_model", beta=1.0, reference=False, console=console)


def reward_model(config: RewardModelConfig, console: ConsoleLog | None = None) -> str:
    return asyncio.run(reward_model_async(config, console))
