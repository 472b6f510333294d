"""The local engine (polyrl.local) against independent references.

Loss values are recomputed here in plain torch from the learner logprobs the engine returns;
gradients are recomputed through a *separate* Hugging Face + PEFT model loaded from the same
adapter checkpoint (``PeftModel.from_pretrained``), using each loss's analytic derivative with
respect to the token logprobs (``d loss / d lp_t``), so nothing here goes through
``polyrl.local.losses``. Everything runs on the ``unit`` tiny model (~60k parameters).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from pathlib import Path

import pytest
import torch
from tinker import types

from polyrl.local import ServiceClient

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

LOW, HIGH = 0.8, 1.2  # Tinker's default PPO / CISPO ratio bounds
LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")


# ---- helpers ----------------------------------------------------------------------------------
def f32(values) -> types.TensorData:
    return types.TensorData.from_torch(torch.as_tensor(values, dtype=torch.float32).reshape(-1))


def make_datum(inputs: list[int], targets: list[int], **floats) -> types.Datum:
    loss_inputs: dict = {"target_tokens":
                         types.TensorData.from_torch(torch.tensor(targets, dtype=torch.long))}
    loss_inputs.update({k: f32(v) for k, v in floats.items()})
    return types.Datum(model_input=types.ModelInput.from_ints(list(inputs)), loss_fn_inputs=loss_inputs)


def with_inputs(d: types.Datum, **floats) -> types.Datum:
    """``d`` with extra / replaced float loss inputs."""
    inputs = dict(d.loss_fn_inputs)
    inputs.update({k: f32(v) for k, v in floats.items()})
    return types.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


def random_datum(gen: torch.Generator, length: int, vocab: int = 700) -> types.Datum:
    ids = torch.randint(0, vocab, (length + 1,), generator=gen).tolist()
    return make_datum(ids[:-1], ids[1:])


def out_logprobs(out: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch().float() for o in out.loss_fn_outputs]


def adapter_params(tc) -> dict[str, torch.nn.Parameter]:
    """The training client's LoRA parameters by PEFT name (adapter name normalised to ``default``)."""
    st = tc._state
    marker = f".{st.adapter}."
    named = {n.replace(marker, ".default."): p for n, p in st.base.peft_model.named_parameters()
             if marker in n}
    assert {id(p) for p in named.values()} == {id(p) for p in st.params}
    return named


def weights(tc) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in adapter_params(tc).items()}


def take_grads(tc) -> dict[str, torch.Tensor]:
    """The accumulated gradients (zero where none), which are then cleared."""
    out = {}
    for n, p in adapter_params(tc).items():
        out[n] = (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).cpu()
        p.grad = None
    return out


def grad_norm(g: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for v in g.values()))


def assert_grads_close(got: dict, want: dict, rtol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    scale = max(float(v.abs().max()) for v in want.values())
    assert scale > 0, "reference gradient is zero: the check would be vacuous"
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=rtol * scale, msg=lambda m: f"{n}: {m}")


def assert_weights_equal(a: dict, b: dict, atol: float = 1e-7) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=atol, msg=lambda m: f"{n}: {m}")


def checkpoint_dir(store: Path, path: str) -> Path:
    from polyrl.local.checkpoints import Store

    return Store(store).resolve(path)[1]


def adam(lr: float = 1e-2) -> types.AdamParams:
    return types.AdamParams(learning_rate=lr)


def load_reference(model_dir: str, adapter_dir: Path):
    """A plain HF model + PEFT adapter loaded from disk: independent of polyrl's engine."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    model.eval()
    return model


def ref_token_logprobs(ref, d: types.Datum) -> torch.Tensor:
    ids = torch.tensor([d.model_input.to_ints()])
    targets = d.loss_fn_inputs["target_tokens"].to_torch().long().reshape(-1)
    logits = ref(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def ref_grads(ref, data: list[types.Datum], coefs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradient of ``sum_t coef_t * lp_t`` (``coef_t`` = d loss / d lp_t, held constant)."""
    ref.zero_grad(set_to_none=True)
    total = sum((c.float() * ref_token_logprobs(ref, d)).sum() for d, c in zip(data, coefs))
    total.backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in ref.named_parameters() if p.requires_grad}


def float_input(d: types.Datum, key: str) -> torch.Tensor | None:
    td = d.loss_fn_inputs.get(key)
    return None if td is None else td.to_torch().double().reshape(-1)


def reference_loss(name: str, lps: list[torch.Tensor], data: list[types.Datum],
                   config: dict) -> tuple[float, list[torch.Tensor]]:
    """(loss value, per-datum d loss / d lp) for loss ``name``, from the formulas in Tinker's docs."""
    low = config.get("clip_low_threshold", LOW)
    high = config.get("clip_high_threshold", HIGH)
    total, coefs = 0.0, []
    for lp, d in zip(lps, data):
        lp = lp.double()
        if name == "cross_entropy":
            w = float_input(d, "weights")
            w = torch.ones_like(lp) if w is None else w
            total += float(-(w * lp).sum())
            coefs.append(-w)
            continue
        old, adv = float_input(d, "logprobs"), float_input(d, "advantages")
        ratio = torch.exp(lp - old)
        clipped_ratio = ratio.clamp(low, high)
        if name == "importance_sampling":
            total += float(-(ratio * adv).sum())
            coefs.append(-ratio * adv)
        elif name == "ppo":
            total += float(-torch.minimum(ratio * adv, clipped_ratio * adv).sum())
            # the clipped branch is the minimum (and flat) when A > 0, r > high or A < 0, r < low
            flat = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
            coefs.append(torch.where(flat, torch.zeros_like(ratio), -ratio * adv))
        elif name == "cispo":
            total += float(-(clipped_ratio * lp * adv).sum())
            coefs.append(-clipped_ratio * adv)
        elif name == "dro":
            beta = config.get("beta", 0.05)
            total += float(-(lp * adv - 0.5 * beta * (lp - old) ** 2).sum())
            coefs.append(-(adv - beta * (lp - old)))
        elif name == "gspo":
            mask = float_input(d, "sequence_ratio_mask")
            mask = (mask != 0) if mask is not None else (adv != 0)
            seq_ratio = math.exp(float((lp - old)[mask].mean()))
            r = torch.full_like(lp, seq_ratio)
            total += float(-torch.minimum(r * adv, r.clamp(low, high) * adv).sum())
            flat = ((adv > 0) & (r > high)) | ((adv < 0) & (r < low))
            coefs.append(torch.where(flat, torch.zeros_like(r), -r * adv))
        else:
            raise AssertionError(name)
    return total, coefs


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def service(store) -> ServiceClient:
    return ServiceClient(store_dir=store)


@pytest.fixture(scope="module")
def warm(service, store, tiny_model_dir):
    """A saved training state whose LoRA A and B are both nonzero (so every gradient is), plus a
    reference PEFT model loaded from the same checkpoint directory."""
    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=1).result()
    gen = torch.Generator().manual_seed(0)
    data = [random_datum(gen, n) for n in (5, 9, 13)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam(0.02))
    path = tc.save_state("warm").result().path
    directory = checkpoint_dir(store, path)
    return {"path": path, "dir": directory, "ref": load_reference(tiny_model_dir, directory)}


