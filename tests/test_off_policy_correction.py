"""Off-policy corrections (``off_policy.correction``): each correction's loss and gradient against a direct
computation of the documented formulas and against the published definitions (verl's rollout correction,
TRL's vLLM importance sampling, IcePop), their metrics, the engine's checks, the client-side folding
used with hosted Tinker against the in-loss result, ``polyrl serve`` against in-process, and a
``polyrl train`` run logging the metrics."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import torch
from test_local_engine import (  # noqa: F401 - store, service and warm are fixtures shared with that module
    assert_grads_close,
    from_state,
    out_logprobs,
    random_datum,
    ref_grads,
    service,
    store,
    take_grads,
    warm,
    with_inputs,
)
from test_serve import KEY, Served
from test_stable_reinforce import off_policy  # noqa: F401 - a fixture: sequences sampled off the learner
from tinker import types

from polyrl.backend import ServiceGuard
from polyrl.config.schema import TrainConfig
from polyrl.local import ServiceClient
from polyrl.local.losses import CORRECTIONS, Segments, get_loss, policy_gradient_losses
from polyrl.rl.step_metrics import off_policy_metrics
from polyrl.rl.update import fold_correction

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
LENGTHS = (5, 7, 6)
CONFIGS = {"tis": {"tis_cap": 1.5}, "mis": {"mis_low": 0.6, "mis_high": 1.4},
           "seq_mis": {"seq_mis_low": 0.3, "seq_mis_high": 3.0},
           "geo_mis": {"geo_mis_low": 0.8, "geo_mis_high": 1.25},
           "icepop": {"icepop_low": 0.6, "icepop_high": 1.6}}
#: Every registered loss an off-policy correction applies to (each has its direct computation below).
LOSSES = tuple(name for name in policy_gradient_losses() if get_loss(name).correction)


# ---- direct computations (the documented formulas, written out) -----------------------------------
def batch(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], Segments]:
    """Learner logprobs (a leaf with gradient) of three datums and sampler logprobs: close to them on the
    first, all above them on the second (a sequence every mask rejects), spread ~0.8 on the third (tokens
    truncated and masked); advantages zero on each datum's first two ("prompt") tokens; float64."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    lp = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ids = torch.cat([torch.full((k,), i) for i, k in enumerate(LENGTHS)])
    bias, spread = torch.tensor([0.0, 0.5, 0.0])[ids], torch.tensor([0.05, 0.2, 0.8])[ids]
    q = lp.detach() + bias + spread * torch.randn(n, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for s in starts:
        adv[s:s + 2] = 0.0
    mask = (adv != 0).double()
    return lp, {"logprobs": q, "advantages": adv, "mask": mask}, Segments(ids, len(LENGTHS))


def direct_factor(kind: str, rho: list[float], ids: list[int], active: list[bool], low: float,
                  high: float) -> list[float]:
    """c_t per token, one token (and one sequence) at a time."""
    if kind in ("seq_mis", "geo_mis"):
        keep = {}
        for d in set(ids):
            logs = [math.log(r) for r, i, a in zip(rho, ids, active) if i == d and a]
            value = math.exp(sum(logs) / (len(logs) if kind == "geo_mis" and logs else 1))
            keep[d] = low <= value <= high
        return [float(keep[i]) if a else 1.0 for i, a in zip(ids, active)]
    out = []
    for r, a in zip(rho, active):
        inside = low <= r <= high
        c = {"tis": min(r, high), "mis": float(inside), "icepop": r if inside else 0.0}[kind]
        out.append(c if a else 1.0)
    return out


def bounds(kind: str) -> tuple[float, float]:
    keys = CORRECTIONS[kind]
    config = CONFIGS[kind]
    return (0.0, config[keys[0]]) if kind == "tis" else (config[keys[0]], config[keys[1]])


def direct_loss(name: str, lp: torch.Tensor, inputs: dict, seg: Segments, c: torch.Tensor) -> torch.Tensor:
    """Each loss written out with advantage c * A; a loss whose ratio the correction re-anchors takes
    it against the learner's detached logprobs (value 1, gradient of log p)."""
    a = c * inputs["advantages"]
    r = torch.exp(lp - lp.detach())
    if name == "importance_sampling":
        return -(r * a).sum()
    if name in ("ppo", "gspo"):  # gspo: the sequence's mean log-ratio against itself is 0
        return -torch.minimum(r * a, r.clamp(0.8, 1.2) * a).sum()
    if name == "cispo":
        return -(r.detach().clamp(0.8, 1.2) * lp * a).sum()
    if name == "dro":  # no ratio to re-anchor: the penalty still pulls towards the sampler
        return -(lp * a - 0.5 * 0.05 * (lp - inputs["logprobs"]) ** 2 * inputs["mask"]).sum()
    m = inputs["sampled"]  # stable_reinforce keeps its own truncated weight against the sampler
    w = torch.exp((lp.detach() - inputs["sampler_logprobs"]) * m).clamp(max=2.0)
    return -(m * w * a * lp).sum()


def run_loss(name: str, lp: torch.Tensor, inputs: dict, seg: Segments, config: dict):
    if lp.grad is not None:
        lp.grad = None
    loss, metrics = get_loss(name).fn(lp, inputs, seg, config)
    loss.backward()
    return float(loss), lp.grad.clone(), metrics


def loss_inputs(name: str, inputs: dict) -> dict:
    if name == "stable_reinforce":
        return {"advantages": inputs["advantages"], "sampled": inputs["mask"],
                "sampler_logprobs": inputs["logprobs"] * inputs["mask"]}
    if name == "dro":
        return inputs
    if name == "gspo":
        return {"logprobs": inputs["logprobs"], "advantages": inputs["advantages"],
                "sequence_ratio_mask": inputs["mask"]}
    return {"logprobs": inputs["logprobs"], "advantages": inputs["advantages"]}


@pytest.mark.parametrize("kind", sorted(CORRECTIONS))
@pytest.mark.parametrize("name", LOSSES)
def test_correction_loss_and_gradient_match_a_direct_computation(name, kind):
    if name == "stable_reinforce" and kind == "tis":
        pytest.skip("refused: stable_reinforce truncates its own weight (test_engine_refusals)")
    lp, raw, seg = batch(seed=LOSSES.index(name) * 10 + len(kind))
    inputs = loss_inputs(name, raw)
    low, high = bounds(kind)
    active = raw["mask"] != 0
    rho = torch.exp(lp.detach() - raw["logprobs"]).tolist()
    c = torch.tensor(direct_factor(kind, rho, seg.ids.tolist(), active.tolist(), low, high),
                     dtype=torch.float64)
    affected = c[active] == (high if kind == "tis" else 0.0)  # truncated, or masked
    assert 0 < int(affected.sum()) < int(active.sum())
    value, grad, _ = run_loss(name, lp, inputs, seg, CONFIGS[kind])
    lp.grad = None
    want = direct_loss(name, lp, inputs, seg, c)
    want.backward()
    assert value == pytest.approx(float(want), abs=1e-6)
    torch.testing.assert_close(grad, lp.grad, rtol=0, atol=1e-6)
    plain, plain_grad, _ = run_loss(name, lp, inputs, seg, {})
    assert not torch.allclose(plain_grad, grad)  # and it is not the loss without a correction


# ---- the published definitions (written from their docs; never their code) ----------------------
def test_tis_is_verl_decoupled_token_is_and_trl_token_truncate():
    """verl (rollout correction, decoupled mode, token level): L = sum_t w_t * max(-A r, -A clip(r)) with
    w_t = min(pi_old / pi_rollout, C) detached and r = pi_theta / pi_old; pi_old is the policy at the
    step's start, which in polyrl's one-optimizer-step-per-batch loop is the learner itself. TRL's
    token_truncate multiplies the same per-token loss by min(exp(old - vllm), cap)."""
    lp, raw, seg = batch(seed=3)
    cap = 1.5
    old = lp.detach()
    w = torch.clamp(torch.exp(old - raw["logprobs"]), max=cap)
    r = torch.exp(lp - old)
    adv = raw["advantages"]
    verl = (w * torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))).sum()
    verl.backward()
    want = lp.grad.clone()
    value, grad, _ = run_loss("ppo", lp, loss_inputs("ppo", raw), seg, {"tis_cap": cap})
    assert value == pytest.approx(float(verl), abs=1e-9)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("kind", ["seq_mis", "geo_mis", "mis"])
