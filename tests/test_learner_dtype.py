"""The learner's own precision (``local.dtype``): what ``auto`` picks, and a bfloat16 learner with float32
adapters (mixed precision) that trains, samples from its packed copy and agrees with a float32 learner.

The rest of the suite runs with ``$POLYRL_DTYPE=float32`` (tests/conftest.py); here bfloat16 is asked for."""

from __future__ import annotations

import pytest
import torch
from test_sampler_precision import BF16, CPU, F32, datum
from tinker import types

from polyrl.local import ServiceClient, sampler_copy
from polyrl.local import model as model_module
from polyrl.local.attention import TREE_ATTENTION, float32_attention
from polyrl.local.model import BaseModel, LoraSpec, select_dtype

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

def fixed_data(vocab: int) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(0)
    return [datum(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in (6, 10, 14)]


def set_adapter(service: ServiceClient, tc, seed: int) -> None:
    """Every adapter parameter (B included) random from ``seed``, on the engine's thread."""
    def fill():
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in tc._state.params:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    service.engine.call(fill)


# ---- what auto picks ----------------------------------------------------------------------------------
def test_auto_picks_a_bfloat16_learner_where_the_device_runs_it_fast(monkeypatch):
    monkeypatch.delenv(model_module.DTYPE_ENV, raising=False)
    monkeypatch.setattr(sampler_copy, "cpu_bf16_feature", lambda: "AVX-512 BF16")
    assert select_dtype("auto", CPU) == (BF16, "auto: this CPU has AVX-512 BF16")
    assert select_dtype("auto", CPU, 576) == (BF16, "auto: this CPU has AVX-512 BF16")  # SmolLM2-135M
    # the tiny models' products are too small to gain: they stay float32
    assert select_dtype("auto", CPU, 64) == (F32, "auto: hidden size 64 is too small to gain from bfloat16")
    assert select_dtype("bfloat16", CPU, 64)[0] == BF16
    monkeypatch.setattr(sampler_copy, "cpu_bf16_feature", lambda: None)
    assert select_dtype("auto", CPU) == (F32, "auto: this CPU has no native bfloat16 arithmetic")
    assert select_dtype("bfloat16", CPU) == (BF16, "as configured")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert select_dtype("auto", cuda) == (BF16, "auto: the GPU has bfloat16")
    assert select_dtype("auto", cuda, 64)[0] == BF16  # the size rule is the CPU's
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert select_dtype("auto", cuda)[0] == F32
    assert select_dtype("auto", torch.device("mps"))[0] == F32
    monkeypatch.setenv(model_module.DTYPE_ENV, "float32")  # a machine-wide override of the guess
    monkeypatch.setattr(sampler_copy, "cpu_bf16_feature", lambda: "AMX-BF16")
    assert select_dtype("auto", CPU) == (F32, "auto: $POLYRL_DTYPE")
    assert select_dtype("bfloat16", CPU)[0] == BF16  # a configured dtype wins
    monkeypatch.setenv(model_module.DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=r"\$POLYRL_DTYPE must be one of"):
        select_dtype("auto", CPU)


# ---- the parts ----------------------------------------------------------------------------------------
def test_a_fused_lora_over_a_bfloat16_base_is_the_float32_formula_within_rounding(tiny_model_dir):
    """The fused layer casts the float32 factors to bfloat16 for its products: output and gradients
    within bfloat16 rounding of ``base(x) + scale * (x @ A.T) @ B.T`` in float32, the gradients landing
    in the float32 factors. The adapter's term is far above that rounding (a layer that dropped it, or
    left the factors' gradients empty, fails)."""
    from polyrl.local.lora import FusedLoraLinear

    base = BaseModel(tiny_model_dir, "cpu", "bfloat16", sampler_dtype="bfloat16")
    base.add_adapter("a", LoraSpec(rank=4, seed=0))
    layer = next(m for m in base.peft_model.modules() if isinstance(m, FusedLoraLinear))
    a, b = layer.lora_A["a"].weight, layer.lora_B["a"].weight
    assert a.dtype == b.dtype == F32 and layer.base_layer.weight.dtype == BF16
    with torch.no_grad():
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(2)).to(BF16)
    with base.use("a", train=True):
        out = layer(x)
    assert out.dtype == BF16
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad_out.to(BF16))
    assert a.grad is not None and b.grad is not None and a.grad.dtype == b.grad.dtype == F32

    a32, b32 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    base_out = x.float() @ layer.base_layer.weight.float().t()
    want = base_out + layer.scaling["a"] * (x.float() @ a32.t()) @ b32.t()
    want.backward(grad_out)
    scale = float(want.abs().max())
    assert float((want - base_out).abs().max()) > 0.2 * scale  # the adapter's term matters here
    torch.testing.assert_close(out.float(), want.detach(), rtol=0, atol=0.02 * scale)
    for got, ref in ((a.grad, a32.grad), (b.grad, b32.grad)):
        assert float(ref.abs().max()) > 0
        torch.testing.assert_close(got, ref, rtol=0, atol=0.02 * float(ref.abs().max()))


