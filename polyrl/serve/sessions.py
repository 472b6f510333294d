"""What ``polyrl serve`` keeps per session: the live sessions and the training clients they hold.

Both belong to the API key that made them: a lookup with another key's ``owner`` gets the same "not found"
as an id that never existed. They are stores, not operations: :class:`~polyrl.serve.server.Server` ends a
session (releasing what it holds), :class:`~polyrl.serve.training.Training` runs the training clients'
operations, and :class:`~polyrl.serve.quotas.Quotas` counts what a key holds.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Container, Iterator

from polyrl.serve.protocol import RequestError
from polyrl.serve.runs import paginate
from polyrl.serve.state import ModelRecord, Session

MAX_REMEMBERED_FINISHED = 10_000  # finished session ids kept to answer 410 instead of 404


class Sessions:
    """The live sessions by id, at most ``config.max_sessions`` per key, and the recently finished ones."""

    def __init__(self, config) -> None:
        self._config = config  # read at each call: ``max_sessions``
        self._live: dict[str, Session] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # finished session id -> owner (for 410s)

    def __getitem__(self, session_id: str) -> Session:
        return self._live[session_id]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def create(self, tags: list[str], user_metadata: dict | None, owner: str) -> dict:
        """A new session of ``owner``'s, or a 403 when the key already has ``max_sessions`` live ones."""
        live = sum(s.owner == owner for s in self._live.values())
        limit = self._config.max_sessions
        if live >= limit:
            raise RequestError(403, f"this key has {live} live sessions, the most this server allows per key "
                                    f"(--max-sessions {limit}); close some "
                                    "(ServiceClient.close) or let them time out")
        sid = f"sess-{uuid.uuid4().hex[:12]}"
        self._live[sid] = Session(sid, owner, tags, user_metadata)
        return {"session_id": sid, "type": "create_session"}

    def owned(self, session_id: str, owner: str) -> Session:
        """``owner``'s live session (seen now), or a 410 for one that finished, a 404 for any other id."""
        s = self._live.get(session_id)
        if s is None or s.owner != owner:
            if self._finished.get(session_id) == owner:
                raise RequestError(410, f"session {session_id} has finished")
            raise RequestError(404, f"unknown session_id {session_id!r} "
                                    "(sessions do not survive a server restart)")
        s.last_seen = time.monotonic()
        return s

    def heartbeat(self, session_id: str, owner: str) -> dict:
        s = self._live.get(session_id)
        if s is None or s.owner != owner:
            raise RequestError(410, f"session {session_id!r} is not active")
        s.last_seen = time.monotonic()
        return {"type": "session_heartbeat"}

    def describe(self, session_id: str, owner: str, models: Container[str], samplers: Container[str]) -> dict:
        """Tinker's ``GetSessionResponse``: the live session's training runs (those still in ``models``) and
        samplers (those still in ``samplers``)."""
        s = self.owned(session_id, owner)
        return {"training_run_ids": [m for m in s.models if m in models],
                "sampler_ids": [x for x in s.samplers if x in samplers],
                "user_metadata": {str(k): str(v) for k, v in (s.user_metadata or {}).items()} or None}

    def listing(self, limit: int, offset: int, owner: str) -> dict:
        """The key's live sessions, newest first (a finished one is gone, as its models are)."""
        mine = sorted((s for s in self._live.values() if s.owner == owner), key=lambda s: -s.created)
        return {"sessions": paginate([s.session_id for s in mine], limit, offset)[0]}

    def end(self, session_id: str, owner: str) -> Session | None:
        """Remove ``owner``'s live session and remember it finished; None if it had already finished, a 404
        for any other id."""
        s = self._live.get(session_id)
        if s is None or s.owner != owner:
            if self._finished.get(session_id) == owner:
                return None
            raise RequestError(404, f"unknown session_id {session_id!r}")
        del self._live[session_id]
        self._finished[session_id] = owner
        while len(self._finished) > MAX_REMEMBERED_FINISHED:
            self._finished.popitem(last=False)
        return s

    def idle(self, timeout_s: float, now: float) -> list[Session]:
        """The live sessions that sent nothing for more than ``timeout_s`` seconds."""
        return [s for s in self._live.values() if now - s.last_seen > timeout_s]


class Models:
    """The live training clients by model id (each in its session's ``models`` too)."""

    def __init__(self) -> None:
        self._live: dict[str, ModelRecord] = {}

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def values(self) -> list[ModelRecord]:
        """The records, taken at once (the engine's thread reads them too)."""
        return list(self._live.values())

    def get(self, model_id: str) -> ModelRecord | None:
        """The record of ``model_id``, whoever owns it (for ownership checks)."""
        return self._live.get(model_id)

    def add(self, rec: ModelRecord) -> None:
        self._live[rec.model_id] = rec

    def owned(self, model_id: str, owner: str) -> ModelRecord:
        """``owner``'s training client (its last request now), or a 404."""
        rec = self._live.get(model_id)
        if rec is None or rec.owner != owner:
            raise RequestError(404, f"unknown model_id {model_id!r} (models do not survive a server restart; "
                                    "load a checkpoint instead)")
        rec.last_request = time.time()
        return rec

    def of(self, owner: str) -> list[ModelRecord]:
        """``owner``'s training clients."""
        return [r for r in self.values() if r.owner == owner]

    def release(self, session: Session) -> list[ModelRecord]:
        """Remove the session's training clients; their records."""
        return [self._live.pop(mid) for mid in session.models if mid in self._live]