def from_state(service, path: str, optimizer: bool = True):
    if optimizer:
        return service.create_training_client_from_state_with_optimizer(path).result()
    return service.create_training_client_from_state(path).result()


@pytest.fixture(scope="module")
def learned(service, tiny_model_dir):
    """A LoRA trained with cross_entropy to answer one prompt with a fixed sequence."""
    tc = service.create_lora_training_client(tiny_model_dir, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt = tok.encode("Question: what is 12 + 30?")
    target = tok.encode(" The answer is 42, final.")
    full = prompt + target
    d = make_datum(full[:-1], full[1:], weights=[0.0] * (len(prompt) - 1) + [1.0] * len(target))
    losses = []
    for _ in range(60):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(adam(0.005))
        losses.append(fb.result().metrics["loss:sum"])
    sampler = tc.save_weights_and_get_sampling_client("learned").result()
    return {"tc": tc, "tok": tok, "prompt": prompt, "target": target, "losses": losses, "sampler": sampler}


# ---- losses: values and gradients -------------------------------------------------------------
def _loss_batch(tc, gen: torch.Generator) -> list[types.Datum]:
    """Three datums of different lengths with old logprobs off by a random amount (ratios spread
    over ~[0.5, 2], so PPO's clipping is active on some tokens) and some zero advantages."""
    base = [random_datum(gen, n) for n in (4, 11, 17)]
    lps = out_logprobs(tc.forward(base, "cross_entropy").result())
    data = []
    for d, lp in zip(base, lps):
        old = lp + 0.4 * torch.randn(len(lp), generator=gen)
        adv = torch.randn(len(lp), generator=gen)
        adv[: len(lp) // 4] = 0.0  # "prompt" tokens
        weights = torch.rand(len(lp), generator=gen)
        data.append(with_inputs(d, logprobs=old, advantages=adv, weights=weights))
    return data


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_loss_value_and_gradient_match_reference(service, warm, loss_fn):
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(100 + LOSS_NAMES.index(loss_fn))
    data = _loss_batch(tc, gen)
    keys = {"cross_entropy": ("target_tokens", "weights")}.get(
        loss_fn, ("target_tokens", "logprobs", "advantages"))
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in keys})
            for d in data]

    out = tc.forward_backward(data, loss_fn).result()
    got = take_grads(tc)
    lps = out_logprobs(out)
    assert [len(x) for x in lps] == [d.model_input.length for d in data]
    for d, lp in zip(data, lps):  # the learner's logprobs are the reference model's
        torch.testing.assert_close(lp, ref_token_logprobs(warm["ref"], d).detach(), rtol=0, atol=2e-5)

    value, coefs = reference_loss(loss_fn, lps, data, {})
    assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-5, abs=1e-5)
    assert_grads_close(got, ref_grads(warm["ref"], data, coefs))


def test_loss_config_changes_value_and_gradient(service, warm):
    """dro's beta, ppo's thresholds and gspo's sequence_ratio_mask all reach the loss."""
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(7)
    data = [types.Datum(model_input=d.model_input,
                        loss_fn_inputs={k: d.loss_fn_inputs[k]
                                        for k in ("target_tokens", "logprobs", "advantages")})
            for d in _loss_batch(tc, gen)]
    cases = [("dro", {"beta": 0.7}, data),
             ("ppo", {"clip_low_threshold": 0.6, "clip_high_threshold": 1.05}, data),
             ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, data),
             ("gspo", {}, [with_inputs(d, sequence_ratio_mask=(
                               torch.arange(d.model_input.length) % 2 == 0).float())
                           for d in data])]
    for loss_fn, config, batch in cases:
        out = tc.forward_backward(batch, loss_fn, config).result()
        got = take_grads(tc)
        value, coefs = reference_loss(loss_fn, out_logprobs(out), batch, config)
        default_value, _ = reference_loss(loss_fn, out_logprobs(out), [types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"})
            for d in batch], {})
        assert abs(value - default_value) > 1e-3, f"{loss_fn}: the config case must differ from the default"
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-5, abs=1e-5), loss_fn
        assert_grads_close(got, ref_grads(warm["ref"], batch, coefs))


# ---- PPO / CISPO clipping ---------------------------------------------------------------------
CLIP_CASES = [  # (ratio, where it sits relative to [0.8, 1.2])
    (0.5, "below"), (LOW, "at_low"), (1.0, "inside"), (HIGH, "at_high"), (1.7, "above"),
]


def _single_token_datum(d: types.Datum, lp: torch.Tensor, t: int, ratio: float, adv: float) -> types.Datum:
    """Only token ``t`` is active (nonzero advantage); its old logprob makes exp(lp - old) = ratio."""
    old = lp.clone().double()
    old[t] = lp[t].double() - math.log(ratio)
    a = torch.zeros(len(lp))
    a[t] = adv
    return with_inputs(d, logprobs=old.float(), advantages=a)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_clipping_at_and_beyond_thresholds(service, warm, loss_fn):
    tc = from_state(service, warm["path"])
    d = random_datum(torch.Generator().manual_seed(3), 10)
    lp = out_logprobs(tc.forward([d], "cross_entropy").result())[0]
    t = 6
    token_grad = ref_grads(warm["ref"], [d], [torch.eye(len(lp))[t]])  # gradient of lp_t alone

    def run(ratio, adv, config=None):
        dd = _single_token_datum(d, lp, t, ratio, adv)
        out = tc.forward_backward([dd], loss_fn, config).result()
        return out.metrics, take_grads(tc)

    for config, low, high, cases in [
        (None, LOW, HIGH, CLIP_CASES),
        # custom thresholds: 0.6 and 1.4 are inside [0.5, 1.5], 0.4 and 1.7 beyond
        ({"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, 0.5, 1.5,
         [(0.4, "below"), (0.5, "at_low"), (0.6, "inside"), (1.4, "inside"), (1.5, "at_high"),
          (1.7, "above")]),
    ]:
        for ratio, where in cases:
            for adv in (1.5, -1.5):
                metrics, grads = run(ratio, adv, config)
                clipped = min(max(ratio, low), high)
                if loss_fn == "ppo":
                    want_value = -min(ratio * adv, clipped * adv)
                    # the gradient vanishes where the flat, clipped branch is the minimum
                    flat = (adv > 0 and where == "above") or (adv < 0 and where == "below")
                    coef = 0.0 if flat else -ratio * adv
                else:  # cispo: clipped weight, gradient everywhere
                    want_value = -clipped * float(lp[t]) * adv
                    coef = -clipped * adv
                label = f"{loss_fn} ratio={ratio} ({where}) adv={adv} config={config}"
                assert metrics["loss:sum"] == pytest.approx(want_value, rel=1e-4, abs=1e-6), label
                want_clipped = 1.0 if where in ("below", "above") else 0.0
                if where not in ("at_low", "at_high"):
                    assert metrics["clipped_tokens:sum"] == want_clipped, label
                if where in ("at_low", "at_high"):
                    continue  # the boundary itself: the value is continuous, the gradient a convention
                if coef == 0.0:
                    assert grad_norm(grads) == 0.0, f"{label}: a clipped token must not contribute gradient"
                else:
                    assert grad_norm(grads) > 0, label
                    assert_grads_close(grads, {n: coef * g for n, g in token_grad.items()})


def test_per_token_clip_thresholds_override_config(service, warm):
    tc = from_state(service, warm["path"])
    d = random_datum(torch.Generator().manual_seed(4), 6)
    lp = out_logprobs(tc.forward([d], "cross_entropy").result())[0]
    dd = _single_token_datum(d, lp, 3, 1.4, 1.0)
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}  # 1.4 inside: unclipped
    assert tc.forward([dd], "ppo", config).result().metrics["loss:sum"] == pytest.approx(-1.4, rel=1e-4)
    per_token = with_inputs(dd, clip_low_threshold=[0.9] * len(lp), clip_high_threshold=[1.1] * len(lp))
    assert (tc.forward([per_token], "ppo", config).result().metrics["loss:sum"]
            == pytest.approx(-1.1, rel=1e-4))


