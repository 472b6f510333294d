"""Batched generation with a KV cache.

The engine hands :func:`generate` every sampling request that is waiting, so concurrent episodes
share one decode loop: identical prompts (a GRPO group) are prefilled once and their caches
repeated, rows that finish are dropped from the cache, and each request keeps its own
temperature, top-k/top-p, stops, ``max_tokens`` and seed.

Returned logprobs are the model's own (temperature 1, unfiltered) log-probabilities of the sampled
tokens: what ``forward`` computes for the same tokens, so RL importance ratios compare like with
like. They agree to float32 rounding, not bit for bit: a matrix product's rounding depends on the
batch (rows, padding) a request runs in, and which requests share a batch depends on timing.

Sampling is by inverse CDF: one uniform number per row per step, vectorised over the batch. A
seeded request's rows draw theirs from a counter-based hash of (row seed, step), so a sample never
depends on its batch, and nothing loops over rows in Python (on a GPU, a per-row generator would
be one kernel launch per row per step).

Images (vision-language models, ``vision``): prompts are the same when their tokens and images are; a
batch with images is prefilled through the multimodal model (vision tower, then the language model at
each token's multimodal positions, ``[4, rows, width]``), and each row decodes at its text position plus
its prompt's rope delta, on every axis, as the model's own generation does.
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
    images: tuple = ()  # a vision-language model's images (polyrl.local.vision.ModelImage)
    mrope: torch.Tensor | None = None  # [3, len(prompt)] multimodal positions, with images
    rope_delta: int = 0  # how far decoding's positions run ahead of the token count

    @property
    def key(self) -> tuple:
        """What makes two prompts the same: tokens and images (content and place)."""
        return (tuple(self.prompt), tuple((im.key, im.start) for im in self.images))


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


def _row_uniforms(seeds: torch.Tensor, seeded: torch.Tensor, step: int, generator) -> torch.Tensor:
    """Uniforms for a decode step: counter-based for seeded rows, the engine's generator for the rest."""
    u = torch.rand(len(seeds), generator=generator, device=seeds.device, dtype=torch.float64)
    if bool(seeded.any()):
        u = torch.where(seeded, counter_uniforms(seeds, step), u)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row ``i``'s token: the first whose cumulative probability reaches ``u[i]`` of the row's total."""
    cdf = probs.cumsum(-1)
    want = (u * cdf[:, -1].double()).to(cdf.dtype).unsqueeze(1)
    return torch.searchsorted(cdf, want).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@torch.inference_mode()
def generate(model, jobs: list[SampleJob], tokenizer, device, generator: torch.Generator | None,
             logits_fn=None, vision=None) -> list[types.SampleResponse]:
    """Run all ``jobs`` in one batched decode loop; one ``SampleResponse`` per job, in order.

    ``logits_fn`` maps hidden states to float32 logits (the model's unembedding); with it the prefill
    unembeds every position only of the prompts whose logprobs were asked for. ``vision``: a
    vision-language model's :class:`polyrl.local.vision.Vision` (then ``logits_fn`` is required)."""
    # ---- prefill unique prompts (left-padded) -------------------------------------------------
    unique: dict[tuple, int] = {}
    first: dict[int, SampleJob] = {}
    for job in jobs:
        first.setdefault(unique.setdefault(job.key, len(unique)), job)
    prompts = [first[i].prompt for i in range(len(unique))]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    pad = 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    lp_prompts = sorted({unique[j.key] for j in jobs if j.include_prompt_logprobs or j.prompt_only})
    with_images = [first[i] for i in range(len(prompts)) if first[i].images]
    deltas = torch.tensor([first[i].rope_delta for i in range(len(prompts))], device=device)
    from transformers import DynamicCache

    cache = DynamicCache()
    # decode writes into preallocated per-layer buffers instead of concatenating every step
    # (sized for the expected length, capped so a huge max_tokens does not reserve memory up front)
    capacity = width + min(INITIAL_DECODE_CAPACITY, max((j.max_tokens for j in jobs if not j.prompt_only), default=0))
    layer_class = _buffer_layer_class()
    cache.layer_class_to_replicate = lambda: layer_class(capacity)
    split = logits_fn is not None and (bool(lp_prompts) or bool(with_images))
    if with_images:  # the multimodal model: images encoded and placed, multimodal positions
        multimodal = positions.unsqueeze(0).repeat(3, 1, 1)
        for i in range(len(prompts)):
            if first[i].mrope is not None:
                multimodal[:, i, width - len(prompts[i]):] = first[i].mrope.to(device)
        out = vision.inner(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                           position_ids=torch.cat([positions.unsqueeze(0), multimodal]),
                           **vision.inputs([im for job in with_images for im in job.images], device))
    else:
        out = (model.get_decoder() if split else model)(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **({} if split else {"logits_to_keep": 0 if lp_prompts else 1}),
        )
    prompt_lps: dict[int, np.ndarray] = {}
    if split:  # unembed the last position of every prompt, every position of the asked-for ones
        hidden = out.last_hidden_state
        last_logits = logits_fn(hidden[:, -1, :])
        rows_logits = ((i, logits_fn(hidden[i, width - len(prompts[i]) : -1])) for i in lp_prompts)
    else:
        logits = out.logits.float()
        last_logits = logits[:, -1, :]
        rows_logits = ((i, logits[i, width - len(prompts[i]) : -1]) for i in lp_prompts)
    for i, row_logits in rows_logits:
        p = prompts[i]
        arr = np.full(len(p), np.nan, dtype=np.float32)
        if len(p) > 1:
            targets = torch.tensor(p[1:], device=device)
            picked = row_logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row_logits, dim=-1)
            arr[1:] = picked.cpu().numpy()
        for image in first[i].images:  # an image position is no token's prediction
            arr[image.start:image.end] = np.nan
        prompt_lps[i] = arr

    # ---- expand to one row per sample --------------------------------------------------------
    rows: list[_Row] = []
    row_prompt: list[int] = []
    row_seed: list[int] = []  # -1: unseeded
    for j, job in enumerate(jobs):
        if job.prompt_only:
            continue
        # A seeded request gives each of its samples its own seed (drawn from the request's), so a
        # sample's draws never depend on when its siblings, or other requests, finish.
        seeds = [-1] * job.num_samples
        if job.params.seed is not None:
            parent = torch.Generator().manual_seed(int(job.params.seed))
            seeds = torch.randint(0, 2**62, (job.num_samples,), generator=parent).tolist()
        for seed in seeds:
            rows.append(_Row(job=j))
            row_prompt.append(unique[job.key])
            row_seed.append(seed)

    if rows:
        seeds = torch.tensor(row_seed, dtype=torch.long, device=device)
        _decode(model, jobs, rows, row_prompt, seeds, cache, mask, lengths, last_logits, tokenizer, device,
                generator, deltas if bool(deltas.any()) else None)

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
        plp = prompt_lps.get(unique[job.key]) if (job.include_prompt_logprobs or job.prompt_only) else None
        responses.append(types.SampleResponse(sequences=seqs, prompt_logprobs_np=plp))
    return responses


