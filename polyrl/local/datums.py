"""A ``forward_backward`` call's datums, validated and turned into what the loss functions take.

A datum's ``target_tokens`` are ``(N,)``, one per ``model_input`` token, or ``(N, K)`` for a loss that
takes K targets per position (``cross_entropy``'s top-K soft targets); its ``weights`` then have the
same shape, and every other loss input is ``(N,)``. A loss that needs provenance (``stable_reinforce``)
gets, per datum, which targets were sampled and their recorded sampler logprobs
(:class:`polyrl.local.stability.SampledInputs`) as the inputs ``sampled`` and ``sampler_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tinker import types

from polyrl.local import losses
from polyrl.local.stability import SampledInputs, check_tiling
from polyrl.local.vision import ModelImage

if TYPE_CHECKING:
    from polyrl.local.model import BaseModel


@dataclass
class PreparedDatum:
    tokens: list[int]
    target: torch.Tensor  # int64 [len(tokens)] or [len(tokens), K]
    floats: dict[str, torch.Tensor]  # float32 loss inputs, each [len(tokens)] (weights: like target)
    images: list[ModelImage] = field(default_factory=list)  # a vision-language model's images

    @property
    def k(self) -> int:
        """Targets per position: 0 for one target of shape (N,)."""
        return 0 if self.target.dim() == 1 else int(self.target.shape[1])


def model_input_tokens(base: BaseModel, model_input: types.ModelInput,
                       where: str) -> tuple[list[int], list[ModelImage]]:
    """The tokens of a ``ModelInput`` (image positions: the model's placeholder) and its images, which a
    vision-language model's processor turns into pixels here."""
    if base.vision is not None:
        return base.vision.read_chunks(model_input.chunks, where)
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise ValueError(f"{where} has a {chunk.type!r} chunk, but model {base.name!r} is text-only (a "
                             "vision-language model takes images)")
        tokens.extend(int(t) for t in chunk.tokens)
    return tokens, []


def prepare_datum(i: int, datum: types.Datum, spec: losses.LossSpec | None, base: BaseModel,
                  sampled: SampledInputs | None = None) -> PreparedDatum:
    """One datum's tokens, targets and float inputs (and a vision-language model's images), validated
    with clear errors."""
    if not isinstance(datum, types.Datum):
        raise ValueError(f"data[{i}] is a {type(datum).__name__}, not a tinker.types.Datum")
    vocab = base.vocab_size
    tokens, found = model_input_tokens(base, datum.model_input, f"data[{i}].model_input")
    if not tokens:
        raise ValueError(f"data[{i}].model_input is empty")
    inputs = datum.loss_fn_inputs
    name = spec.name if spec else "custom"
    required = spec.inputs if spec else ("target_tokens",)
    for key in required:
        if key not in inputs:
            raise ValueError(f"data[{i}].loss_fn_inputs is missing {key!r} (loss {name} needs "
                             f"{list(required)})")
    allowed = set(required) | set(spec.optional_inputs if spec else ()) | {"weights", "mask"}
    target = inputs["target_tokens"].to_torch().long()
    if target.dim() == 2 and not (spec and spec.top_k):
        raise ValueError(f"data[{i}]: target_tokens has shape {list(target.shape)}; loss {name} takes one "
                         "target per token, shape (N,) (only cross_entropy takes (N, K) targets)")
    if target.dim() == 2 and target.shape[1] < 1:
        raise ValueError(f"data[{i}]: target_tokens has shape {list(target.shape)}; K must be at least 1")
    if target.dim() != 2:
        target = target.reshape(-1)
    if len(target) != len(tokens):
        raise ValueError(f"data[{i}]: target_tokens has {len(target)} entries but model_input has "
                         f"{len(tokens)} tokens")
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab):
        raise ValueError(f"data[{i}]: target_tokens out of range for vocabulary size {vocab}")
    if max(tokens) >= vocab or min(tokens) < 0:
        raise ValueError(f"data[{i}]: model_input token out of range for vocabulary size {vocab}")
    check_tiling(i, datum, len(tokens), len(target))
    floats = {}
    for key, td in inputs.items():
        if key == "target_tokens" or key not in allowed:
            continue
        if key == "logprobs" and spec is not None and spec.provenance:
            continue  # the recorded sampler logprobs stand in for the client's
        t = td.to_torch().float()
        if key == "weights" and target.dim() == 2:
            if list(t.shape) != list(target.shape):
                raise ValueError(f"data[{i}]: loss_fn_inputs['weights'] has shape {list(t.shape)}; with "
                                 f"target_tokens of shape {list(target.shape)} it must have the same")
        else:
            t = t.reshape(-1)
            if len(t) != len(tokens):
                raise ValueError(f"data[{i}]: loss_fn_inputs[{key!r}] has {len(t)} entries but model_input "
                                 f"has {len(tokens)} tokens")
        floats[key] = t
    if sampled is not None:
        advantages = floats["advantages"]
        stray = torch.nonzero((advantages != 0) & ~torch.from_numpy(sampled.sampled)).flatten()
        if len(stray):
            p = int(stray[0])
            raise ValueError(f"data[{i}]: advantage {float(advantages[p]):g} at target position {p}, which "
                             f"no SampledProvenanceSpan covers; {name} trains sampled tokens only")
        floats["sampled"] = torch.from_numpy(sampled.sampled.astype("float32"))
        floats["sampler_logprobs"] = torch.from_numpy(sampled.sampler_logprobs)
    return PreparedDatum(tokens, target, floats, found)


def batch_loss(spec: losses.LossSpec, datums: list[PreparedDatum], lps: list[torch.Tensor], config: dict,
               device: torch.device) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The loss of a micro-batch's datums: one call of the loss per set of ``loss_fn_inputs`` keys and
    target width (datums may differ, e.g. ``weights`` on some only; each is computed with exactly its own
    inputs)."""
    by_keys: dict[tuple, list[int]] = {}
    for n, d in enumerate(datums):
        by_keys.setdefault((d.k, *sorted(d.floats)), []).append(n)
    total, metrics = None, []
    for (_, *keys), members in by_keys.items():
        flat_lp = torch.cat([lps[n] for n in members])
        inputs = {k: torch.cat([datums[n].floats[k] for n in members]).to(device) for k in keys}
        seg_ids = torch.cat([torch.full((len(lps[n]),), j, dtype=torch.long) for j, n in enumerate(members)])
        loss, m = spec.fn(flat_lp, inputs, losses.Segments(seg_ids.to(device), len(members)), config)
        total = loss if total is None else total + loss
        metrics.append(m)
    return total, metrics


def reduce_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch metrics by the reduction their ``name:reduction`` key names."""
    reducers = {"sum": sum, "max": max, "min": min}
    keys = {k for p in parts for k in p}
    out = {}
    for k in sorted(keys):
        values = [p[k] for p in parts if k in p]
        out[k] = reducers.get(k.rsplit(":", 1)[-1], lambda v: sum(v) / len(v))(values)
    return out
