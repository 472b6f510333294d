"""Sampling in ``polyrl serve``: sampling sessions (from a base model or a saved checkpoint) and
``asample`` requests, checked against the key's quotas and gathered into the engine's sampling batches
(:class:`~polyrl.serve.state.SampleGate`), bypassing the training clients' ``seq_id`` order.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

from polyrl.local.engine import Engine, SamplerState
from polyrl.local.sampler import SampleJob
from polyrl.local.service import PromptQueries, make_sample_job, record_sequences
from polyrl.local.stability import SequenceRecords, input_positions
from polyrl.serve import protocol as P
from polyrl.serve.protocol import RequestError
from polyrl.serve.quotas import Quotas
from polyrl.serve.sample_wire import encode_sample_response, sample_response_json
from polyrl.serve.sessions import Sessions
from polyrl.serve.state import Futures, SampleGate, SamplerRecord, Session, chain
from polyrl.serve.work import BaseModels, EngineWork

if TYPE_CHECKING:
    from polyrl.serve.lifecycle import Checkpoints


class Samplers:
    """The live sampling clients by id (each in its session's ``samplers`` too, at most
    ``max_samplers_per_session`` of them) and their requests."""

    def __init__(self, config, engine: Engine, work: EngineWork, sessions: Sessions, bases: BaseModels,
                 checkpoints: Checkpoints, quotas: Quotas, futures: Futures, records: SequenceRecords,
                 limits: P.RequestLimits) -> None:
        self._config = config  # read at each call: the limits
        self._engine = engine
        self._work = work
        self._sessions = sessions
        self._bases = bases
        self._checkpoints = checkpoints
        self._quotas = quotas
        self._futures = futures
        self._records = records  # sampled sequences, by key and session (for stable_reinforce)
        self._limits = limits
        self._live: dict[str, SamplerRecord] = {}
        quiet = config.sample_quiet_ms / 1000
        self._gate = SampleGate(work.submit_sample, work.busy, quiet, 3 * quiet, 100 * quiet)

    def __contains__(self, sampler_id: object) -> bool:
        return sampler_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def values(self) -> list[SamplerRecord]:
        return list(self._live.values())

    def release(self, session: Session) -> list[SamplerRecord]:
        """Remove the session's sampling clients; their records."""
        return [self._live.pop(sid) for sid in session.samplers if sid in self._live]

    def add(self, session: Session, rec: SamplerRecord) -> None:
        """Add a sampling client to its session, dropping the session's least recently used ones past
        ``max_samplers_per_session``."""
        self._live[rec.sampler_id] = rec
        session.samplers.append(rec.sampler_id)
        session.samplers = [s for s in session.samplers if s in self._live]
        excess = len(session.samplers) - self._config.max_samplers_per_session
        if excess > 0:  # drop the least recently used, and what their snapshots held in the engine
            dropped = sorted(session.samplers, key=lambda s: self._live[s].last_used)[:excess]
            for sid in dropped:
                session.samplers.remove(sid)
            self._work.release([], [self._live.pop(sid) for sid in dropped], session.owner)

    def create_sampling_session(self, req: P.CreateSamplingSessionReq, owner: str) -> dict:
        session = self._sessions.owned(req.session_id, owner)
        sampler_id = f"{session.session_id}:sample:{req.sampling_session_seq_id}"
        if sampler_id in self._live:
            return {"sampling_session_id": sampler_id}
        if req.model_path is not None:
            meta = self._checkpoints.checkpoint_meta(req.model_path, owner, loading=True)
            base = self._bases.canonical(meta["base_model"])
            path = req.model_path
            ready = self._work.submit(lambda: self._engine.load_sampler(path), owner)
        elif req.base_model is not None:
            base = self._bases.canonical(req.base_model)
            ready = self._work.submit(lambda: SamplerState(self._engine.base(base), None, None), owner)
        else:
            raise RequestError(400, "create_sampling_session needs model_path or base_model")
        self.add(session, SamplerRecord(sampler_id, session.session_id, owner, base, req.model_path,
                                        ready, False))
        return {"sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str, owner: str) -> dict:
        rec = self._live.get(sampler_id)
        if rec is None or rec.owner != owner:
            raise RequestError(404, f"unknown sampler {sampler_id!r}")
        out = {"sampler_id": sampler_id, "base_model": rec.base_model}
        if rec.model_path:
            out["model_path"] = rec.model_path
        return out

    def sample(self, req: P.SampleReq, owner: str) -> dict:
        if req.sampling_session_id is None:
            raise RequestError(400, "asample needs a sampling_session_id "
                                    "(create one with create_sampling_session)")
        rec = self._live.get(req.sampling_session_id)
        if rec is None or rec.owner != owner:
            raise RequestError(404, f"unknown sampling_session_id {req.sampling_session_id!r} "
                                    "(it expired, its session finished, or the server restarted)")
        rec.last_used = time.monotonic()
        if req.seq_id is not None and req.seq_id in rec.seen:
            rid, ids = rec.seen[req.seq_id]
            return {"request_id": rid, "sample_sequence_ids": ids}
        P.check_prompt_images(req.prompt, self._limits)
        n_prompt, cfg = req.prompt.length, self._config
        if n_prompt > cfg.max_request_tokens:
            raise RequestError(400, f"prompt of {n_prompt} tokens is longer than this server takes "
                                    f"({cfg.max_request_tokens}, --max-request-tokens)")
        if req.num_samples > cfg.max_samples_in_flight:
            raise RequestError(400, f"num_samples {req.num_samples} is more than this server lets a key "
                                    f"have in flight ({cfg.max_samples_in_flight}, --max-samples-in-flight); "
                                    "ask in smaller requests")
        decode = req.num_samples * _new_tokens(rec, req.sampling_params.max_tokens, n_prompt)
        if decode > cfg.max_decode_tokens_in_flight:
            raise RequestError(400, f"{req.num_samples} samples of up to {decode // req.num_samples} tokens "
                                    "are more than this server lets a key decode at once "
                                    f"({cfg.max_decode_tokens_in_flight} tokens, "
                                    "--max-decode-tokens-in-flight); ask for fewer samples or a lower "
                                    "max_tokens")
        self._quotas.in_flight_room(owner, "samples", req.num_samples)
        self._quotas.in_flight_room(owner, "tokens", n_prompt)
        self._quotas.in_flight_room(owner, "decode", decode)
        ids = [uuid.uuid4().hex for _ in range(req.num_samples)]
        out: Future = Future()
        self._quotas.hold(owner, out, tokens=n_prompt, samples=req.num_samples, decode=decode)
        rid = self._futures.add(out, lambda r: sample_response_json(r, ids), encode_sample_response,
                                owner=owner, session_id=rec.session_id)
        done = out
        if req.record_stability_info:  # recorded (under the ids the client has) before the result is out
            done = Future()
            prompt = input_positions(req.prompt)
            chain(done, out, lambda r: record_sequences(self._records, owner, rec.session_id, prompt, r, ids))
        if req.seq_id is not None:
            rec.seen[req.seq_id] = (rid, ids)
            if len(rec.seen) > 8192:  # retries only ever repeat recent requests
                for seq in list(rec.seen)[:4096]:
                    del rec.seen[seq]
        loop_add = functools.partial(self._gate.add, owner=owner)

        loop = asyncio.get_running_loop()

        def prepare(state: SamplerState) -> SampleJob:
            target = None
            if req.target_prompt_logprobs is not None:
                target = P.tensor_from_json(req.target_prompt_logprobs, "target_prompt_logprobs",
                                            self._limits.max_values)
            queries = PromptQueries(req.topk_prompt_logprobs, req.topk_sample_logprobs, target,
                                    req.prompt_alt_tokens_k, req.prompt_logprobs_last_n)
            return make_sample_job(state.base, req.prompt, req.num_samples, req.sampling_params,
                                   bool(req.prompt_logprobs), queries=queries, max_k=cfg.max_target_k)

        def start(state: SamplerState) -> None:
            if any(c.type == "image" for c in req.prompt.chunks):  # decoding images: off the event loop
                def prepared(f: asyncio.Future) -> None:
                    if f.exception() is not None:
                        out.set_exception(f.exception())
                    else:
                        loop_add(state, f.result(), done)

                loop.run_in_executor(None, prepare, state).add_done_callback(prepared)
                return
            try:
                job = prepare(state)
            except (ValueError, RequestError) as e:
                out.set_exception(e)
                return
            loop_add(state, job, done)

        if rec.ready.done():
            if rec.ready.exception() is not None:
                out.set_exception(rec.ready.exception())
            else:
                start(rec.ready.result())
        else:
            def when_ready(f: Future) -> None:
                if f.exception() is not None:
                    out.set_exception(f.exception())
                else:
                    loop.call_soon_threadsafe(start, f.result())

            rec.ready.add_done_callback(when_ready)
        return {"request_id": rid, "sample_sequence_ids": ids}


UNKNOWN_CONTEXT_TOKENS = 4096  # a sample's tokens when neither max_tokens nor the model's context is known


def _new_tokens(rec: SamplerRecord, max_tokens: int | None, prompt: int) -> int:
    """The most tokens one sample of a request may decode: ``max_tokens``, within the model's context (the
    engine stops there)."""
    context = None
    if rec.ready.done() and rec.ready.exception() is None:
        context = rec.ready.result().base.max_context_length
    if context is None:
        return max(1, max_tokens or UNKNOWN_CONTEXT_TOKENS)
    room = max(1, context - prompt)
    return min(max_tokens or room, room)
