"""Top-K, target and alternative-token logprobs on ``sample``, ``prompt_logprobs_last_n``, and
``cross_entropy`` with ``(N, K)`` soft targets, on the local engine, against a direct computation: the
full log-softmax of an independent Hugging Face + PEFT model's logits (``test_local_engine``'s reference).
"""

from __future__ import annotations

import pytest
import torch
from test_local_engine import (  # noqa: F401 - store and service are fixtures shared with that module
    adapter_params,
    assert_grads_close,
    from_state,
    make_datum,
    service,
    store,
    take_grads,
    warm,
)
from tinker import types

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
ATOL = 1e-5


def full_logprobs(ref, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: row ``i`` is the model's log-softmax after ``tokens[: i + 1]``."""
    with torch.no_grad():
        return torch.log_softmax(ref(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def sampler(service, warm):
    return from_state(service, warm["path"]).save_weights_and_get_sampling_client().result()


PROMPT = [5, 17, 99, 3, 250, 41, 7, 600, 12]


def test_topk_prompt_and_sample_logprobs_equal_the_full_log_softmax(sampler, warm):
    k = 6
    r = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        2,
        types.SamplingParams(max_tokens=7, seed=3),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=4,
    ).result()
    ref = full_logprobs(warm["ref"], PROMPT)
    topk = r.topk_prompt_logprobs
    assert len(topk) == len(PROMPT) and topk[0] is None  # position 0 predicts nothing
    for p in range(1, len(PROMPT)):
        values, ids = torch.topk(ref[p - 1], k)
        assert [t for t, _ in topk[p]] == ids.tolist(), p
        torch.testing.assert_close(torch.tensor([lp for _, lp in topk[p]]), values, rtol=0, atol=ATOL)
    want = ref[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.prompt_logprobs[1:]), want, rtol=0, atol=ATOL)
    for seq in r.sequences:
        full = full_logprobs(warm["ref"], PROMPT + seq.tokens)
        assert len(seq.topk_logprobs) == len(seq.tokens) == 7
        for j, row in enumerate(seq.topk_logprobs):
            values, ids = torch.topk(full[len(PROMPT) - 1 + j], 4)
            assert [t for t, _ in row] == ids.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in row]), values, rtol=0, atol=ATOL)
            assert seq.logprobs[j] == pytest.approx(float(full[len(PROMPT) - 1 + j, seq.tokens[j]]), abs=ATOL)


def test_target_prompt_logprobs_dense_and_sparse_keep_their_layout(sampler, warm):
    n = len(PROMPT)
    ids = torch.full((n - 1, 3), -1, dtype=torch.long)
    ids[0, 0], ids[3, 2], ids[5, 1], ids[7, 0], ids[7, 1] = 11, 700, 0, PROMPT[8], 42
    ref = full_logprobs(warm["ref"], PROMPT)
    want = torch.where(ids >= 0, ref[:-1].gather(-1, ids.clamp(min=0)), torch.zeros(ids.shape))
    params = types.SamplingParams(max_tokens=1)
    prompt = types.ModelInput.from_ints(PROMPT)
    dense = sampler.sample(
        prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(ids)
    ).result()
    assert dense.target_prompt_logprobs.sparse_crow_indices is None
    torch.testing.assert_close(dense.target_prompt_logprobs.to_torch(), want, rtol=0, atol=ATOL)
    sparse_in = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse_in.sparse_crow_indices is not None
    sparse = (
        sampler.sample(prompt, 1, params, target_prompt_logprobs=sparse_in).result().target_prompt_logprobs
    )
    assert sparse.sparse_crow_indices == sparse_in.sparse_crow_indices
    assert sparse.sparse_col_indices == sparse_in.sparse_col_indices
    torch.testing.assert_close(sparse.to_torch(), want, rtol=0, atol=ATOL)


def test_prompt_alt_tokens_are_draws_with_the_models_logprobs(sampler, warm):
    prompt = types.ModelInput.from_ints(PROMPT)
    ref = full_logprobs(warm["ref"], PROMPT)
    r = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=5), prompt_alt_tokens_k=16).result()
    tokens, lps = r.prompt_alt_tokens.tokens.to_torch(), r.prompt_alt_tokens.logprobs.to_torch()
    assert list(tokens.shape) == list(lps.shape) == [len(PROMPT) - 1, 16]
    torch.testing.assert_close(lps, ref[:-1].gather(-1, tokens), rtol=0, atol=ATOL)
    assert len(set(tokens.flatten().tolist())) > 16  # draws, not one token repeated
    again = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=1, seed=5), prompt_alt_tokens_k=16
    ).result()
    assert torch.equal(again.prompt_alt_tokens.tokens.to_torch(), tokens)  # seeded: reproducible
    greedy = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=3)
        .result()
        .prompt_alt_tokens.tokens.to_torch()
    )
    assert torch.equal(greedy, ref[:-1].argmax(-1, keepdim=True).expand(-1, 3))


