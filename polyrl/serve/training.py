"""Training clients in ``polyrl serve``: their creation (from a base model or a checkpoint) and their
operations (``forward_backward``, ``optim_step``, saves), each run by the engine's worker thread in the
model's ``seq_id`` order (:class:`~polyrl.serve.state.OrderedOps`).

Every operation takes the caller's ``owner`` (a digest of its API key): another key's model is "not found".
An operation refused at the request (a malformed body, a quota, a bad checkpoint name) still uses up its
``seq_id``, so that the model's later operations need not wait for it.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future

from tinker import types

from polyrl.local import losses
from polyrl.local.checkpoints import age_recipients
from polyrl.local.engine import Engine, TrainerState
from polyrl.local.model import LoraSpec
from polyrl.local.optim import check_kind, optimizer_type
from polyrl.local.stability import SequenceRecords
from polyrl.serve import protocol as P
from polyrl.serve.lifecycle import Checkpoints
from polyrl.serve.output_wire import encode_forward_backward_output, forward_backward_output_json
from polyrl.serve.protocol import RequestError
from polyrl.serve.quotas import Quotas
from polyrl.serve.runs import Runs, check_id, optimizer_config
from polyrl.serve.sampling import Samplers
from polyrl.serve.sessions import Models, Sessions
from polyrl.serve.state import Futures, ModelRecord, OrderedOps, SamplerRecord, Session, chain, wait_done
from polyrl.serve.work import BaseModels, EngineWork

TINKER_LOSSES = losses.TINKER_LOSSES  # the SDK's LossFnType: Tinker has them, polyrl may not


def _json(model) -> dict:
    return model.model_dump(mode="json", exclude_none=True)


class Training:
    """The training clients' operations. A client's record lives in ``models`` (and its session's
    ``models``); its runs and checkpoints in the store, through ``runs`` and ``checkpoints``."""

    def __init__(self, config, engine: Engine, work: EngineWork, bases: BaseModels, sessions: Sessions,
                 models: Models, runs: Runs, checkpoints: Checkpoints, samplers: Samplers, quotas: Quotas,
                 futures: Futures, records: SequenceRecords) -> None:
        self._config = config  # read at each call: max_seq_ahead, long_poll_s
        self._engine = engine
        self._work = work
        self._bases = bases
        self._sessions = sessions
        self._models = models
        self._runs = runs
        self._checkpoints = checkpoints
        self._samplers = samplers
        self._quotas = quotas
        self._futures = futures
        self._records = records  # the sequences sampled, for the losses that check provenance

    def tick(self, gap_timeout_s: float, now: float) -> None:
        """Fail operations that waited more than ``gap_timeout_s`` for an earlier ``seq_id``; forget old
        retries' answers."""
        for rec in self._models.values():
            rec.ops.check_gap(gap_timeout_s, now)
            rec.ops.forget_old()

    # ---- training clients: creation -------------------------------------------------------------------
    def _new_model(self, session: Session, model_seq_id: int, base_model: str, lora: dict,
                   user_metadata: dict | None, start) -> str:
        """Admit the model against the key's quotas, record the run (and its owner) in the store, then have
        the engine ``start()`` the model."""
        model_id = f"{session.session_id}:train:{model_seq_id}"
        spec = LoraSpec(**lora)
        size = self._quotas.adapter_room(session.owner, base_model, spec)
        try:
            self._runs.record(model_id, session.owner, base_model, lora, user_metadata)
        except OSError as e:
            raise RequestError(503, f"could not record training run {model_id}: {e.strerror or e}",
                               "server") from None

        def admitted() -> TrainerState:
            if rec.adapter_bytes == 0:  # its base model was not loaded at the request: admitted here
                self._engine.base(base_model)
                rec.adapter_bytes = self._quotas.adapter_room(session.owner, base_model, spec) or 1
            return start()

        ready: Future = Future()
        rid = self._futures.add(ready, lambda st: {"model_id": st.model_id, "type": "create_model"},
                                owner=session.owner, session_id=session.session_id)
        ops = OrderedOps(functools.partial(self._work.submit, owner=session.owner), self._futures,
                         max_ahead=self._config.max_seq_ahead, owner=session.owner,
                         session_id=session.session_id)
        rec = ModelRecord(model_id, session.session_id, session.owner, base_model, lora, user_metadata, ready,
                          ops, rid, adapter_bytes=size)
        self._models.add(rec)
        chain(self._work.submit(admitted, session.owner), ready)
        session.models.append(model_id)
        ready.add_done_callback(lambda f: self._runs.forget(model_id) if f.exception() is not None else None)
        return rid

    def create_model(self, req: P.CreateModelReq, owner: str) -> dict:
        session = self._sessions.owned(req.session_id, owner)
        model_id = f"{session.session_id}:train:{req.model_seq_id}"
        if (existing := self._models.get(model_id)) is not None:  # a retried POST
            return {"request_id": existing.create_request_id, "model_id": model_id}
        opt_type = self._optimizer(req.optimizer_config)
        base = self._bases.canonical(req.base_model)
        lc = req.lora_config or types.LoraConfig(rank=32)
        if lc.rank < 1:
            raise RequestError(400, f"lora rank must be >= 1, got {lc.rank}")
        if not (lc.train_mlp or lc.train_attn or lc.train_unembed):
            raise RequestError(400, "at least one of train_mlp, train_attn, train_unembed must be true")
        spec = LoraSpec(lc.rank, lc.train_mlp, lc.train_attn, lc.train_unembed, lc.seed)
        rid = self._new_model(session, req.model_seq_id, base, spec.to_dict(), req.user_metadata,
                              lambda: self._engine.create_trainer(model_id, base, spec, opt_type))
        return {"request_id": rid, "model_id": model_id}

    @staticmethod
    def _optimizer(config: dict | None) -> str:
        """The optimizer a new training client is created with (Tinker fixes it for the client's life)."""
        try:
            return optimizer_type(config)
        except ValueError as e:
            raise RequestError(400, str(e)) from None

    async def get_info(self, req: P.ModelReq, owner: str) -> dict:
        rec = self._models.owned(req.model_id, owner)
        if not await wait_done(rec.ready, self._config.long_poll_s):
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
            "optimizer_config": optimizer_config(st.optimizer_type),
        }

    def load_weights(self, req: P.LoadWeightsReq, owner: str) -> dict:
        try:
            meta = self._checkpoints.checkpoint_meta(req.path, owner, req.weights_access_token, loading=True)
            self._bases.canonical(meta["base_model"])
        except RequestError as e:  # into a model: the refusal uses up its seq_id, so later operations run
            if req.model_id is not None and req.seq_id is not None:
                self.refuse_op(req.model_id, req.seq_id, e, owner)
            raise
        path = req.path
        if req.model_id is not None:  # load_state into an existing training client
            rec = self._models.owned(req.model_id, owner)
            if req.seq_id is None:
                raise RequestError(400, "load_weights into a model needs its seq_id")

            def load() -> dict:
                old: TrainerState = rec.ready.result()
                new = self._engine.load_trainer(rec.model_id, path, req.optimizer, old.optimizer_type)
                old.base.delete_adapter(old.adapter)
                done: Future = Future()
                done.set_result(new)
                rec.ready = done
                return {"path": path, "model_id": rec.model_id, "type": "load_weights"}

            return {"request_id": rec.ops.submit(req.seq_id, load, dict), "model_id": rec.model_id}
        if req.session_id is None or req.model_seq_id is None:
            raise RequestError(400, "load_weights needs either model_id and seq_id, "
                                    "or session_id and model_seq_id")
        session = self._sessions.owned(req.session_id, owner)
        model_id = f"{session.session_id}:train:{req.model_seq_id}"
        if (existing := self._models.get(model_id)) is not None:
            return {"request_id": existing.create_request_id, "model_id": model_id}
        source_run = path[len("tinker://"):].split("/")[0]
        user_metadata = req.user_metadata
        if user_metadata is None:
            user_metadata = (self._runs.info(source_run) or {}).get("user_metadata")
        opt_type = self._optimizer(req.optimizer_config)  # unless the checkpoint's optimizer state comes too
        rid = self._new_model(session, req.model_seq_id, meta["base_model"], meta["lora"], user_metadata,
                              lambda: self._engine.load_trainer(model_id, path, req.optimizer, opt_type))
        self._futures.get(rid).to_json = lambda st: {"path": path, "model_id": st.model_id,
                                                    "type": "load_weights"}
        return {"request_id": rid, "model_id": model_id}

    def forward_backward(self, fb: P.ForwardBackwardReq, owner: str) -> dict:
        rec = self._models.owned(fb.model_id, owner)
        loss_fn, config, data, backward = fb.loss_fn, dict(fb.loss_fn_config), fb.data, not fb.forward_only

        def provenance(datums: list[types.Datum]):
            """The datums' provenance against the sequences this model's session recorded."""
            return self._records.resolve(owner, rec.session_id, datums)

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
            return self._engine.forward_backward(rec.ready.result(), data, loss_fn, config, backward,
                                                 provenance)

        new, ahead = rec.ops.accepts(fb.seq_id), fb.seq_id > rec.ops.next_seq
        if new and ahead:
            self._quotas.waiting_room(rec, fb.seq_id, fb.tokens)
        elif new and not rec.ops.waiting:  # one that others wait for is always let in
            self._quotas.in_flight_room(owner, "tokens", fb.tokens)
        rid = rec.ops.submit(fb.seq_id, run, forward_backward_output_json, encode_forward_backward_output)
        if new:
            self._quotas.hold(owner, self._futures.get(rid).future, tokens=fb.tokens)
            if ahead:
                rec.waiting_tokens[fb.seq_id] = fb.tokens
        return {"request_id": rid, "model_id": rec.model_id}

    def refuse_op(self, model_id: str, seq_id: int, error: RequestError, owner: str) -> None:
        """A malformed operation still uses up its seq_id, so the model's later operations need not wait."""
        rec = self._models.get(model_id)
        if rec is not None and rec.owner == owner:
            rec.ops.refuse(seq_id, error)

    def optim_step(self, req: P.OptimStepReq, owner: str) -> dict:
        rec = self._models.owned(req.model_id, owner)
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
            return self._engine.optim_step(rec.ready.result(), params)

        return {"request_id": rec.ops.submit(req.seq_id, run, _json), "model_id": rec.model_id}

    def _checkpoint_name(self, rec: ModelRecord, seq_id: int, name: str) -> str:
        """A name the store accepts and a later load can name again; a bad one uses up ``seq_id``."""
        try:
            return check_id(name, "checkpoint name")
        except RequestError as e:
            rec.ops.refuse(seq_id, e)
            raise

    def save_weights(self, req: P.SaveWeightsReq, owner: str) -> dict:
        rec = self._models.owned(req.model_id, owner)
        name = self._checkpoint_name(rec, req.seq_id, req.path or f"ckpt-{int(time.time() * 1000)}")

        def run() -> dict:
            path = self._engine.save_state(rec.ready.result(), name, req.overwrite, req.user_metadata,
                                           req.ttl_seconds)
            return {"path": path, "type": "save_weights"}

        return self._checkpoints.save(rec, req.seq_id, "weights", name, run, req.overwrite, req.ttl_seconds)

    def save_for_sampler(self, req: P.SaveForSamplerReq, owner: str) -> dict:
        rec = self._models.owned(req.model_id, owner)
        if req.path is not None:
            name = self._checkpoint_name(rec, req.seq_id, req.path)

            def run() -> dict:
                path = self._engine.save_for_sampler(rec.ready.result(), name, req.user_metadata,
                                                     req.ttl_seconds)
                return {"path": path, "type": "save_weights_for_sampler"}

            return self._checkpoints.save(rec, req.seq_id, "sampler_weights", name, run, True,
                                          req.ttl_seconds)
        if req.sampling_session_seq_id is None:
            raise RequestError(400, "save_weights_for_sampler needs a path (name) "
                                    "or a sampling_session_seq_id")
        if req.seq_id in rec.ops.seen:
            return {"request_id": rec.ops.seen[req.seq_id], "model_id": rec.model_id}
        session = self._sessions.owned(rec.session_id, owner)
        sampler_id = f"{session.session_id}:sample:{req.sampling_session_seq_id}"
        snapshot: Future = Future()

        def run() -> dict:
            st: TrainerState = rec.ready.result()
            snapshot.set_result(self._engine.snapshot_sampler(st))
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        rid = rec.ops.submit(req.seq_id, run, dict)
        self._futures.get(rid).future.add_done_callback(
            lambda f: None if snapshot.done()
            else snapshot.set_exception(f.exception() or RuntimeError("no snapshot")))
        self._samplers.add(session, SamplerRecord(sampler_id, session.session_id, owner, rec.base_model, None,
                                                  snapshot, True))
        return {"request_id": rid, "model_id": rec.model_id}

    def save_external(self, req: P.SaveExternalReq, owner: str) -> dict:
        rec = self._models.owned(req.model_id, owner)
        name = self._checkpoint_name(rec, req.seq_id, req.path)
        try:
            age_recipients(req.age_encryption_recipients)  # checked at the request
        except ValueError as e:
            rec.ops.refuse(req.seq_id, error := RequestError(400, str(e)))
            raise error from None

        def run() -> dict:
            path = self._engine.save_external(rec.ready.result(), name, req.ttl_seconds,
                                              req.age_encryption_recipients)
            rows = self._runs.checkpoints(rec.model_id)
            size = sum(c["size_bytes"] or 0 for c in rows if c["tinker_path"] == path)
            return {"path": path, "size_bytes": size, "type": "save_weights_external"}

        return self._checkpoints.save(rec, req.seq_id, "external_weights", name, run, False, req.ttl_seconds)

