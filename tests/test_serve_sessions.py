"""``polyrl serve``'s session and training-client stores on their own: each key sees only its own, a
finished session answers 410 to its key and 404 to others, and a key's live sessions are capped."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from polyrl.serve.protocol import RequestError
from polyrl.serve.sessions import Models, Sessions
from polyrl.serve.state import ModelRecord


def _status(fn, *args) -> int:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value.status


def test_sessions_belong_to_their_key_and_end_once():
    sessions = Sessions(SimpleNamespace(max_sessions=2))
    first = sessions.create(["t"], {"k": 1}, "alice")["session_id"]
    second = sessions.create([], None, "alice")["session_id"]
    theirs = sessions.create([], None, "bob")["session_id"]
    with pytest.raises(RequestError, match="--max-sessions 2") as full:
        sessions.create([], None, "alice")
    assert full.value.status == 403
    assert sessions.owned(first, "alice").tags == ["t"]
    assert _status(sessions.owned, theirs, "alice") == 404  # another key's is as unknown as a made-up id
    assert set(sessions.listing(10, 0, "alice")["sessions"]) == {first, second}

    session = sessions.owned(first, "alice")
    session.models.append("m")
    session.samplers.extend(["gone", "s"])
    assert sessions.describe(first, "alice", {"m"}, {"s"}) == {
        "training_run_ids": ["m"], "sampler_ids": ["s"], "user_metadata": {"k": "1"}}

    assert _status(sessions.end, theirs, "alice") == 404
    assert sessions.end(first, "alice") is session
    assert sessions.end(first, "alice") is None  # finished already: nothing to do
    assert first not in sessions and len(sessions) == 2
    assert _status(sessions.owned, first, "alice") == 410
    assert _status(sessions.owned, first, "bob") == 404
    assert _status(sessions.heartbeat, first, "alice") == 410
    sessions.create([], None, "alice")  # room again


def test_idle_sessions_are_those_past_the_timeout():
    sessions = Sessions(SimpleNamespace(max_sessions=10))
    quiet, busy = (sessions.create([], None, "a")["session_id"] for _ in range(2))
    now = sessions[busy].last_seen + 100
    sessions[quiet].last_seen -= 1
    assert [s.session_id for s in sessions.idle(100.5, now)] == [quiet]


def test_models_belong_to_their_key():
    models = Models()

    def record(model_id: str, owner: str) -> ModelRecord:
        return ModelRecord(model_id, "sess", owner, "base", {}, None, Future(), None, "rid")  # type: ignore[arg-type]

    mine, theirs = record("sess:train:0", "alice"), record("sess:train:1", "bob")
    models.add(mine)
    models.add(theirs)
    assert models.owned("sess:train:0", "alice") is mine
    assert _status(models.owned, "sess:train:1", "alice") == 404
    assert models.of("alice") == [mine] and len(models) == 2
    session = SimpleNamespace(models=["sess:train:0", "sess:train:9"])
    assert models.release(session) == [mine]  # type: ignore[arg-type]
    assert "sess:train:0" not in models and models.get("sess:train:1") is theirs
