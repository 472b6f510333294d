"""How a decode step draws its tokens: by inverse CDF, one uniform number per row per step, vectorised
over the batch. A seeded request's rows draw theirs from a counter-based hash of (row seed, step), so a
sample never depends on its batch, and nothing loops over rows in Python (on a GPU, a per-row generator
would be one kernel launch per row per step)."""

from __future__ import annotations

import torch

CDF_CHUNK = 1024  # tokens per chunk of the two-level inverse-CDF draw (see inverse_cdf)


def filtered_logits(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k and top-p masking, row by row (vectorised)."""
    x = logits / temps.clamp(min=1e-5).unsqueeze(1)  # [B, V] / [B, 1]
    needs_k = top_k > 0
    needs_p = top_p < 1.0
    if bool(needs_k.any()) or bool(needs_p.any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [B, V] each, best first
        vocab = x.shape[-1]
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)  # [1, V]
        k = torch.where(needs_k, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [B, 1]
        drop = ranks >= k  # [B, V], in sorted order
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        drop |= before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # always keep the best token
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32), without int64 overflow (16-bit halves of ``c``)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' lowbias32), elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row, a pure function of (row seed, step): 53 random bits from
    two hashes of the seed's 32-bit halves and the step."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    h = _mix32(lo ^ _mix32(hi ^ _mix32(torch.full_like(seeds, step & _MASK32) ^ 0x9E3779B9)))
    h2 = _mix32(h ^ 0x85EBCA6B)
    return ((h >> 6).double() * 134217728.0 + (h2 >> 5).double() + 0.5) / 9007199254740992.0  # 26 + 27 bits


def row_uniforms(seeds: torch.Tensor, seeded: torch.Tensor, step: int, generator) -> torch.Tensor:
    """Uniforms for a decode step: counter-based for seeded rows, the engine's generator for the rest."""
    u = torch.rand(len(seeds), generator=generator, device=seeds.device, dtype=torch.float64)
    if bool(seeded.any()):
        u = torch.where(seeded, counter_uniforms(seeds, step), u)
    return u


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token: the first whose cumulative weight reaches ``u[i]`` of the row's total.

    ``weights [B, V]`` (probabilities, or any non-negative multiple of them). A cumulative sum along the
    whole vocabulary is one sequential pass per row, so over a wide vocabulary the draw first picks the
    chunk of ``CDF_CHUNK`` tokens where the row's cumulative weight reaches its target (from the chunks'
    sums) and then the token inside that chunk; every row's result depends on that row alone."""
    batch, vocab = weights.shape
    if vocab <= 2 * CDF_CHUNK:
        cdf = weights.cumsum(-1)  # [B, V]
        want = (u * cdf[:, -1].double()).to(cdf.dtype).unsqueeze(1)  # [B, 1]
        return torch.searchsorted(cdf, want).squeeze(1).clamp_(max=vocab - 1)  # [B]
    whole = vocab // CDF_CHUNK * CDF_CHUNK  # the last chunk may be shorter (or empty)
    chunk_cdf = torch.cat([weights[:, :whole].reshape(batch, -1, CDF_CHUNK).sum(-1),
                           weights[:, whole:].sum(-1, keepdim=True)], dim=1).cumsum(-1)  # [B, C]
    want = (u * chunk_cdf[:, -1].double()).to(chunk_cdf.dtype).unsqueeze(1)  # [B, 1]
    chunk = torch.searchsorted(chunk_cdf, want).clamp_(max=chunk_cdf.shape[1] - 1)  # [B, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)  # [B, 1]
    columns = chunk * CDF_CHUNK + torch.arange(CDF_CHUNK, device=weights.device)  # [B, chunk]
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    cdf = inside.cumsum(-1) + before  # [B, chunk]
    # the chunk's own sum may round below its entry of chunk_cdf: then its last token of positive weight
    index = torch.searchsorted(cdf, torch.minimum(want, cdf[:, -1:])).squeeze(1)  # [B]
    return (chunk.squeeze(1) * CDF_CHUNK + index).clamp_(max=vocab - 1)
