"""``ServiceClient``, ``TrainingClient`` and ``SamplingClient`` with the official ``tinker`` SDK's
methods and signatures, served in-process by the local engine.

Every method returns what the SDK returns: futures with ``.result()``, ``await`` and
``.result_async()`` (the SDK's own ``APIFuture`` class); client-creating methods return a future
that also forwards attribute access to the client, as the SDK's back-compat wrappers do.
"""

from __future__ import annotations

import itertools
import math
import os
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture
from tinker.types.optimizer import OptimParamsBase

from polyrl.local import losses
from polyrl.local.datums import model_input_tokens
from polyrl.local.engine import Engine, SamplerState, TrainerState
from polyrl.local.model import BaseModel, LoraSpec
from polyrl.local.optim import DimuonSettings, optimizer_type
from polyrl.local.rest import RestClient
from polyrl.local.sampler import MAX_LOGPROBS_K, SampleJob, resolve_stops
from polyrl.local.stability import SequenceRecords, input_positions
from polyrl.local.vllm import stop_on_sigterm
from polyrl.samplers import VllmSettings, resolve_sampler

LOCAL_OWNER = "local"  # in-process, the ServiceClient is both the owner and the session of its records


def record_sequences(records: SequenceRecords, owner: str, session: str, prompt: np.ndarray,
                     response: types.SampleResponse,
                     sequence_ids: list[str] | None = None) -> types.SampleResponse:
    """Record a response's sequences (under ``sequence_ids``, else their own), all sampled from the prompt
    whose positions (:func:`polyrl.local.stability.input_positions`) are ``prompt``, and pass it on."""
    ids = sequence_ids or [seq.sequence_id for seq in response.sequences]
    records.add(owner, session, prompt, [(sid, seq.tokens_np, seq.logprobs_np)
                                         for sid, seq in zip(ids, response.sequences, strict=True)])
    return response


class ClientFuture(AwaitableConcurrentFuture):
    """A future of a client that can also be used as the client (like the SDK's back-compat futures)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result(), name)


def _done(value) -> AwaitableConcurrentFuture:
    fut: Future = Future()
    fut.set_result(value)
    return AwaitableConcurrentFuture(fut)


def _chain(fut: Future, fn) -> Future:
    """A future of ``fn(fut.result())``."""
    out: Future = Future()

    def cb(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001
            out.set_exception(e)

    fut.add_done_callback(cb)
    return out


@dataclass(frozen=True)
class PromptQueries:
    """What a ``sample`` call may ask about its prompt and its samples besides the samples themselves
    (Tinker's options: see :mod:`polyrl.local.sampler`)."""

    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: types.TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None

    def apply(self, job: SampleJob, vocab: int, max_k: int) -> SampleJob:
        """``job`` with these queries, each checked against the prompt, the vocabulary and ``max_k``."""
        n, widest = len(job.prompt), min(max_k, vocab)
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            k = getattr(self, name)
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= widest:
                raise ValueError(f"{name} must be a count between 0 and {widest} (the most this engine "
                                 f"returns per position), got {k!r}")
        last_n = self.prompt_logprobs_last_n
        if last_n is not None:
            if not (job.include_prompt_logprobs or job.prompt_only):
                raise ValueError("prompt_logprobs_last_n applies to prompt logprobs; set "
                                 "include_prompt_logprobs")
            if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n <= n - 1:
                raise ValueError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {n - 1}, "
                                 f"got {last_n!r}")
        target = None
        if self.target_prompt_logprobs is not None:
            target = target_ids(self.target_prompt_logprobs, n, vocab, max_k)
        return replace(job, last_n=last_n, topk_prompt=self.topk_prompt_logprobs,
                       topk_sample=self.topk_sample_logprobs, target_prompt=target,
                       target_layout=self.target_prompt_logprobs if target is not None else None,
                       alt_k=self.prompt_alt_tokens_k)


