"""``polyrl serve``'s state: the Tinker protocol's operations, mapped onto polyrl's local engine.

:class:`Server` composes the objects that hold it, each given what it uses: :class:`~polyrl.serve.sessions.
Sessions` and :class:`~polyrl.serve.sessions.Models` (the stores), :class:`~polyrl.serve.training.Training`
(training clients' operations), :class:`~polyrl.serve.sampling.Samplers` (sampling clients and requests),
:class:`~polyrl.serve.lifecycle.Checkpoints` (checkpoints and runs), :class:`~polyrl.serve.quotas.Quotas`
(what each key may hold), :class:`~polyrl.serve.work.BaseModels` and :class:`~polyrl.serve.work.EngineWork`
(the engine as the keys share it) and :class:`~polyrl.serve.state.Futures` (results). Routes call the object
that owns the operation; the server itself does only what spans them: ending sessions and housekeeping.

Every method runs on the server's event loop and returns what the route sends back: a future
(``{"request_id", ...}``) whose result ``retrieve_future`` fetches later, or a direct answer.
Each takes the caller's ``owner`` (a digest of its API key): sessions, models, samplers, futures
and checkpoints belong to the key that made them, and any other key gets the same "not found"
as for an id that never existed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from polyrl.backend import vllm_settings
from polyrl.config.schema import LocalEngineConfig
from polyrl.local.engine import Engine
from polyrl.local.stability import DEFAULT_MAX_RECORDED_TOKENS, SequenceRecords
from polyrl.samplers import resolve_sampler
from polyrl.serve import protocol as P
from polyrl.serve.lifecycle import Checkpoints
from polyrl.serve.quotas import Quotas
from polyrl.serve.runs import Runs
from polyrl.serve.sampling import Samplers
from polyrl.serve.sessions import Models, Sessions
from polyrl.serve.state import Futures
from polyrl.serve.training import Training
from polyrl.serve.work import BaseModels, EngineWork

log = logging.getLogger("polyrl.serve")


@dataclass
class ServeConfig:
    models: list[str] = field(default_factory=list)  # served base models; empty: any the engine can load
    api_keys: list[str] = field(default_factory=list)
    local: LocalEngineConfig = field(default_factory=LocalEngineConfig)  # the engine's settings, as train's
    max_body_bytes: int = 64 << 20
    long_poll_s: float = 30.0  # retrieve_future waits this long before answering 408 (SDK timeout: 45 s)
    gap_timeout_s: float = 120.0
    sample_quiet_ms: float = 10.0  # see SampleGate; 0 sends every sampling request to the engine at once
    result_ttl_s: float = 900.0
    session_timeout_s: float = 1800.0
    max_samplers_per_session: int = 64
    max_seq_ahead: int = 1024  # how far past a model's next seq_id an operation may arrive (and wait)
    preload: bool = True
    # What one request may hold (400 past it): model_input tokens of a forward_backward (or a sampling
    # prompt), datums of a forward_backward, K of an (N, K) loss input.
    max_request_tokens: int = 1 << 20
    max_request_datums: int = 1024
    max_target_k: int = 128
    # Images of one request (400 past it), and one image's encoded bytes and declared pixels (413 past them:
    # read from its header before anything is queued or decoded).
    max_request_images: int = 64
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 36_000_000
    # What one API key may have at once, so that no key starves the others: tokens of forward_backward
    # data and sampling prompts accepted and not yet done, and samples likewise (429 with Retry-After past
    # them: the SDK waits and retries; 400 for data that would wait for an earlier seq_id, which a 429
    # would hang); checkpoints stored (403 past it, until some are deleted).
    max_tokens_in_flight: int = 1 << 22
    max_samples_in_flight: int = 8192
    max_decode_tokens_in_flight: int = 1 << 21  # num_samples x max_tokens of sampling requests
    max_checkpoints: int = 1000
    # What one key may keep (403 past them): live sessions, training clients, and their adapters' memory
    # (weights, gradients, optimizer moments); a LoRA rank above max_lora_rank or the model's width is a 400.
    max_sessions: int = 256
    max_models: int = 64
    max_adapter_bytes: int = 4 << 30
    max_lora_rank: int = 256
    max_recorded_tokens: int = DEFAULT_MAX_RECORDED_TOKENS  # per key, for stable_reinforce (LRU eviction)
    sweep_interval_s: float = 60.0  # how often expired checkpoints are removed from the store
    # A connection's request headers, then its body, must arrive within these (slow clients are closed).
    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0


class Server:
    """The engine, and the objects that serve the protocol over it (see the module's doc)."""

    def __init__(self, config: ServeConfig, engine: Engine | None = None):
        self.config = config
        local = config.local
        if engine is None:
            vllm = vllm_settings(local.vllm, config.max_lora_rank)
            sampler = resolve_sampler(local.sampler, local.device, vllm)
            engine = Engine(local.store_dir, local.device, local.dtype, local.micro_batch_tokens,
                            local.gradient_checkpointing, local.max_store_bytes, local.sampler_dtype, sampler,
                            vllm if sampler == "vllm" else None, local.attention)
        self.engine = engine
        self.limits = P.RequestLimits(config.max_request_tokens, config.max_request_datums,
                                      config.max_target_k, config.max_request_images, config.max_image_bytes,
                                      config.max_image_pixels)
        self.futures = Futures()
        self.records = SequenceRecords(config.max_recorded_tokens)  # sampled sequences, by key and session
        self.work = EngineWork(self.engine)
        self.bases = BaseModels(config.models, self.engine)
        self.sessions = Sessions(config)
        self.models = Models()
        self.quotas = Quotas(config, self.models, self.engine)
        runs = Runs(self.engine.store)
        self.checkpoints = Checkpoints(config, self.engine, runs, self.models, self.sessions, self.futures)
        self.samplers = Samplers(config, self.engine, self.work, self.sessions, self.bases, self.checkpoints,
                                 self.quotas, self.futures, self.records, self.limits)
        self.training = Training(config, self.engine, self.work, self.bases, self.sessions, self.models, runs,
                                 self.checkpoints, self.samplers, self.quotas, self.futures, self.records)

    # ---- sessions: what spans the stores --------------------------------------------------------------
    def get_session(self, session_id: str, owner: str) -> dict:
        """Tinker's ``GetSessionResponse``: the live session's training runs and samplers."""
        return self.sessions.describe(session_id, owner, self.models, self.samplers)

    def finish_session(self, session_id: str, owner: str, reason: str = "finished") -> dict:
        """End a session and free everything in it: models (and their adapters), samplers, results."""
        s = self.sessions.end(session_id, owner)
        if s is None:  # finished already
            return {}
        models = self.models.release(s)
        for rec in models:
            rec.ops.close(f"model {rec.model_id} was released: its session {reason}")
        samplers = self.samplers.release(s)
        self.futures.drop_session(session_id)
        self.records.drop_session(session_id)
        self.work.release(models, samplers, owner)
        return {}

    # ---- housekeeping --------------------------------------------------------------------------------
    def tick(self) -> None:
        """Called about once a second: ordering gaps, expired results, abandoned sessions."""
        now = time.monotonic()
        self.training.tick(self.config.gap_timeout_s, now)
        self.futures.expire(self.config.result_ttl_s, now)
        self.records.sweep()
        for s in self.sessions.idle(self.config.session_timeout_s, now):
            log.warning("session %s sent no heartbeat for %.0f s; releasing its models", s.session_id,
                        now - s.last_seen)
            self.finish_session(s.session_id, s.owner, "timed out")