# ---- gradient accumulation --------------------------------------------------------------------
def test_gradient_accumulation_halves_equal_union(service, warm):
    a = from_state(service, warm["path"])
    b = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(11)
    base = [random_datum(gen, n) for n in (3, 20, 7, 12, 5, 16)]
    lps = out_logprobs(a.forward(base, "cross_entropy").result())
    data = [with_inputs(d, logprobs=lp + 0.3 * torch.randn(len(lp), generator=gen),
                        advantages=torch.randn(len(lp), generator=gen)) for d, lp in zip(base, lps)]

    m1 = a.forward_backward(data[:3], "importance_sampling")
    m2 = a.forward_backward(data[3:], "importance_sampling")
    engine = service.engine
    saved_budget = engine.micro_batch_tokens
    engine.micro_batch_tokens = 40  # also split the union into several micro-batches
    try:
        mu = b.forward_backward(data, "importance_sampling").result()
    finally:
        engine.micro_batch_tokens = saved_budget
    assert m1.result().metrics["loss:sum"] + m2.result().metrics["loss:sum"] == pytest.approx(
        mu.metrics["loss:sum"], rel=1e-5)
    grads_a = {n: p.grad.clone() for n, p in adapter_params(a).items()}
    grads_b = {n: p.grad.clone() for n, p in adapter_params(b).items()}
    assert grad_norm(grads_b) > 0
    assert_grads_close(grads_a, grads_b, rtol=1e-5)

    a.optim_step(adam(1e-3)).result()
    b.optim_step(adam(1e-3)).result()
    wa, wb = weights(a), weights(b)
    assert_weights_equal(wa, wb, atol=1e-6)
    assert any(not torch.equal(wa[n], w) for n, w in from_weights(service, warm["path"]).items())


def from_weights(service, path):
    return weights(from_state(service, path, optimizer=False))


# ---- sampler ----------------------------------------------------------------------------------
def _forward_logprobs_of(tc, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    full = prompt + tokens
    lp = out_logprobs(tc.forward([make_datum(full[:-1], full[1:])], "cross_entropy").result())[0]
    return lp[len(prompt) - 1 :]


def test_sampler_logprobs_match_forward(service, warm):
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("sampling_lp").result()
    gen = torch.Generator().manual_seed(5)
    requests = [  # (prompt length, num_samples, params)
        (3, 1, types.SamplingParams(max_tokens=5)),
        (7, 3, types.SamplingParams(max_tokens=17)),
        (12, 2, types.SamplingParams(max_tokens=30, temperature=0.7)),
        (1, 1, types.SamplingParams(max_tokens=9, top_p=0.9, top_k=50)),
        (20, 1, types.SamplingParams(max_tokens=2)),
    ]
    prompts = [torch.randint(0, 700, (n,), generator=gen).tolist() for n, _, _ in requests]
    # all submitted before waiting, so the engine batches them into one decode loop
    futures = [sampler.sample(types.ModelInput.from_ints(p), n, params)
               for p, (_, n, params) in zip(prompts, requests)]
    lengths = set()
    for prompt, (_, n, params), fut in zip(prompts, requests, futures):
        res = fut.result()
        assert len(res.sequences) == n
        for seq in res.sequences:
            assert 1 <= len(seq.tokens) <= params.max_tokens
            assert len(seq.logprobs) == len(seq.tokens)
            lengths.add(len(seq.tokens))
            # sampler logprobs are the model's own (temperature 1) logprobs, as forward computes them
            want = _forward_logprobs_of(tc, prompt, list(seq.tokens))
            torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float32), want,
                                       rtol=0, atol=1e-4)
    assert len(lengths) >= 3


def test_sampler_cache_growth_and_pruning_keep_logprobs_exact(service, warm, monkeypatch):
    """Rows finishing at different steps (dropped from the KV cache) and a cache that has to grow
    past its initial size still give the forward pass's logprobs."""
    import polyrl.local.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "INITIAL_DECODE_CAPACITY", 3)
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("growth").result()
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 700, (n,), generator=gen).tolist() for n in (2, 9, 5)]
    stops = list(range(0, 768, 13))
    futures = [sampler.sample(types.ModelInput.from_ints(p), 3,
                              types.SamplingParams(max_tokens=40, stop=stops, seed=i))
               for i, p in enumerate(prompts)]
    lengths = []
    for prompt, fut in zip(prompts, futures):
        for seq in fut.result().sequences:
            lengths.append(len(seq.tokens))
            want = _forward_logprobs_of(tc, prompt, list(seq.tokens))
            torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float32), want,
                                       rtol=0, atol=1e-4)
    assert len(set(lengths)) > 2 and max(lengths) > 6, lengths


def _decode_rows(tc) -> tuple[list[int], object]:
    """The rows of every decode pass of ``tc``'s model (its embedding sees one token per row), and the hook
    that records them."""
    fed: list[int] = []

    def record(_module, args, _out):
        ids = args[0]
        if ids.dim() == 1 or ids.shape[-1] == 1:  # a decode pass, not a prefill
            fed.append(int(ids.shape[0]))

    return fed, tc._state.base.hf_model.get_input_embeddings().register_forward_hook(record)


def test_rows_with_the_same_history_share_decode_passes(learned):
    """Samples of one prompt that have drawn the same tokens so far are one row of each decode pass and of
    the KV cache, and part when they draw different tokens: every sample's logprobs are still the forward
    pass's, rows ending at different steps included, and the passes fed fewer rows than tokens."""
    tc, sampler, prompt, target = learned["tc"], learned["sampler"], learned["prompt"], learned["target"]
    fed, hook = _decode_rows(tc)
    try:
        greedy = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                                types.SamplingParams(max_tokens=len(target), temperature=0.0)).result()
        assert [list(s.tokens) for s in greedy.sequences] == [target] * 4
        assert fed == [1] * (len(target) - 1), fed  # one row for the four
        fed.clear()
        stops = [t for t in range(0, 1024, 5) if t not in target]  # rows that wander off the answer end
        requests = [(prompt, 6, types.SamplingParams(max_tokens=12, temperature=1.6, seed=7)),
                    (prompt, 4, types.SamplingParams(max_tokens=10, temperature=2.0, seed=3, stop=stops)),
                    (prompt[1:], 3, types.SamplingParams(max_tokens=8, temperature=3.0, seed=5))]
        futures = [sampler.sample(types.ModelInput.from_ints(p), n, params) for p, n, params in requests]
        results = [(p, fut.result().sequences) for (p, _, _), fut in zip(requests, futures)]
    finally:
        hook.remove()
    tokens = 0
    for p, sequences in results:
        for seq in sequences:
            tokens += len(seq.tokens) - 1  # each sample's tokens but its last went through a decode pass
            want = _forward_logprobs_of(tc, p, list(seq.tokens))
            torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float32), want,
                                       rtol=0, atol=1e-4)
    tempered = [list(s.tokens) for s in results[0][1]]
    parted = [(a, b) for i, a in enumerate(tempered) for b in tempered[i + 1:] if a[0] == b[0] and a != b]
    assert parted, "the check needs samples that share a first token, then part"
    assert len({len(s.tokens) for s in results[1][1]}) > 1, "the check needs samples ending at other steps"
    assert sum(fed) < tokens, (sum(fed), tokens)


