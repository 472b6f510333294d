"""The Tinker protocol's operations, mapped onto polyrl's local engine.

Every method runs on the server's event loop and returns what the route sends back: a future
(``{"request_id", ...}``) whose result ``retrieve_future`` fetches later, or a direct answer.
Each takes the caller's ``owner`` (a digest of its API key): sessions, models, samplers, futures
and checkpoints belong to the key that made them, and any other key gets the same "not found"
as for an id that never existed.
Training operations are closures the engine's worker thread runs in each model's ``seq_id``
order (:class:`~polyrl.serve.state.OrderedOps`); sampling bypasses that order and is gathered
into the engine's sampling batches (:class:`~polyrl.serve.state.SampleGate`).
Its base classes hold the other jobs, one per file: sampling (:mod:`~polyrl.serve.sampling`), per-key
quotas (:mod:`~polyrl.serve.quotas`) and the checkpoint lifecycle (:mod:`~polyrl.serve.lifecycle`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from polyrl.config import LocalEngineConfig
from polyrl.local import losses
from polyrl.local.allocator import give_back_free_memory
from polyrl.local.engine import Engine, SamplerState, TrainerState
from polyrl.local.model import LoraSpec, resolve_model_path
from polyrl.local.optim import check_kind, optimizer_type
from polyrl.local.stability import DEFAULT_MAX_RECORDED_TOKENS, SequenceRecords
from polyrl.serve import protocol as P
from polyrl.serve.lifecycle import CheckpointLifecycle
from polyrl.serve.output_wire import encode_forward_backward_output, forward_backward_output_json
from polyrl.serve.protocol import RequestError
from polyrl.serve.quotas import Quotas
from polyrl.serve.runs import Runs, check_id, check_tinker_path, paginate
from polyrl.serve.sampling import Sampling
from polyrl.serve.state import (
    Futures, ModelRecord, OrderedOps, Outstanding, SampleGate, SamplerRecord, Session, Usage, chain,
    error_body, wait_done,
)

log = logging.getLogger("polyrl.serve")
TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
                 "custom")


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


def _json(model: Any) -> dict:
    return model.model_dump(mode="json", exclude_none=True)


class Server(CheckpointLifecycle, Sampling, Quotas):
    def __init__(self, config: ServeConfig, engine: Engine | None = None):
        self.config = config
        local = config.local
        self.engine = engine or Engine(local.store_dir, local.device, local.dtype, local.micro_batch_tokens,
                                       local.gradient_checkpointing, local.max_store_bytes,
                                       local.sampler_dtype)
        self.runs = Runs(self.engine.store)
        self.futures = Futures()
        self.sessions: dict[str, Session] = {}
        # recently finished session id -> owner (for 410s)
        self.finished: OrderedDict[str, str] = OrderedDict()
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        self.outstanding = Outstanding()
        self.usage = Usage()
        self.saving: dict[str, list[tuple[Future, tuple[str, str, str]]]] = {}  # owner -> saves not yet done
        self.records = SequenceRecords(config.max_recorded_tokens)  # sampled sequences, by key and session
        self.limits = P.RequestLimits(config.max_request_tokens, config.max_request_datums,
                                      config.max_target_k, config.max_request_images, config.max_image_bytes,
                                      config.max_image_pixels)
        quiet = config.sample_quiet_ms / 1000
        self.gate = SampleGate(self._submit_sample, self.outstanding.__bool__, quiet, 3 * quiet, 100 * quiet)
        self.served: dict[str, str] = {}  # any spelling of a served model -> its canonical name
        for name in config.models:
            expanded = os.path.expanduser(name)
            canonical = os.path.realpath(expanded) if os.path.isdir(expanded) else name
            self.served[name] = self.served[canonical] = canonical
        self._init_lifecycle()

    def _submit(self, fn, owner: str) -> Future:
        """Run ``fn`` on the engine as ``owner``'s work (keys take turns on the engine)."""
        return self.outstanding.track(self.engine.submit(fn, owner))

    def _submit_sample(self, state: SamplerState, job, owner: str) -> Future:
        return self.outstanding.track(self.engine.submit_sample(state, job, owner))

    # ---- models --------------------------------------------------------------------------------
    def preload(self) -> None:
        for name in dict.fromkeys(self.served.values()):
            self.engine.call(lambda n=name: self.engine.base(n).tokenizer)
            log.info("loaded %s", name)

    def base_model_name(self, name: str) -> str:
        """The canonical name of a served base model, or a 400 listing the served ones."""
        if not isinstance(name, str) or not name:
            raise RequestError(400, "base_model is required")
        if not self.served:
            try:
                resolve_model_path(name)
            except ValueError as e:
                raise RequestError(400, str(e)) from None
            return name
        expanded = os.path.expanduser(name)
        canonical = self.served.get(name) or (self.served.get(os.path.realpath(expanded))
                                              if os.path.isdir(expanded) else None)
        if canonical is None:
            raise RequestError(400, f"base model {name!r} is not served here; "
                                    f"served: {sorted(set(self.served.values()))}")
        return canonical

    def capabilities(self) -> dict:
        loaded = {m.name: m for m in self.engine.loaded_models()}
        names = list(dict.fromkeys([*self.served.values(), *loaded]))
        return {
            "supported_models": [
                {"model_name": n, "max_context_length": loaded[n].max_context_length if n in loaded else None,
                 "trainable": True, "sampleable": True}
                for n in names
            ],
            "supported_loss_fns": sorted(losses.LOSSES),
        }

    # ---- sessions ------------------------------------------------------------------------------
    def create_session(self, req: P.CreateSessionReq, owner: str) -> dict:
        self.session_room(owner)
        sid = f"sess-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = Session(sid, owner, req.tags, req.user_metadata)
        return {"session_id": sid, "type": "create_session"}

    def _session(self, session_id: str, owner: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.owner != owner:
            if self.finished.get(session_id) == owner:
                raise RequestError(410, f"session {session_id} has finished")
            raise RequestError(404, f"unknown session_id {session_id!r} "
                                    "(sessions do not survive a server restart)")
        s.last_seen = time.monotonic()
        return s

    def heartbeat(self, req: P.SessionReq, owner: str) -> dict:
        s = self.sessions.get(req.session_id)
        if s is None or s.owner != owner:
            raise RequestError(410, f"session {req.session_id!r} is not active")
        s.last_seen = time.monotonic()
        return {"type": "session_heartbeat"}

    def get_session(self, session_id: str, owner: str) -> dict:
        """Tinker's ``GetSessionResponse``: the live session's training runs and samplers."""
        s = self._session(session_id, owner)
        return {"training_run_ids": [m for m in s.models if m in self.models],
                "sampler_ids": [x for x in s.samplers if x in self.samplers],
                "user_metadata": {str(k): str(v) for k, v in (s.user_metadata or {}).items()} or None}

    def list_sessions(self, limit: int, offset: int, owner: str) -> dict:
        """The key's live sessions, newest first (a finished one is gone, as its models are)."""
        mine = sorted((s for s in self.sessions.values() if s.owner == owner), key=lambda s: -s.created)
        return {"sessions": paginate([s.session_id for s in mine], limit, offset)[0]}

    def finish_session(self, session_id: str, owner: str, reason: str = "finished") -> dict:
        """End a session and free everything in it: models (and their adapters), samplers, results."""
        s = self.sessions.get(session_id)
        if s is None or s.owner != owner:
            if self.finished.get(session_id) == owner:
                return {}
            raise RequestError(404, f"unknown session_id {session_id!r}")
        del self.sessions[session_id]
        self.finished[session_id] = owner
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)
        models = [self.models.pop(mid) for mid in s.models if mid in self.models]
        for rec in models:
            rec.ops.close(f"model {rec.model_id} was released: its session {reason}")
        samplers = [self.samplers.pop(sid) for sid in s.samplers if sid in self.samplers]
        self.futures.drop_session(session_id)
        self.records.drop_session(session_id)
        self._release_clients(models, samplers, owner)
        return {}

    def _release_clients(self, models: list[ModelRecord], samplers: list[SamplerRecord], owner: str) -> None:
        """Have the engine give back what released training and sampling clients held: each model's
        adapter and optimizer state, the sampling slots (and folded weights) of each sampler's snapshot,
        then the allocator's free pages, so that memory returns to where it was once sessions end.
        Runs on the engine's worker after ``owner``'s work already queued, which may still use them."""

        def free() -> None:
            for rec in models:
                if (st := _result(rec.ready)) is not None:
                    st.base.delete_adapter(st.adapter)
                    # a future or callback that still holds the state keeps no tensors alive through it
                    st.optimizer.state.clear()
                    st.params.clear()
            for srec in samplers:
                if (state := _result(srec.ready)) is not None and state.weights is not None:
                    state.base.release_snapshot(state)
            models.clear()  # the worker may hold this job until its next one: it must pin nothing
            samplers.clear()
            give_back_free_memory()

        if models or samplers:
            self.engine.submit(free, owner)

    # ---- training clients ----------------------------------------------------------------------
    def _new_model(self, session: Session, model_seq_id: int, base_model: str, lora: dict,
                   user_metadata: dict | None, start) -> str:
        """Admit the model against the key's quotas, record the run (and its owner) in the store, then have
        the engine ``start()`` the model."""
        model_id = f"{session.session_id}:train:{model_seq_id}"
        spec = LoraSpec(**lora)
        size = self.adapter_room(session.owner, base_model, spec)
        try:
            self.runs.record(model_id, session.owner, base_model, lora, user_metadata)
        except OSError as e:
            raise RequestError(503, f"could not record training run {model_id}: {e.strerror or e}",
                               "server") from None

        def admitted() -> TrainerState:
            if rec.adapter_bytes == 0:  # its base model was not loaded at the request: admitted here
                self.engine.base(base_model)
                rec.adapter_bytes = self.adapter_room(session.owner, base_model, spec) or 1
            return start()

        ready: Future = Future()
        rid = self.futures.add(ready, lambda st: {"model_id": st.model_id, "type": "create_model"},
                               owner=session.owner, session_id=session.session_id)
        ops = OrderedOps(functools.partial(self._submit, owner=session.owner), self.futures,
                         max_ahead=self.config.max_seq_ahead, owner=session.owner,
                         session_id=session.session_id)
        rec = ModelRecord(model_id, session.session_id, session.owner, base_model, lora, user_metadata, ready,
                          ops, rid, adapter_bytes=size)
        self.models[model_id] = rec
        chain(self._submit(admitted, session.owner), ready)
        session.models.append(model_id)
        ready.add_done_callback(lambda f: self.runs.forget(model_id) if f.exception() is not None else None)
        return rid

    def create_model(self, req: P.CreateModelReq, owner: str) -> dict:
        session = self._session(req.session_id, owner)
        model_id = f"{session.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:  # a retried POST
            return {"request_id": self.models[model_id].create_request_id, "model_id": model_id}
        opt_type = self._optimizer(req.optimizer_config)
        base = self.base_model_name(req.base_model)
        lc = req.lora_config or types.LoraConfig(rank=32)
        if lc.rank < 1:
            raise RequestError(400, f"lora rank must be >= 1, got {lc.rank}")
        if not (lc.train_mlp or lc.train_attn or lc.train_unembed):
            raise RequestError(400, "at least one of train_mlp, train_attn, train_unembed must be true")
        spec = LoraSpec(lc.rank, lc.train_mlp, lc.train_attn, lc.train_unembed, lc.seed)
        rid = self._new_model(session, req.model_seq_id, base, spec.to_dict(), req.user_metadata,
                              lambda: self.engine.create_trainer(model_id, base, spec, opt_type))
        return {"request_id": rid, "model_id": model_id}

    @staticmethod
    def _optimizer(config: dict | None) -> str:
        """The optimizer a new training client is created with (Tinker fixes it for the client's life)."""
        try:
            return optimizer_type(config)
        except ValueError as e:
            raise RequestError(400, str(e)) from None

    def _model(self, model_id: str, owner: str) -> ModelRecord:
        rec = self.models.get(model_id)
        if rec is None or rec.owner != owner:
            raise RequestError(404, f"unknown model_id {model_id!r} (models do not survive a server restart; "
                                    "load a checkpoint instead)")
        rec.last_request = time.time()
        return rec

    async def get_info(self, req: P.ModelReq, owner: str) -> dict:
        rec = self._model(req.model_id, owner)
        if not await wait_done(rec.ready, self.config.long_poll_s):
            raise RequestError(503, f"model {req.model_id} is still being created", "server")
        if rec.ready.exception() is not None:
            raise RequestError(404, f"model {req.model_id} could not be created: {rec.ready.exception()}")
        st: TrainerState = rec.ready.result()
        return {
            "type": "get_info",
            "model_id": rec.model_id,
            "model_data": {"arch": st.base.arch, "model_name": st.base.name, "tokenizer_id": st.base.path},
            "is_lora": True,
            "lora_rank": st.spec.rank,
            "model_name": st.base.name,
            "optimizer_config": _optimizer_config(st.optimizer_type),
        }

    def _run_owner(self, run_id: str) -> str | None:
        """Who owns a run: a key digest, ``""`` for a run no key owns, None if there is no such run."""
        rec = self.models.get(run_id)
        return rec.owner if rec is not None else self.runs.owner(run_id)

    def _readable(self, run_id: str, owner: str) -> bool:
        return self._run_owner(run_id) in (owner, "")

    def _checkpoint_meta(self, path: str, owner: str, token: str | None = None,
                         loading: bool = False) -> dict:
        """A checkpoint's metadata, if ``owner`` (or the key ``token`` is) may read it: its own, one no key
        owns, or a published one; otherwise the same 404 as for a missing one. ``loading``: external weights
        (made to be downloaded) are a 400."""
        cp = check_tinker_path(path)
        try:
            _, directory = self.engine.store.resolve(path)
            meta = self.engine.store.meta(directory)
        except (ValueError, OSError):
            raise RequestError(404, f"checkpoint {path} not found") from None
        readers = {owner, "", self.token_owner(token)}
        if self._run_owner(cp.run_id) not in readers and not meta.get("public"):
            raise RequestError(404, f"checkpoint {path} not found")
        if loading and cp.kind == "external_weights":
            raise RequestError(400, f"checkpoint {path} is external weights, made to be downloaded; load the "
                                    "training or sampler checkpoint it was saved from")
        return meta

    def load_weights(self, req: P.LoadWeightsReq, owner: str) -> dict:
        try:
            meta = self._checkpoint_meta(req.path, owner, req.weights_access_token, loading=True)
            self.base_model_name(meta["base_model"])
        except RequestError as e:  # into a model: the refusal uses up its seq_id, so later operations run
            if req.model_id is not None and req.seq_id is not None:
                self.refuse_op(req.model_id, req.seq_id, e, owner)
            raise
        path = req.path
        if req.model_id is not None:  # load_state into an existing training client
            rec = self._model(req.model_id, owner)
            if req.seq_id is None:
                raise RequestError(400, "load_weights into a model needs its seq_id")

            def load() -> dict:
                old: TrainerState = rec.ready.result()
                new = self.engine.load_trainer(rec.model_id, path, req.optimizer, old.optimizer_type)
                old.base.delete_adapter(old.adapter)
                done: Future = Future()
                done.set_result(new)
                rec.ready = done
                return {"path": path, "model_id": rec.model_id, "type": "load_weights"}

            return {"request_id": rec.ops.submit(req.seq_id, load, dict), "model_id": rec.model_id}
        if req.session_id is None or req.model_seq_id is None:
            raise RequestError(400, "load_weights needs either model_id and seq_id, "
                                    "or session_id and model_seq_id")
        session = self._session(req.session_id, owner)
        model_id = f"{session.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:
            return {"request_id": self.models[model_id].create_request_id, "model_id": model_id}
        source_run = path[len("tinker://"):].split("/")[0]
        user_metadata = req.user_metadata
        if user_metadata is None:
            user_metadata = (self.runs.info(source_run) or {}).get("user_metadata")
        opt_type = self._optimizer(req.optimizer_config)  # unless the checkpoint's optimizer state comes too
        rid = self._new_model(session, req.model_seq_id, meta["base_model"], meta["lora"], user_metadata,
                              lambda: self.engine.load_trainer(model_id, path, req.optimizer, opt_type))
        self.futures.get(rid).to_json = lambda st: {"path": path, "model_id": st.model_id,
                                                    "type": "load_weights"}
        return {"request_id": rid, "model_id": model_id}

    def forward_backward(self, fb: P.ForwardBackwardReq, owner: str) -> dict:
        rec = self._model(fb.model_id, owner)
        loss_fn, config, data, backward = fb.loss_fn, dict(fb.loss_fn_config), fb.data, not fb.forward_only

        def provenance(datums: list[types.Datum]):
            """The datums' provenance against the sequences this model's session recorded."""
            return self.records.resolve(owner, rec.session_id, datums)

        spec = losses.LOSSES.get(loss_fn)
        if spec is not None and spec.provenance and rec.ops.accepts(fb.seq_id) and data:
            try:  # named sequences that are unknown, expired or another session's: refused at once
                provenance(data)
            except ValueError as e:
                error = RequestError(400, str(e))
                rec.ops.refuse(fb.seq_id, error)
                raise error from None

        def run() -> types.ForwardBackwardOutput:
            if loss_fn not in losses.LOSSES:
                known = ("is one of Tinker's losses but is not implemented by" if loss_fn in TINKER_LOSSES
                         else "is not a loss of")
                raise RequestError(400, f"loss_fn {loss_fn!r} {known} polyrl serve; supported: "
                                        f"{', '.join(sorted(losses.LOSSES))}")
            if not data:
                raise ValueError("forward_backward got no data")
            return self.engine.forward_backward(rec.ready.result(), data, loss_fn, config, backward,
                                                provenance)

        new, ahead = rec.ops.accepts(fb.seq_id), fb.seq_id > rec.ops.next_seq
        if new and ahead:
            self.waiting_room(rec, fb.seq_id, fb.tokens)
        elif new and not rec.ops.waiting:  # one that others wait for is always let in
            self.in_flight_room(owner, "tokens", fb.tokens)
        rid = rec.ops.submit(fb.seq_id, run, forward_backward_output_json, encode_forward_backward_output)
        if new:
            self.usage.hold(owner, self.futures.get(rid).future, tokens=fb.tokens)
            if ahead:
                rec.waiting_tokens[fb.seq_id] = fb.tokens
        return {"request_id": rid, "model_id": rec.model_id}

    def refuse_op(self, model_id: str, seq_id: int, error: RequestError, owner: str) -> None:
        """A malformed operation still uses up its seq_id, so the model's later operations need not wait."""
        rec = self.models.get(model_id)
        if rec is not None and rec.owner == owner:
            rec.ops.refuse(seq_id, error)

    def optim_step(self, req: P.OptimStepReq, owner: str) -> dict:
        rec = self._model(req.model_id, owner)
        try:
            params = P.optim_settings(req)
            ready = rec.ready.done() and rec.ready.exception() is None
            created = rec.ready.result() if ready and rec.ops.accepts(req.seq_id) else None
            if created is not None:  # a step of another optimizer than the client's is refused at once
                check_kind(created.optimizer_type, params)
        except (RequestError, ValueError) as e:
            error = e if isinstance(e, RequestError) else RequestError(400, str(e))
            rec.ops.refuse(req.seq_id, error)
            raise error from None

        def run() -> types.OptimStepResponse:
            return self.engine.optim_step(rec.ready.result(), params)

        return {"request_id": rec.ops.submit(req.seq_id, run, _json), "model_id": rec.model_id}

    def _checkpoint_name(self, rec: ModelRecord, seq_id: int, name: str) -> str:
        """A name the store accepts and a later load can name again; a bad one uses up ``seq_id``."""
        try:
            return check_id(name, "checkpoint name")
        except RequestError as e:
            rec.ops.refuse(seq_id, e)
            raise

    def save_weights(self, req: P.SaveWeightsReq, owner: str) -> dict:
        rec = self._model(req.model_id, owner)
        name = self._checkpoint_name(rec, req.seq_id, req.path or f"ckpt-{int(time.time() * 1000)}")

        def run() -> dict:
            path = self.engine.save_state(rec.ready.result(), name, req.overwrite, req.user_metadata,
                                          req.ttl_seconds)
            return {"path": path, "type": "save_weights"}

        return self._save(rec, req.seq_id, "weights", name, run, req.overwrite, req.ttl_seconds)

    def save_for_sampler(self, req: P.SaveForSamplerReq, owner: str) -> dict:
        rec = self._model(req.model_id, owner)
        if req.path is not None:
            name = self._checkpoint_name(rec, req.seq_id, req.path)

            def run() -> dict:
                path = self.engine.save_for_sampler(rec.ready.result(), name, req.user_metadata,
                                                    req.ttl_seconds)
                return {"path": path, "type": "save_weights_for_sampler"}

            return self._save(rec, req.seq_id, "sampler_weights", name, run, True, req.ttl_seconds)
        if req.sampling_session_seq_id is None:
            raise RequestError(400, "save_weights_for_sampler needs a path (name) "
                                    "or a sampling_session_seq_id")
        if req.seq_id in rec.ops.seen:
            return {"request_id": rec.ops.seen[req.seq_id], "model_id": rec.model_id}
        session = self._session(rec.session_id, owner)
        sampler_id = f"{session.session_id}:sample:{req.sampling_session_seq_id}"
        snapshot: Future = Future()

        def run() -> dict:
            st: TrainerState = rec.ready.result()
            snapshot.set_result(self.engine.snapshot_sampler(st))
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        rid = rec.ops.submit(req.seq_id, run, dict)
        self.futures.get(rid).future.add_done_callback(
            lambda f: None if snapshot.done()
            else snapshot.set_exception(f.exception() or RuntimeError("no snapshot")))
        self.add_sampler(session, SamplerRecord(sampler_id, session.session_id, owner, rec.base_model, None,
                                                snapshot, True))
        return {"request_id": rid, "model_id": rec.model_id}

    # ---- futures -----------------------------------------------------------------------------------
    async def retrieve(self, req: P.RetrieveFutureReq, accept_proto: bool, owner: str) -> tuple[int, Any]:
        """(HTTP status, body): bytes for protobuf, a dict for JSON."""
        pending = self.futures.owned(req.request_id, owner)
        if pending is None:
            raise RequestError(404, f"unknown or expired request_id {req.request_id!r}")
        if not await wait_done(pending.future, self.config.long_poll_s):
            return 408, {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        error = pending.future.exception()
        if error is not None:
            body = error_body(error)
            if body["category"] == "server":
                log.error("request %s failed", req.request_id, exc_info=error)
            return 200, body
        result = pending.future.result()
        if accept_proto and pending.to_proto is not None:
            return 200, pending.to_proto(result)
        return 200, pending.to_json(result)

    # ---- REST ----------------------------------------------------------------------------------------
    def _live_run(self, run_id: str) -> dict | None:
        rec = self.models.get(run_id)
        if rec is None:
            return None
        return {"base_model": rec.base_model, "lora": rec.lora, "user_metadata": rec.user_metadata,
                "last_request": rec.last_request}

    def _visible_run(self, run_id: str, owner: str, access_scope: str = "owned") -> str:
        """A run ``owner`` may see: its own or one no key owns; with ``access_scope="accessible"`` also one
        with a published checkpoint."""
        check_id(run_id, "training run id")
        if not self._readable(run_id, owner) and not (
                access_scope == "accessible" and any(c["public"] for c in self.runs.checkpoints(run_id))):
            raise RequestError(404, f"training run {run_id!r} not found")
        return run_id

    def training_run(self, run_id: str, owner: str, access_scope: str = "owned") -> dict:
        return self._run_view(self._visible_run(run_id, owner, access_scope), owner)

    def _run_view(self, run_id: str, owner: str) -> dict:
        """A run as ``owner`` may see it: all of it if it may read the run, else only what is published."""
        if self._readable(run_id, owner):
            return self.runs.training_run(run_id, self._live_run(run_id))
        return self.runs.training_run(run_id, public_only=True)

    def _own_runs(self, owner: str) -> list[str]:
        return self.runs.run_ids([m for m, rec in self.models.items() if rec.owner == owner], owner)

    def training_runs(self, limit: int, offset: int, owner: str, access_scope: str = "owned",
                      project_id: str | None = None) -> dict:
        """The key's runs (``accessible``: and those with a published checkpoint), newest first; with a
        ``project_id``, those copied into that project."""
        run_ids = self._own_runs(owner)
        if access_scope == "accessible":
            run_ids = list(dict.fromkeys([*run_ids, *self.runs.public_runs()]))
        if project_id is not None:
            run_ids = [r for r in run_ids if (self.runs.info(r) or {}).get("project_id") == project_id]
        rows = []
        for run_id in run_ids:
            try:
                rows.append(self._run_view(run_id, owner))
            except RequestError:
                continue
        rows.sort(key=lambda r: r["last_request_time"], reverse=True)
        page, cursor = paginate(rows, limit, offset)
        return {"training_runs": page, "cursor": cursor}

    def checkpoints(self, run_id: str, owner: str) -> dict:
        return {"checkpoints": self.runs.checkpoints(self._visible_run(run_id, owner))}

    def delete_checkpoint(self, run_id: str, checkpoint_id: str, owner: str) -> None:
        path = self.runs.checkpoint_path(run_id, checkpoint_id)
        if self._run_owner(run_id) != owner:  # only the owner deletes; nobody deletes what no key owns
            raise RequestError(404, f"checkpoint {path} not found")
        self.runs.delete_checkpoint(path)

    def user_checkpoints(self, limit: int, offset: int, owner: str) -> dict:
        rows = [c for run_id in self._own_runs(owner) for c in self.runs.checkpoints(run_id)]
        rows.sort(key=lambda c: c.get("time") or "", reverse=True)
        page, cursor = paginate(rows, limit, offset)
        return {"checkpoints": page, "cursor": cursor}

    def weights_info(self, req: P.WeightsInfoReq, owner: str) -> dict:
        meta = self._checkpoint_meta(req.tinker_path, owner)
        lora = meta.get("lora", {})
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora.get("rank"),
                "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
                "train_attn": lora.get("train_attn"),
                "optimizer_config": _optimizer_config(meta.get("optimizer", "adamw"))}

    # ---- housekeeping --------------------------------------------------------------------------------
    def tick(self) -> None:
        """Called about once a second: ordering gaps, expired results, abandoned sessions."""
        now = time.monotonic()
        for rec in self.models.values():
            rec.ops.check_gap(self.config.gap_timeout_s, now)
            rec.ops.forget_old()
        self.futures.expire(self.config.result_ttl_s, now)
        self.records.sweep()
        for s in list(self.sessions.values()):
            if now - s.last_seen > self.config.session_timeout_s:
                log.warning("session %s sent no heartbeat for %.0f s; releasing its models", s.session_id,
                            now - s.last_seen)
                self.finish_session(s.session_id, s.owner, "timed out")


def _result(future: Future) -> Any:
    """A done future's result, or None while it runs or when it failed."""
    return future.result() if future.done() and future.exception() is None else None


def _optimizer_config(kind: str) -> dict:
    """The optimizer config a client is told (``get_info``, ``weights_info``), as the SDK's types write it."""
    return {"type": "dimuon", "version": 1} if kind == "dimuon" else {"type": "adamw"}
