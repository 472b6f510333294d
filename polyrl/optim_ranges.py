"""The ranges an optimizer step's hyperparameters and a loss's settings must lie in.

One table, read where the values enter: the engine's check of every ``optim_step``
(:mod:`polyrl.local.optim`, so ``polyrl serve``'s requests and the in-process client alike) and the run
config's validators (:mod:`polyrl.config.schema`), so a value ``polyrl train`` accepts at load is one the
engine accepts at its first step. A leaf: it imports nothing of polyrl (the config schema imports it).

The upper bounds are generous: far above any value a run uses, low enough that one step cannot overflow
float32 weights or a Python float (``(32 / rank) ** rank_lr_correction_exponent``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# LoRA runs use learning rates of 1e-6..1e-2 (Adam's steps are about lr in size per entry, Dimuon's
# lr * sqrt(rank) per matrix): 10 is three orders past any of them and still a finite, bounded step.
MAX_LEARNING_RATE = 10.0
# AdamW multiplies each weight by 1 - lr * weight_decay: usual values are 0..0.1.
MAX_WEIGHT_DECAY = 10.0
# Dimuon scales its step by (32 / rank) ** exponent: 0.5 by default, 0 for none; up to 2 the factor stays
# finite and modest for every rank (rank 1: 1024x). A negative exponent would make larger ranks take
# larger steps, which no correction means.
MAX_RANK_LR_CORRECTION_EXPONENT = 2.0


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of finite numbers (infinities and NaN are never in one)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


LEARNING_RATE = Range(0.0, MAX_LEARNING_RATE)
BETA = Range(0.0, 1.0, high_open=True)
ADAM = {
    "learning_rate": LEARNING_RATE, "beta1": BETA, "beta2": BETA, "eps": Range(0.0, low_open=True),
    "weight_decay": Range(0.0, MAX_WEIGHT_DECAY), "grad_clip_norm": Range(0.0),
}
DIMUON = {
    "learning_rate": LEARNING_RATE, "beta1": BETA, "grad_clip_norm": Range(0.0),
    "damping": Range(0.0, low_open=True),
    "rank_lr_correction_exponent": Range(0.0, MAX_RANK_LR_CORRECTION_EXPONENT),
}
OPTIMIZERS = {"adam": ADAM, "adamw": ADAM, "dimuon": DIMUON}
# loss_fn_config settings whose range the loss itself requires (stable_reinforce's ratio cap and KL).
LOSS_CONFIG = {"max_ratio": Range(0.0, low_open=True), "kl_coeff": Range(0.0)}


def number(value: object) -> str:
    """A number as a short text (``1e+308``, not its 309 digits); anything else as its repr."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    if abs(value) < 10**15 and float(value).is_integer():
        return str(int(value))
    text = repr(float(value))
    return text if len(text) <= 12 else f"{value:.6g}"


def range_problems(values: Mapping[str, object], ranges: Mapping[str, Range]) -> list[tuple[str, str]]:
    """``(name, "must be <range>, got <value>")`` for each of ``values`` outside its range in ``ranges``
    (names ``ranges`` lacks are not checked here)."""
    return [(name, f"must be {ranges[name]}, got {number(value)}")
            for name, value in values.items() if name in ranges and value not in ranges[name]]


def optimizer_problems(kind: str, values: Mapping[str, object]) -> list[tuple[str, str]]:
    """Problems of an optimizer step's hyperparameters (``kind``: 'adam', 'adamw' or 'dimuon'); None
    values (a default left to the service) are not checked."""
    return range_problems({k: v for k, v in values.items() if v is not None}, OPTIMIZERS[kind])