def test_seeded_sampling_is_reproducible(service, warm):
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("seeded").result()
    prompt = types.ModelInput.from_ints([5, 17, 200, 33])
    params = lambda seed: types.SamplingParams(max_tokens=24, seed=seed)  # noqa: E731

    first = sampler.sample(prompt, 1, params(123)).result().sequences[0].tokens
    # the same seed, this time batched with other requests
    others = [sampler.sample(types.ModelInput.from_ints([9, 10 + i]), 2, types.SamplingParams(max_tokens=30))
              for i in range(3)]
    again = sampler.sample(prompt, 1, params(123))
    [o.result() for o in others]
    assert list(again.result().sequences[0].tokens) == list(first)
    assert list(sampler.sample(prompt, 1, params(124)).result().sequences[0].tokens) != list(first)

    multi = sampler.sample(prompt, 4, params(99)).result()
    seqs = {tuple(s.tokens) for s in multi.sequences}
    assert len(seqs) == 4, "num_samples > 1 must give distinct samples"
    multi_again = sampler.sample(prompt, 4, params(99)).result()
    assert [list(s.tokens) for s in multi_again.sequences] == [list(s.tokens) for s in multi.sequences]
    unseeded = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=24)).result()
    assert len({tuple(s.tokens) for s in unseeded.sequences}) == 4


def test_seeded_multi_sample_does_not_depend_on_batch(service, warm):
    """Rows of a seeded request that stop early must not shift the other rows' random draws,
    whatever else is in the batch."""
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("seeded_batch").result()
    prompt = types.ModelInput.from_ints([5, 17, 200, 33])
    stops = list(range(0, 768, 9))  # ~11% of the vocabulary stops: rows finish at different steps
    params = types.SamplingParams(max_tokens=30, seed=2024, stop=stops)
    alone = sampler.sample(prompt, 6, params).result()
    lengths = {len(s.tokens) for s in alone.sequences}
    assert len(lengths) > 1, "the check needs rows that finish at different steps"
    crowd = [sampler.sample(types.ModelInput.from_ints([9, 10 + i]), 4, types.SamplingParams(max_tokens=30))
             for i in range(6)]
    batched = sampler.sample(prompt, 6, params)
    [c.result() for c in crowd]
    assert [list(s.tokens) for s in batched.result().sequences] == [list(s.tokens) for s in alone.sequences]


def test_cross_entropy_learns_a_fixed_sequence(learned):
    losses = learned["losses"]
    assert losses[-1] < losses[0] / 20, losses
    res = learned["sampler"].sample(types.ModelInput.from_ints(learned["prompt"]), 1,
                                    types.SamplingParams(max_tokens=len(learned["target"]),
                                                         temperature=0.0)).result()
    seq = res.sequences[0]
    assert list(seq.tokens) == learned["target"]
    assert seq.stop_reason == "length"


def test_stop_strings_and_stop_ids(learned):
    sampler, tok, target = learned["sampler"], learned["tok"], learned["target"]
    prompt = types.ModelInput.from_ints(learned["prompt"])
    pieces = [tok.decode([t]) for t in target]
    assert pieces[:6] == [" The", " answer", " is", " ", "4", "2"], pieces  # the stops below rely on these

    def greedy(stop, max_tokens=20):
        return sampler.sample(prompt, 1,
                              types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop))

    cases = [  # (stop, expected token count): the sequence ends at the token completing the stop
        ("42", 6),  # spans two tokens, completed by "2"
        ("swer", 2),  # inside one token
        ("is 4", 5),  # spans three tokens
        (["final", "answer"], 2),  # the earliest of several
        ([target[6]], 7),  # a token id
        ([target[6], target[2]], 3),
    ]
    futures = [greedy(stop) for stop, _ in cases]  # batched together
    for (stop, n), fut in zip(cases, futures):
        seq = fut.result().sequences[0]
        assert list(seq.tokens) == target[:n], (stop, seq.tokens)
        assert seq.stop_reason == "stop", stop
        assert len(seq.logprobs) == n

    for max_tokens in (1, 4):
        seq = greedy(None, max_tokens).result().sequences[0]
        assert list(seq.tokens) == target[:max_tokens] and seq.stop_reason == "length"
    seq = greedy("42", 5).result().sequences[0]  # the length limit comes first
    assert len(seq.tokens) == 5 and seq.stop_reason == "length"
    seq = greedy("never appears", 12).result().sequences[0]
    assert len(seq.tokens) == 12 and seq.stop_reason == "length"


def test_prompt_logprobs_match_forward(service, warm):
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("prompt_lp").result()
    prompt = [11, 250, 3, 99, 400, 7, 64, 128, 5]
    want = out_logprobs(tc.forward([make_datum(prompt[:-1], prompt[1:])], "cross_entropy").result())[0]

    # batched with a longer prompt, so this one is left-padded in the prefill
    other = sampler.sample(types.ModelInput.from_ints(list(range(30, 60))), 2,
                           types.SamplingParams(max_tokens=4))
    res = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=3),
                         include_prompt_logprobs=True).result()
    computed = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert other.result().prompt_logprobs is None
    for got in (res.prompt_logprobs, computed):
        assert len(got) == len(prompt)
        assert got[0] is None or math.isnan(got[0])
        torch.testing.assert_close(torch.tensor(got[1:], dtype=torch.float32), want, rtol=0, atol=1e-4)


# ---- checkpoints ------------------------------------------------------------------------------
def test_save_state_round_trip_gives_identical_next_step(service, store, tiny_model_dir):
    gen = torch.Generator().manual_seed(21)
    batches = [[random_datum(gen, n) for n in (6, 10)] for _ in range(3)]
    a = service.create_lora_training_client(tiny_model_dir, rank=4, seed=5).result()
    for batch in batches[:2]:
        a.forward_backward(batch, "cross_entropy")
        a.optim_step(adam(0.01))
    path = a.save_state("two_steps").result().path
    after_two = weights(a)
    a.forward_backward(batches[2], "cross_entropy")
    a.optim_step(adam(0.01)).result()
    after_three = weights(a)

    b = service.create_training_client_from_state_with_optimizer(path).result()
    assert_weights_equal(weights(b), after_two, atol=0)
    assert b._state.steps == 2
    b.forward_backward(batches[2], "cross_entropy")
    b.optim_step(adam(0.01)).result()
    assert_weights_equal(weights(b), after_three, atol=0)  # a checkpoint holds all a step depends on

    # without the optimizer: same weights, fresh AdamW state (the first step is lr * g / (|g| + eps))
    c = service.create_training_client_from_state(path).result()
    assert_weights_equal(weights(c), after_two, atol=0)
    assert len(c._state.optimizer.state) == 0
    c.forward_backward(batches[2], "cross_entropy").result()
    grads = {n: p.grad.clone() for n, p in adapter_params(c).items()}
    c.optim_step(adam(0.01)).result()
    after_c = weights(c)
    for n, g in grads.items():
        torch.testing.assert_close(after_c[n] - after_two[n], -0.01 * g / (g.abs() + 1e-12),
                                   rtol=1e-4, atol=1e-8)
    assert max(float((after_c[n] - after_three[n]).abs().max()) for n in after_c) > 1e-4


