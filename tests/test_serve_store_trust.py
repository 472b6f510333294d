"""What the checkpoint store shows and keeps when several keys share ``polyrl serve``: another key sees only
the published part of a run; a signed download URL serves only the exact checkpoint, in the publication
state, it was issued for; no answer names a server path; a refused save is logged. And what the store does
with a crash's leftovers and with an expiry decided while a save lands."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker
from test_serve import KEY, OTHER_KEY, Served, _retrieve
from tinker import types
from tinker._client import AsyncTinker

from polyrl.local import checkpoints
from polyrl.local.checkpoints import CheckpointPath, Store

OLD = "2000-01-01T00:00:00+00:00"  # an expires_at long past
# A path rooted at '/': a '/' that starts a word and is followed by a directory (a tinker:// path's
# slashes follow ':', '/' or a letter)
ROOTED = re.compile(r"(?<![\w:/.<])/[\w.%~-]+/")


def _writer(payload: bytes):
    def write(d: Path) -> None:
        (d / "adapter_model.safetensors").write_bytes(payload)
        (d / "adapter_config.json").write_text("{}")
    return write


def _old(path: Path) -> None:
    """Make ``path`` and the files in it look untouched for an hour."""
    then = time.time() - 3600
    for p in [*path.iterdir(), path]:
        os.utime(p, (then, then))


def _stale_temp(kind_dir: Path, name: str, size: int, stale: bool) -> Path:
    d = kind_dir / name
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"x" * size)
    if stale:
        _old(d)
    return d


# ------------------------------------------------------------------------------------ the store alone
@pytest.mark.parametrize("call", ["sweep", "resolve", "list"])
def test_an_expiry_decided_before_an_overwrite_lands_removes_nothing_new(tmp_path, monkeypatch, call):
    """The overwrite lands between the decision "expired" and the removal (a hook in ``expired``, the
    decision itself): the new checkpoint stays, whole."""
    store = Store(tmp_path)
    cp = CheckpointPath("run:train:0", "sampler_weights", "s")
    store.write(cp, _writer(b"old"), {"base_model": "m"}, True, ttl_seconds=3600)
    store._update_meta(store.directory(cp), expires_at=OLD)
    real, landed = checkpoints.expired, []

    def expired_then_overwritten(meta, now=None):
        verdict = real(meta, now)
        if verdict and not landed:
            landed.append(store.write(cp, _writer(b"new"), {"base_model": "m"}, True))
        return verdict

    monkeypatch.setattr(checkpoints, "expired", expired_then_overwritten)
    store._swept_at = time.monotonic()  # the overwrite's own occasional sweep is not what is tested
    if call == "sweep":
        store.sweep()
    elif call == "resolve":  # what is there now is the new one, not expired
        assert store.resolve(str(cp))[1] == store.directory(cp)
    else:
        store.list(cp.run_id)
    assert landed
    _, d = store.resolve(str(cp))
    assert (d / "adapter_model.safetensors").read_bytes() == b"new"


def test_temporary_directories_count_toward_the_cap_and_abandoned_ones_make_room(tmp_path):
    store = Store(tmp_path)
    cp = CheckpointPath("run:train:0", "weights", "w")
    store.write(cp, _writer(b"w" * 100), {"base_model": "m"})
    held = store.used_bytes()
    temp = _stale_temp(store.directory(cp).parent, ".tmp-new-0123abcd-w2", 1000, stale=False)
    assert store.used_bytes() == held + 1000
    capped, third = Store(tmp_path, max_bytes=held + 1100), CheckpointPath("run:train:0", "weights", "w3")
    with pytest.raises(tinker.PermissionDeniedError, match="cap"):  # a save under way is kept, and counted
        capped.write(third, _writer(b"y" * 200), {"base_model": "m"})
    _old(temp)  # abandoned: the sweep of a save past the cap removes it
    capped.write(third, _writer(b"y" * 200), {"base_model": "m"})
    assert not temp.exists() and capped.exists(third)


def test_an_incomplete_checkpoint_is_absent_counted_and_reclaimed_by_the_sweep(tmp_path):
    store = Store(tmp_path)
    run = "run:train:0"
    no_weights, no_meta, whole = (CheckpointPath(run, "weights", n)
                                  for n in ("no-weights", "no-meta", "whole"))
    for cp in (no_weights, no_meta, whole):
        store.write(cp, _writer(b"z" * 100), {"base_model": "m"})
    (store.directory(no_weights) / "adapter_model.safetensors").unlink()
    (store.directory(no_meta) / "polyrl.json").unlink()
    left = {cp.name: sum(f.stat().st_size for f in store.directory(cp).iterdir())
            for cp in (no_weights, no_meta, whole)}
    assert [r["checkpoint_id"] for r in store.list(run)] == ["weights/whole"]
    with pytest.raises(tinker.NotFoundError, match="not found") as missing:
        store.resolve(str(no_weights))
    assert str(tmp_path) not in str(missing.value)
    assert not store.exists(no_weights)
    assert store.used_bytes() == sum(left.values())  # what is left of both is still counted ...
    store.sweep()  # ... until the sweep reclaims it
    assert not store.directory(no_weights).exists() and not store.directory(no_meta).exists()
    assert store.exists(whole) and store.used_bytes() == left["whole"]
    store.write(no_weights, _writer(b"again"), {"base_model": "m"})  # the name is free again
    assert store.exists(no_weights)


# --------------------------------------------------------------------------------------- polyrl serve
LEFTOVER_RUN = "left:train:0"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """A server whose store holds a crash's leftovers when it starts: an abandoned temporary directory
    (untouched for an hour), one being written right now, and a checkpoint whose ``polyrl.json`` is gone."""
    store = tmp_path_factory.mktemp("trust-store")
    seed = Store(store)
    kind_dir = seed.run_directory(LEFTOVER_RUN) / "weights"
    seed.write(CheckpointPath(LEFTOVER_RUN, "weights", "kept"), _writer(b"k" * 100), {"base_model": "m"})
    seed.write(CheckpointPath(LEFTOVER_RUN, "weights", "metaless"), _writer(b"m" * 100), {"base_model": "m"})
    (kind_dir / "metaless" / "polyrl.json").unlink()
    _stale_temp(kind_dir, ".tmp-new-0123abcd-abandoned", 1000, stale=True)
    _stale_temp(kind_dir, ".tmp-new-89abcdef-writing", 1000, stale=False)
    s = Served(tiny_model_dir, store, "--long-poll", "1", "--sweep-interval", "3600")
    s.store = store
    s.leftovers = kind_dir
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mine(served, tiny_model_dir):
    """KEY's training client, its run holding private user metadata."""
    return served.sdk(KEY).create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0,
                                                       user_metadata={"secret": "hush"}).result()


