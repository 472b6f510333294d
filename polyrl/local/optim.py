"""The engine's optimizers: AdamW (``torch.optim.AdamW``, Tinker's default) and Dimuon.

Tinker fixes a training client's optimizer when the client is created (``optimizer=`` of
``create_lora_training_client``; a full-state load keeps the checkpoint's), and each ``optim_step``
passes the matching hyperparameters: ``AdamParams`` or ``DimuonParams``. A step of the other kind is
refused, as is any optimizer but these two.

Dimuon, as polyrl implements it (Tinker's documentation fixes its parameters, not every constant):
on each LoRA matrix ``W`` (``A`` is rank x in, ``B`` out x rank; any 2-D trained parameter), with its
gradient ``G`` (after the global ``grad_clip_norm``, as for Adam)::

    M <- beta1 * M + (1 - beta1) * G                         (EMA momentum, M starts at 0)
    rho_i = ||M[i, :]||,  gamma_j = ||M[:, j]||                (row and column norms)
    N = diag(rho + damping * mean(rho) + eps)^-1/2  M  diag(gamma + damping * mean(gamma) + eps)^-1/2
    O = U V^T  for  N = U S V^T                              (the matrix sign; singular values below
                                                              1e-6 of the largest count as 0)
    W <- W - learning_rate * (32 / rank) ** rank_lr_correction_exponent * O

``O`` has Frobenius norm sqrt(rank) for a full-rank LoRA matrix, so ``learning_rate`` is the step
along a direction of that norm, as Tinker documents; the rank correction (relative to rank 32) is the
same for every LoRA matrix. ``eps`` is 1e-12 of the mean row (column) norm. polyrl computes ``O``
exactly, from the eigendecomposition of the small (rank x rank) Gram matrix, not by iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from tinker import types

from polyrl.optim_ranges import optimizer_problems

REFERENCE_RANK = 32
DEFAULT_BETA1 = 0.9
DEFAULT_DAMPING = 0.1
DEFAULT_RANK_LR_CORRECTION_EXPONENT = 0.5
SIGN_RTOL = 1e-6  # singular values below this share of the largest are treated as zero
NORM_EPS = 1e-12
OPTIMIZERS = ("adamw", "dimuon")


@dataclass(frozen=True)
class DimuonSettings:
    """One Dimuon step's hyperparameters (``tinker.types.DimuonParams``, plus the two Tinker's
    documentation lists that SDK 0.38's type does not carry yet)."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = DEFAULT_BETA1
    damping: float = DEFAULT_DAMPING
    rank_lr_correction_exponent: float = DEFAULT_RANK_LR_CORRECTION_EXPONENT

    @classmethod
    def of(cls, params: Any) -> DimuonSettings:
        """From ``DimuonParams`` (or another ``OptimParamsBase`` of type 'dimuon') or a JSON dict; a
        ValueError naming the field for an unknown key or a value out of range."""
        values = dict(params) if isinstance(params, dict) else params.model_dump()
        kind = values.pop("type", "dimuon")
        if kind != "dimuon":
            raise ValueError(f"optimizer params of type {kind!r} are not Dimuon's")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"dimuon params have unknown keys {unknown} (known: {sorted(known)})")
        values = {name: value for name, value in values.items() if value is not None}  # null: the default
        if "learning_rate" not in values:
            raise ValueError("dimuon params need a learning_rate")
        raise_problems("dimuon_params", optimizer_problems("dimuon", values))
        return cls(**{name: float(value) for name, value in values.items()})


def optimizer_type(config: Any) -> str:
    """'adamw' or 'dimuon' from an optimizer config (``AdamOptimizerConfig``, ``DimuonOptimizerConfig``,
    a dict with ``type``, or None for the default); a ValueError for any other."""
    if config is None:
        return "adamw"
    kind = config.get("type", "adamw") if isinstance(config, dict) else getattr(config, "type", None)
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer {kind!r} is not supported; supported: {', '.join(OPTIMIZERS)}")
    return kind