def _decode(model, jobs, rows, row_prompt, seeds, cache, prompt_mask, prompt_lengths, prompt_last_logits,
            tokenizer, device, generator, prompt_deltas=None):
    index = torch.tensor(row_prompt, device=device)
    cache.batch_select_indices(index)
    mask = prompt_mask[index]
    next_pos = prompt_lengths[index]
    delta = prompt_deltas[index] if prompt_deltas is not None else None  # multimodal positions run ahead
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
    seeded = seeds >= 0
    sel = torch.arange(len(rows), device=device)
    step = 0

    while True:
        u = _row_uniforms(seeds[sel], seeded[sel], step, generator)
        logp = torch.log_softmax(logits, dim=-1)
        if plain:  # temperature 1, no top-k / top-p: the distribution is the model's own
            sampled = _inverse_cdf(logp.exp(), u)
        else:
            sampled = _inverse_cdf(torch.softmax(_filtered_logits(logits, temps[sel], top_k[sel], top_p[sel]), -1), u)
        tokens = torch.where(temps[sel] <= 0, logits.argmax(-1), sampled) if any_greedy else sampled
        step += 1
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
            delta = delta[keep] if delta is not None else None
            in_cache = [in_cache[pos] for pos in alive]
        width += 1
        if width > mask_buf.shape[1]:
            mask_buf = torch.cat([mask_buf, torch.ones_like(mask_buf)], dim=1)
        step_pos = next_pos.unsqueeze(1)
        if delta is not None:  # [text index, then time/height/width: the index plus the prompt's delta]
            step_pos = torch.stack([step_pos, *([step_pos + delta.unsqueeze(1)] * 3)])
        out = model(
            input_ids=tokens.unsqueeze(1),
            attention_mask=mask_buf[:, :width],
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
        logits = out.logits[:, -1, :].float()


def _hits_stop_string(tokens: list[int], stops: tuple[str, ...], max_chars: int, tokenizer) -> bool:
    tail = tokenizer.decode(tokens[-(max_chars + 4) :], skip_special_tokens=False)
    return any(s in tail for s in stops)
