"""A deterministic policy for rollout tests: it has the SamplingClient interface, replies with the
given assistant messages in turn, and records every prompt and sampling parameters it received."""

from __future__ import annotations

from typing import Callable

import numpy as np
from tinker import types


class ScriptedSampler:
    def __init__(self, renderer, replies,
                 logprobs: Callable[[int], np.ndarray | None] = lambda n: np.full(n, -0.5)):
        self.renderer, self.replies, self.logprobs = renderer, list(replies), logprobs
        self.prompts: list[list[int]] = []
        self.params: list[types.SamplingParams] = []

    async def sample(self, prompt, num_samples, params):
        self.prompts.append(prompt.to_ints())
        self.params.append(params)
        tokens = self.renderer.assistant_tokens(self.replies.pop(0))
        logprobs = self.logprobs(len(tokens))  # None: a service that returns no logprobs
        seq = types.SampledSequence(stop_reason="stop", sequence_id="s",
                                    tokens_np=np.array(tokens, dtype=np.int32),
                                    logprobs_np=(None if logprobs is None
                                                 else np.asarray(logprobs, dtype=np.float32)))
        return types.SampleResponse(sequences=[seq])