def test_prompt_logprobs_last_n_returns_exactly_the_last_n(sampler, warm):
    ref = full_logprobs(warm["ref"], PROMPT)
    want = ref[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    prompt = types.ModelInput.from_ints(PROMPT)
    for last_n in (1, 3, len(PROMPT) - 1):
        r = sampler.sample(
            prompt,
            1,
            types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=2,
            prompt_logprobs_last_n=last_n,
        ).result()
        plp = r.prompt_logprobs
        assert len(plp) == len(PROMPT)
        assert [x is None for x in plp] == [True] * (len(PROMPT) - last_n) + [False] * last_n
        torch.testing.assert_close(torch.tensor(plp[-last_n:]), want[-last_n:], rtol=0, atol=ATOL)
        assert [x is None for x in r.topk_prompt_logprobs] == [x is None for x in plp]
        scored = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=last_n).result()
        assert [x is None for x in scored] == [x is None for x in plp]
        torch.testing.assert_close(torch.tensor(scored[-last_n:]), want[-last_n:], rtol=0, atol=ATOL)


def test_bad_top_k_requests_are_clear_errors(sampler):
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=1)

    def target(shape: tuple[int, int], fill: int = 1) -> types.TensorData:
        return types.TensorData.from_torch(torch.full(shape, fill, dtype=torch.long))

    cases = [
        ({"topk_prompt_logprobs": 129}, "topk_prompt_logprobs must be a count between 0 and 128"),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs must be a count between 0 and 128"),
        ({"prompt_alt_tokens_k": 1000}, "prompt_alt_tokens_k must be a count between 0 and 128"),
        (
            {"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)},
            "prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = 8",
        ),
        ({"prompt_logprobs_last_n": 2}, "set include_prompt_logprobs"),
        ({"target_prompt_logprobs": target((len(PROMPT), 2))}, "it must be [len(prompt) - 1 = 8, K]"),
        ({"target_prompt_logprobs": target((len(PROMPT) - 1, 129))}, "K between 1 and 128"),
        ({"target_prompt_logprobs": target((len(PROMPT) - 1, 2), 10**6)}, "out of range for vocabulary"),
        ({"target_prompt_logprobs": target((len(PROMPT) - 1, 2), -1)}, "names no token id"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError) as err:
            sampler.sample(prompt, 1, params, **kwargs)
        assert words in str(err.value), (kwargs, str(err.value))


# ---- cross_entropy with (N, K) soft targets --------------------------------------------------------
def soft_datum(
    gen: torch.Generator, n: int, k: int, prompt: int | None = None, vocab: int = 700
) -> types.Datum:
    """``n`` positions, each with ``k`` targets weighted like renormalized teacher probabilities (some
    positions all zero, as prompt positions are), sent as the SDK sends a 2-D torch tensor (sparse)."""
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    targets = torch.randint(0, vocab, (n, k), generator=gen)
    weights = torch.softmax(torch.randn(n, k, generator=gen), dim=-1)
    weights[: n // 3 if prompt is None else prompt] = 0.0
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def test_soft_target_cross_entropy_equals_direct_computation_with_gradients(service, warm):
    gen = torch.Generator().manual_seed(4)
    data = [
        soft_datum(gen, 16, 5, prompt=12),
        make_datum([3, 4, 5, 6], [4, 5, 6, 7], weights=[0.0, 1.0, 0.5, 1.0]),
        soft_datum(gen, 6, 20),
    ]
    assert data[0].loss_fn_inputs["weights"].sparse_crow_indices is not None  # as the SDK sends it
    tc = from_state(service, warm["path"])
    out = tc.forward_backward(data, "cross_entropy").result()
    got = take_grads(tc)

    ref = warm["ref"]
    ref.zero_grad(set_to_none=True)
    total = 0.0
    for i, d in enumerate(data):
        logp = torch.log_softmax(ref(input_ids=torch.tensor([d.model_input.to_ints()])).logits[0].float(), -1)
        targets = d.loss_fn_inputs["target_tokens"].to_torch().long()
        weights = d.loss_fn_inputs["weights"].to_torch().float()
        picked = logp.gather(-1, targets if targets.dim() == 2 else targets[:, None])
        picked = picked if targets.dim() == 2 else picked[:, 0]
        loss = -(weights * picked).sum()
        loss.backward()
        total += float(loss)
        lp = out.loss_fn_outputs[i]["logprobs"]
        assert lp.shape == list(targets.shape)
        torch.testing.assert_close(lp.to_torch(), picked.detach(), rtol=0, atol=ATOL)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    want = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in ref.named_parameters()
        if p.requires_grad
    }
    assert_grads_close(got, want, rtol=1e-5)


def test_soft_targets_outside_cross_entropy_and_misshapen_weights_are_refused(service, warm):
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(5)
    d = soft_datum(gen, 6, 3)
    rl = types.Datum(
        model_input=d.model_input,
        loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": [-1.0] * 6,
            "advantages": [1.0] * 6,
        },
    )
    with pytest.raises(ValueError, match=r"shape \[6, 3\]; loss ppo takes one target per token"):
        tc.forward_backward([rl], "ppo").result()
    narrow = types.Datum(
        model_input=d.model_input,
        loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": torch.ones(6, 2)},
    )
    with pytest.raises(
        ValueError, match=r"'weights'\] has shape \[6, 2\]; with target_tokens of shape \[6, 3\]"
    ):
        tc.forward_backward([narrow], "cross_entropy").result()
    assert all(p.grad is None for p in adapter_params(tc).values())  # nothing was accumulated