def target_ids(td: types.TensorData, n: int, vocab: int, max_k: int) -> torch.Tensor:
    """``target_prompt_logprobs`` as a dense int64 ``[n - 1, K]`` tensor (-1 where nothing is asked),
    after checking its shape before anything of its size is allocated."""
    shape = list(td.shape or [])
    if td.dtype != "int64" or len(shape) != 2:
        raise ValueError(f"target_prompt_logprobs must be an int64 tensor of shape [len(prompt) - 1, K], got "
                         f"{td.dtype} of shape {shape}")
    if shape[0] != n - 1 or not 1 <= shape[1] <= max_k:
        raise ValueError(f"target_prompt_logprobs has shape {shape}; it must be [len(prompt) - 1 = {n - 1}, "
                         f"K] with K between 1 and {max_k}")
    try:
        ids = td.to_torch(pad_value=-1).long()
    except (RuntimeError, ValueError, AssertionError) as e:
        raise ValueError(f"target_prompt_logprobs is not a valid tensor of shape {shape}: {e}") from None
    if list(ids.shape) != shape:
        raise ValueError(f"target_prompt_logprobs holds {ids.numel()} values, not {shape[0] * shape[1]}")
    if int(ids.min()) < -1 or int(ids.max()) >= vocab:
        raise ValueError(f"target_prompt_logprobs holds token ids out of range for vocabulary size {vocab} "
                         "(-1: no id)")
    if int(ids.max()) < 0:
        raise ValueError("target_prompt_logprobs names no token id (every cell is -1)")
    return ids