def test_float32_attention_is_sdpa_in_float32_cast_back():
    """A 16-bit learner's attention on a CPU: SDPA of the inputs in float32 (float masks too), output cast
    back to the inputs' dtype; gradients reach the 16-bit inputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=gen).to(BF16).requires_grad_() for _ in range(3))
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = float32_attention(module, q, k, v, mask.to(BF16), scaling=8**-0.5)
    want, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), mask, scaling=8**-0.5)
    assert out.dtype == BF16
    assert torch.equal(out, want.to(BF16))
    out.float().sum().backward()
    assert q.grad.dtype == BF16 and float(q.grad.abs().sum()) > 0
    f32 = [t.detach().float() for t in (q, k, v)]
    same, _ = float32_attention(module, *f32, mask, scaling=8**-0.5)  # float32 passes through
    assert torch.equal(same, sdpa_attention_forward(module, *f32, mask, scaling=8**-0.5)[0])


# ---- a bfloat16 learner end to end --------------------------------------------------------------------
def test_a_bfloat16_learner_trains_and_samples_from_its_packed_copy(tiny_model_dir, tmp_path, monkeypatch):
    """``local.dtype: bfloat16`` (what ``auto`` picks on this CPU if it has bfloat16 arithmetic): float32
    adapters and optimizer over bfloat16 weights, attention in float32, training that lowers the loss,
    and a sampler that keeps a packed copy (its fast decode) with each snapshot folded in float32, whose
    logprobs of its own samples stay within bfloat16 rounding of the learner's."""
    monkeypatch.delenv(sampler_copy.AUTO_ENV, raising=False)
    service = ServiceClient(store_dir=tmp_path / "store", dtype="bfloat16", sampler_dtype="auto")
    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    base = tc._state.base
    assert base.dtype == BF16 and all(p.dtype == F32 for p in tc._state.params)
    # packed rows attend along each datum's path, in float32 on this CPU (tests/test_tree_attention.py)
    assert base.hf_model.config._attn_implementation == TREE_ATTENTION and base.tree_attention
    [info] = service.sampler_precision()
    assert (info["sampler_dtype"], info["learner_dtype"]) == ("bfloat16", "bfloat16")
    if sampler_copy.packs(BF16):
        assert base.sampler_copy is not None and base.sampler_copy.packed
        assert base.sampler_decode_step is not None
        assert "learner bfloat16 (as configured): a" in info["note"] and info["copy_bytes"] > 0

    data = fixed_data(700)
    losses = []
    for _ in range(6):
        out = tc.forward_backward(data, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        metrics = tc.optim_step(types.AdamParams(learning_rate=0.02)).result().metrics
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.8 * losses[0], losses
    assert all(p.dtype == F32 and torch.isfinite(p).all() for p in tc._state.params)
    assert metrics["sampler/dtype_bits:mean"] == 16

    prompt = [5, 17, 230, 41, 9]
    sampler = tc.save_weights_and_get_sampling_client("bf16").result()
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                         types.SamplingParams(max_tokens=16, seed=3)).result()
    diffs = []
    for seq in res.sequences:
        learner = tc.forward([datum(prompt + list(seq.tokens))], "cross_entropy").result()
        lp = learner.loss_fn_outputs[0]["logprobs"].to_torch().float()[len(prompt) - 1:]
        diffs.append((torch.tensor(seq.logprobs) - lp).abs())
    diffs = torch.cat(diffs)
    assert float(diffs.max()) < 0.3 and float(diffs.mean()) < 0.05, diffs

    if base.sampler_copy is not None:  # the fold: bfloat16 weight + float32 delta, summed in float32
        from peft.tuners.lora import Linear as LoraLinear

        from polyrl.local.lora import add_delta

        layers = {n.removeprefix("base_model.model."): m for n, m in base.peft_model.named_modules()
                  if isinstance(m, LoraLinear)}
        values = base.sampler_copy._values(base._merge_targets(tc._state.adapter))
        packed = [(holder[1], value) for holder, value in values.items() if holder[0] == "packed"]
        assert packed  # o_proj, down_proj and the head of each block are packed alone
        for path, value in packed:
            layer = layers[path]
            got = value.to_dense() if value.is_mkldnn else value
            want = layer.base_layer.weight.float()
            add_delta(layer, tc._state.adapter, want)  # in float32, rounded once (not twice, in bfloat16)
            assert torch.equal(got, want.to(BF16)), path
            assert float((got != layer.base_layer.weight).float().mean()) > 0.05  # the snapshot is in


def test_a_bfloat16_learner_computes_the_float32_learners_gradient(tiny_model_dir, tmp_path):
    """The same adapter (nonzero A and B) on the same data: a bfloat16 learner's loss within 1% of a float32
    learner's and its gradient pointing the same way (cosine >= 0.99), for every factor."""
    grads, losses = {}, {}
    for dtype in ("float32", "bfloat16"):
        service = ServiceClient(store_dir=tmp_path / dtype, dtype=dtype, sampler_dtype="float32")
        tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
        set_adapter(service, tc, seed=7)
        losses[dtype] = tc.forward_backward(fixed_data(700), "cross_entropy").result().metrics["loss:sum"]
        grads[dtype] = service.engine.call(lambda tc=tc: [p.grad.detach().clone() for p in tc._state.params])
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.01 * abs(losses["float32"]), losses
    assert len(grads["float32"]) == len(grads["bfloat16"]) > 0
    for want, got in zip(grads["float32"], grads["bfloat16"]):
        assert got.dtype == F32 and float(want.norm()) > 0
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert float(cosine) >= 0.99, float(cosine)
