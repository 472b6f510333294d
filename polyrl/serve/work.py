"""The local engine as ``polyrl serve`` shares it between keys: its work queue (:class:`EngineWork`) and the
base models it serves (:class:`BaseModels`)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

from polyrl.local import losses
from polyrl.local.allocator import give_back_free_memory
from polyrl.local.engine import Engine, SamplerState
from polyrl.local.model import resolve_model_path
from polyrl.serve.protocol import RequestError
from polyrl.serve.state import ModelRecord, Outstanding, SamplerRecord

log = logging.getLogger("polyrl.serve")


class EngineWork:
    """Each key's work on the engine (keys take turns there), tracked until it is done: while none is,
    the engine is idle (:class:`~polyrl.serve.state.SampleGate` holds sampling requests back only then)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._outstanding = Outstanding()

    def busy(self) -> bool:
        """Whether any work submitted here is not done yet."""
        return bool(self._outstanding)

    def submit(self, fn, owner: str) -> Future:
        """Run ``fn`` on the engine as ``owner``'s work."""
        return self._outstanding.track(self._engine.submit(fn, owner))

    def submit_sample(self, state: SamplerState, job, owner: str) -> Future:
        """Sample ``job`` with ``state`` in the engine's next sampling batch, as ``owner``'s work."""
        return self._outstanding.track(self._engine.submit_sample(state, job, owner))

    def release(self, models: list[ModelRecord], samplers: list[SamplerRecord], owner: str) -> None:
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
            self._engine.submit(free, owner)


class BaseModels:
    """The base models served: ``names`` (any spelling of each: a directory by its real path too), or, with
    none, any model the engine can load."""

    def __init__(self, names: list[str], engine: Engine) -> None:
        self._engine = engine
        self._served: dict[str, str] = {}  # any spelling of a served model -> its canonical name
        for name in names:
            expanded = os.path.expanduser(name)
            canonical = os.path.realpath(expanded) if os.path.isdir(expanded) else name
            self._served[name] = self._served[canonical] = canonical

    def preload(self) -> None:
        """Load every served model (its tokenizer too) before the first request."""
        for name in dict.fromkeys(self._served.values()):
            self._engine.call(lambda n=name: self._engine.base(n).tokenizer)
            log.info("loaded %s", name)

    def canonical(self, name: str) -> str:
        """The canonical name of a served base model, or a 400 listing the served ones."""
        if not isinstance(name, str) or not name:
            raise RequestError(400, "base_model is required")
        if not self._served:
            try:
                resolve_model_path(name)
            except ValueError as e:
                raise RequestError(400, str(e)) from None
            return name
        expanded = os.path.expanduser(name)
        canonical = self._served.get(name) or (self._served.get(os.path.realpath(expanded))
                                               if os.path.isdir(expanded) else None)
        if canonical is None:
            raise RequestError(400, f"base model {name!r} is not served here; "
                                    f"served: {sorted(set(self._served.values()))}")
        return canonical

    def capabilities(self) -> dict:
        loaded = {m.name: m for m in self._engine.loaded_models()}
        names = list(dict.fromkeys([*self._served.values(), *loaded]))
        return {
            "supported_models": [
                {"model_name": n, "max_context_length": loaded[n].max_context_length if n in loaded else None,
                 "trainable": True, "sampleable": True}
                for n in names
            ],
            "supported_loss_fns": sorted(losses.LOSSES),
        }


def _result(future: Future) -> Any:
    """A done future's result, or None while it runs or when it failed."""
    return future.result() if future.done() and future.exception() is None else None