def make_sample_job(base: BaseModel, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams,
                    include_prompt_logprobs: bool = False, prompt_only: bool = False,
                    queries: PromptQueries = PromptQueries(), max_k: int = MAX_LOGPROBS_K) -> SampleJob:
    """A validated :class:`SampleJob` for ``base`` (shared by the in-process client and ``polyrl serve``); a
    vision-language model's images are decoded and processed here, on the caller's thread."""
    tokens, found = model_input_tokens(base, prompt, "prompt")
    if not tokens:
        raise ValueError("prompt is empty")
    if min(tokens) < 0 or max(tokens) >= base.vocab_size:
        raise ValueError(f"prompt token out of range for vocabulary size {base.vocab_size}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    context = base.max_context_length or 1 << 30
    if len(tokens) >= context:
        raise ValueError(f"prompt of {len(tokens)} tokens does not fit the model's context of {context}")
    room = context - len(tokens)
    if params.max_tokens is not None and params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    max_tokens = min(params.max_tokens or room, room)
    eos = base.hf_model.generation_config.eos_token_id if base.hf_model.generation_config else None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    stop_ids, stop_strings = resolve_stops(params.stop, base.tokenizer, eos_ids)
    mrope, delta = base.vision.rope(tokens, found) if found else (None, 0)
    job = SampleJob(tokens, num_samples, params, include_prompt_logprobs, stop_ids, stop_strings,
                    max_tokens, prompt_only, images=tuple(found), mrope=mrope, rope_delta=delta)
    return queries.apply(job, base.vocab_size, max_k)


class ServiceClient:
    """Entry point, like ``tinker.ServiceClient``, with an in-process engine behind it.

    ``store_dir`` is where checkpoints live (default ``$POLYRL_STORE_DIR`` or
    ``~/.cache/polyrl/store``); ``device`` is ``auto`` | ``cpu`` | ``cuda[:N]`` | ``mps``; ``dtype`` is
    the learner's: ``auto`` (bfloat16 on capable GPUs and on CPUs with native bfloat16 arithmetic, else
    float32; see :func:`polyrl.local.model.select_dtype`) or a dtype name. ``models`` lists base models
    reported by ``get_server_capabilities`` before they are loaded. ``micro_batch_tokens`` caps the
    tokens of one forward/backward pass; ``gradient_checkpointing`` (``auto``: on for models of
    300M parameters and more) trades recomputation for activation memory. ``max_store_bytes`` caps
    the store (a save past it is refused); ``project_id`` (or ``$TINKER_PROJECT_ID``) is where
    ``copy_weights`` puts copies, as in the SDK. ``sampler_dtype`` is the dtype sampling computes in
    (``auto``: bfloat16 where the device runs it fast; see
    :func:`polyrl.local.sampler_copy.select_sampler_dtype`). ``sampler`` is what samples: ``polyrl`` (the
    engine's own sampler), ``vllm`` (vLLM, reached as ``vllm`` says: :mod:`polyrl.local.vllm`) or ``auto``
    (:func:`polyrl.local.vllm.resolve_sampler`). ``attention`` is how packed rows attend in training
    (``auto`` | ``dense`` | ``tree`` | ``flex``; :meth:`polyrl.local.model.BaseModel._select_attention`).

    The client is the session: the sequences its samplers record (``record_stability_info=True``) are
    what its training clients' ``stable_reinforce`` datums may name (:mod:`polyrl.local.stability`).
    """

    def __init__(self, store_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
                 models: Sequence[str] = (), micro_batch_tokens: int | str = "auto",
                 gradient_checkpointing: bool | str = "auto", max_store_bytes: int | None = None,
                 project_id: str | None = None, sampler_dtype: str = "auto", sampler: str = "polyrl",
                 vllm: VllmSettings | None = None, attention: str = "auto", **_ignored: Any):
        vllm = vllm or VllmSettings()
        self.sampler = resolve_sampler(sampler, device, vllm)
        if self.sampler == "vllm" and not vllm.urls:
            stop_on_sigterm()  # the vLLM servers this engine starts end with it
        self.engine = Engine.shared(store_dir, device, dtype, micro_batch_tokens, gradient_checkpointing,
                                    max_store_bytes, sampler_dtype, self.sampler,
                                    vllm if self.sampler == "vllm" else None, attention)
        self._project_id = project_id or os.environ.get("TINKER_PROJECT_ID") or None
        self.session_id = f"local-{uuid.uuid4().hex[:8]}"
        self.records = SequenceRecords()
        self._models = list(models)
        self._counter = itertools.count()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def close(self, status: str = "success", detail: str | None = None):
        return _done(None)

    def _next_model_id(self) -> str:
        return f"{self.session_id}:train:{next(self._counter)}"

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True, user_metadata: dict[str, str] | None = None,
                                    optimizer: Any = None) -> ClientFuture:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("at least one of train_mlp, train_attn, train_unembed must be True")
        spec = LoraSpec(rank, train_mlp, train_attn, train_unembed, seed)
        kind = optimizer_type(optimizer)
        model_id = self._next_model_id()
        fut = self.engine.submit(lambda: self.engine.create_trainer(model_id, base_model, spec, kind))
        return ClientFuture(_chain(fut, self._training_client))

    def _training_client(self, st: TrainerState) -> "TrainingClient":
        return TrainingClient(self.engine, st, self.records, self.session_id)

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: Any = None) -> ClientFuture:
        return self._from_state(path, with_optimizer=False, optimizer=optimizer_type(optimizer))

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None
                                                         ) -> ClientFuture:
        return self._from_state(path, with_optimizer=True)

    def _from_state(self, path: str, with_optimizer: bool, optimizer: str = "adamw") -> ClientFuture:
        model_id = self._next_model_id()
        fut = self.engine.submit(lambda: self.engine.load_trainer(model_id, path, with_optimizer, optimizer))
        return ClientFuture(_chain(fut, self._training_client))

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False) -> ClientFuture:
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        if model_path is not None:
            fut = self.engine.submit(lambda: self.engine.load_sampler(model_path))
        else:
            fut = self.engine.submit(lambda: SamplerState(self.engine.base(base_model), None, None))
        record = (self.records, self.session_id) if record_stability_info else None
        return ClientFuture(_chain(fut, lambda s: SamplingClient(self.engine, s, record)))

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        loaded = {m.name: m for m in self.engine.loaded_models()}
        names = list(dict.fromkeys([*self._models, *loaded]))
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(
                    model_name=n,
                    max_context_length=loaded[n].max_context_length if n in loaded else None,
                    trainable=True,
                    sampleable=True,
                )
                for n in names
            ]
        )

    def sampler_precision(self) -> list[dict[str, Any]]:
        """For each base model loaded: the sampler's dtype and the learner's, why (``note``: one line), and
        the memory of the sampler's own copy of the weights (0 when it samples from the learner's)."""
        def read() -> list[dict[str, Any]]:
            return [{"model": b.name, "sampler_dtype": str(b.sampler_dtype).removeprefix("torch."),
                     "learner_dtype": str(b.dtype).removeprefix("torch."), "copy_bytes": b.sampler_bytes,
                     "note": b.sampler_note} for b in self.engine.loaded_models()]

        entries = self.engine.call(read)
        for entry in entries:  # vLLM samples instead: once its servers answer (or why they cannot)
            if (vllm := self.engine.vllm_sampler(entry["model"])) is not None:
                vllm.wait_ready()
                entry.update(vllm.describe(entry["learner_dtype"]))
        return entries

    def supported_losses(self) -> list[str]:
        return sorted(losses.LOSSES)

    def create_rest_client(self) -> RestClient:
        return RestClient(self.engine, self.get_server_capabilities, self._project_id)

    def copy_weights(self, path: str, *, ttl_seconds: int | None = None,
                     weights_access_token: str | None = None) -> APIFuture[str]:
        """A copy of ``path`` in a new training run, in this client's project (as the SDK's)."""
        return self.create_rest_client().copy_weights(path, self._project_id, ttl_seconds=ttl_seconds,
                                                      weights_access_token=weights_access_token)

    # async variants, as in the SDK
    async def create_lora_training_client_async(self, *args, **kwargs) -> "TrainingClient":
        return await self.create_lora_training_client(*args, **kwargs)

    async def create_training_client_from_state_async(self, *args, **kwargs) -> "TrainingClient":
        return await self.create_training_client_from_state(*args, **kwargs)

    async def create_training_client_from_state_with_optimizer_async(self, *args,
                                                                     **kwargs) -> "TrainingClient":
        return await self.create_training_client_from_state_with_optimizer(*args, **kwargs)

    async def create_sampling_client_async(self, *args, **kwargs) -> "SamplingClient":
        return await self.create_sampling_client(*args, **kwargs)

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return self.get_server_capabilities()


