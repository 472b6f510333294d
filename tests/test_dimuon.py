"""Dimuon on the local engine: a training client created with ``DimuonOptimizerConfig`` steps with
``DimuonParams``; two steps' updates equal a direct implementation of the documented formula written
here (SVD for the matrix sign, where the engine uses the Gram matrix's eigendecomposition); its
momentum survives a save and load; Adam is untouched (an AdamW step, bit for bit); mixing them up is
a clear error."""

from __future__ import annotations

import math

import pytest
import torch
from test_local_engine import (  # noqa: F401 - store and service are fixtures shared with that module
    adapter_params,
    assert_weights_equal,
    random_datum,
    service,
    store,
    weights,
)
from tinker import types

from polyrl.local.optim import DimuonSettings

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
RANK = 4


def direction(m: torch.Tensor, damping: float) -> torch.Tensor:
    """The documented Dimuon direction of a momentum matrix: row/column preconditioning, then U V^T."""
    m = m.double()
    if not m.any():  # no momentum yet (a LoRA A while B is still zero): no direction
        return torch.zeros_like(m)
    rows, cols = m.norm(dim=1), m.norm(dim=0)
    dr = rows + damping * rows.mean() + 1e-12 * rows.mean()
    dc = cols + damping * cols.mean() + 1e-12 * cols.mean()
    n = m / dr.sqrt()[:, None] / dc.sqrt()[None, :]
    u, s, vh = torch.linalg.svd(n, full_matrices=False)
    keep = s > 1e-6 * s.max()
    return u[:, keep] @ vh[keep]


def grads_of(tc) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in adapter_params(tc).items()
    }


def data(seed: int) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(seed)
    return [random_datum(gen, n) for n in (7, 11)]


