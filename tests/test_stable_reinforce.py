"""StableReinforce on the local engine: sequences recorded by ``record_stability_info`` samplers,
provenance spans checked against them, the loss and its gradient against a direct computation of
polyrl's documented formula, and the records' ownership, expiry and memory bound. Also the Datums
``polyrl train`` builds for it, against tinker-cookbook's own ``trajectory_to_data``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_local_engine import (  # noqa: F401 - store and service are fixtures shared with that module
    assert_grads_close,
    checkpoint_dir,
    from_state,
    load_reference,
    ref_grads,
    ref_token_logprobs,
    service,
    store,
    take_grads,
    warm,
)
from tinker import types

from polyrl import images
from polyrl.local import ServiceClient
from polyrl.local.stability import SequenceRecords
from polyrl.rl.advantages import to_datum
from polyrl.rl.episode import Episode

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
PROMPT = [5, 17, 99, 3, 250, 41]


def sampled_datum(
    prompt: list[int], seq: types.SampledSequence, advantage: float, logprobs: list[float] | None = None,
    spans: Sequence[images.ImageSpan] = (),
) -> types.Datum:
    """One sampled sequence as an RL datum with provenance, as tinker-cookbook's rl_loop builds it (the
    prompt's pictures, if any, at ``spans``)."""
    tokens = prompt + list(seq.tokens)
    n_prompt, n_sampled = len(prompt), len(seq.tokens)
    sid = seq.sequence_id
    model_input, targets = images.next_token_inputs(tokens, list(spans))
    inputs = {
        "target_tokens": targets,
        "logprobs": logprobs if logprobs is not None else [0.0] * (n_prompt - 1) + list(seq.logprobs),
        "advantages": [0.0] * (n_prompt - 1) + [advantage] * n_sampled,
    }
    datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled),
        ],
    )


@pytest.fixture(scope="module")
def off_policy(service, warm, store, tiny_model_dir):
    """Sequences sampled (and recorded) from the warm weights, then a large step taken, so the learner
    is off the sampler's policy (ratios far from 1, some past max_ratio); a reference model at the
    learner's weights."""
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    response = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 4, types.SamplingParams(max_tokens=6, seed=2)
    ).result()
    data = [sampled_datum(PROMPT, seq, adv) for seq, adv in zip(response.sequences, (1.0, -0.5, 2.0, -1.0))]
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path = tc.save_state("off-policy").result().path
    return {
        "tc": tc,
        "response": response,
        "data": data,
        "ref": load_reference(tiny_model_dir, checkpoint_dir(store, path)),
    }


def reference(
    lps: list[torch.Tensor],
    data: list[types.Datum],
    response: types.SampleResponse,
    max_ratio: float,
    kl_coeff: float,
) -> tuple[float, list[torch.Tensor], float]:
    """(loss, d loss / d lp per datum, truncated tokens) of the documented formula, from the *recorded*
    sampler logprobs (the response's), whatever the datum's own ``logprobs`` say."""
    total, coefs, truncated = 0.0, [], 0
    for lp, d, seq in zip(lps, data, response.sequences):
        lp = lp.double()
        n_prompt = len(lp) - len(seq.tokens)
        mask = torch.tensor([0.0] * n_prompt + [1.0] * len(seq.tokens), dtype=torch.float64)
        q = torch.tensor([0.0] * n_prompt + list(seq.logprobs), dtype=torch.float64)
        adv = d.loss_fn_inputs["advantages"].to_torch().double()
        r = torch.exp((lp - q) * mask)
        w = r.clamp(max=max_ratio)
        total += float(-(mask * w * adv * lp).sum() + kl_coeff * (mask * (r - 1 - (lp - q) * mask)).sum())
        coefs.append(-mask * w * adv + kl_coeff * mask * (r - 1))
        truncated += int(((r > max_ratio) & (mask > 0)).sum())
    return total, coefs, truncated


@pytest.mark.parametrize("config", [{}, {"max_ratio": 1.05, "kl_coeff": 0.3}])
def test_loss_and_gradient_equal_the_formula_with_recorded_logprobs(off_policy, config):
    tc, data, response = off_policy["tc"], off_policy["data"], off_policy["response"]
    out = tc.forward_backward(data, "stable_reinforce", config or None).result()
    got = take_grads(tc)
    lps = [ref_token_logprobs(off_policy["ref"], d).detach() for d in data]
    loss, coefs, truncated = reference(
        lps, data, response, config.get("max_ratio", 2.0), config.get("kl_coeff", 0.0)
    )
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert out.metrics["sampled_tokens:sum"] == sum(len(s.tokens) for s in response.sequences)
    assert out.metrics["truncated_tokens:sum"] == truncated
    if config:
        assert truncated > 0 and out.metrics["kl_sampler:sum"] > 0  # the off-policy branches are exercised
    assert_grads_close(got, ref_grads(off_policy["ref"], data, coefs), rtol=1e-5)