class TrainingClient:
    """A LoRA adapter being trained; operations run in submission order on the engine."""

    def __init__(self, engine: Engine, state: TrainerState, records: SequenceRecords | None = None,
                 session_id: str = ""):
        self._engine = engine
        self._state = state
        self._records = records if records is not None else SequenceRecords()
        self._session_id = session_id
        self.model_id = state.model_id

    def _provenance(self, data: list[types.Datum]):
        return self._records.resolve(LOCAL_OWNER, self._session_id, data)

    def _sampling_client(self, state: SamplerState, record_stability_info: bool) -> "SamplingClient":
        record = (self._records, self._session_id) if record_stability_info else None
        return SamplingClient(self._engine, state, record)

    def _submit(self, fn) -> APIFuture:
        return AwaitableConcurrentFuture(self._engine.submit(fn))

    def forward(self, data: list[types.Datum], loss_fn: str,
                loss_fn_config: dict | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        losses.get_loss(loss_fn)
        return self._submit(lambda: self._engine.forward_backward(
            self._state, data, loss_fn, loss_fn_config, backward=False, provenance=self._provenance))

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: dict | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        losses.get_loss(loss_fn)
        return self._submit(lambda: self._engine.forward_backward(
            self._state, data, loss_fn, loss_fn_config, backward=True, provenance=self._provenance))

    def forward_backward_custom(self, data: list[types.Datum], loss_fn, *,
                                loss_type_input: str | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        return self._submit(lambda: self._engine.forward_backward_custom(self._state, data, loss_fn))

    def optim_step(self, optim_params: Any = None, *,
                   adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        """``AdamParams`` or ``DimuonParams``, matching the optimizer the client was created with."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("Specify optim_params or legacy adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        if isinstance(params, OptimParamsBase):
            params = DimuonSettings.of(params)
        elif not isinstance(params, types.AdamParams):
            raise ValueError("optim_step needs tinker.types.AdamParams or tinker.types.DimuonParams, got "
                             f"{type(params).__name__}")
        return self._submit(lambda: self._engine.optim_step(self._state, params))

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsResponse]:
        """As the SDK's: a name that exists fails the future with ``tinker.ConflictError`` (a ValueError)."""
        return self._submit(lambda: types.SaveWeightsResponse(
            path=self._engine.save_state(self._state, name, overwrite, user_metadata, ttl_seconds)))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None
                                 ) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        return self._submit(lambda: types.SaveWeightsForSamplerResponse(
            path=self._engine.save_for_sampler(self._state, name, user_metadata, ttl_seconds)))

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None,
                              ) -> APIFuture[types.SaveWeightsExternalResponse]:
        return self._submit(lambda: types.SaveWeightsExternalResponse(
            path=self._engine.save_external(self._state, name, ttl_seconds, age_encryption_recipients)))

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False,
                                             kind: str = "snapshot") -> ClientFuture:
        def op() -> SamplerState:
            path = self._engine.save_for_sampler(self._state, name) if name else None
            return self._engine.snapshot_sampler(self._state, path)

        fut = self._engine.submit(op)
        return ClientFuture(_chain(fut, lambda s: self._sampling_client(s, record_stability_info)))

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture:
        fut = self._engine.submit(lambda: self._engine.load_sampler(model_path))
        return ClientFuture(_chain(fut, lambda s: self._sampling_client(s, record_stability_info)))

    def load_state(self, path: str,
                   weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str,
                                  weights_access_token: str | None = None
                                  ) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, with_optimizer=True)

    def _load(self, path: str, with_optimizer: bool) -> APIFuture[types.LoadWeightsResponse]:
        def op():
            new = self._engine.load_trainer(self.model_id, path, with_optimizer, self._state.optimizer_type)
            self._state.base.delete_adapter(self._state.adapter)
            self._state = new
            return types.LoadWeightsResponse(path=path, model_id=self.model_id)

        return self._submit(op)

    def get_info(self) -> types.GetInfoResponse:
        base = self._state.base
        return types.GetInfoResponse(
            model_id=self.model_id,
            model_data=types.ModelData(arch=base.arch, model_name=base.name, tokenizer_id=base.path),
            is_lora=True,
            lora_rank=self._state.spec.rank,
            model_name=base.name,
        )

    def get_tokenizer(self):
        return self._state.base.tokenizer

    # async variants, as in the SDK (each returns the same future its sync twin does)
    async def forward_async(self, *a, **k):
        return self.forward(*a, **k)

    async def forward_backward_async(self, *a, **k):
        return self.forward_backward(*a, **k)

    async def forward_backward_custom_async(self, *a, **k):
        return self.forward_backward_custom(*a, **k)

    async def optim_step_async(self, *a, **k):
        return self.optim_step(*a, **k)

    async def save_state_async(self, *a, **k):
        return self.save_state(*a, **k)

    async def save_weights_for_sampler_async(self, *a, **k):
        return self.save_weights_for_sampler(*a, **k)

    async def save_weights_external_async(self, *a, **k):
        return self.save_weights_external(*a, **k)

    async def load_state_async(self, *a, **k):
        return self.load_state(*a, **k)

    async def load_state_with_optimizer_async(self, *a, **k):
        return self.load_state_with_optimizer(*a, **k)

    async def save_weights_and_get_sampling_client_async(self, *a, **k) -> "SamplingClient":
        return await self.save_weights_and_get_sampling_client(*a, **k)

    async def create_sampling_client_async(self, *a, **k) -> "SamplingClient":
        return await self.create_sampling_client(*a, **k)

    async def get_info_async(self) -> types.GetInfoResponse:
        return self.get_info()