def make_optimizer(kind: str, params: list[torch.nn.Parameter], rank: int) -> torch.optim.Optimizer:
    if kind == "dimuon":
        return Dimuon(params, rank)
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


def check_adam(params: types.AdamParams) -> None:
    """Adam's hyperparameters in their ranges (:mod:`polyrl.optim_ranges`); a one-line ValueError naming
    each field that is not."""
    raise_problems("adam_params", optimizer_problems("adamw", params.model_dump()))


def raise_problems(prefix: str, problems: list[tuple[str, str]]) -> None:
    if problems:
        raise ValueError("; ".join(f"{prefix}.{name} {reason}" for name, reason in problems))


def check_kind(kind: str, params: types.AdamParams | DimuonSettings) -> None:
    """A step's hyperparameters must be those of the client's optimizer (``kind``)."""
    given = "dimuon" if isinstance(params, DimuonSettings) else "adamw"
    if given != kind:
        raise ValueError(f"optim_step got {'DimuonParams' if given == 'dimuon' else 'AdamParams'}, but this "
                         f"training client's optimizer is {kind} (fixed when it was created: "
                         "create_lora_training_client(optimizer=...))")
    if isinstance(params, types.AdamParams):
        check_adam(params)


def configure(optimizer: torch.optim.Optimizer, params: types.AdamParams | DimuonSettings) -> None:
    """Set this step's hyperparameters on ``optimizer`` (checked by :func:`check_kind`)."""
    for group in optimizer.param_groups:
        if isinstance(params, DimuonSettings):
            group.update(lr=params.learning_rate, beta1=params.beta1, damping=params.damping,
                         exponent=params.rank_lr_correction_exponent)
        else:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)


def matrix_sign(n: torch.Tensor) -> torch.Tensor:
    """``U V^T`` of ``n = U S V^T`` (its polar factor), through the eigendecomposition of the smaller
    Gram matrix in float64; directions whose singular value is below ``SIGN_RTOL`` of the largest are 0."""
    x = n.double()
    wide = x.shape[0] <= x.shape[1]
    gram = x @ x.T if wide else x.T @ x
    eigenvalues, vectors = torch.linalg.eigh(gram)
    s = eigenvalues.clamp(min=0).sqrt()
    keep = s > SIGN_RTOL * s.max()
    inv = torch.where(keep, 1.0 / torch.where(keep, s, torch.ones_like(s)), torch.zeros_like(s))
    root = (vectors * inv) @ vectors.T  # gram^-1/2 on its range
    return (root @ x if wide else x @ root).to(n.dtype)


def dimuon_direction(m: torch.Tensor, damping: float) -> torch.Tensor:
    """The matrix sign of the row- and column-preconditioned momentum ``m`` (2-D)."""
    rows, cols = m.norm(dim=1), m.norm(dim=0)
    dr = rows + damping * rows.mean() + NORM_EPS * rows.mean()
    dc = cols + damping * cols.mean() + NORM_EPS * cols.mean()
    if not bool(dr.min() > 0) or not bool(dc.min() > 0):  # an all-zero momentum: no direction
        return torch.zeros_like(m)
    return matrix_sign(m / dr.sqrt()[:, None] / dc.sqrt()[None, :])


class Dimuon(torch.optim.Optimizer):
    """Dimuon on LoRA matrices (see the module docstring); its state is each parameter's momentum."""

    def __init__(self, params: list[torch.nn.Parameter], rank: int):
        defaults = {"lr": 1e-4, "beta1": DEFAULT_BETA1, "damping": DEFAULT_DAMPING,
                    "exponent": DEFAULT_RANK_LR_CORRECTION_EXPONENT, "rank": rank}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            scale = group["lr"] * (REFERENCE_RANK / group["rank"]) ** group["exponent"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                m = state["momentum"]
                m.mul_(group["beta1"]).add_(p.grad.float(), alpha=1 - group["beta1"])
                m2 = m.reshape(m.shape[0], -1)
                p.add_(dimuon_direction(m2, group["damping"]).reshape(p.shape).to(p.dtype), alpha=-scale)
