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
from pathlib import Path
from typing import Any, Sequence

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from polyrl.local import losses
from polyrl.local.engine import (DEFAULT_MICRO_BATCH_TOKENS, Engine, SamplerState, TrainerState,
                                 model_input_tokens)
from polyrl.local.model import BaseModel, LoraSpec
from polyrl.local.rest import RestClient
from polyrl.local.sampler import SampleJob, resolve_stops


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


def check_sample_options(topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
                         prompt_alt_tokens_k: int = 0, target_prompt_logprobs: Any = None) -> None:
    """Refuse the ``sample`` options the local engine does not implement."""
    if topk_prompt_logprobs or topk_sample_logprobs or prompt_alt_tokens_k or target_prompt_logprobs is not None:
        raise ValueError("top-k logprobs, target_prompt_logprobs and prompt_alt_tokens are not supported "
                         "by the local engine")


def make_sample_job(base: BaseModel, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams,
                    include_prompt_logprobs: bool = False, prompt_only: bool = False) -> SampleJob:
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
    return SampleJob(tokens, num_samples, params, include_prompt_logprobs, stop_ids, stop_strings,
                     max_tokens, prompt_only, tuple(found), mrope, delta)


class ServiceClient:
    """Entry point, like ``tinker.ServiceClient``, with an in-process engine behind it.

    ``store_dir`` is where checkpoints live (default ``$POLYRL_STORE_DIR`` or
    ``~/.cache/polyrl/store``); ``device`` is ``auto`` | ``cpu`` | ``cuda[:N]`` | ``mps``; ``dtype`` is
    ``auto`` (bfloat16 on capable GPUs, else float32) or a dtype name. ``models`` lists base models
    reported by ``get_server_capabilities`` before they are loaded. ``micro_batch_tokens`` caps the
    tokens of one forward/backward pass; ``gradient_checkpointing`` (``auto``: on for models of
    300M parameters and more) trades recomputation for activation memory. ``max_store_bytes`` caps
    the store (a save past it is refused); ``project_id`` (or ``$TINKER_PROJECT_ID``) is where
    ``copy_weights`` puts copies, as in the SDK.
    """

    def __init__(self, store_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
                 models: Sequence[str] = (), micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
                 gradient_checkpointing: bool | str = "auto", max_store_bytes: int | None = None,
                 project_id: str | None = None, **_ignored: Any):
        self.engine = Engine.shared(store_dir, device, dtype, micro_batch_tokens, gradient_checkpointing,
                                    max_store_bytes)
        self._project_id = project_id or os.environ.get("TINKER_PROJECT_ID") or None
        self.session_id = f"local-{uuid.uuid4().hex[:8]}"
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
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None, optimizer: Any = None) -> ClientFuture:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("at least one of train_mlp, train_attn, train_unembed must be True")
        spec = LoraSpec(rank, train_mlp, train_attn, train_unembed, seed)
        model_id = self._next_model_id()
        fut = self.engine.submit(lambda: self.engine.create_trainer(model_id, base_model, spec))
        return ClientFuture(_chain(fut, lambda st: TrainingClient(self.engine, st)))

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None, optimizer: Any = None) -> ClientFuture:
        return self._from_state(path, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None) -> ClientFuture:
        return self._from_state(path, with_optimizer=True)

    def _from_state(self, path: str, with_optimizer: bool) -> ClientFuture:
        model_id = self._next_model_id()
        fut = self.engine.submit(lambda: self.engine.load_trainer(model_id, path, with_optimizer))
        return ClientFuture(_chain(fut, lambda st: TrainingClient(self.engine, st)))

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False) -> ClientFuture:
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        if model_path is not None:
            fut = self.engine.submit(lambda: self.engine.load_sampler(model_path))
        else:
            fut = self.engine.submit(lambda: SamplerState(self.engine.base(base_model), None, None))
        return ClientFuture(_chain(fut, lambda s: SamplingClient(self.engine, s)))

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

    async def create_training_client_from_state_with_optimizer_async(self, *args, **kwargs) -> "TrainingClient":
        return await self.create_training_client_from_state_with_optimizer(*args, **kwargs)

    async def create_sampling_client_async(self, *args, **kwargs) -> "SamplingClient":
        return await self.create_sampling_client(*args, **kwargs)

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return self.get_server_capabilities()


