"""LoRA arithmetic of the local engine, on PEFT's own adapter layers.

A LoRA linear layer computes ``base(x) + scale * (x @ A.T) @ B.T``. PEFT writes the adapter's term as a
product, a scaling and a sum, three ``[tokens, out]`` tensors in forward and more in backward; here the
term goes into one ``addmm`` (:class:`FusedLoraLinear`), and a snapshot's delta ``scale * B @ A`` is added
to a weight in place (:func:`add_delta`). On a CPU each fresh tensor of that size costs as much again in
page faults as its arithmetic, so this took a fifth off a SmolLM2-135M training step.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as LoraLinear


def _plain(layer: LoraLinear, slot: str) -> bool:
    """Whether ``slot`` is a vanilla LoRA of ``layer``: no variant (DoRA, ...), no dropout, no bias,
    not fan-in-fan-out (Conv1D weights), both factors plain matrices of one dtype."""
    a, b = getattr(layer.lora_A[slot], "weight", None), getattr(layer.lora_B[slot], "weight", None)
    return (a is not None and b is not None and a.dim() == b.dim() == 2 and a.dtype == b.dtype
            and slot not in getattr(layer, "lora_variant", {}) and not layer.use_dora.get(slot, False)
            and isinstance(layer.lora_dropout[slot], torch.nn.Identity)
            and getattr(layer.lora_B[slot], "bias", None) is None
            and not getattr(layer, "fan_in_fan_out", False))


class FusedLoraLinear(LoraLinear):
    """PEFT's LoRA linear layer whose one active vanilla adapter adds its term inside one ``addmm``:
    ``base(x) + scale * (x @ A.T) @ B.T`` with no ``[tokens, out]`` temporaries for ``B``'s product and its
    scaling (their backward needs none either). Over a 16-bit base the float32 factors are cast to the
    base's dtype for the products, as autocast does (their gradients come back in float32). Anything else
    (no or several active adapters, a merged layer, variants, dropout, an input not in the base's dtype,
    extra arguments) runs PEFT's own forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        active = [name for name in self.active_adapters if name in self.lora_A]
        if (args or kwargs or self.disable_adapters or self.merged or len(active) != 1
                or not _plain(self, active[0])):
            return super().forward(x, *args, **kwargs)
        slot = active[0]
        a, b = self.lora_A[slot].weight, self.lora_B[slot].weight
        if x.dtype != self.base_layer.weight.dtype:
            return super().forward(x, *args, **kwargs)
        a, b = a.to(x.dtype), b.to(x.dtype)  # no copy when the dtypes agree
        result = self.base_layer(x)  # [..., out]
        low = torch.nn.functional.linear(x, a)  # [..., r]
        out = torch.addmm(result.reshape(-1, result.shape[-1]), low.reshape(-1, low.shape[-1]), b.t(),
                          alpha=self.scaling[slot])  # [tokens, out]
        return out.view(result.shape)


def fuse(model: torch.nn.Module) -> None:
    """Make every PEFT LoRA linear layer of ``model`` a :class:`FusedLoraLinear` (same state, same
    results up to float rounding)."""
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear


def add_delta(layer: torch.nn.Module, slot: str, weight: torch.Tensor) -> None:
    """Add ``layer``'s LoRA delta for adapter ``slot`` to ``weight`` (its base weight or a copy), in place.
    A vanilla LoRA adds ``scale * B @ A`` as one ``addmm_`` (no ``[out, in]`` temporary); other forms
    (variants, fan-in-fan-out, parameter wrappers) go through PEFT's own ``get_delta_weight``."""
    plain = isinstance(layer, LoraLinear) and _plain(layer, slot)
    if plain and layer.lora_A[slot].weight.dtype == weight.dtype:
        weight.addmm_(layer.lora_B[slot].weight, layer.lora_A[slot].weight, alpha=layer.scaling[slot])
    else:
        weight.add_(layer.get_delta_weight(slot).to(weight.dtype))