def test_masks_are_verl_rejection_sampling(kind):
    """verl's rejection sampling keeps token t (rollout_rs=token) when C_low <= rho_t <= C_high, a
    sequence (rollout_rs=sequence) when C_low <= prod_t rho_t <= C_high, and (geometric) when
    C_low <= exp(mean_t log rho_t) <= C_high, over the response tokens; REINFORCE on the kept ones."""
    lp, raw, seg = batch(seed=11)
    low, high = bounds(kind)
    log_rho = (lp.detach() - raw["logprobs"]) * raw["mask"]
    n = seg.sum(raw["mask"])
    per_seq = {"seq_mis": seg.sum(log_rho), "geo_mis": seg.sum(log_rho) / n}.get(kind)
    accepted = ((torch.exp(per_seq) >= low) & (torch.exp(per_seq) <= high))[seg.ids] if per_seq is not None \
        else (torch.exp(log_rho) >= low) & (torch.exp(log_rho) <= high)
    assert accepted.any() and not accepted[raw["mask"] != 0].all()
    reference = -(accepted * raw["advantages"] * lp).sum()
    reference.backward()
    want = lp.grad.clone()
    inputs = loss_inputs("importance_sampling", raw)
    _, grad, _ = run_loss("importance_sampling", lp, inputs, seg, CONFIGS[kind])
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-9)


