"""The engine shares itself between owners (``polyrl serve``'s API keys): a long decode of one owner pauses
between slices for another owner's work, and resumes exactly where it was."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from tinker import types

from polyrl.local.engine import Engine
from polyrl.local.model import LoraSpec
from polyrl.local.sampler import SampleJob

LONG = 300  # decode steps of the long request: far more than a slice


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("fair-store"), device="cpu")
    e.slice_s, e.switch_share = 0.0, 0  # a slice of one decode step, whatever the machine's speed
    yield e
    e.stop()


def _sampler(engine: Engine, model_dir: str, model_id: str, seed: int):
    """A sampling snapshot of a LoRA whose weights differ from the base's (and from other seeds')."""

    def make():
        st = engine.create_trainer(model_id, model_dir, LoraSpec(4, seed=seed), "adamw")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in st.params:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        return engine.snapshot_sampler(st)

    return engine.call(make)


def _job(tokens: int, samples: int, seed: int) -> SampleJob:
    """A request that runs exactly ``tokens`` decode steps (no stop token ends it early)."""
    params = types.SamplingParams(max_tokens=tokens, seed=seed, temperature=1.0)
    return SampleJob([1, 2, 3, 4, 5], samples, params, max_tokens=tokens)


def test_a_long_decode_pauses_for_another_owners_work_and_resumes_exactly(engine, tiny_model_dir):
    a = _sampler(engine, tiny_model_dir, "fair-a:train:0", seed=1)
    b = _sampler(engine, tiny_model_dir, "fair-b:train:0", seed=2)  # the same sampling slot, other weights
    embed = engine.call(lambda: engine.base(tiny_model_dir).hf_model.get_input_embeddings())
    passes = [0]  # model passes (prefills and decode steps) of every request

    def count(module, args, output) -> None:
        passes[0] += 1

    handle = embed.register_forward_hook(count)
    try:
        alone = engine.submit_sample(a, _job(LONG, 3, seed=7), owner="key-a").result(timeout=600)

        shared = engine.submit_sample(a, _job(LONG, 3, seed=7), owner="key-a")
        while not shared.running():  # its decode has started
            time.sleep(0.001)
        seen: dict[str, object] = {}
        done = threading.Event()

        def b_sampled(f):
            seen["passes"], seen["a_done"] = passes[0], shared.done()
            done.set()

        small = engine.submit_sample(b, _job(2, 1, seed=3), owner="key-b")
        start = passes[0]  # (read once b's request is queued: the passes since are a's after it, and b's)
        small.add_done_callback(b_sampled)
        op = engine.submit(lambda: shared.done(), owner="key-b")  # a training operation of key b
        assert done.wait(600)
        a_done_when_b_op_ran = op.result(timeout=600)
        result = shared.result(timeout=600)
    finally:
        handle.remove()
    # key b's request waited for at most one slice of key a's decode, not for all of it
    assert seen["a_done"] is False and a_done_when_b_op_ran is False
    # with one-step slices the keys alternate: a's step under way, then b's passes each followed by a's
    assert seen["passes"] - start <= 8, (seen, start)
    assert len(small.result().sequences[0].tokens) == 2
    # a's samples are what they are when it decodes alone: its cache and rows survived the pause, and its
    # adapter was put back in the sampling slot that b's used meanwhile
    for got, want in zip(result.sequences, alone.sequences, strict=True):
        assert got.tokens == want.tokens and len(got.tokens) == LONG
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


def test_one_owner_runs_in_submission_order_without_pauses(engine, tiny_model_dir):
    """With one owner there is nobody to pause for: a training operation submitted after a sampling
    request runs once that request is done, as a single queue would."""
    a = _sampler(engine, tiny_model_dir, "fair-c:train:0", seed=4)
    sample = engine.submit_sample(a, _job(200, 2, seed=1), owner="key-a")
    op = engine.submit(lambda: sample.done(), owner="key-a")
    assert op.result(timeout=600) is True