@pytest.fixture(scope="module")
def theirs(served, tiny_model_dir):
    """OTHER_KEY's training client."""
    return served.sdk(OTHER_KEY).create_lora_training_client(base_model=tiny_model_dir, rank=4,
                                                             seed=1).result()


def _rest(served, key: str = KEY) -> tinker.RestClient:
    return tinker.RestClient(base_url=served.url, api_key=key)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _no_server_path(served, body: str) -> None:
    assert str(served.store) not in body and str(Path(served.store).resolve()) not in body, body
    assert not ROOTED.search(body), body


def test_the_server_start_reclaims_a_crashs_leftovers_and_keeps_what_is_being_written(served):
    left = {p.name for p in served.leftovers.iterdir()}
    assert left == {"kept", ".tmp-new-89abcdef-writing"}


def test_another_key_sees_only_the_published_part_of_a_run(served, mine):
    published = mine.save_state("published").result().path
    private = mine.save_state("private-later").result().path
    mine.save_weights_for_sampler("private-sampler").result()
    rest, other = _rest(served), _rest(served, OTHER_KEY)
    rest.publish_checkpoint_from_tinker_path(published).result()

    run = other.get_training_run(mine.model_id, access_scope="accessible").result()
    listed = {r.training_run_id: r for r in
              other.list_training_runs(access_scope="accessible", limit=1000).result().training_runs}
    for seen in (run, listed[mine.model_id]):
        assert seen.user_metadata in (None, {})
        assert seen.last_checkpoint is not None and seen.last_checkpoint.tinker_path == published
        assert seen.last_sampler_checkpoint is None
        assert seen.lora_rank == 4
    own = rest.get_training_run(mine.model_id).result()  # the owner sees everything
    assert own.user_metadata == {"secret": "hush"}
    assert own.last_checkpoint.tinker_path == private
    assert own.last_sampler_checkpoint.tinker_path.endswith("/private-sampler")
    rest.unpublish_checkpoint_from_tinker_path(published).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(mine.model_id, access_scope="accessible").result()