def test_checkpoint_paths_live_in_the_store(service, store, warm):
    tc = from_state(service, warm["path"])
    state_path = tc.save_state("ckpt-a").result().path
    sampler_path = tc.save_weights_for_sampler("ckpt-b").result().path
    assert re.fullmatch(r"tinker://[^/]+/weights/ckpt-a", state_path), state_path
    assert re.fullmatch(r"tinker://[^/]+/sampler_weights/ckpt-b", sampler_path), sampler_path
    assert state_path.split("/")[2] == sampler_path.split("/")[2]  # one run id
    state_dir, sampler_dir = checkpoint_dir(store, state_path), checkpoint_dir(store, sampler_path)
    assert state_dir.is_relative_to(store) and sampler_dir.is_relative_to(store)
    assert ({"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"}
            <= {p.name for p in state_dir.iterdir()})
    assert ((sampler_dir / "adapter_model.safetensors").is_file()
            and not (sampler_dir / "optimizer.pt").exists())
    with pytest.raises(ValueError, match="already exists"):
        tc.save_state("ckpt-a").result()


def test_sampler_weights_round_trip(service, warm):
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(8)
    tc.forward_backward([random_datum(gen, 9)], "cross_entropy")
    tc.optim_step(adam(0.05)).result()
    path = tc.save_weights_for_sampler("for_sampling").result().path

    sampler = service.create_sampling_client(model_path=path).result()
    assert sampler.model_path == path
    base_sampler = service.create_sampling_client(base_model=tc._state.base.name).result()
    prompt = [40, 41, 42, 43, 44]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=10)).result()
    for seq in res.sequences:
        want = _forward_logprobs_of(tc, prompt, list(seq.tokens))
        torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float32), want, rtol=0, atol=1e-4)
    # the saved weights, not the base model's
    base_lp = torch.tensor(base_sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    lora_lp = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    assert float((base_lp - lora_lp).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="no optimizer state"):
        service.create_training_client_from_state_with_optimizer(path).result()


def test_training_clients_on_one_base_are_independent(service, tiny_model_dir):
    a = service.create_lora_training_client(tiny_model_dir, rank=4, seed=9).result()
    b = service.create_lora_training_client(tiny_model_dir, rank=4, seed=9).result()
    assert a._state.base is b._state.base and a.model_id != b.model_id
    gen = torch.Generator().manual_seed(2)
    data = [random_datum(gen, 8), random_datum(gen, 5)]
    probe = [random_datum(gen, 12)]
    b_weights = weights(b)
    assert_weights_equal(weights(a), b_weights, atol=0)  # same seed, same start
    b_lp = out_logprobs(b.forward(probe, "cross_entropy").result())[0]
    b_sampler = b.save_weights_and_get_sampling_client("b0").result()
    b_sample_lp = b_sampler.compute_logprobs(probe[0].model_input).result()

    for _ in range(3):
        a.forward_backward(data, "cross_entropy")
        a.optim_step(adam(0.05))
    a_lp = out_logprobs(a.forward(probe, "cross_entropy").result())[0]
    assert float((a_lp - b_lp).abs().max()) > 1e-3  # a moved
    assert_weights_equal(weights(b), b_weights, atol=0)
    assert all(p.grad is None for p in b._state.params)
    assert torch.equal(out_logprobs(b.forward(probe, "cross_entropy").result())[0], b_lp)
    assert len(b._state.optimizer.state) == 0 and len(a._state.optimizer.state) > 0
    # b's sampler snapshot still samples with b's weights
    assert b_sampler.compute_logprobs(probe[0].model_input).result()[1:] == b_sample_lp[1:]

    a_state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in a._state.optimizer.state.items()}
    b.forward_backward(data, "cross_entropy")
    b.optim_step(adam(0.05)).result()
    for p, s in a._state.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, a_state[id(p)][k])
    assert any(not torch.equal(weights(b)[n], w) for n, w in b_weights.items())


def test_sampling_client_is_a_frozen_snapshot(service, warm):
    tc = from_state(service, warm["path"])
    probe = random_datum(torch.Generator().manual_seed(6), 10)
    old = tc.save_weights_and_get_sampling_client().result()
    old_lp = old.compute_logprobs(probe.model_input).result()
    for _ in range(2):
        tc.forward_backward([probe], "cross_entropy")
        tc.optim_step(adam(0.05))
    new = tc.save_weights_and_get_sampling_client().result()
    new_lp = new.compute_logprobs(probe.model_input).result()  # the new weights now sit in the sampling slot
    trainer_lp = out_logprobs(tc.forward([make_datum(probe.model_input.to_ints()[:-1],
                                                     probe.model_input.to_ints()[1:])],
                                         "cross_entropy").result())[0]
    torch.testing.assert_close(torch.tensor(new_lp[1:]), trainer_lp, rtol=0, atol=1e-4)
    assert max(abs(a - b) for a, b in zip(new_lp[1:], old_lp[1:])) > 1e-3
    assert old.compute_logprobs(probe.model_input).result()[1:] == old_lp[1:]


# ---- futures, pipelining, asyncio -------------------------------------------------------------
def test_pipelined_submission_keeps_order(service, warm):
    gen = torch.Generator().manual_seed(13)
    batches = [[random_datum(gen, n) for n in (5, 9)] for _ in range(3)]
    seq = from_state(service, warm["path"])
    want_losses = []
    for batch in batches:
        want_losses.append(seq.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
        seq.optim_step(adam(0.01)).result()

    pipe = from_state(service, warm["path"])
    futures = []
    for batch in batches:  # nothing waited on until everything is queued
        futures.append(pipe.forward_backward(batch, "cross_entropy"))
        futures.append(pipe.optim_step(adam(0.01)))
    results = [f.result() for f in futures]
    assert [r.metrics["loss:sum"] for r in results[0::2]] == pytest.approx(want_losses, rel=1e-6)
    assert all(isinstance(r, types.OptimStepResponse) for r in results[1::2])
    assert len(set(want_losses)) == 3
    assert_weights_equal(weights(pipe), weights(seq), atol=1e-7)


def test_futures_work_under_asyncio(service, warm):
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("async").result()
    data = [random_datum(torch.Generator().manual_seed(17), 7)]

    async def main():
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam(0.01))
        fb_out = await fb
        opt_out = await opt.result_async()
        fb2 = await (await tc.forward_backward_async(data, "cross_entropy"))
        await (await tc.optim_step_async(adam(0.01)))
        samples = await asyncio.gather(*[sampler.sample_async(data[0].model_input, 1,
                                                              types.SamplingParams(max_tokens=4))
                                         for _ in range(3)])
        sampled = await sampler.sample(data[0].model_input, 2,
                                       types.SamplingParams(max_tokens=3)).result_async()
        return fb_out, opt_out, fb2, samples, sampled

    fb_out, opt_out, fb2, samples, sampled = asyncio.run(main())
    assert isinstance(fb_out, types.ForwardBackwardOutput) and isinstance(opt_out, types.OptimStepResponse)
    assert fb2.metrics["loss:sum"] < fb_out.metrics["loss:sum"]  # the step in between was applied
    # unseeded draws: a sample may end at the end-of-sequence token before its 4 tokens
    for seq in (s.sequences[0] for s in samples):
        ran_out = (len(seq.tokens), seq.stop_reason) == (4, "length")
        assert ran_out or (seq.stop_reason == "stop" and 0 < len(seq.tokens) <= 4), seq
    assert len(sampled.sequences) == 2