class SamplingClient:
    """Samples from a frozen set of weights; requests from many callers are batched together. With
    ``record`` (made with ``record_stability_info=True``) every sampled sequence is recorded for its
    session before its result is handed out."""

    def __init__(self, engine: Engine, state: SamplerState,
                 record: tuple[SequenceRecords, str] | None = None):
        self._engine = engine
        self._state = state
        self._record = record
        self.model_path = state.model_path

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
               topk_sample_logprobs: int = 0, target_prompt_logprobs: types.TensorData | None = None,
               prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[types.SampleResponse]:
        queries = PromptQueries(topk_prompt_logprobs, topk_sample_logprobs, target_prompt_logprobs,
                                prompt_alt_tokens_k, prompt_logprobs_last_n)
        job = make_sample_job(self._state.base, prompt, num_samples, sampling_params, include_prompt_logprobs,
                              queries=queries)
        fut = self._engine.submit_sample(self._state, job)
        if self._record is not None:
            records, session = self._record
            positions = input_positions(prompt)
            fut = _chain(fut, lambda r: record_sequences(records, LOCAL_OWNER, session, positions, r))
        return AwaitableConcurrentFuture(fut)

    def compute_logprobs(self, prompt: types.ModelInput,
                         prompt_logprobs_last_n: int | None = None) -> APIFuture[list[float | None]]:
        queries = PromptQueries(prompt_logprobs_last_n=prompt_logprobs_last_n)
        job = make_sample_job(self._state.base, prompt, 1, types.SamplingParams(max_tokens=1),
                              prompt_only=True, queries=queries)
        fut = self._engine.submit_sample(self._state, job)
        return AwaitableConcurrentFuture(_chain(fut, lambda r: r.prompt_logprobs))

    async def sample_async(self, *a, **k) -> types.SampleResponse:
        return await self.sample(*a, **k)

    async def compute_logprobs_async(self, *a, **k) -> list[float | None]:
        return await self.compute_logprobs(*a, **k)

    def get_tokenizer(self):
        return self._state.base.tokenizer

    def get_base_model(self) -> str:
        return self._state.base.name

    async def get_base_model_async(self) -> str:
        return self.get_base_model()