def test_the_clients_own_logprobs_are_not_used(off_policy):
    """The loss trains against what the sampler recorded: wrong client-side logprobs change nothing."""
    tc, data, response = off_policy["tc"], off_policy["data"], off_policy["response"]
    lied = [
        sampled_datum(
            PROMPT,
            seq,
            float(d.loss_fn_inputs["advantages"].tolist()[-1]),
            logprobs=[-20.0] * (len(PROMPT) - 1 + len(seq.tokens)),
        )
        for d, seq in zip(data, response.sequences)
    ]
    a = tc.forward(data, "stable_reinforce").result().metrics["loss:sum"]
    b = tc.forward(lied, "stable_reinforce").result().metrics["loss:sum"]
    assert a == b


def test_provenance_is_checked_against_the_records(service, off_policy, warm):
    tc, data, response = off_policy["tc"], off_policy["data"], off_policy["response"]
    good, seq = data[0], response.sequences[0]
    tokens = good.model_input.to_ints()

    def respan(model_input, loss_fn_inputs):  # not through with_provenance, which checks the tiling
        return types.Datum(
            model_input=good.model_input,
            loss_fn_inputs=good.loss_fn_inputs,
            model_input_spans=model_input,
            loss_fn_input_spans=loss_fn_inputs,
        )

    P, S = types.PromptProvenanceSpan, types.SampledProvenanceSpan  # noqa: N806
    sid, n, ns = seq.sequence_id, len(PROMPT), len(seq.tokens)
    assert len(tokens) == n + ns - 1
    other = tc.save_weights_and_get_sampling_client().result()  # a sampler that records nothing
    unrecorded = other.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6)
    ).result()
    elsewhere = ServiceClient(store_dir=service.engine.store.root)  # another session (same engine)
    foreign = (
        elsewhere.create_training_client_from_state(warm["path"])
        .result()
        .save_weights_and_get_sampling_client(record_stability_info=True)
        .result()
        .sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6))
        .result()
    )
    swapped = list(good.loss_fn_inputs["advantages"].tolist())
    swapped[2] = 1.0
    cases = [
        (
            types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs),
            "has no provenance spans",
        ),
        (sampled_datum(PROMPT, unrecorded.sequences[0], 1.0), "is not recorded for this session"),
        (sampled_datum(PROMPT, foreign.sequences[0], 1.0), "is not recorded for this session"),
        (
            respan(
                good.model_input_spans,
                [P(sequence_id=sid, offset=1, length=n - 2), S(sequence_id=sid, length=ns + 1)],
            ),
            f"names positions [0, {ns + 1}) of sequence {sid!r}'s sampled tokens, which has {ns}",
        ),
        (
            respan(
                [P(sequence_id=sid, length=n - 1), S(sequence_id=sid, length=ns)], good.loss_fn_input_spans
            ),
            "holds token",
        ),  # shifted by one: the tokens are not the recorded ones
        (
            respan([P(sequence_id=sid, length=n)], good.loss_fn_input_spans),
            f"cover {n} positions but the field has {len(tokens)}",
        ),
        (
            types.Datum(
                model_input=good.model_input,
                loss_fn_inputs={**good.loss_fn_inputs, "advantages": swapped},
                model_input_spans=good.model_input_spans,
                loss_fn_input_spans=good.loss_fn_input_spans,
            ),
            "advantage 1 at target position 2, which no SampledProvenanceSpan covers",
        ),
    ]
    for datum, words in cases:
        with pytest.raises(ValueError) as err:
            tc.forward_backward([data[1], datum], "stable_reinforce").result()
        assert words in str(err.value), (words, str(err.value))
    assert all(v.abs().max() == 0 for v in take_grads(tc).values())  # none of them accumulated anything
    with pytest.raises(ValueError, match="loss_fn_config keys"):
        tc.forward_backward(data, "stable_reinforce", {"clip_low_threshold": 0.8}).result()
    # other losses accept provenance without records (tinker-cookbook sends it with every loss)
    assert (
        "loss:sum"
        in tc.forward([sampled_datum(PROMPT, unrecorded.sequences[0], 1.0)], "ppo").result().metrics
    )