# ---- errors -----------------------------------------------------------------------------------
def test_bad_input_raises_clear_errors(service, warm, tiny_model_dir):
    tc = from_state(service, warm["path"])
    good = make_datum([1, 2, 3], [2, 3, 4], logprobs=[-1.0] * 3, advantages=[1.0] * 3)

    no_adv = types.Datum(model_input=good.model_input,
                         loss_fn_inputs={k: v for k, v in good.loss_fn_inputs.items() if k != "advantages"})
    with pytest.raises(ValueError, match="advantages"):
        tc.forward_backward([no_adv], "importance_sampling").result()
    with pytest.raises(ValueError, match="stable_reinforce"):
        tc.forward_backward([good], "stable_reinforce").result()
    with pytest.raises(ValueError, match="target_tokens has 2 entries but model_input has 3"):
        tc.forward_backward([make_datum([1, 2, 3], [2, 3])], "cross_entropy").result()
    with pytest.raises(ValueError, match=r"'advantages'.*2 entries"):
        tc.forward_backward([with_inputs(good, advantages=[1.0, 1.0])], "ppo").result()
    with pytest.raises(ValueError, match="clip_ratio"):
        tc.forward_backward([good], "ppo", {"clip_ratio": 0.2}).result()
    with pytest.raises(ValueError, match="out of range"):
        tc.forward_backward([make_datum([1, 2, 10_000], [2, 3, 4])], "cross_entropy").result()
    with pytest.raises(ValueError, match="/nonexistent/model"):
        service.create_lora_training_client("/nonexistent/model").result()
    with pytest.raises(ValueError, match="not found"):
        service.create_training_client_from_state("tinker://no-such-run/weights/nothing").result()
    with pytest.raises(ValueError, match="tinker://"):
        service.create_training_client_from_state("/tmp/not-a-checkpoint").result()
    with pytest.raises(ValueError, match="not found"):
        service.create_sampling_client(model_path="tinker://no-such-run/sampler_weights/x").result()
    # nothing was applied and the client still works
    out = tc.forward_backward([good], "importance_sampling").result()
    assert math.isfinite(out.metrics["loss:sum"])


def test_store_directories_are_portable_names(tmp_path):
    """Run ids hold ':' (Tinker's scheme); on disk they are percent-encoded and listed back as ids."""
    from polyrl.local.checkpoints import CheckpointPath, Store

    store = Store(tmp_path)
    cp = CheckpointPath("local-1a2b:train:0", "weights", "step_1")
    path = store.write(cp, lambda d: (d / "adapter.bin").write_bytes(b"x"), {"model_id": cp.run_id})
    assert path == "tinker://local-1a2b:train:0/weights/step_1"
    assert [p.name for p in tmp_path.iterdir()] == ["local-1a2b%3Atrain%3A0"]
    assert store.runs() == ["local-1a2b:train:0"]
    assert store.resolve(path)[1] == tmp_path / "local-1a2b%3Atrain%3A0" / "weights" / "step_1"
    assert [c["tinker_path"] for c in store.list("local-1a2b:train:0")] == [path]


def test_counter_uniforms_are_uniform_and_a_function_of_seed_and_step():
    """Seeded rows draw from a hash of (seed, step): vectorised, batch-independent, and uniform."""
    from polyrl.local.draw import counter_uniforms, inverse_cdf

    seeds = torch.randint(0, 2**62, (20000,), generator=torch.Generator().manual_seed(0))
    u = counter_uniforms(seeds, 7)
    assert u.dtype == torch.float64 and float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(counter_uniforms(seeds[5:9], 7), u[5:9])  # a row's draw ignores its batch
    assert not torch.equal(counter_uniforms(seeds, 8), u)  # and changes with the step
    # uniform: every tenth of (0, 1) gets its share (chi-square, 9 degrees of freedom, p ~ 1e-6 bound)
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    chi2 = float(((counts - 2000) ** 2 / 2000).sum())
    assert chi2 < 50, counts
    # consecutive seeds are not correlated (a weak hash would map 0, 1, 2, ... to nearby numbers)
    v = counter_uniforms(torch.arange(20000), 0)
    assert abs(float(torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1])) < 0.03

    # inverse-CDF sampling with these uniforms follows the distribution
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    tokens = inverse_cdf(probs.expand(len(u), -1).contiguous(), u)
    freq = torch.bincount(tokens, minlength=5).double() / len(u)
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.015)
    assert int((tokens == 1).sum()) == 0  # a zero-probability token is never drawn


def test_the_two_level_inverse_cdf_draws_what_one_cumulative_sum_would():
    """Over a wide vocabulary the draw picks a chunk, then a token in it: each row's token is the first
    whose cumulative probability (float64, from the row alone) reaches u of the total, to rounding; a
    zero-probability token is never drawn, not at the end of a chunk nor in the short last chunk."""
    from polyrl.local.draw import CDF_CHUNK, counter_uniforms, inverse_cdf

    vocab = 3 * CDF_CHUNK + 100  # three whole chunks and a short one
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(64, vocab, generator=gen), -1)  # [B, V]
    zero = [CDF_CHUNK - 1, 2 * CDF_CHUNK - 1, 2 * CDF_CHUNK, vocab - 1]
    probs[:, zero] = 0.0
    probs[:8, 3 * CDF_CHUNK:] = 0.0  # rows whose short last chunk weighs nothing
    u = counter_uniforms(torch.arange(64), 0)
    tokens = inverse_cdf(probs, u)
    cdf = probs.double().cumsum(-1)  # [B, V]
    want = u * cdf[:, -1]
    rows = torch.arange(64)
    below = torch.where(tokens > 0, cdf[rows, (tokens - 1).clamp(min=0)], torch.zeros_like(want))
    assert bool((below <= want + 1e-6).all()) and bool((cdf[rows, tokens] >= want - 1e-6).all())
    assert not any(int(t) in zero for t in tokens) and bool((tokens[:8] < 3 * CDF_CHUNK).all())
    assert torch.equal(inverse_cdf(probs[5:9], u[5:9]), tokens[5:9])  # a row's draw ignores its batch
    # a distribution concentrated around a chunk boundary is followed as it is
    peaked = torch.zeros(vocab)
    peaked[CDF_CHUNK - 3: CDF_CHUNK + 2] = torch.tensor([0.1, 0.3, 0.0, 0.4, 0.2])
    v = counter_uniforms(torch.arange(20000), 1)
    drawn = inverse_cdf(peaked.expand(len(v), -1).contiguous(), v)
    freq = torch.bincount(drawn, minlength=vocab).double() / len(v)
    torch.testing.assert_close(freq, peaked.double(), rtol=0, atol=0.015)


