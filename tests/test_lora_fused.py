"""The local engine's LoRA layers (polyrl.local.lora.FusedLoraLinear): the adapter's term added inside one
``addmm`` must give PEFT's own forward and gradients, and fall back to PEFT wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora import Linear as LoraLinear

from polyrl.local.lora import FusedLoraLinear
from polyrl.local.model import BaseModel, LoraSpec

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning")]


def adapted(tiny_model_dir) -> BaseModel:
    base = BaseModel(tiny_model_dir, "cpu", "float32")
    base.add_adapter("a", LoraSpec(rank=4, seed=0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in base.peft_model.modules():
            if isinstance(m, LoraLinear):
                m.lora_B["a"].weight.copy_(torch.randn(m.lora_B["a"].weight.shape, generator=gen) * 0.3)
    return base


def loss_and_grads(base: BaseModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    params = base.adapter_params("a")
    for p in params:
        p.grad = None
    with base.use("a", train=True) as model:
        logits = model(input_ids=ids).logits
    loss = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in params]


def test_fused_lora_layers_give_pefts_outputs_and_gradients(tiny_model_dir):
    base = adapted(tiny_model_dir)
    layers = [m for m in base.peft_model.modules() if isinstance(m, LoraLinear)]
    assert layers and all(type(m) is FusedLoraLinear for m in layers)  # the head included
    ids = torch.randint(0, 700, (1, 40), generator=torch.Generator().manual_seed(2))
    fused = loss_and_grads(base, ids)
    for m in layers:
        m.__class__ = LoraLinear  # PEFT's own forward on the same state
    want = loss_and_grads(base, ids)
    torch.testing.assert_close(fused[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], want[1], rtol=1e-6, atol=1e-6)
    assert len(fused[2]) == len(want[2]) and any(float(g.abs().max()) > 0 for g in want[2])
    for got, expected in zip(fused[2], want[2]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_fused_lora_layers_leave_other_cases_to_peft(tiny_model_dir):
    base = adapted(tiny_model_dir)
    ids = torch.randint(0, 700, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with base.use("a") as model:
            adapted_logits = model(input_ids=ids).logits
            with base.peft_model.disable_adapter():  # disabled adapters (PEFT's path): the bare model
                bare = model(input_ids=ids).logits
        for m in base.peft_model.modules():
            if isinstance(m, LoraLinear):
                m.lora_B["a"].weight.zero_()
        with base.use("a") as model:  # an adapter adding nothing: the bare model too
            zero = model(input_ids=ids).logits
    torch.testing.assert_close(bare, zero, rtol=0, atol=0)
    assert float((adapted_logits - bare).abs().max()) > 1e-3