def test_records_expire_after_a_day_unused_and_are_bounded_per_key():
    now = [0.0]
    records = SequenceRecords(max_tokens=30, clock=lambda: now[0])
    prompt = [1, 2, 3, 4]

    def datum(sid: str) -> types.Datum:
        d = types.Datum(
            model_input=types.ModelInput.from_ints(prompt + [9]),
            loss_fn_inputs={"target_tokens": prompt[1:] + [9, 8], "advantages": [0.0] * 5},
        )
        return d.with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=sid, length=4),
                types.SampledProvenanceSpan(sequence_id=sid, length=1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=3),
                types.SampledProvenanceSpan(sequence_id=sid, length=2),
            ],
        )

    records.add("key", "s1", prompt, [("a", [9, 8], [-1.0, -2.0]), ("b", [9, 8], [-1.5, -2.5])])
    got = records.resolve("key", "s1", [datum("a")])[0]
    assert got.sampled.tolist() == [False] * 3 + [True] * 2 and got.sampler_logprobs.tolist()[-2:] == [
        -1.0,
        -2.0,
    ]
    with pytest.raises(ValueError, match="not recorded for this session"):
        records.resolve("key", "s2", [datum("a")])  # another session of the same key
    with pytest.raises(ValueError, match="not recorded for this session"):
        records.resolve("other-key", "s1", [datum("a")])
    now[0] = 86_000.0
    records.resolve("key", "s1", [datum("a")])  # a training use restarts a's day
    now[0] = 86_401.0
    records.sweep()
    records.resolve("key", "s1", [datum("a")])
    with pytest.raises(ValueError, match="went unused for a day"):
        records.resolve("key", "s1", [datum("b")])  # b was last used at 0
    # the bound: 6 tokens per record (prompt + sampled), at most 30 per key; the least recently used go
    records.add("key", "s1", prompt, [(f"c{i}", [9, 8], [-1.0, -1.0]) for i in range(5)])
    assert records.tokens("key") == 30
    with pytest.raises(
        ValueError, match="evicted as the least recently used when this key's records passed 30"
    ):
        records.resolve("key", "s1", [datum("a")])
    records.resolve("key", "s1", [datum("c0")])
    records.drop_session("s1")
    assert records.tokens("key") == 0


def test_targets_under_a_prompt_span_may_be_placeholders_but_sampled_targets_are_checked():
    """tinker-cookbook's rl_loop pads the prompt's targets with token 0 (the loss never trains them); the
    model input and the sampled targets must still hold the recorded tokens."""
    records = SequenceRecords()
    prompt = [1, 2, 3, 4]
    records.add("key", "s1", prompt, [("a", [9, 8], [-1.0, -2.0])])

    def datum(inputs: list[int], targets: list[int]) -> types.Datum:
        d = types.Datum(model_input=types.ModelInput.from_ints(inputs),
                        loss_fn_inputs={"target_tokens": targets, "advantages": [0.0] * 3 + [1.0] * 2})
        return d.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id="a", length=4),
                         types.SampledProvenanceSpan(sequence_id="a", length=1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="a", offset=1, length=3),
                            types.SampledProvenanceSpan(sequence_id="a", length=2)],
        )

    got = records.resolve("key", "s1", [datum(prompt + [9], [0, 0, 0, 9, 8])])[0]
    assert got.sampled.tolist() == [False] * 3 + [True] * 2
    assert got.sampler_logprobs.tolist() == [0, 0, 0, -1, -2]
    with pytest.raises(ValueError, match="loss_fn_input_spans\\[1\\]: position 4 holds token 7"):
        records.resolve("key", "s1", [datum(prompt + [9], [0, 0, 0, 9, 7])])
    with pytest.raises(ValueError, match="model_input_spans\\[0\\]: position 0 holds token 0"):
        records.resolve("key", "s1", [datum([0, 2, 3, 4, 9], [2, 3, 4, 9, 8])])


# ---- the Datums polyrl train builds ---------------------------------------------------------------
def test_train_datums_carry_the_same_provenance_as_the_cookbooks():
    """A two-turn episode: polyrl's stable_reinforce Datum has the model input, targets and provenance
    spans tinker-cookbook's ``trajectory_to_data`` builds for the same trajectory."""
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.rl.data_processing import trajectory_to_data
    from tinker_cookbook.rl.types import Trajectory, Transition

    ep = Episode("env", "train", 0, 0)
    ep.append([1, 2, 3])
    ep.append([10, 11], [-0.1, -0.2], runs=[(2, "seq-1")])
    ep.append([4, 5])
    ep.append([12, 13, 14], [-0.3, -0.4, -0.5], runs=[(3, "seq-2")])
    ep.turn_advantages = [0.5, 0.5]
    ours = to_datum(ep, "stable_reinforce")
    transitions = [
        Transition(
            ob=types.ModelInput.from_ints([1, 2, 3]),
            reward=0.0,
            episode_done=False,
            ac=TokensWithLogprobs(tokens=[10, 11], maybe_logprobs=[-0.1, -0.2], sequence_id="seq-1"),
        ),
        Transition(
            ob=types.ModelInput.from_ints([1, 2, 3, 10, 11, 4, 5]),
            reward=1.0,
            episode_done=True,
            ac=TokensWithLogprobs(
                tokens=[12, 13, 14], maybe_logprobs=[-0.3, -0.4, -0.5], sequence_id="seq-2"
            ),
        ),
    ]
    (theirs,) = trajectory_to_data(
        Trajectory(transitions=transitions, final_ob=types.ModelInput.empty()), 0.5
    )
    assert ours.model_input.to_ints() == theirs.model_input.to_ints()
    for key in ("target_tokens", "logprobs", "advantages"):
        assert ours.loss_fn_inputs[key].tolist() == pytest.approx(theirs.loss_fn_inputs[key].tolist()), key
    assert ours.model_input_spans == theirs.model_input_spans
    assert ours.loss_fn_input_spans == theirs.loss_fn_input_spans
    assert to_datum(ep, "ppo").model_input_spans is None  # only the loss that needs it gets provenance