def test_dro_penalty_applies_to_masked_tokens_only(service, warm):
    """A datum whose advantages are all zero and whose sampled tokens are on-policy has nothing to
    teach: with ``mask`` on the sampled tokens, the 0.0 placeholder logprobs of prompt tokens must
    not be pulled towards 0 by the quadratic penalty."""
    tc = from_state(service, warm["path"])
    d = random_datum(torch.Generator().manual_seed(31), 12)
    lp = out_logprobs(tc.forward([d], "cross_entropy").result())[0]
    mask = (torch.arange(12) >= 7).float()  # the last five tokens were sampled
    # 0.0 on prompt tokens, as the trainer sends
    sampler_lp = torch.where(mask.bool(), lp, torch.zeros_like(lp))
    masked = with_inputs(d, logprobs=sampler_lp, advantages=torch.zeros(12), mask=mask)
    tc.forward_backward([masked], "dro", {"beta": 0.5}).result()
    assert grad_norm(take_grads(tc)) < 1e-6
    # without a mask every token is penalised (Tinker's definition of the loss)
    unmasked = with_inputs(d, logprobs=sampler_lp, advantages=torch.zeros(12))
    tc.forward_backward([unmasked], "dro", {"beta": 0.5}).result()
    assert grad_norm(take_grads(tc)) > 1e-3


def test_models_loaded_on_several_threads_at_once_load(tiny_model_dir, small_model_dir):
    """Hugging Face's loading is not thread-safe (modules built on one thread land on the meta
    device of another: "Cannot copy out of meta tensor"), so polyrl serialises it."""
    import threading

    from polyrl.local.model import BaseModel

    errors: list[str] = []

    def load(path: str) -> None:
        try:
            for _ in range(3):
                BaseModel(path)
        except Exception as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=load, args=(p,))
               for p in (tiny_model_dir, small_model_dir, tiny_model_dir)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_overwriting_a_checkpoint_never_loses_the_old_one(tmp_path, monkeypatch):
    from polyrl.errors import CheckpointWriteError
    from polyrl.local import checkpoints as ck

    store = ck.Store(tmp_path)
    cp = ck.CheckpointPath("run", "sampler_weights", "latest")
    store.write(cp, lambda d: (d / "weights.bin").write_text("old"), {})
    final = store.directory(cp)
    real_replace = os.replace

    def fail_into_place(src, dst):
        if Path(dst) == final:
            raise OSError("no space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", fail_into_place)
    with pytest.raises(CheckpointWriteError, match="no space"):
        store.write(cp, lambda d: (d / "weights.bin").write_text("new"), {}, overwrite=True)
    monkeypatch.undo()
    assert (store.resolve(str(cp))[1] / "weights.bin").read_text() == "old"
    store.write(cp, lambda d: (d / "weights.bin").write_text("new"), {}, overwrite=True)
    assert (store.resolve(str(cp))[1] / "weights.bin").read_text() == "new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["latest"]  # nothing left aside


def test_checkpoint_files_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    from polyrl.local import checkpoints as ck

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(ck.os, "fsync", fsync)
    monkeypatch.setattr(ck.os, "replace", replace)
    store = ck.Store(tmp_path)
    cp = ck.CheckpointPath("run", "weights", "000002")

    def writer(d: Path) -> None:
        (d / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        (d / "optimizer.pt").write_bytes(b"\1" * 64)

    store.write(cp, writer, {})
    final = str(store.directory(cp))
    into_place = events.index(("replace", final))
    synced_before = {Path(p).name for kind, p in events[:into_place] if kind == "fsync"}
    assert {"adapter_model.safetensors", "optimizer.pt", "polyrl.json"} <= synced_before, events
    assert ("fsync", str(Path(final).parent)) in events[into_place:], "the rename itself must be made durable"


def test_in_process_clients_refuse_what_the_server_refuses(service, warm):
    """The engine itself refuses non-finite sampling and optimizer values and names a checkpoint
    directory could not be loaded back from, whichever client calls it."""
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    for temperature in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=temperature))
    before = weights(tc)
    for bad in ({"learning_rate": float("nan")}, {"learning_rate": float("inf")}, {"learning_rate": -1e-3},
                {"beta1": 1.0}, {"eps": float("nan")}):
        with pytest.raises(ValueError, match="adam_params"):
            tc.optim_step(types.AdamParams(**{"learning_rate": 1e-3, **bad})).result()
    assert_weights_equal(weights(tc), before)  # nothing was applied
    for name in (".hidden", "a" * 300, "a/b", "", ":x"):
        with pytest.raises(ValueError, match="checkpoint name"):
            tc.save_state(name).result()
    assert tc.save_state("ok.name-1:2").result().path.endswith("/weights/ok.name-1:2")


def test_sampling_from_merged_weights_equals_the_adapter_branch(service, warm, monkeypatch):
    """A snapshot is sampled with its LoRA folded into a copy of the weights (tied unembedding
    included: folding must not touch the input embedding). Same seeds, same tokens and logprobs as
    PEFT's side branches, and the base weights are untouched afterwards."""
    import polyrl.local.model as model_mod

    tc = from_state(service, warm["path"])
    base = tc._state.base
    before = {n: p.detach().clone() for n, p in base.hf_model.named_parameters() if "lora_" not in n}
    prompts = [types.ModelInput.from_ints([5, 17, 200, 33]), types.ModelInput.from_ints([9, 10, 11])]
    params = types.SamplingParams(max_tokens=12, seed=7)

    def run():
        sampler = tc.save_weights_and_get_sampling_client().result()  # a new snapshot: nothing cached
        return [sampler.sample(p, 3, params).result() for p in prompts]

    merged = run()
    assert service.engine.call(lambda: any(m for _, m in base._merged.values()))  # the merged path ran
    monkeypatch.setattr(model_mod, "MERGED_SAMPLING_MAX_BYTES", 0)
    branch = run()
    for a, b in zip(merged, branch):
        for sa, sb in zip(a.sequences, b.sequences):
            assert list(sa.tokens) == list(sb.tokens)
            torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs),
                                       rtol=0, atol=1e-5)
    for n, p in base.hf_model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, before[n]), n


# ---- non-finite updates ------------------------------------------------------------------------
def _optimizer_state(tc) -> dict:
    """AdamW's state and hyperparameters, as tensors compared bit for bit."""
    sd = tc._state.optimizer.state_dict()
    return {"state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                      for k, s in sd["state"].items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["groups"] == b["groups"] and a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for n, v in a["state"][k].items():
            w = b["state"][k][n]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, n)


