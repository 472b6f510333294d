"""Target-token log-probabilities of packed micro-batches, without a ``[tokens x vocab]`` tensor that
lives for the whole micro-batch.

The decoder runs once over the packed rows (:mod:`polyrl.local.packing`); the unembedding, the
log-sum-exp and the target gather then run over chunks of the packed positions. In backward each
chunk's logits are recomputed from its hidden states (activation checkpointing), so at most one
chunk of float32 logits exists at a time; except, when the model itself is not checkpointed, the first
chunks, up to ``KEPT_LOGITS_BYTES`` of logits a micro-batch, which keep theirs for backward (recomputing
is a second unembedding, the largest product of a small model: ~7% of a SmolLM2 training pass). A
packed position shared by several datums (a common prefix) is unembedded once and gathered for each
datum's own target.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from polyrl.local.model import BaseModel
from polyrl.local.packing import MicroBatch

# Float32 logits alive at once: 64 MiB is ~110 positions of a 150k vocabulary, ~340 of a 49k one.
LOGITS_CHUNK_BYTES = 64 << 20
# Float32 logits kept for backward instead of recomputed, per micro-batch of a model trained without
# activation checkpointing: four chunks.
KEPT_LOGITS_BYTES = 256 << 20


class TargetLogprobs(torch.autograd.Function):
    """``logits[local[j], targets[j]] - logsumexp(logits[local[j]])`` for each request ``j`` (``[R]``) of
    float32 ``logits [C, V]``. Its backward writes the logits' gradient into one ``[C, V]`` tensor (each
    position's softmax times minus its requests' total gradient, plus each request's gradient at its
    target) where autograd's own builds four (a scattered one-hot, the softmax, its product and the sum)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, local: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)  # [C]
        ctx.save_for_backward(logits, lse, local, targets)
        return logits[local, targets] - lse[local]  # [R]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad [R]
        logits, lse, local, targets = ctx.saved_tensors
        total = torch.zeros_like(lse).index_add_(0, local, grad.to(lse.dtype))  # [C]
        out = torch.sub(logits, lse.unsqueeze(1)).exp_().mul_(-total.unsqueeze(1))  # [C, V]
        out.index_put_((local, targets), grad.to(out.dtype), accumulate=True)
        return out, None, None


def _chunk_logprobs(base: BaseModel, hidden: torch.Tensor, local: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets[j] | hidden[local[j]])`` for each request ``j`` of one chunk."""
    return TargetLogprobs.apply(base.logits(hidden), local, targets)  # [C, D] -> [C, V] -> [R]


def _requests(mb: MicroBatch, targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(packed position, target token) of every request, and the requests per datum. A datum's target
    is ``[n]`` (one per token) or ``[n, K]`` (K per token, e.g. top-K soft targets): its positions are
    then each repeated K times."""
    if all(t.dim() == 1 for t in targets):
        return mb.gather, torch.cat(targets), list(mb.lengths)
    gathers = mb.gather.split(mb.lengths)
    gather = torch.cat([g if t.dim() == 1 else g.repeat_interleave(t.shape[1])
                        for g, t in zip(gathers, targets)])
    return gather, torch.cat([t.reshape(-1) for t in targets]), [t.numel() for t in targets]


def packed_logprobs(base: BaseModel, mb: MicroBatch, targets: list[torch.Tensor],
                    chunk_bytes: int | None = None, kept_bytes: int | None = None) -> list[torch.Tensor]:
    """Log-probability of every target token of each datum of ``mb`` (in ``mb.datums`` order), shaped
    like the datum's targets (``[n]`` or ``[n, K]``). ``chunk_bytes``: ``LOGITS_CHUNK_BYTES`` unless given;
    ``kept_bytes``: ``KEPT_LOGITS_BYTES``, or 0 for a checkpointed model, unless given."""
    chunk_bytes = LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if kept_bytes is None:
        kept_bytes = 0 if base.gradient_checkpointing else KEPT_LOGITS_BYTES
    # [B, T] packed rows -> [B, T, D] hidden states (split) or [B, T, V] logits
    out, split = base.packed_forward(mb.input_ids, mb.position_ids, mb.attend, mb.plan, **mb.vision)
    gather, target, lengths = _requests(mb, targets)  # [R] packed position, [R] target token
    target = target.to(out.device)
    flat = out.reshape(-1, out.shape[-1])  # [B * T, D or V]

    def shaped(lp: torch.Tensor) -> list[torch.Tensor]:
        return [x.reshape(t.shape) for x, t in zip(lp.split(lengths), targets)]

    if not split:  # full logits came back (an architecture whose unembedding cannot run apart)
        lp = TargetLogprobs.apply(flat, gather, target)  # [R]
        return shaped(lp)
    # Unique packed positions in chunks; requests (datum tokens) sorted by position so each chunk's
    # requests are one contiguous run.
    positions, inverse = torch.unique(gather, return_inverse=True)  # unique positions; [R] index into them
    order = torch.argsort(inverse, stable=True)
    inverse_sorted, target_sorted = inverse[order], target[order]
    row_bytes = 4 * base.vocab_size  # one position's float32 logits
    per_chunk = max(1, chunk_bytes // row_bytes)
    kept_rows = kept_bytes // row_bytes // per_chunk * per_chunk  # whole chunks
    pieces = []
    for start in range(0, len(positions), per_chunk):
        end = min(start + per_chunk, len(positions))
        # one chunk in all is kept: there is no other to save memory for
        recompute = torch.is_grad_enabled() and len(positions) > per_chunk and end > kept_rows
        lo, hi = torch.searchsorted(inverse_sorted,
                                    torch.tensor([start, end], device=inverse_sorted.device)).tolist()
        hidden = flat[positions[start:end]]  # [C, D]: the chunk's unique positions
        local = inverse_sorted[lo:hi] - start  # [R_chunk] index into the chunk
        if recompute:
            pieces.append(checkpoint(_chunk_logprobs, base, hidden, local, target_sorted[lo:hi],
                                     use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(base, hidden, local, target_sorted[lo:hi]))
    lp = torch.cat(pieces)[torch.argsort(order)]  # [R], back in request order
    return shaped(lp)
