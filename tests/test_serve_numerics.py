"""``polyrl serve`` through the official SDK over real HTTP on 127.0.0.1: top-K, target and
alternative-token logprobs and ``prompt_logprobs_last_n`` (protobuf and JSON results), ``(N, K)`` soft
targets, StableReinforce (recording, provenance spans in the protobuf datums, ownership), and Dimuon.
Numbers are checked against a direct computation with the base model (a fresh LoRA adds nothing) or
against the in-process engine given the same requests."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from test_serve import KEY, OTHER_KEY, PROTO, Served, _create_model, _fwdbwd_body, _retrieve, _session
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from polyrl.local import ServiceClient

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
PROMPT = [5, 17, 99, 3, 250, 41, 7, 600, 12]
ATOL = 1e-5


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("serve-numerics-store"), "--long-poll", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model


def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_topk_target_and_alternative_logprobs_through_serve(sdk, base, tiny_model_dir, tmp_path):
    sampler = sdk.create_sampling_client(base_model=tiny_model_dir).result()
    ref = full_logprobs(base, PROMPT)
    ids = torch.full((len(PROMPT) - 1, 4), -1, dtype=torch.long)
    ids[1, 0], ids[6, 3], ids[7, 1] = 9, 321, 4
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None
    request = dict(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2,
                   sampling_params=types.SamplingParams(max_tokens=5, seed=1), include_prompt_logprobs=True,
                   topk_prompt_logprobs=5, topk_sample_logprobs=3, target_prompt_logprobs=target,
                   prompt_alt_tokens_k=4, prompt_logprobs_last_n=4)
    r = sampler.sample(**request).result()
    assert [x is None for x in r.prompt_logprobs] == [True] * (len(PROMPT) - 4) + [False] * 4
    want = ref[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.prompt_logprobs[-4:]), want[-4:], rtol=0, atol=ATOL)
    for p, row in enumerate(r.topk_prompt_logprobs):
        if p < len(PROMPT) - 4:
            assert row is None
            continue
        values, top = torch.topk(ref[p - 1], 5)
        assert [t for t, _ in row] == top.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in row]), values, rtol=0, atol=ATOL)
    got = r.target_prompt_logprobs
    assert got.sparse_crow_indices == target.sparse_crow_indices  # the request's sparse layout, kept
    torch.testing.assert_close(
        got.to_torch(),
        torch.where(ids >= 0, ref[:-1].gather(-1, ids.clamp(min=0)), torch.zeros(ids.shape)),
        rtol=0,
        atol=ATOL,
    )
    alt = r.prompt_alt_tokens
    torch.testing.assert_close(
        alt.logprobs.to_torch(), ref[:-1].gather(-1, alt.tokens.to_torch()), rtol=0, atol=ATOL
    )
    for seq in r.sequences:
        full = full_logprobs(base, PROMPT + seq.tokens)
        for j, row in enumerate(seq.topk_logprobs):
            values, top = torch.topk(full[len(PROMPT) - 1 + j], 3)
            assert [t for t, _ in row] == top.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in row]), values, rtol=0, atol=ATOL)
    # the local engine answers the same request with the same numbers
    local = (
        ServiceClient(store_dir=tmp_path)
        .create_sampling_client(base_model=tiny_model_dir)
        .result()
        .sample(**request)
        .result()
    )
    assert [s.tokens for s in local.sequences] == [s.tokens for s in r.sequences]
    assert torch.equal(local.prompt_alt_tokens.tokens.to_torch(), alt.tokens.to_torch())
    with pytest.raises(
        tinker.RequestFailedError, match="topk_prompt_logprobs must be a count between 0 and 128"
    ):
        sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            1,
            types.SamplingParams(max_tokens=1),
            topk_prompt_logprobs=500,
        ).result()


def test_top_k_results_as_json(served, tiny_model_dir):
    session = _session(served)
    served.http.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": tiny_model_dir},
    )
    target = {
        "data": [9, 4],
        "dtype": "int64",
        "shape": [len(PROMPT) - 1, 2],
        "sparse_crow_indices": [0, 1, 1, 1, 1, 1, 1, 2, 2],
        "sparse_col_indices": [1, 0],
    }
    r = served.http.post(
        "/asample",
        json={
            "sampling_session_id": f"{session}:sample:0",
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2},
            "prompt_logprobs": True,
            "topk_prompt_logprobs": 2,
            "topk_sample_logprobs": 2,
            "prompt_logprobs_last_n": 3,
            "target_prompt_logprobs": target,
            "prompt_alt_tokens_k": 2,
        },
    )
    assert r.status_code == 200, r.text
    out = _retrieve(served, r.json()["request_id"])
    assert [x is None for x in out["prompt_logprobs"]] == [True] * (len(PROMPT) - 3) + [False] * 3
    assert len(out["topk_prompt_logprobs"]) == len(PROMPT) and len(out["topk_prompt_logprobs"][-1]) == 2
    assert len(out["sequences"][0]["topk_logprobs"]) == len(out["sequences"][0]["tokens"])
    tp = out["target_prompt_logprobs"]
    assert tp["sparse_col_indices"] == [1, 0] and tp["shape"] == [len(PROMPT) - 1, 2] and len(tp["data"]) == 2
    assert out["prompt_alt_tokens"]["tokens"]["shape"] == [len(PROMPT) - 1, 2]
    bad = dict(target, shape=[10**6, 10**3])
    r = served.http.post(
        "/asample",
        json={
            "sampling_session_id": f"{session}:sample:0",
            "seq_id": 2,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2},
            "target_prompt_logprobs": bad,
        },
    )
    error = _retrieve(served, r.json()["request_id"])
    assert "declares shape [1000000, 1000]" in error["error"] and error["category"] == "user"


def test_soft_target_cross_entropy_through_serve(sdk, base, tiny_model_dir):
    training = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
    gen = torch.Generator().manual_seed(0)
    tokens = PROMPT
    n = len(tokens)
    targets = torch.randint(0, 700, (n, 6), generator=gen)
    weights = torch.softmax(torch.randn(n, 6, generator=gen), -1)
    weights[: n - 2] = 0.0  # mostly zero, so the SDK sends it sparse
    soft = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    assert soft.loss_fn_inputs["weights"].sparse_crow_indices is not None
    hard = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:4]),
        loss_fn_inputs={"target_tokens": tokens[1:5], "weights": [1.0] * 4},
    )
    out = training.forward([soft, hard, soft], "cross_entropy").result()
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[n, 6], [4], [n, 6]]
    ref = full_logprobs(base, tokens)  # a fresh LoRA (B = 0) is the base model
    picked = ref.gather(-1, targets)
    torch.testing.assert_close(out.loss_fn_outputs[0]["logprobs"].to_torch(), picked, rtol=0, atol=ATOL)
    hard_lp = ref[:4].gather(-1, torch.tensor(tokens[1:5])[:, None])[:, 0]
    want = 2 * float(-(weights * picked).sum()) - float(hard_lp.sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)


def sampled_datum(prompt: list[int], seq: types.SampledSequence, advantage: float) -> types.Datum:
    tokens = prompt + list(seq.tokens)
    n, ns, sid = len(prompt), len(seq.tokens), seq.sequence_id
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": [-30.0] * (len(tokens) - 1),  # not what the loss uses
        "advantages": [0.0] * (n - 1) + [advantage] * ns,
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=n),
            types.SampledProvenanceSpan(sequence_id=sid, length=ns - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=ns),
        ],
    )


def test_stable_reinforce_through_serve(served, sdk, base, tiny_model_dir):
    training = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
    recording = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    response = recording.sample(
        types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=5)
    ).result()
    data = [sampled_datum(PROMPT, seq, adv) for seq, adv in zip(response.sequences, (1.0, -1.0))]
    out = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).result()
    # at this point the learner is the sampler (ratio 1): the loss is -sum A * logp over sampled tokens
    want = 0.0
    for seq, adv in zip(response.sequences, (1.0, -1.0)):
        full = full_logprobs(base, PROMPT + seq.tokens)
        lp = full[len(PROMPT) - 1 : -1].gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
        np.testing.assert_allclose(lp.numpy(), seq.logprobs, atol=1e-5)
        want += float(-(adv * lp).sum())
    # the two sequences' sums nearly cancel at times, so the bound is per token (as above), not relative
    tokens = sum(len(s.tokens) for s in response.sequences)
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5 * tokens)
    assert out.metrics["sampled_tokens:sum"] == sum(len(s.tokens) for s in response.sequences)
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"] > 0

    # what the records do not vouch for is a 400 on the request, naming the sequence
    plain = training.save_weights_and_get_sampling_client().result()  # records nothing
    unrecorded = plain.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=5)
    ).result()
    other_session = served.sdk(KEY)
    other_key = served.sdk(OTHER_KEY)
    try:
        foreign = [
            sc.create_sampling_client(base_model=tiny_model_dir, record_stability_info=True)
            .result()
            .sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=5))
            .result()
            for sc in (other_session, other_key)
        ]
    finally:
        other_session.close("success").result()
        other_key.close("success").result()
    for seq in (unrecorded.sequences[0], *(f.sequences[0] for f in foreign)):
        with pytest.raises(tinker.BadRequestError) as err:
            training.forward_backward([sampled_datum(PROMPT, seq, 1.0)], "stable_reinforce").result()
        assert f"sequence_id {seq.sequence_id!r} is not recorded for this session" in str(err.value)
    with pytest.raises(tinker.BadRequestError, match="has no provenance spans"):
        training.forward_backward(
            [types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)],
            "stable_reinforce",
        ).result()
    assert "loss:sum" in training.forward(data, "stable_reinforce").result().metrics  # and it goes on


def test_provenance_spans_in_protobuf_datums_are_checked(served, tiny_model_dir):
    session = _session(served)
    model_id = _create_model(served, tiny_model_dir, session)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s", offset=1, length=3)],
    )
    r = served.http.post("/forward_backward", content=_fwdbwd_body(model_id, 1, [datum]), headers=PROTO)
    assert r.status_code == 200, r.text  # accepted (and not resolved) with a loss that does not use it
    assert "loss:sum" in _retrieve(served, r.json()["request_id"])["metrics"]
    cases = [
        ("sequence_id", "", "sequence_id must be 1 to 128 characters"),
        ("length", -2, "has offset 0 and length -2; both must be >= 0"),
        ("drop", None, "provenance comes as a pair"),
    ]
    for seq, (field, value, words) in enumerate(cases, start=2):
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(_fwdbwd_body(model_id, seq, [datum]))
        if field == "drop":
            del msg.data[0].loss_fn_input_spans[:]
        else:
            setattr(msg.data[0].model_input_spans[0].prompt_tokens, field, value)
        r = served.http.post("/forward_backward", content=msg.SerializeToString(), headers=PROTO)
        assert r.status_code == 400 and words in r.json()["error"], r.text


def test_dimuon_through_serve_equals_the_local_engine(served, sdk, tiny_model_dir, tmp_path):
    training = sdk.create_lora_training_client(
        base_model=tiny_model_dir, rank=4, seed=5, optimizer=types.DimuonOptimizerConfig()
    ).result()
    assert training.get_info().optimizer_config.type == "dimuon"
    local = (
        ServiceClient(store_dir=tmp_path)
        .create_lora_training_client(tiny_model_dir, rank=4, seed=5, optimizer=types.DimuonOptimizerConfig())
        .result()
    )
    gen = torch.Generator().manual_seed(1)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(torch.randint(0, 700, (n,), generator=gen).tolist()),
            loss_fn_inputs={"target_tokens": torch.randint(0, 700, (n,), generator=gen).tolist()},
        )
        for n in (6, 9)
    ]
    for client in (training, local):
        for step in range(2):
            client.forward_backward(data, "cross_entropy").result()
            client.optim_step(types.DimuonParams(learning_rate=0.05, beta1=0.5)).result()
    got = [o["logprobs"].to_numpy() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]
    want = [o["logprobs"].to_numpy() for o in local.forward(data, "cross_entropy").result().loss_fn_outputs]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    fresh = [
        o["logprobs"].to_numpy()
        for o in sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=5)
        .result()
        .forward(data, "cross_entropy")
        .result()
        .loss_fn_outputs
    ]
    assert np.abs(got[0] - fresh[0]).max() > 1e-3  # the steps moved the weights
    with pytest.raises(
        tinker.BadRequestError,
        match="optim_step got AdamParams, but this training client's optimizer is dimuon",
    ):
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("dimuon").result().path
    rest = httpx.post(
        f"{served.url}/api/v1/weights_info", json={"tinker_path": path}, headers={"X-API-Key": KEY}
    )
    assert rest.json()["optimizer_config"] == {"type": "dimuon", "version": 1}
    resumed = sdk.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().optimizer_config.type == "dimuon"
    with pytest.raises(tinker.BadRequestError, match="dimuon_params.beta1 must be in"):
        training.optim_step(types.DimuonParams.model_construct(learning_rate=1e-3, beta1=1.5)).result()