def test_icepop_is_its_published_objective():
    """IcePop (INTELLECT-3 report eq. 1): J = sum_t M(pi_train / pi_infer; alpha, beta) * A_t with
    M(k) = k on [alpha, beta] and 0 outside, the gradient flowing through k: loss -J, value and gradient."""
    lp, raw, seg = batch(seed=5)
    alpha, beta = bounds("icepop")
    k = torch.exp(lp - raw["logprobs"])
    inside = ((k >= alpha) & (k <= beta)).detach()
    reference = -(torch.where(inside, k, torch.zeros_like(k)) * raw["advantages"]).sum()
    reference.backward()
    want = lp.grad.clone()
    value, grad, _ = run_loss("importance_sampling", lp, loss_inputs("importance_sampling", raw), seg,
                              CONFIGS["icepop"])
    assert value == pytest.approx(float(reference), abs=1e-9)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-9)


# ---- metrics -----------------------------------------------------------------------------------
def test_metrics_count_the_sampled_tokens_truncated_and_masked():
    lp = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    rho = torch.tensor([1.0, 0.25, 0.9, 1.0, 1.5, 3.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([0.0, 1.0, -1.0, 2.0, 1.0, -0.5, 0.0], dtype=torch.float64)  # 5 sampled tokens
    inputs = {"logprobs": -torch.log(rho), "advantages": adv}
    seg = Segments(torch.zeros(7, dtype=torch.long), 1)
    _, _, tis = run_loss("importance_sampling", lp, inputs, seg, {"tis_cap": 2.0})
    assert tis["is_tokens:sum"] == 5 and tis["is_truncated:sum"] == 1 and tis["is_masked:sum"] == 0
    assert tis["is_weight:sum"] == pytest.approx(0.25 + 0.9 + 1.0 + 1.5 + 3.0)
    assert (tis["is_weight:max"], tis["is_weight:min"]) == pytest.approx((3.0, 0.25))
    _, _, mis = run_loss("importance_sampling", lp, inputs, seg, {"mis_low": 0.5, "mis_high": 2.0})
    assert mis["is_masked:sum"] == 2 and mis["is_truncated:sum"] == 0
    _, _, seq = run_loss("importance_sampling", lp, inputs, seg, {"seq_mis_low": 0.5, "seq_mis_high": 1.01})
    assert seq["is_masked:sum"] == 5  # the sequence's product 0.25 * 0.9 * 1.5 * 3 = 1.0125 is past 1.01
    rows = off_policy_metrics([tis, {"loss:sum": 1.0}, {**tis, "is_weight:max": 7.0, "is_weight:min": 0.5}])
    assert rows == pytest.approx({"off_policy/is_weight_mean": 6.65 / 5, "off_policy/is_weight_max": 7.0,
                                  "off_policy/is_weight_min": 0.25, "off_policy/truncated_frac": 0.2,
                                  "off_policy/masked_frac": 0.0})
    assert off_policy_metrics([{"loss:sum": 1.0}]) == {}


# ---- the local engine, client-side folding, polyrl serve -----------------------------------------
def engine_batch(tc, seed: int, loss_fn: str = "ppo") -> list[types.Datum]:
    """Three random datums with sampler logprobs off the learner's as in :func:`batch` and advantages
    zero on their first two tokens (plus the action mask dro and gspo take)."""
    gen = torch.Generator().manual_seed(seed)
    base = [random_datum(gen, n) for n in (6, 9, 12)]
    data = []
    for i, (d, lp) in enumerate(zip(base, out_logprobs(tc.forward(base, "cross_entropy").result()))):
        q = lp + (0.0, 0.5, 0.0)[i] + (0.05, 0.2, 0.8)[i] * torch.randn(len(lp), generator=gen)
        adv = torch.randn(len(lp), generator=gen)
        adv[:2] = 0.0
        extra = {"dro": {"mask": (adv != 0).float()}, "gspo": {"sequence_ratio_mask": (adv != 0).float()}}
        data.append(with_inputs(d, logprobs=q, advantages=adv, **extra.get(loss_fn, {})))
    return data


def inputs_of(d: types.Datum, key: str) -> torch.Tensor:
    return d.loss_fn_inputs[key].to_torch().double().reshape(-1)


@pytest.mark.parametrize("kind", sorted(CORRECTIONS))
def test_engine_applies_the_correction_in_the_loss(service, warm, kind):
    """ppo with a correction on the tiny model: the loss, its gradient (against a reference PEFT model's
    gradient of sum_t -c_t A_t log p_t) and the metrics, from the learner's logprobs."""
    tc = from_state(service, warm["path"])
    data = engine_batch(tc, seed=len(kind))
    out = tc.forward_backward(data, "ppo", CONFIGS[kind]).result()
    got = take_grads(tc)
    low, high = bounds(kind)
    lps = [lp.double() for lp in out_logprobs(out)]
    flat = torch.cat([lp - inputs_of(d, "logprobs") for lp, d in zip(lps, data)])
    adv = torch.cat([inputs_of(d, "advantages") for d in data])
    ids = [i for i, lp in enumerate(lps) for _ in range(len(lp))]
    c = torch.tensor(direct_factor(kind, torch.exp(flat).tolist(), ids, (adv != 0).tolist(), low, high),
                     dtype=torch.float64)
    assert out.metrics["loss:sum"] == pytest.approx(float(-(c * adv).sum()), rel=1e-5, abs=1e-5)
    coefs = list(torch.split(-c * adv, [len(lp) for lp in lps]))
    assert_grads_close(got, ref_grads(warm["ref"], data, coefs))
    active = adv != 0
    assert out.metrics["is_tokens:sum"] == int(active.sum())
    assert out.metrics["is_weight:sum"] == pytest.approx(float(torch.exp(flat)[active].sum()), rel=1e-5)
    masked = int(((c == 0) & active).sum())
    assert out.metrics["is_masked:sum"] == masked and (masked > 0) == (kind != "tis")


def test_engine_refusals(service, warm):
    tc = from_state(service, warm["path"])
    data = engine_batch(tc, seed=1)
    ce = [types.Datum(model_input=d.model_input,
                      loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in data]
    cases = [
        (ce, "cross_entropy", {"tis_cap": 2.0}, "are an off-policy correction, which needs the sampler's "
                                                "logprobs: loss 'cross_entropy' has none"),
        (data, "ppo", {"tis_cap": 0.5}, "tis_cap must be >= 1, got 0.5"),
        (data, "ppo", {"mis_low": 1.2, "mis_high": 2.0}, "must have 0 <= low < 1 < high"),
        (data, "ppo", {"mis_low": 0.5}, "correction 'mis' needs ['mis_low', 'mis_high']"),
        (data, "ppo", {"tis_cap": 2.0, "icepop_low": 0.5, "icepop_high": 2.0}, "one at a time"),
        (data, "ppo", {"tis_cap": float("inf")}, "must be finite"),
    ]
    for d, loss, config, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")) as info:
            tc.forward_backward(d, loss, config).result()
        assert "\n" not in str(info.value)
    spec = get_loss("stable_reinforce")
    with pytest.raises(ValueError, match="would truncate it twice"):
        inputs = {"advantages": torch.ones(2), "sampled": torch.ones(2), "sampler_logprobs": torch.zeros(2)}
        spec.fn(torch.zeros(2), inputs, Segments(torch.zeros(2, dtype=torch.long), 1), {"tis_cap": 2.0})


@pytest.mark.parametrize(("loss_fn", "kind"), [("ppo", "tis"), ("importance_sampling", "seq_mis"),
                                               ("gspo", "icepop"), ("dro", "geo_mis"), ("cispo", "mis")])
def test_client_side_folding_equals_the_in_loss_correction(service, warm, loss_fn, kind):
    """What polyrl train does with backend tinker (a forward pass, the factor folded into the advantages,
    the ratio losses' logprobs made the learner's) gives the loss, gradients and metrics of the
    correction inside the loss."""
    inside, folding = from_state(service, warm["path"]), from_state(service, warm["path"])
    data = engine_batch(inside, seed=7, loss_fn=loss_fn)
    want = inside.forward_backward(data, loss_fn, CONFIGS[kind]).result()
    guard = ServiceGuard(None, 60.0)
    folded, metrics = asyncio.run(fold_correction(folding, guard, data, loss_fn, CONFIGS[kind]))
    assert all("tis_cap" not in d.loss_fn_inputs for d in folded)
    got = folding.forward_backward(folded, loss_fn).result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert_grads_close(take_grads(folding), take_grads(inside))
    for key, value in metrics.items():
        assert want.metrics[key] == pytest.approx(value, rel=1e-5), key
    assert metrics["is_masked:sum"] + metrics["is_truncated:sum"] > 0


def test_folding_equals_the_in_loss_mask_for_stable_reinforce(service, off_policy):
    """stable_reinforce keeps its own truncated weight against the recorded sampler logprobs; a mask
    folded client-side (provenance says which targets were sampled) equals the mask inside the loss."""
    inside = off_policy["tc"]
    folding = from_state(service, inside.save_state("folding").result().path)
    config = {"icepop_low": 0.7, "icepop_high": 1.3}
    want = inside.forward_backward(off_policy["data"], "stable_reinforce", config).result()
    folded, metrics = asyncio.run(fold_correction(folding, ServiceGuard(None, 60.0), off_policy["data"],
                                                  "stable_reinforce", config))
    got = folding.forward_backward(folded, "stable_reinforce").result()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert_grads_close(take_grads(folding), take_grads(inside))
    assert metrics["is_tokens:sum"] == want.metrics["is_tokens:sum"] == want.metrics["sampled_tokens:sum"]
    assert 0 < metrics["is_masked:sum"] == want.metrics["is_masked:sum"] < metrics["is_tokens:sum"]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("serve-correction-store"), "--long-poll", "1")
    yield s
    s.stop()


def test_serve_applies_the_correction_as_in_process(served, tiny_model_dir, tmp_path):
    """The correction's loss_fn_config keys travel over Tinker's HTTP protocol unchanged: the same loss,
    metrics and update as the in-process engine."""
    sdk = served.sdk(KEY)
    remote = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=5).result()
    local = ServiceClient(store_dir=tmp_path).create_lora_training_client(tiny_model_dir, rank=4,
                                                                          seed=5).result()
    data = engine_batch(local, seed=3)
    for loss_fn, kind in (("ppo", "icepop"), ("importance_sampling", "tis")):
        outs = [client.forward_backward(data, loss_fn, CONFIGS[kind]).result() for client in (remote, local)]
        for key, value in outs[1].metrics.items():
            assert outs[0].metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        assert outs[1].metrics["is_masked:sum"] + outs[1].metrics["is_truncated:sum"] > 0
        for client in (remote, local):
            client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    got, want = (out_logprobs(c.forward(data, "cross_entropy").result()) for c in (remote, local))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-5)
    assert (got[0] - out_logprobs(sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=5)
                                  .result().forward(data, "cross_entropy").result())[0]).abs().max() > 1e-3
    sdk.close("success").result()


