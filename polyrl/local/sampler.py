"""Batched generation with a KV cache.

The engine hands :func:`generate` every sampling request that is waiting, so concurrent episodes
share one decode loop: identical prompts (a GRPO group) are prefilled once and their caches
repeated, rows that finish are dropped from the cache, and each request keeps its own
temperature, top-k/top-p, stops, ``max_tokens`` and seed.

Returned logprobs are the model's own (temperature 1, unfiltered) log-probabilities of the sampled
tokens: what ``forward`` computes for the same tokens, so RL importance ratios compare like with
like. They agree to float32 rounding, not bit for bit: a matrix product's rounding depends on the
batch (rows, padding) a request runs in, and which requests share a batch depends on timing.

A request can also ask for what the model says about its prompt and its samples (Tinker's options):
the logprob of every prompt token (or of the last ``prompt_logprobs_last_n``), the top-K tokens and
logprobs at each prompt position and each sampled position, the logprobs of given target tokens at
each prompt position, and K tokens drawn at each prompt position. All come from the full
log-softmax of the model's float32 logits, computed in chunks of positions.

Sampling is by inverse CDF, one uniform number per row per step (:mod:`polyrl.local.draw`).

Images (vision-language models, ``vision``): prompts are the same when their tokens and images are; a
batch with images is prefilled through the multimodal model (vision tower, then the language model at
each token's multimodal positions, ``[4, rows, width]``), and each row decodes at its text position plus
its prompt's rope delta, on every axis, as the model's own generation does.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from polyrl.local.cpu_decode import DECODE_ATTENTION, with_cache
from polyrl.local.draw import filtered_logits, inverse_cdf, row_uniforms

MAX_LOGPROBS_K = 128  # widest top-K / target / alternative-token request (also bounded by the vocabulary)
TOPK_MASK_LOGPROB = -99999.0  # Tinker's filler for a top-K row with nothing in it (token 0)
PROMPT_CHUNK_BYTES = 64 << 20  # float32 logits of prompt positions alive at once
PRUNE_FRACTION = 0.25  # drop ended histories from the decode cache once this share of it is done
INITIAL_DECODE_CAPACITY = 512  # new-token positions reserved up front in the KV cache (it grows by doubling)
PADDED_DECODE_CAPACITY = 16  # the same for a padded cache (see _BufferLayer), which grows by as much


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
    last_n: int | None = None  # prompt logprobs (and top-K rows) of the last n prompt tokens only
    topk_prompt: int = 0
    topk_sample: int = 0
    target_prompt: torch.Tensor | None = None  # int64 [len(prompt) - 1, K], -1: nothing asked
    target_layout: types.TensorData | None = None  # a sparse request's layout, which the answer keeps
    alt_k: int = 0  # tokens drawn at each prompt position after the first
    images: tuple = ()  # a vision-language model's images (polyrl.local.vision.ModelImage)
    mrope: torch.Tensor | None = None  # [3, len(prompt)] multimodal positions, with images
    rope_delta: int = 0  # how far decoding's positions run ahead of the token count

    @property
    def wants_prompt(self) -> bool:
        """Whether the prefill must unembed every prompt position for this job."""
        return (self.include_prompt_logprobs or self.prompt_only or self.topk_prompt > 0
                or self.target_prompt is not None or self.alt_k > 0)

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
        views of it, instead of concatenating the whole cache on every decode step.

        ``padded``: a one-token step gets the whole buffer instead (zeros past the cached positions, which
        the attention mask then masks, as for Hugging Face's static cache): a contiguous tensor, which the
        batched products of :func:`polyrl.local.cpu_decode.decode_attention` need to run at speed in
        bfloat16 (a view of part of the buffer is copied on every call). As attention runs over all of it,
        the buffer then grows by a few positions at a time (``PADDED_DECODE_CAPACITY``, or a sixteenth of
        it when longer), not by doubling: each growth copies the cache once, as a step's attention reads
        it, so padding and copies together cost about as much as a tenth of attention."""

        def __init__(self, capacity: int, padded: bool = False, rows: int = 0):
            super().__init__()
            self.capacity = capacity
            self.padded = padded
            self.row_capacity = rows  # rows reserved up front for :meth:`fork`
            self.length = 0
            self.rows = 0  # rows in use: the buffer's first ones

        def _new(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            return like.new_zeros(shape) if self.padded else like.new_empty(shape)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.rows = key_states.shape[0]
            rows, cap = max(self.row_capacity, self.rows), max(self.capacity, key_states.shape[-2])
            self._k = self._new(key_states, (rows, *key_states.shape[1:-2], cap, key_states.shape[-1]))
            self._v = self._new(value_states, (rows, *value_states.shape[1:-2], cap, value_states.shape[-1]))
            self.is_initialized = True

        def _reserve(self, end: int) -> None:
            if end > self._k.shape[-2]:
                cap = self._k.shape[-2]
                cap = max(end, cap + max(PADDED_DECODE_CAPACITY, cap // 16) if self.padded else 2 * cap)

                def grow(b: torch.Tensor) -> torch.Tensor:
                    more = b.new_zeros((*b.shape[:-2], cap - b.shape[-2], b.shape[-1]))
                    return torch.cat([b, more], dim=-2)

                self._k, self._v = grow(self._k), grow(self._v)

        def _views(self) -> None:
            self.keys = self._k[: self.rows, :, : self.length]
            self.values = self._v[: self.rows, :, : self.length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self._reserve(end)
            self._k[: self.rows, :, self.length : end] = key_states
            self._v[: self.rows, :, self.length : end] = value_states
            self.length = end
            self._views()
            if self.padded and key_states.shape[-2] == 1:
                return self._k[: self.rows], self._v[: self.rows]  # the leading rows: contiguous
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            if self.padded and query_length == 1 and self.is_initialized:
                self._reserve(self.length + 1)  # here, so that the mask has the length update returns
                return self._k.shape[-2], 0
            return super().get_mask_sizes(query_length)

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep rows ``indices``, in that order, as the buffer's first rows (its room kept)."""
            if self.is_initialized:
                n = len(indices)
                if n > self._k.shape[0]:
                    self._k, self._v = self._k[indices], self._v[indices]
                else:  # gathered first: ``indices`` may read rows that others overwrite
                    self._k[:n], self._v[:n] = self._k[indices], self._v[indices]
                self.rows = n
                self._views()

        def fork(self, parents: list[int]) -> None:
            """Append a copy of each of rows ``parents`` (growing the buffer's rows when full)."""
            n = len(parents)
            if self.rows + n > self._k.shape[0]:
                more = max(n, self._k.shape[0] // 2)
                self._k = torch.cat([self._k, self._new(self._k, (more, *self._k.shape[1:]))])
                self._v = torch.cat([self._v, self._new(self._v, (more, *self._v.shape[1:]))])
            index = torch.tensor(parents, device=self._k.device)
            self._k[self.rows : self.rows + n] = self._k[index]
            self._v[self.rows : self.rows + n] = self._v[index]
            self.rows += n
            self._views()

    return _BufferLayer


def new_cache(capacity: int, padded: bool = False, rows: int = 0):
    """A Hugging Face ``DynamicCache`` whose layers are ``_BufferLayer`` objects of ``capacity`` positions,
    with room for ``rows`` rows."""
    from transformers import DynamicCache

    cache = DynamicCache()
    layer_class = _buffer_layer_class()
    cache.layer_class_to_replicate = lambda: layer_class(capacity, padded, rows)
    return cache


@dataclass
class _Row:
    job: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per sampled token


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


class SamplingStopped(RuntimeError):
    """The engine is stopping (Ctrl-C, interpreter exit): a decode loop ends at its next step instead of
    running its jobs to the end, so the worker stops within one step."""


def generate(model, jobs: list[SampleJob], tokenizer, device, generator: torch.Generator | None,
             logits_fn=None, vision=None, decode_fn=None,
             stopping: Callable[[], bool] | None = None) -> list[types.SampleResponse]:
    """Run all ``jobs`` in one batched decode loop to the end; one ``SampleResponse`` per job, in order.
    (:func:`generate_steps` is the same loop, paused between decode steps.)"""
    steps = generate_steps(model, jobs, tokenizer, device, generator, logits_fn, vision, decode_fn, stopping)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def generate_steps(model, jobs: list[SampleJob], tokenizer, device, generator: torch.Generator | None,
                   logits_fn=None, vision=None, decode_fn=None, stopping: Callable[[], bool] | None = None
                   ) -> Generator[None, torch.nn.Module | None, list[types.SampleResponse]]:
    """Run all ``jobs`` in one batched decode loop; one ``SampleResponse`` per job, in order (the
    generator's return value).

    The generator yields before each decode step, so that its caller can pause it there (the engine runs
    another API key's work between slices of a long decode) and resume it with ``send(model)``: the model
    to go on with, as the caller's sampling context gives it again (``None``: the same). Its KV cache and
    rows live in the generator meanwhile.

    ``logits_fn`` maps hidden states to float32 logits (the model's unembedding); with it the prefill
    unembeds every position only of the prompts whose logprobs were asked for. ``vision``: a
    vision-language model's :class:`polyrl.local.vision.Vision` (then ``logits_fn`` is required).
    ``decode_fn(tokens, positions, mask, cache)``, if given, computes a one-token step's logits in the
    model's place for rows without multimodal positions (:class:`polyrl.local.cpu_decode.FastDecode`).
    ``stopping()``, asked before each decode step, ends the loop with :class:`SamplingStopped`."""
    # ---- prefill unique prompts (left-padded) -------------------------------------------------
    unique: dict[tuple, int] = {}
    first: dict[int, SampleJob] = {}
    for job in jobs:
        first.setdefault(unique.setdefault(job.key, len(unique)), job)
    prompts = [first[i].prompt for i in range(len(unique))]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    pad = 0  # ids and mask: [B, T], B the unique prompts, left-padded to T = width
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    lp_prompts = sorted({unique[j.key] for j in jobs if j.wants_prompt})
    with_images = [first[i] for i in range(len(prompts)) if first[i].images]
    deltas = torch.tensor([first[i].rope_delta for i in range(len(prompts))], device=device)
    # decode writes into preallocated per-layer buffers instead of concatenating every step
    # (sized for the expected length, capped so a huge max_tokens does not reserve memory up front)
    capacity = width + min(INITIAL_DECODE_CAPACITY,
                           max((j.max_tokens for j in jobs if not j.prompt_only), default=0))
    padded = getattr(getattr(model, "config", None), "_attn_implementation", None) == DECODE_ATTENTION
    if padded:  # attention runs over the whole buffer: reserve less up front (it grows by a quarter)
        capacity = width + min(PADDED_DECODE_CAPACITY, capacity - width)
    cache = new_cache(capacity, padded, rows=sum(j.num_samples for j in jobs if not j.prompt_only))
    split = logits_fn is not None and (bool(lp_prompts) or bool(with_images))
    if with_images:  # the multimodal model: images encoded and placed, multimodal positions
        multimodal = positions.unsqueeze(0).repeat(3, 1, 1)  # [3, B, T]: time, height, width
        for i in range(len(prompts)):
            if first[i].mrope is not None:
                multimodal[:, i, width - len(prompts[i]):] = first[i].mrope.to(device)
        out = vision.inner(input_ids=ids, attention_mask=mask, use_cache=True,
                           position_ids=torch.cat([positions.unsqueeze(0), multimodal]),  # [4, B, T]
                           **with_cache(vision.inner, cache),
                           **vision.inputs([im for job in with_images for im in job.images], device))
    else:
        prefill = model.get_decoder() if split else model
        out = prefill(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **with_cache(prefill, cache),
            **({} if split else {"logits_to_keep": 0 if lp_prompts else 1}),
        )
    if split:  # unembed the last position of every prompt, every position of the asked-for ones
        hidden = out.last_hidden_state  # [B, T, D]
        last_logits = logits_fn(hidden[:, -1, :])  # [B, V]

        def row_logits(i: int, lo: int, hi: int) -> torch.Tensor:
            return logits_fn(hidden[i, width - len(prompts[i]) + lo: width - len(prompts[i]) + hi])
    else:
        logits = out.logits  # [B, T, V], or [B, 1, V] when only the last position is kept
        last_logits = logits[:, -1, :].float()  # [B, V]

        def row_logits(i: int, lo: int, hi: int) -> torch.Tensor:
            return logits[i, width - len(prompts[i]) + lo: width - len(prompts[i]) + hi].float()
    prompt_out: dict[int, dict] = {}
    for i in lp_prompts:
        members = [j for j, job in enumerate(jobs) if unique[job.key] == i and job.wants_prompt]
        prompt_out.update(_prompt_outputs(prompts[i], [jobs[j] for j in members], members,
                                          lambda lo, hi, i=i: row_logits(i, lo, hi), last_logits.shape[-1],
                                          generator))

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
        seeds_R = torch.tensor(row_seed, dtype=torch.long, device=device)
        state = _decode_state(jobs, rows, row_prompt, cache, mask, lengths, last_logits,
                              deltas if bool(deltas.any()) else None, device)
        draws = _Draws.of(jobs, rows, seeds_R, vision.placeholder_ids if vision is not None else (), device)
        yield from _decode(model, state, draws, tokenizer, device, generator, decode_fn, stopping)

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
                topk_logprobs_np=_topk_matrix(r.topk, job.topk_sample) if job.topk_sample else None,
            )
            for r in by_job.get(j, [])
        ]
        responses.append(types.SampleResponse(sequences=seqs, **prompt_out.get(j, {})))
    return responses


def _topk_matrix(rows: list[tuple[list[int], list[float]]], k: int) -> TopkLogprobs:
    ids = np.asarray([r[0] for r in rows], dtype=np.int32).reshape(len(rows), k)
    return TopkLogprobs(token_ids=ids, logprobs=np.asarray([r[1] for r in rows], dtype=np.float32)
                              .reshape(len(rows), k))


def _prompt_outputs(prompt: list[int], jobs: list[SampleJob], ids: list[int], row_logits, vocab: int,
                    generator: torch.Generator | None) -> dict[int, dict]:
    """What each of ``jobs`` (sharing ``prompt``; keyed by ``ids``) asked about the prompt, as
    ``SampleResponse`` fields. ``row_logits(lo, hi)`` gives the float32 logits at the positions that
    predict prompt tokens ``lo + 1 .. hi``; they are taken in chunks, so at most one chunk of
    ``[positions, vocab]`` logits is alive at once. Position 0 predicts nothing: NaN, a filler top-K
    row, and no row of the target and alternative-token tensors (which have ``len(prompt) - 1``)."""
    n = len(prompt)
    outs = [_PromptOut(n, job, generator) for job in jobs]
    start = min(o.first for o in outs)
    chunk = max(1, PROMPT_CHUNK_BYTES // (4 * vocab))
    for p in range(start, n, chunk):
        hi = min(n, p + chunk)
        logits = row_logits(p - 1, hi - 1)  # [C, V]: predicts prompt[p:hi]
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, torch.tensor(prompt[p:hi], device=logp.device).unsqueeze(-1)).squeeze(-1)
        for out in outs:
            out.add(p, hi, logits, logp, picked)
    return {j: out.fields() for j, out in zip(ids, outs)}


class _PromptOut:
    """One job's answers about its prompt, filled chunk by chunk."""

    def __init__(self, n: int, job: SampleJob, generator: torch.Generator | None):
        self.job = job
        self.first = 1 if (job.target_prompt is not None or job.alt_k or not job.last_n) else n - job.last_n
        self.logprobs = np.full(n, np.nan, dtype=np.float32)
        k = job.topk_prompt
        self.topk = (np.zeros((n, k), np.int32), np.full((n, k), TOPK_MASK_LOGPROB, np.float32))
        wanted = job.target_prompt
        self.target = np.zeros(tuple(wanted.shape), np.float32) if wanted is not None else None
        self.alt = (np.zeros((n - 1, job.alt_k), np.int64), np.zeros((n - 1, job.alt_k), np.float32))
        self.generator = generator
        if job.alt_k and job.params.seed is not None:  # a seeded request draws the same alternatives
            device = generator.device if generator is not None else "cpu"
            self.generator = torch.Generator(device=device).manual_seed(int(job.params.seed) & (2**64 - 1))

    def add(self, p: int, hi: int, logits: torch.Tensor, logp: torch.Tensor, picked: torch.Tensor) -> None:
        """The chunk of positions ``[p, hi)`` (the logits predicting ``prompt[p:hi]``)."""
        job, lo = self.job, max(p, self.first)
        if lo >= hi:
            return
        sub = slice(lo - p, hi - p)
        last_n_from = len(self.logprobs) - job.last_n if job.last_n else 1
        scored = max(lo, last_n_from)  # prompt logprobs and top-K rows honour last_n
        if (job.include_prompt_logprobs or job.prompt_only) and scored < hi:
            self.logprobs[scored:hi] = picked[scored - p:].cpu().numpy()
        if job.topk_prompt and scored < hi:
            values, tokens = torch.topk(logp[scored - p:], job.topk_prompt, dim=-1)
            self.topk[0][scored:hi], self.topk[1][scored:hi] = tokens.cpu().numpy(), values.cpu().numpy()
        if job.target_prompt is not None:
            want = job.target_prompt[lo - 1: hi - 1].to(logp.device)
            got = logp[sub].gather(-1, want.clamp(min=0))
            self.target[lo - 1: hi - 1] = torch.where(want >= 0, got, torch.zeros_like(got)).cpu().numpy()
        if job.alt_k:
            self.alt[0][lo - 1: hi - 1], self.alt[1][lo - 1: hi - 1] = _draw_alternatives(
                logits[sub], logp[sub], job, self.generator)

    def fields(self) -> dict:
        job, out = self.job, {}
        if job.include_prompt_logprobs or job.prompt_only:
            out["prompt_logprobs_np"] = self.logprobs
        if job.topk_prompt:
            out["topk_prompt_logprobs_np"] = TopkLogprobs(token_ids=self.topk[0], logprobs=self.topk[1])
        if self.target is not None:
            out["target_prompt_logprobs"] = _like(job.target_layout, self.target)
        if job.alt_k:
            tokens, logprobs = (types.TensorData.from_numpy(a) for a in self.alt)
            out["prompt_alt_tokens"] = types.PromptAltTokens(tokens=tokens, logprobs=logprobs)
        return out


def _like(layout: types.TensorData | None, dense: np.ndarray) -> types.TensorData:
    """Target logprobs in the request's layout: dense, or the same sparse cells."""
    if layout is None or layout.sparse_crow_indices is None:
        return types.TensorData.from_numpy(dense)
    crow = np.asarray(layout.sparse_crow_indices, dtype=np.int64)
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    values = dense[rows, np.asarray(layout.sparse_col_indices, dtype=np.int64)]
    return types.TensorData(data=values.astype(np.float32), dtype="float32", shape=list(dense.shape),
                            sparse_crow_indices=list(layout.sparse_crow_indices),
                            sparse_col_indices=list(layout.sparse_col_indices))


def _draw_alternatives(logits: torch.Tensor, logp: torch.Tensor, job: SampleJob,
                       generator: torch.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """``job.alt_k`` tokens per position, drawn with replacement at the request's temperature (the most
    likely token at temperature 0), with the model's logprobs (temperature 1) of them."""
    k, temperature = job.alt_k, job.params.temperature
    if temperature <= 0:
        tokens = logits.argmax(-1, keepdim=True).expand(-1, k)  # [C, K]
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(probs, k, replacement=True, generator=generator)
    return tokens.cpu().numpy(), logp.gather(-1, tokens).cpu().numpy()


@dataclass
class _Draws:
    """How each row draws its tokens, fixed for the whole decode: its request's sampling parameters as
    ``[R]`` tensors (R the rows), its seed (``-1``: unseeded) and the banned tokens."""

    temps: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R], -1: off
    top_p: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    seeded: torch.Tensor  # [R] bool
    ban: torch.Tensor | None  # token ids no row may draw
    plain: bool  # every row at temperature 1, no top-k / top-p, nothing banned: the model's distribution
    any_greedy: bool  # some row at temperature 0
    topk_width: int  # the widest top-K of sampled positions asked for (0: none)

    @classmethod
    def of(cls, jobs: list[SampleJob], rows: list[_Row], seeds: torch.Tensor, banned, device) -> _Draws:
        params = [jobs[r.job].params for r in rows]
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        top_k = torch.tensor([p.top_k or -1 for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        plain = (bool((temps == 1).all()) and not bool((top_k > 0).any()) and not bool((top_p < 1).any())
                 and not banned)
        ban = torch.tensor(sorted(banned), dtype=torch.long, device=device) if banned else None
        return cls(temps, top_k, top_p, seeds, seeds >= 0, ban, plain, bool((temps <= 0).any()),
                   max(job.topk_sample for job in jobs))


@dataclass
class _DecodeState:
    """One decode batch between steps. The KV cache, the attention mask, the positions and the logits hold
    one row per distinct history (see :func:`_decode`); ``of`` maps each row still decoding to its
    history's row."""

    jobs: list[SampleJob]
    rows: list[_Row]  # every sample's row, ended or not
    live: list[int]  # the rows still decoding (indices into ``rows``)
    of: list[int]  # each live row's history: its row of the cache, mask, positions and logits
    cache: Any  # the KV cache, [C, ...] per layer (C the histories)
    mask_buf: torch.Tensor  # [C, T + room]: every step's attention mask is a view of it (no concatenation)
    width: int  # the mask's columns in use
    next_pos: torch.Tensor  # [C]: each history's next position
    delta: torch.Tensor | None  # [C]: how far multimodal positions run ahead (None: no images)
    logits: torch.Tensor  # [C, V] float32: what each history predicts next
    logit_buf: torch.Tensor  # a step's logits, per history, go into these buffers (see _decode_state)
    row_buf: torch.Tensor  # ... per row
    prob_buf: torch.Tensor  # ... and their probabilities
    max_stop_chars: int  # the longest stop string's characters
    step: int = 0  # draws made


def _decode_state(jobs: list[SampleJob], rows: list[_Row], row_prompt: list[int], cache,
                  prompt_mask: torch.Tensor, prompt_lengths: torch.Tensor, prompt_last_logits: torch.Tensor,
                  prompt_deltas: torch.Tensor | None, device) -> _DecodeState:
    """The state before the first draw: one history per prompt, its cache row the prefill's."""
    mask_buf = torch.ones((len(prompt_mask), prompt_mask.shape[1]
                           + min(INITIAL_DECODE_CAPACITY, max(j.max_tokens for j in jobs))),
                          dtype=prompt_mask.dtype, device=device)
    mask_buf[:, : prompt_mask.shape[1]] = prompt_mask
    # A fresh tensor of a step's size is fresh pages every step (the engine's mmap threshold): the buffers
    # are made once. The cache holds at most a row per sample and per prompt: a row per live history (at
    # most one per live sample), and until they are dropped the ended ones (prompts with no samples,
    # histories whose samples all ended)
    vocab = prompt_last_logits.shape[-1]
    logit_buf, row_buf, prob_buf = (torch.empty((n, vocab), dtype=torch.float32, device=device)
                                    for n in (len(rows) + len(prompt_last_logits), len(rows), len(rows)))
    max_stop_chars = max((len(s) for j in jobs for s in j.stop_strings), default=0)
    return _DecodeState(jobs, rows, list(range(len(rows))), list(row_prompt), cache, mask_buf,
                        prompt_mask.shape[1], prompt_lengths, prompt_deltas, prompt_last_logits, logit_buf,
                        row_buf, prob_buf, max_stop_chars)


def _decode(model, state: _DecodeState, draws: _Draws, tokenizer, device, generator,
            decode_fn=None, stopping=None) -> Generator[None, torch.nn.Module | None, None]:
    """Decode ``state``'s rows to their ends, yielding before each step (see :func:`generate_steps`). Rows
    with the same tokens so far (a prompt's samples until they draw different tokens: most of a group,
    once a policy is sure of its answer) have the same hidden states, so they share one row of the KV
    cache and of every decode pass: the cache holds one row per distinct history, which parts in two when
    its rows draw different tokens. ``draws.ban``: tokens no row may draw (a vision-language model's image
    placeholders), filtered out of every draw as top-k is; the logprobs stay the model's own."""
    while True:
        resumed = yield  # a pause point: the caller may run other work here, then send the model back
        if resumed is not None:
            model = resumed
        if stopping is not None and stopping():
            raise SamplingStopped("the local engine is stopping: sampling ended early")
        tokens, token_lp, logp = _draw(state, draws, generator, device)
        drawn = tokens.tolist()
        still = _record_draws(state, drawn, token_lp, logp, draws.topk_width, tokenizer)
        if not still:
            return
        feed = _next_histories(state, still, drawn, device)
        state.logits = _step_logits(model, state, feed, decode_fn)


def _draw(state: _DecodeState, draws: _Draws, generator, device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One token for each live row: (tokens [B], their logprobs [B], the rows' log-softmax [B, V] when it
    was computed, else None), B the live rows."""
    logits, live = state.logits, state.live
    sel = torch.tensor(live, device=device)  # [B]
    if state.of != list(range(len(logits))):  # each row's logits: its history's
        logits = torch.index_select(logits, 0, torch.tensor(state.of, device=device),
                                    out=state.row_buf[: len(live)])
    u = row_uniforms(draws.seeds[sel], draws.seeded[sel], state.step, generator)  # [B]
    state.step += 1
    if draws.plain:  # temperature 1, no top-k / top-p: the distribution is the model's own
        # PyTorch's softmax kernel itself, writing into the buffer (the public function has no `out`)
        probs = torch._softmax(logits, -1, False, out=state.prob_buf[: len(logits)])  # [B, V]
        tokens = inverse_cdf(probs, u)
        # log of the drawn token's probability: a token this draw can reach is no denormal number
        token_lp = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()  # [B]
        logp = torch.log_softmax(logits, dim=-1) if draws.topk_width else None  # [B, V]
        return tokens, token_lp, logp
    temps = draws.temps[sel]
    allowed = logits if draws.ban is None else logits.index_fill(1, draws.ban, float("-inf"))
    sampled = inverse_cdf(torch.softmax(filtered_logits(allowed, temps, draws.top_k[sel], draws.top_p[sel]),
                                        -1), u)
    tokens = torch.where(temps <= 0, allowed.argmax(-1), sampled) if draws.any_greedy else sampled
    logp = torch._log_softmax(logits, -1, False, out=state.prob_buf[: len(logits)])  # [B, V]
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logp


def _record_draws(state: _DecodeState, drawn: list[int], token_lp: torch.Tensor, logp: torch.Tensor | None,
                  topk_width: int, tokenizer) -> list[int]:
    """Append each live row's drawn token (its logprob, its top-K) and end the rows it stops; the positions
    in ``state.live`` of the rows that go on."""
    if topk_width:  # [B, K] each
        assert logp is not None
        top_values, top_ids = (t.tolist() for t in torch.topk(logp, topk_width, dim=-1))
    rows, jobs, max_stop_chars = state.rows, state.jobs, state.max_stop_chars
    still = []
    for pos, (row_i, tok, lp) in enumerate(zip(state.live, drawn, token_lp.tolist())):
        row = rows[row_i]
        job = jobs[row.job]
        row.tokens.append(tok)
        row.logprobs.append(lp)
        if job.topk_sample:
            row.topk.append((top_ids[pos][: job.topk_sample], top_values[pos][: job.topk_sample]))
        row.stop_reason = _stop_reason(row, job, tok, max_stop_chars, tokenizer)
        if row.stop_reason is None:
            still.append(pos)
    return still


def _stop_reason(row: _Row, job: SampleJob, token: int, max_stop_chars: int, tokenizer) -> str | None:
    """Why ``row`` ends after drawing ``token`` (its last): ``"stop"`` (a stop token or string), ``"length"``
    (``max_tokens``), or None when it goes on."""
    if token in job.stop_ids:
        return "stop"
    if job.stop_strings and _hits_stop_string(row.tokens, job.stop_strings, max_stop_chars, tokenizer):
        return "stop"
    if len(row.tokens) >= job.max_tokens:
        return "length"
    return None


def _next_histories(state: _DecodeState, still: list[int], drawn: list[int], device) -> torch.Tensor:
    """Keep the rows at positions ``still`` of ``state.live``, and their histories after this step: each a
    history and the token drawn after it. A history's cache row goes on with its first continuation; each
    other continuation (the history parts) gets a copy of it at the end of the cache. Once
    ``PRUNE_FRACTION`` of the cache is ended histories, those rows are dropped. The token each cache row
    takes next ([C])."""
    of = state.of
    after: dict[tuple[int, int], int] = {}
    parents: list[int] = []
    taken: set[int] = set()
    for pos in still:
        key = (of[pos], drawn[pos])
        if key in after:
            continue
        if of[pos] in taken:
            after[key] = len(state.mask_buf) + len(parents)
            parents.append(of[pos])
        else:
            after[key] = of[pos]
            taken.add(of[pos])
    of = [after[(of[pos], drawn[pos])] for pos in still]
    state.live = [state.live[pos] for pos in still]
    if parents:
        for layer in state.cache.layers:
            layer.fork(parents)
        index = torch.tensor(parents, device=device)
        state.mask_buf = torch.cat([state.mask_buf, state.mask_buf[index]])
        state.next_pos = torch.cat([state.next_pos, state.next_pos[index]])
        if state.delta is not None:
            state.delta = torch.cat([state.delta, state.delta[index]])
    feed = [0] * len(state.mask_buf)  # an ended history's row takes any token (its logits go unused) ...
    for (_, tok), row in after.items():
        feed[row] = tok
    if len(state.mask_buf) - len(after) >= PRUNE_FRACTION * len(state.mask_buf):  # ... until enough ended
        keep = sorted(after.values())
        renumber = {row: i for i, row in enumerate(keep)}
        index = torch.tensor(keep, device=device)
        state.cache.batch_select_indices(index)
        state.mask_buf, state.next_pos = state.mask_buf[index], state.next_pos[index]
        if state.delta is not None:
            state.delta = state.delta[index]
        feed, of = [feed[row] for row in keep], [renumber[row] for row in of]
    state.of = of
    return torch.tensor(feed, device=device)


def _step_logits(model, state: _DecodeState, tokens: torch.Tensor, decode_fn) -> torch.Tensor:
    """One decode pass: each history takes its token of ``tokens [C]``; the float32 logits of what comes
    next, ``[C, V]``."""
    state.width += 1
    if state.width > state.mask_buf.shape[1]:
        state.mask_buf = torch.cat([state.mask_buf, torch.ones_like(state.mask_buf)], dim=1)
    mask, next_pos, delta = state.mask_buf[:, : state.width], state.next_pos, state.delta
    state.next_pos = next_pos + 1
    if decode_fn is not None and delta is None:
        return _float32(decode_fn(tokens, next_pos, mask, state.cache), state.logit_buf)  # [C, V]
    step_pos = next_pos.unsqueeze(1)  # [C, 1]
    if delta is not None:  # [text index, then time/height/width: index plus the prompt's delta]
        step_pos = torch.stack([step_pos, *([step_pos + delta.unsqueeze(1)] * 3)])  # [4, C, 1]
    out = model(
        input_ids=tokens.unsqueeze(1),  # [C, 1]
        attention_mask=mask,
        position_ids=step_pos,
        use_cache=True,
        **with_cache(model, state.cache),
    )
    return _float32(out.logits[:, -1, :], state.logit_buf)  # [C, 1, V] -> [C, V]


def _float32(logits: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` as float32: themselves, or cast into the first ``B`` rows of ``buffer``."""
    return logits if logits.dtype == torch.float32 else buffer[: len(logits)].copy_(logits)


def _hits_stop_string(tokens: list[int], stops: tuple[str, ...], max_chars: int, tokenizer) -> bool:
    tail = tokenizer.decode(tokens[-(max_chars + 4) :], skip_special_tokens=False)
    return any(s in tail for s in stops)
