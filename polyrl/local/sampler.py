"""Batched generation with a KV cache.

The engine hands :func:`generate` every sampling request that is waiting, so concurrent episodes
share one decode loop: identical prompts (a GRPO group) are prefilled once and their caches
repeated, rows that finish are dropped from the cache, and each request keeps its own
temperature, top-k/top-p, stops, ``max_tokens`` and seed.

Returned logprobs are the model's own (temperature 1, unfiltered) log-probabilities of the sampled
tokens: exactly what ``forward`` computes for the same tokens, so RL importance ratios compare
like with like.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types

PRUNE_FRACTION = 0.25  # drop finished rows from the cache once this share of the batch is done


@dataclass
class SampleJob:
    """One ``sample`` call: a prompt, ``num_samples`` continuations, its own parameters."""

    prompt: list[int]
    num_samples: int
    params: types.SamplingParams
    include_prompt_logprobs: bool = False
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    max_tokens: int = 16
    prompt_only: bool = False  # compute_logprobs: prefill, no sampling


@dataclass
class _Row:
    job: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None


def resolve_stops(stop, tokenizer, eos_ids: list[int]) -> tuple[frozenset[int], tuple[str, ...]]:
    """``SamplingParams.stop`` as (token ids, strings); the model's end-of-sequence ids always stop."""
    ids, strings = set(eos_ids), []
    if stop is None:
        pass
    elif isinstance(stop, str):
        strings.append(stop)
    else:
        for s in stop:
            if isinstance(s, str):
                strings.append(s)
            elif isinstance(s, (int, np.integer)):
                ids.add(int(s))
            else:
                raise ValueError(f"stop entries must be strings or token ids, got {type(s).__name__}")
    if any(s == "" for s in strings):
        raise ValueError("stop strings must not be empty")
    return frozenset(ids), tuple(strings)


