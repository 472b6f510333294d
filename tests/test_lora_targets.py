"""LoRA trains the layers asked for on every architecture: the fused expert weights of a
mixture-of-experts model (Qwen3-MoE in current transformers stores each layer's experts as 3-D
parameters, not linear layers) through PEFT ``target_parameters``, and a kind that matches no layer
is an error naming the model class rather than a run that silently trains less."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from polyrl.local import ServiceClient

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from polyrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-moe"), "unit-moe", seed=0))


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> ServiceClient:
    return ServiceClient(store_dir=tmp_path_factory.mktemp("store"))


def named_params(tc) -> dict[str, torch.Tensor]:
    st = tc._state
    marker = f".{st.adapter}."
    return {n.replace(marker, "."): p.detach().clone() for n, p in st.base.peft_model.named_parameters()
            if marker in n}


def datum(ids: list[int]) -> types.Datum:
    target = types.TensorData.from_torch(torch.tensor(ids[1:], dtype=torch.long))
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": target})


def forward_logprobs(tc, d: types.Datum) -> torch.Tensor:
    return tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch().float()


def test_moe_experts_are_trained_saved_and_loaded(service, moe_model_dir, tmp_path):
    tc = service.create_lora_training_client(moe_model_dir, rank=4, seed=0, train_attn=False,
                                             train_unembed=False).result()
    before = named_params(tc)
    experts = {n for n in before if ".mlp.experts." in n}
    # both fused weights (gate_up_proj, down_proj) of both layers, A and B each; nothing else was asked for
    assert len(experts) == 2 * 2 * 2 and experts == set(before), sorted(before)
    assert all(p.shape[0] == 4 * 4 or p.shape[1] == 4 * 4 for n, p in before.items()), "rank x experts"

    gen = torch.Generator().manual_seed(0)
    data = [datum(torch.randint(0, 700, (n,), generator=gen).tolist()) for n in (9, 14)]
    for _ in range(2):  # B starts at zero, so A's gradient is zero until B has moved once
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    after = named_params(tc)
    unchanged = [n for n in experts if torch.equal(before[n], after[n])]
    assert not unchanged, unchanged

    # the expert LoRA changes what the model computes
    base = service.create_sampling_client(base_model=moe_model_dir).result()
    base_lp = torch.tensor(base.compute_logprobs(data[0].model_input).result()[1:])
    trained_lp = forward_logprobs(tc, data[0])[:-1]
    assert float((base_lp - trained_lp).abs().max()) > 1e-3

    # round trip through a checkpoint: same weights, same logprobs, and the sampler sees them too
    path = tc.save_state("experts").result().path
    loaded = service.create_training_client_from_state(path).result()
    assert named_params(loaded).keys() == after.keys()
    for n, p in named_params(loaded).items():
        torch.testing.assert_close(p, after[n], rtol=0, atol=0)
    torch.testing.assert_close(forward_logprobs(loaded, data[1]), forward_logprobs(tc, data[1]), rtol=0,
                               atol=1e-6)
    sampler = tc.save_weights_and_get_sampling_client("experts-sampler").result()
    sampled_lp = torch.tensor(sampler.compute_logprobs(data[0].model_input).result()[1:])
    torch.testing.assert_close(sampled_lp, trained_lp, rtol=0, atol=1e-5)

    # the saved directory is a standard PEFT adapter: plain PEFT loads it and computes the same logprobs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM


    adapter_dir = service.engine.store.resolve(path)[1]
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe_model_dir),
                                    str(adapter_dir)).eval()
    ids = torch.tensor([data[1].model_input.to_ints()])
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(input_ids=ids).logits[0].float(), -1)
    targets = data[1].loss_fn_inputs["target_tokens"].to_torch().long()
    torch.testing.assert_close(ref_lp.gather(-1, targets[:, None])[:, 0], forward_logprobs(tc, data[1]),
                               rtol=0, atol=1e-5)


def test_every_kind_on_a_moe_model_reaches_its_layers(service, moe_model_dir):
    tc = service.create_lora_training_client(moe_model_dir, rank=2, seed=0).result()
    names = set(named_params(tc))
    for part in (".mlp.experts.", ".self_attn.q_proj.", ".self_attn.o_proj.", "lm_head."):
        assert any(part in n for n in names), part


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    """GPT-2's attention and MLP layers are ``Conv1D`` modules, which LoRA here does not target."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from polyrl.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("gpt2")
    tokenizer = build_tokenizer(768)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                               n_positions=128)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_a_kind_that_matches_no_layer_is_an_error_naming_the_model_class(service, gpt2_dir):
    with pytest.raises(ValueError, match=r"train_attn: .*GPT2LMHeadModel.* has no attn layers"):
        service.create_lora_training_client(gpt2_dir, rank=2).result()
    with pytest.raises(ValueError, match=r"train_mlp: .*GPT2LMHeadModel.* has no mlp layers"):
        service.create_lora_training_client(gpt2_dir, rank=2, train_attn=False).result()
    tc = service.create_lora_training_client(gpt2_dir, rank=2, train_attn=False, train_mlp=False).result()
    assert {n.split(".lora_")[0] for n in named_params(tc)} == {"base_model.model.lm_head"}
