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

import functools
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types

PRUNE_FRACTION = 0.25  # drop finished rows from the cache once this share of the batch is done
INITIAL_DECODE_CAPACITY = 512  # new-token positions reserved up front in the KV cache (it grows by doubling)


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


@functools.cache
def _buffer_layer_class():
    """``_BufferLayer``, defined on first use so that importing polyrl does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        """A ``DynamicLayer`` that appends into a preallocated buffer (grown by doubling) and returns
        views of it, instead of concatenating the whole cache on every decode step."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            cap = max(self.capacity, key_states.shape[-2])
            self._k = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
            self._v = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self._k.shape[-2]:
                cap = max(end, 2 * self._k.shape[-2])
                grow = lambda b: torch.cat([b, b.new_empty((*b.shape[:-2], cap - b.shape[-2], b.shape[-1]))], dim=-2)  # noqa: E731
                self._k, self._v = grow(self._k), grow(self._v)
            self._k[..., self.length : end, :] = key_states
            self._v[..., self.length : end, :] = value_states
            self.length = end
            self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self._k, self._v = self._k[indices], self._v[indices]
                self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    return _BufferLayer


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


def _gumbel(shape: tuple[int, int], seeded: list[tuple[int, torch.Generator]], device, default_gen) -> torch.Tensor:
    """Gumbel noise; the ``(row, generator)`` rows of seeded requests draw from their own generator
    (batch-independent)."""
    u = torch.rand(shape, device=device, generator=default_gen)
    for i, g in seeded:
        u[i] = torch.rand(shape[1], device=device, generator=g)
    return u.clamp_(min=1e-20).log_().neg_().clamp_(min=1e-20).log_().neg_()


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
    # decode writes into preallocated per-layer buffers instead of concatenating every step
    # (sized for the expected length, capped so a huge max_tokens does not reserve memory up front)
    capacity = width + min(INITIAL_DECODE_CAPACITY, max((j.max_tokens for j in jobs if not j.prompt_only), default=0))
    layer_class = _buffer_layer_class()
    cache.layer_class_to_replicate = lambda: layer_class(capacity)
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
        # A seeded request gives each of its samples its own generator (seeded from the request's
        # seed), so a sample's draws never depend on when its siblings, or other requests, finish.
        seeds: list[int | None] = [None] * job.num_samples
        if job.params.seed is not None:
            parent = torch.Generator().manual_seed(int(job.params.seed))
            seeds = torch.randint(0, 2**62, (job.num_samples,), generator=parent).tolist()
        for seed in seeds:
            gen = None
            if seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed)
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
    any_greedy = bool((temps <= 0).any())
    plain = bool((temps == 1).all()) and not bool((top_k > 0).any()) and not bool((top_p < 1).any())
    # the attention mask of every step is a view of one buffer (no per-step concatenation)
    mask_buf = torch.ones((len(rows), mask.shape[1] + min(INITIAL_DECODE_CAPACITY, max(j.max_tokens for j in jobs))),
                          dtype=mask.dtype, device=device)
    mask_buf[:, : mask.shape[1]] = mask
    width = mask.shape[1]
    seeded = [(pos, g) for pos, g in enumerate(row_gen) if g is not None]
    sel = torch.arange(len(rows), device=device)

    while True:
        gumbel = _gumbel(tuple(logits.shape), seeded, device, generator)
        logp = torch.log_softmax(logits, dim=-1)
        if plain:  # temperature 1, no top-k / top-p: nothing to filter (x / 1.0 == x exactly)
            sampled = (logits + gumbel).argmax(-1)
        else:
            sampled = (_filtered_logits(logits, temps[sel], top_k[sel], top_p[sel]) + gumbel).argmax(-1)
        tokens = torch.where(temps[sel] <= 0, logits.argmax(-1), sampled) if any_greedy else sampled
        token_lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
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
            mask_buf, next_pos, tokens, sel = mask_buf[keep], next_pos[keep], tokens[keep], sel[keep]
            in_cache = [in_cache[pos] for pos in alive]
            seeded = [(pos, row_gen[row_i]) for pos, row_i in enumerate(in_cache) if row_gen[row_i] is not None]
        width += 1
        if width > mask_buf.shape[1]:
            mask_buf = torch.cat([mask_buf, torch.ones_like(mask_buf)], dim=1)
        out = model(
            input_ids=tokens.unsqueeze(1),
            attention_mask=mask_buf[:, :width],
            position_ids=next_pos.unsqueeze(1),
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
        logits = out.logits[:, -1, :].float()


def _hits_stop_string(tokens: list[int], stops: tuple[str, ...], max_chars: int, tokenizer) -> bool:
    tail = tokenizer.decode(tokens[-(max_chars + 4) :], skip_special_tokens=False)
    return any(s in tail for s in stops)