@pytest.mark.parametrize("case", ["nan_advantage", "huge_advantage", "nan_gradient_finite_loss"])
def test_a_non_finite_update_is_refused_and_changes_nothing(service, warm, case):
    """A batch whose loss or gradient is not finite (a NaN advantage; a finite advantage of 1e30, whose
    gradient overflows float32; a custom loss that is finite while its gradient is NaN) is refused by
    optim_step with one line: weights and optimizer state stay bit for bit, the gradients are dropped,
    and the next good step trains as if the bad batch had never come."""
    from polyrl.errors import NonFiniteUpdateError

    tc, twin = from_state(service, warm["path"]), from_state(service, warm["path"])
    good = _loss_batch(tc, torch.Generator().manual_seed(31))
    n = len(good[0].loss_fn_inputs["advantages"].data)
    weights_before, state_before = weights(tc), _optimizer_state(tc)

    tc.forward_backward(good[1:], "importance_sampling").result()  # good gradients, then the bad batch
    if case == "nan_gradient_finite_loss":
        def loss_fn(data, lps):  # sqrt'(0) is inf, times 0: NaN, while the loss is 0
            return torch.sqrt(lps[0][0] * 0.0), {}
        out = tc.forward_backward_custom(good[:1], loss_fn).result()
        assert out.metrics["loss:sum"] == 0.0
    else:
        value = float("nan") if case == "nan_advantage" else 1e30
        tc.forward_backward([with_inputs(good[0], advantages=[value] * n)], "importance_sampling").result()
    with pytest.raises(NonFiniteUpdateError) as refused:
        tc.optim_step(adam()).result()
    message = str(refused.value)
    assert "\n" not in message and message.startswith("optim_step refused: "), message
    assert "unchanged" in message and ("not finite" in message or "overflows" in message), message
    assert isinstance(refused.value, ValueError)  # polyrl serve reports it as the caller's data problem
    assert_weights_equal(weights(tc), weights_before, atol=0)
    _assert_same_state(_optimizer_state(tc), state_before)
    assert all(p.grad is None for p in tc._state.params) and tc._state.steps == twin._state.steps

    for client in (tc, twin):  # the next step is the step the bad batch never touched
        client.forward_backward(good, "importance_sampling").result()
        client.optim_step(adam()).result()
    after = weights(tc)
    assert_weights_equal(after, weights(twin), atol=0)
    assert all(torch.isfinite(w).all() for w in after.values())
    assert max(float((after[k] - weights_before[k]).abs().max()) for k in after) > 0


def test_checkpoints_with_non_finite_weights_are_never_written(service, store, warm):
    from polyrl.errors import NonFiniteUpdateError

    tc = from_state(service, warm["path"])
    with torch.no_grad():
        tc._state.params[0][0, 0] = float("nan")  # as a checkpoint from elsewhere could carry
    for save, name in ((tc.save_state, "poisoned-state"), (tc.save_weights_for_sampler, "poisoned-sampler")):
        with pytest.raises(NonFiniteUpdateError, match=r"refused: 1 of \d+ adapter weights are not finite"):
            save(name).result()
    listed = {c["checkpoint_id"] for c in tc._engine.store.list(tc.model_id)}
    assert not any("poisoned" in c for c in listed)
    assert not [p for p in Path(store).rglob("*poisoned*")]


def test_stopping_the_engine_cancels_queued_work_and_lets_the_running_operation_finish(tmp_path):
    import threading

    from polyrl.local.engine import Engine

    engine = Engine(tmp_path)
    started, release = threading.Event(), threading.Event()
    running = engine.submit(lambda: (started.set(), release.wait(60), "finished")[-1])
    queued = engine.submit(lambda: "never run")
    assert started.wait(60)
    threading.Timer(0.1, release.set).start()  # stop() waits for it whenever it comes
    assert engine.stop(timeout=120)
    assert running.result() == "finished" and queued.cancelled()
    assert engine.submit(lambda: "too late").cancelled()
    assert engine not in Engine._running  # nothing left for stop_all at exit


def test_training_on_from_a_checkpoint_in_a_fresh_process_is_bit_identical(service, store, tiny_model_dir,
                                                                           tmp_path):
    """A checkpoint holds everything a step depends on: three more importance-sampling steps on the same
    data give the same weights bit for bit here and in a new process (its own thread pools, allocator
    and hash seed), as a relaunched run needs."""
    import pickle
    import subprocess
    import sys

    from safetensors.torch import load_file

    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=9).result()
    device = str(tc._state.base.device)  # the new process trains where this one does
    gen = torch.Generator().manual_seed(17)
    tc.forward_backward(_loss_batch(tc, gen), "importance_sampling")
    tc.optim_step(adam(0.01))
    path = tc.save_state("fresh-process-start").result().path
    batches = [_loss_batch(tc, gen) for _ in range(3)]
    (tmp_path / "batches.pkl").write_bytes(pickle.dumps(batches))
    script = f"""
import pickle, sys
from tinker import types
from polyrl.local import ServiceClient
service = ServiceClient(store_dir={str(store)!r}, device={device!r})
tc = service.create_training_client_from_state_with_optimizer({path!r}).result()
for batch in pickle.loads(open({str(tmp_path / "batches.pkl")!r}, "rb").read()):
    tc.forward_backward(batch, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=0.01, grad_clip_norm=5.0))
print(tc.save_weights_for_sampler("fresh-process").result().path)
"""
    path_dirs = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path_dirs), "PYTHONHASHSEED": "1234"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for batch in batches:
        tc.forward_backward(batch, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=0.01, grad_clip_norm=5.0))
    here = load_file(checkpoint_dir(store, tc.save_weights_for_sampler("same-process").result().path)
                     / "adapter_model.safetensors")
    there_path = out.stdout.strip().splitlines()[-1]
    there = load_file(checkpoint_dir(store, there_path) / "adapter_model.safetensors")
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)


def test_a_stopping_engine_ends_sampling_at_the_next_decode_step(tiny_model_dir, tokenizer):
    """A decode loop asks ``stopping()`` before each step: once the engine stops (Ctrl-C, interpreter
    exit), the running sample ends within one step instead of running to ``max_tokens`` (a worker still
    in torch code at shutdown aborts the process)."""
    from transformers import AutoModelForCausalLM

    from polyrl.local.sampler import SampleJob, SamplingStopped, generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=3)
    job = SampleJob([1, 2, 3], 2, params, max_tokens=64)
    asked: list[int] = []

    def stopping() -> bool:
        asked.append(1)
        return len(asked) > 5

    with pytest.raises(SamplingStopped, match="stopping"):
        generate(model, [job], tokenizer, torch.device("cpu"), None, stopping=stopping)
    assert len(asked) == 6  # five decode steps ran, the sixth was never taken
    whole = generate(model, [job], tokenizer, torch.device("cpu"), None, stopping=lambda: False)
    assert len(whole[0].sequences) == 2  # never stopping: the jobs run as without the check


def test_sampling_hands_the_model_its_cache_under_the_keyword_it_takes(service, tiny_model_dir):
    """Current transformers take the KV cache as ``cache`` and warn on ``past_key_values`` (a FutureWarning
    in every run); the sampler passes whichever the model's ``forward`` takes."""
    import warnings

    from polyrl.local.cpu_decode import with_cache

    sampler = service.create_sampling_client(base_model=tiny_model_dir)
    model = sampler._state.base.hf_model
    assert list(with_cache(model, "c")) == ["cache"]  # transformers 5.25's Qwen3 forward
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                             types.SamplingParams(max_tokens=4, seed=0)).result()
    assert len(out.sequences) == 2 and all(s.tokens for s in out.sequences)