def test_two_dimuon_steps_equal_the_documented_formula(service, tiny_model_dir):
    tc = service.create_lora_training_client(
        tiny_model_dir, rank=RANK, seed=2, optimizer=types.DimuonOptimizerConfig()
    ).result()
    steps = [
        DimuonSettings(learning_rate=0.01, beta1=0.9),
        DimuonSettings(learning_rate=0.02, beta1=0.8, damping=0.3, grad_clip_norm=1.0),
    ]
    params = [
        types.DimuonParams(learning_rate=0.01, beta1=0.9),
        # the documented damping and rank correction, which SDK 0.38's DimuonParams does not carry yet
        {"type": "dimuon", "learning_rate": 0.02, "beta1": 0.8, "damping": 0.3, "grad_clip_norm": 1.0},
    ]
    momentum: dict[str, torch.Tensor] = {}
    moved = 0
    for i, (want, given) in enumerate(zip(steps, params)):
        before = weights(tc)
        tc.forward_backward(data(i), "cross_entropy").result()
        g = grads_of(tc)
        norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in g.values()))
        clip = min(1.0, want.grad_clip_norm / (norm + 1e-6)) if want.grad_clip_norm > 0 else 1.0
        if isinstance(given, dict):
            from tinker.types.optimizer import OptimParamsBase

            given = OptimParamsBase(**given)
        assert tc.optim_step(given).result().metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        after = weights(tc)
        scale = want.learning_rate * (32 / RANK) ** want.rank_lr_correction_exponent
        for name, w in before.items():
            m = momentum.get(name, torch.zeros_like(w, dtype=torch.float64))
            momentum[name] = want.beta1 * m + (1 - want.beta1) * (g[name].double() * clip)
            expected = w.double() - scale * direction(momentum[name], want.damping)
            torch.testing.assert_close(after[name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)
            moved += int((after[name] != w).any())
    assert moved > 0
    # a full-rank LoRA matrix moved by exactly learning_rate * correction * sqrt(rank) (Frobenius norm)
    a = next(name for name in momentum if "lora_A" in name)
    assert float(direction(momentum[a], steps[-1].damping).norm()) == pytest.approx(math.sqrt(RANK), rel=1e-6)


def test_dimuon_momentum_survives_save_and_load(service, tiny_model_dir):
    tc = service.create_lora_training_client(
        tiny_model_dir, rank=RANK, seed=3, optimizer=types.DimuonOptimizerConfig()
    ).result()
    step = types.DimuonParams(learning_rate=0.01)
    for i in range(2):
        tc.forward_backward(data(i), "cross_entropy")
        tc.optim_step(step).result()
    path = tc.save_state("dimuon-2").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().model_id and resumed._state.optimizer_type == "dimuon"
    for client in (tc, resumed):
        client.forward_backward(data(7), "cross_entropy")
        client.optim_step(step).result()
    assert_weights_equal(weights(resumed), weights(tc), atol=0)
    tc.load_state(path).result()  # weights only, into the client: its optimizer stays Dimuon (fresh momentum)
    tc.forward_backward(data(7), "cross_entropy")
    assert tc.optim_step(step).result().metrics["learning_rate:mean"] == 0.01
    fresh = service.create_training_client_from_state(path).result()  # weights only: a new (Adam) optimizer
    fresh.forward_backward(data(7), "cross_entropy")
    with pytest.raises(ValueError, match="optimizer is adamw"):
        fresh.optim_step(step).result()


def test_adam_is_still_adamw_bit_for_bit(service, tiny_model_dir):
    tc = service.create_lora_training_client(tiny_model_dir, rank=RANK, seed=4).result()
    shadow = {n: torch.nn.Parameter(w.clone()) for n, w in weights(tc).items()}
    reference = torch.optim.AdamW(
        list(shadow.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
    )
    for i, lr in enumerate((0.01, 0.003)):
        tc.forward_backward(data(i), "cross_entropy").result()
        for n, g in grads_of(tc).items():
            shadow[n].grad = g
        tc.optim_step(types.AdamParams(learning_rate=lr, weight_decay=0.01)).result()
        for group in reference.param_groups:
            group.update(lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.01)
        reference.step()
        assert_weights_equal(weights(tc), {n: p.detach() for n, p in shadow.items()}, atol=0)


def test_optimizer_mismatches_and_bad_dimuon_params_are_clear_errors(service, tiny_model_dir):
    dimuon = service.create_lora_training_client(
        tiny_model_dir, rank=RANK, seed=0, optimizer=types.DimuonOptimizerConfig()
    ).result()
    adam = service.create_lora_training_client(tiny_model_dir, rank=RANK, seed=0).result()
    for tc in (dimuon, adam):
        tc.forward_backward(data(0), "cross_entropy").result()
    before = weights(dimuon)
    with pytest.raises(
        ValueError, match="optim_step got AdamParams, but this training client's optimizer is dimuon"
    ):
        dimuon.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(
        ValueError, match="optim_step got DimuonParams, but this training client's optimizer is adamw"
    ):
        adam.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    from tinker.types.optimizer import OptimParamsBase

    for bad, words in (
        ({"learning_rate": -1.0}, "learning_rate must be in [0, 10], got -1"),
        ({"learning_rate": 1e-3, "beta1": 1.0}, "beta1 must be in [0, 1)"),
        ({"learning_rate": 1e-3, "damping": 0.0}, "damping must be > 0"),
        ({"learning_rate": 1e-3, "nesterov": 1.0}, "unknown keys ['nesterov']"),
    ):
        with pytest.raises(
            ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
        ):
            dimuon.optim_step(OptimParamsBase(type="dimuon", **bad))
    assert_weights_equal(weights(dimuon), before, atol=0)  # nothing was applied
    assert (
        dimuon.optim_step(types.DimuonParams(learning_rate=1e-3)).result().metrics["learning_rate:mean"]
        == 1e-3
    )
    with pytest.raises(ValueError, match="optimizer 'sgd' is not supported; supported: adamw, dimuon"):
        service.create_lora_training_client(tiny_model_dir, rank=RANK, optimizer={"type": "sgd"})