class TrainingClient:
    """A LoRA adapter being trained; operations run in submission order on the engine."""

    def __init__(self, engine: Engine, state: TrainerState):
        self._engine = engine
        self._state = state
        self.model_id = state.model_id

    def _submit(self, fn) -> APIFuture:
        return AwaitableConcurrentFuture(self._engine.submit(fn))

    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        losses.get_loss(loss_fn)
        return self._submit(lambda: self._engine.forward_backward(self._state, data, loss_fn, loss_fn_config, backward=False))

    def forward_backward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: dict | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        losses.get_loss(loss_fn)
        return self._submit(lambda: self._engine.forward_backward(self._state, data, loss_fn, loss_fn_config, backward=True))

    def forward_backward_custom(self, data: list[types.Datum], loss_fn, *, loss_type_input: str | None = None) -> APIFuture[types.ForwardBackwardOutput]:
        return self._submit(lambda: self._engine.forward_backward_custom(self._state, data, loss_fn))

    def optim_step(self, optim_params: types.AdamParams | None = None, *, adam_params: types.AdamParams | None = None) -> APIFuture[types.OptimStepResponse]:
        params = optim_params or adam_params
        if not isinstance(params, types.AdamParams):
            raise ValueError("optim_step needs tinker.types.AdamParams (the local engine trains with AdamW)")
        return self._submit(lambda: self._engine.optim_step(self._state, params))

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsResponse]:
        """As the SDK's: a name that exists fails the future with ``tinker.ConflictError`` (a ValueError)."""
        return self._submit(lambda: types.SaveWeightsResponse(
            path=self._engine.save_state(self._state, name, overwrite, user_metadata, ttl_seconds)))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None) -> APIFuture[types.SaveWeightsForSamplerResponse]:
        return self._submit(lambda: types.SaveWeightsForSamplerResponse(
            path=self._engine.save_for_sampler(self._state, name, user_metadata, ttl_seconds)))

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None,
                              ) -> APIFuture[types.SaveWeightsExternalResponse]:
        return self._submit(lambda: types.SaveWeightsExternalResponse(
            path=self._engine.save_external(self._state, name, ttl_seconds, age_encryption_recipients)))

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False, kind: str = "snapshot") -> ClientFuture:
        def op() -> SamplerState:
            path = self._engine.save_for_sampler(self._state, name) if name else None
            return self._engine.snapshot_sampler(self._state, path)

        return ClientFuture(_chain(self._engine.submit(op), lambda s: SamplingClient(self._engine, s)))

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> ClientFuture:
        fut = self._engine.submit(lambda: self._engine.load_sampler(model_path))
        return ClientFuture(_chain(fut, lambda s: SamplingClient(self._engine, s)))

    def load_state(self, path: str, weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None) -> APIFuture[types.LoadWeightsResponse]:
        return self._load(path, with_optimizer=True)

    def _load(self, path: str, with_optimizer: bool) -> APIFuture[types.LoadWeightsResponse]:
        def op():
            new = self._engine.load_trainer(self.model_id, path, with_optimizer)
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
    """Samples from a frozen set of weights; requests from many callers are batched together."""

    def __init__(self, engine: Engine, state: SamplerState):
        self._engine = engine
        self._state = state
        self.model_path = state.model_path

    def _job(self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams,
             include_prompt_logprobs: bool = False, prompt_only: bool = False) -> SampleJob:
        return make_sample_job(self._state.base, prompt, num_samples, params, include_prompt_logprobs, prompt_only)

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs: Any = None, prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[types.SampleResponse]:
        check_sample_options(topk_prompt_logprobs, topk_sample_logprobs, prompt_alt_tokens_k, target_prompt_logprobs)
        job = self._job(prompt, num_samples, sampling_params, include_prompt_logprobs)
        return AwaitableConcurrentFuture(self._engine.submit_sample(self._state, job))

    def compute_logprobs(self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None) -> APIFuture[list[float | None]]:
        job = self._job(prompt, 1, types.SamplingParams(max_tokens=1), prompt_only=True)
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