def _filtered_logits(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k and top-p masking, row by row (vectorised)."""
    x = logits / temps.clamp(min=1e-5).unsqueeze(1)
    needs_k = top_k > 0
    needs_p = top_p < 1.0
    if bool(needs_k.any()) or bool(needs_p.any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        vocab = x.shape[-1]
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
        k = torch.where(needs_k, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        drop = ranks >= k
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        drop |= before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # always keep the best token
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def _gumbel(shape: tuple[int, int], rows_gen: list[torch.Generator | None], device, default_gen) -> torch.Tensor:
    """Gumbel noise; rows of seeded requests draw from their own generator (batch-independent)."""
    u = torch.rand(shape, device=device, generator=default_gen)
    for i, g in enumerate(rows_gen):
        if g is not None:
            u[i] = torch.rand(shape[1], device=device, generator=g)
    exponential = -torch.log(u.clamp(min=1e-20))
    return -torch.log(exponential.clamp(min=1e-20))


@torch.inference_mode()
def generate(model, jobs: list[SampleJob], tokenizer, device, generator: torch.Generator | None) -> list[types.SampleResponse]:
    """Run all ``jobs`` in one batched decode loop; one ``SampleResponse`` per job, in order."""
    # ---- prefill unique prompts (left-padded) -------------------------------------------------
    unique: dict[tuple[int, ...], int] = {}
    for job in jobs:
        unique.setdefault(tuple(job.prompt), len(unique))
    prompts = list(unique)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    pad = 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    want_prompt_lp = any(j.include_prompt_logprobs or j.prompt_only for j in jobs)
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if want_prompt_lp else 1,
    )
    logits = out.logits.float()
    last_logits = logits[:, -1, :]
    prompt_lps: dict[int, np.ndarray] = {}
    if want_prompt_lp:
        logp_all = torch.log_softmax(logits[:, :-1, :], dim=-1)
        targets = ids[:, 1:]
        picked = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        for i, p in enumerate(prompts):
            arr = np.full(len(p), np.nan, dtype=np.float32)
            if len(p) > 1:
                arr[1:] = picked[i, width - len(p) :].cpu().numpy()
            prompt_lps[i] = arr

    # ---- expand to one row per sample --------------------------------------------------------
    rows: list[_Row] = []
    row_prompt: list[int] = []
    row_gen: list[torch.Generator | None] = []
    for j, job in enumerate(jobs):
        if job.prompt_only:
            continue
        gen = None
        if job.params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(job.params.seed))
        for _ in range(job.num_samples):
            rows.append(_Row(job=j))
            row_prompt.append(unique[tuple(job.prompt)])
            row_gen.append(gen)

    if rows:
        _decode(model, jobs, rows, row_prompt, row_gen, cache, mask, lengths, last_logits, tokenizer, device, generator)

    # ---- responses ---------------------------------------------------------------------------
    responses = []
    by_job: dict[int, list[_Row]] = {}
    for r in rows:
        by_job.setdefault(r.job, []).append(r)
    for j, job in enumerate(jobs):
        seqs = [
            types.SampledSequence(
                stop_reason=r.stop_reason or "length",
                sequence_id=uuid.uuid4().hex,
                tokens_np=np.asarray(r.tokens, dtype=np.int32),
                logprobs_np=np.asarray(r.logprobs, dtype=np.float32),
            )
            for r in by_job.get(j, [])
        ]
        plp = prompt_lps.get(unique[tuple(job.prompt)]) if (job.include_prompt_logprobs or job.prompt_only) else None
        responses.append(types.SampleResponse(sequences=seqs, prompt_logprobs_np=plp))
    return responses


def _decode(model, jobs, rows, row_prompt, row_gen, cache, prompt_mask, prompt_lengths, prompt_last_logits, tokenizer, device, generator):
    index = torch.tensor(row_prompt, device=device)
    cache.batch_select_indices(index)
    mask = prompt_mask[index]
    next_pos = prompt_lengths[index]
    logits = prompt_last_logits[index]
    temps = torch.tensor([jobs[r.job].params.temperature for r in rows], device=device, dtype=torch.float32)
    top_k = torch.tensor([jobs[r.job].params.top_k or -1 for r in rows], device=device)
    top_p = torch.tensor([jobs[r.job].params.top_p for r in rows], device=device, dtype=torch.float32)
    max_stop_chars = max((len(s) for j in jobs for s in j.stop_strings), default=0)
    # Row numbers in cache order. Finished rows stay in the cache (and are skipped) until enough
    # of them finish to make dropping them worth reshaping the cache.
    in_cache = list(range(len(rows)))

    while True:
        sel = torch.tensor(in_cache, device=device)
        gumbel = _gumbel(tuple(logits.shape), [row_gen[i] for i in in_cache], device, generator)
        sampled = (_filtered_logits(logits, temps[sel], top_k[sel], top_p[sel]) + gumbel).argmax(-1)
        tokens = torch.where(temps[sel] <= 0, logits.argmax(-1), sampled)
        token_lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        for row_i, tok, lp in zip(in_cache, tokens.tolist(), token_lp.tolist()):
            row = rows[row_i]
            if row.stop_reason is not None:
                continue
            job = jobs[row.job]
            row.tokens.append(tok)
            row.logprobs.append(lp)
            if tok in job.stop_ids:
                row.stop_reason = "stop"
            elif job.stop_strings and _hits_stop_string(row.tokens, job.stop_strings, max_stop_chars, tokenizer):
                row.stop_reason = "stop"
            elif len(row.tokens) >= job.max_tokens:
                row.stop_reason = "length"
        alive = [pos for pos, row_i in enumerate(in_cache) if rows[row_i].stop_reason is None]
        if not alive:
            return
        if len(in_cache) - len(alive) >= PRUNE_FRACTION * len(in_cache):
            keep = torch.tensor(alive, device=device)
            cache.batch_select_indices(keep)
            mask, next_pos, tokens = mask[keep], next_pos[keep], tokens[keep]
            in_cache = [in_cache[pos] for pos in alive]
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(
            input_ids=tokens.unsqueeze(1),
            attention_mask=mask,
            position_ids=next_pos.unsqueeze(1),
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
        logits = out.logits[:, -1, :].float()


def _hits_stop_string(tokens: list[int], stops: tuple[str, ...], max_chars: int, tokenizer) -> bool:
    tail = tokenizer.decode(tokens[-(max_chars + 4) :], skip_special_tokens=False)
    return any(s in tail for s in stops)