# ---- polyrl train --------------------------------------------------------------------------------
def test_train_with_a_correction_logs_its_metrics(tiny_model_dir, tmp_path):
    from test_train import _config

    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    config = _config(tiny_model_dir, tmp_path, max_steps=2, save_every=0, loss_fn="ppo",
                     off_policy={"correction": "tis", "correction_cap": 1.5})
    train(config, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        # sampled and trained in float32 on the same weights: the ratio is 1 up to rounding
        assert row["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        low, mean, high = (row[f"off_policy/is_weight_{k}"] for k in ("min", "mean", "max"))
        assert 0 < low <= mean <= high
        assert row["off_policy/truncated_frac"] == 0.0 and row["off_policy/masked_frac"] == 0.0


def test_train_through_the_sdk_folds_the_correction_client_side(served, tiny_model_dir, tmp_path,
                                                               monkeypatch):
    """backend tinker (here polyrl serve through the official SDK, as hosted Tinker would be): a forward
    pass per minibatch, the correction folded into the Datums, its metrics logged."""
    from test_train import _config

    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    config = _config(tiny_model_dir, tmp_path, backend="tinker", base_url=served.url, local={}, max_steps=2,
                     save_every=0, loss_fn="ppo",
                     off_policy={"correction": "icepop", "stream_minibatches": 2})
    train(config, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["off_policy/masked_frac"] == 0.0 and row["optim/datums"] > 0


# ---- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "expected"), [
    (["off_policy.correction=trunc"], "off_policy.correction: Input should be 'none', 'tis', 'mis', "
                                      "'seq_mis', 'geo_mis' or 'icepop'"),
    (["off_policy.correction=tis", "off_policy.correction_cap=0.5"],
     "off_policy.correction_cap: Input should be greater than or equal to 1"),
    (["off_policy.correction=mis", "off_policy.correction_low=1.5"],
     "off_policy.correction_low: must be below 1 and correction_high above it"),
    (["off_policy.correction=icepop", "off_policy.correction_high=0.9"],
     "off_policy.correction_high: Input should be greater than 1"),
    (["off_policy.correction=tis", "off_policy.correction_low=0.2"],
     "off_policy.correction_low: only used by the masks"),
    (["off_policy.correction_cap=3"], "off_policy.correction_cap: only used by correction 'tis', not 'none'"),
    (["loss_fn=stable_reinforce", "off_policy.correction=tis"],
     "off_policy.correction: stable_reinforce truncates its importance weight itself"),
])
def test_bad_correction_settings_are_one_line_naming_the_key(overrides, expected):
    from test_config import BASE, error_of

    message = error_of(None, overrides, base=BASE)
    assert message.startswith(expected), message
    assert ";" not in message


def test_a_bad_correction_on_the_command_line_exits_2(tmp_path, capsys):
    from polyrl.cli import main

    (tmp_path / "c.yaml").write_text("model_name: tiny\nenvironments: {arithmetic: {}}\n")
    with pytest.raises(SystemExit) as done:
        main(["train", "--config_path", str(tmp_path / "c.yaml"), "--overrides", "off_policy.correction=tis",
              "off_policy.correction_cap=0"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "off_policy.correction_cap" in err[0], err


def test_train_config_keys_match_the_engine(tmp_path):
    """off_policy.correction becomes the engine's loss_fn_config keys (defaults per correction)."""
    from polyrl.rl.update import correction_keys

    def keys(**settings):
        config = TrainConfig(model_name="m", environments={"arithmetic": {}}, off_policy=settings)
        return correction_keys(config)

    assert keys() == {}
    assert keys(correction="tis") == {"tis_cap": 2.0}
    assert keys(correction="geo_mis") == {"geo_mis_low": 0.999, "geo_mis_high": 1.001}
    assert keys(correction="icepop", correction_low=0.2) == {"icepop_low": 0.2, "icepop_high": 5.0}
    assert keys(correction="seq_mis", correction_high=3.0) == {"seq_mis_low": 0.5, "seq_mis_high": 3.0}
    for kind in CORRECTIONS:
        assert set(keys(correction=kind)) == set(CORRECTIONS[kind])