def test_a_signed_url_serves_only_the_checkpoint_and_publication_it_was_issued_for(served, theirs):
    owner_rest, reader_rest = _rest(served, OTHER_KEY), _rest(served, KEY)
    path = theirs.save_weights_external("shared").result().path
    owner_rest.publish_checkpoint_from_tinker_path(path).result()
    readers = reader_rest.get_external_weights_urls(path).result().urls
    assert {_status(u) for u in readers.values()} == {200}

    # deleted, and a new private one saved under the same name: the reader's URLs are dead
    owner_rest.delete_checkpoint_from_tinker_path(path).result()
    assert theirs.save_weights_external("shared").result().path == path
    assert {_status(u) for u in readers.values()} == {404}
    owners = owner_rest.get_external_weights_urls(path).result().urls
    assert {_status(u) for u in owners.values()} == {200}

    # published again: a reader's new URL works until the checkpoint is unpublished
    owner_rest.publish_checkpoint_from_tinker_path(path).result()
    readers = reader_rest.get_external_weights_urls(path).result().urls
    assert {_status(u) for u in readers.values()} == {200}
    owner_rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert {_status(u) for u in readers.values()} == {404}
    owner_rest.publish_checkpoint_from_tinker_path(path).result()  # a new publication, not the old one
    assert {_status(u) for u in readers.values()} == {404}
    assert {_status(u) for u in owners.values()} == {200}  # the owner's own URLs were never a reader's


def test_no_answer_names_a_server_path(served, mine, theirs):
    http = served.http
    run = mine.model_id
    # REST on a checkpoint of one's own run that was never saved
    one = f"/training_runs/{run}/checkpoints/weights/never-saved"
    external = f"/training_runs/{run}/checkpoints/external_weights/never-saved"
    answers = [http.put(one + "/ttl", json={"ttl_seconds": 60}), http.post(one + "/publish", json={}),
               http.get(external + "/external_weights_urls")]
    # a signed URL whose checkpoint was deleted
    gone = theirs.save_weights_external("gone").result().path
    url = _rest(served, OTHER_KEY).get_external_weights_urls(gone).result().urls["adapter_config.json"]
    _rest(served, OTHER_KEY).delete_checkpoint_from_tinker_path(gone).result()
    import httpx

    answers.append(httpx.get(url))
    # loads of a checkpoint that a crash half removed (its weights file gone)
    broken = mine.save_weights_for_sampler("half-removed").result().path
    directory = Store(served.store).directory(CheckpointPath.parse(broken))
    (directory / "adapter_model.safetensors").unlink()
    session = http.post("/create_session", json={"tags": []}).json()["session_id"]
    answers.append(http.post("/create_sampling_session", json={"session_id": session,
                                                               "sampling_session_seq_id": 0,
                                                               "model_path": broken}))
    answers.append(http.post("/load_weights", json={"path": broken, "session_id": session,
                                                    "model_seq_id": 0}))
    for r in answers:
        assert r.status_code == 404, (r.request.url, r.status_code, r.text)
        assert r.json()["category"] == "user" and "not found" in r.json()["error"], r.text
        _no_server_path(served, r.text)
    assert broken not in {c.tinker_path for c in _rest(served).list_checkpoints(run).result().checkpoints}


def test_a_file_system_error_in_an_answer_names_no_server_file():
    """What the engine's worker raises reaches the client as the future's error: an OSError's reason only."""
    from polyrl.serve.state import error_body

    body = error_body(FileNotFoundError(2, "No such file or directory", "/srv/store/run/weights/x/f"))
    assert body == {"error": "FileNotFoundError: No such file or directory", "category": "server"}


def _stderr_until(served: Served, needle: str, deadline_s: float = 30) -> str:
    """What the server wrote to its stderr, read without blocking until it holds ``needle``."""
    fd = served.proc.stderr.fileno()
    os.set_blocking(fd, False)
    seen, deadline = b"", time.monotonic() + deadline_s
    while needle.encode() not in seen and time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk:
            seen += chunk
        else:
            time.sleep(0.05)
    return seen.decode(errors="replace")


def test_a_refused_save_is_logged_once(served, tiny_model_dir):
    http = served.http
    session = http.post("/create_session", json={"tags": []}).json()["session_id"]
    model_id = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                "base_model": tiny_model_dir,
                                                "lora_config": {"rank": 4}}).json()["model_id"]
    saved = http.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "taken"}).json()
    assert _retrieve(served, saved["request_id"])["path"].endswith("/weights/taken")

    async def save_taken() -> None:  # with the SDK's own client, without its retries (5 minutes of 409s)
        raw = AsyncTinker(base_url=served.url, api_key=KEY, max_retries=0)
        request = types.SaveWeightsRequest(model_id=model_id, path="taken", seq_id=2)
        for _ in range(2):  # the same request twice: one refused save
            with pytest.raises(tinker.ConflictError):
                await raw.weights.save(request=request)

    asyncio.run(save_taken())
    logged = _stderr_until(served, "/weights/taken")
    lines = [line for line in logged.splitlines() if "/weights/taken" in line]
    assert len(lines) == 1, logged
    assert "warning" in lines[0].lower() and model_id in lines[0] and "exists" in lines[0], lines
