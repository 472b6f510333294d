"""The checkpoint lifecycle (TTLs and expiry, publishing, copies, external weights and their download, the
store's size cap) and Tinker's error semantics: on the in-process clients (``polyrl.local``) and through
``polyrl serve`` with the official SDK, tinker-cookbook, and a client written as the Minds RL runner's."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker
from safetensors.torch import load_file
from test_serve import KEY, OTHER_KEY, Served, _datum, _retrieve, _tokens
from tinker import types
from tinker._client import AsyncTinker

from polyrl.errors import CheckpointWriteError
from polyrl.local import ServiceClient
from polyrl.local.checkpoints import CheckpointPath, Store


def _wait_until(deadline: float) -> None:
    while time.time() <= deadline:
        time.sleep(0.05)


def _rows(rest, run_id: str) -> dict[str, types.Checkpoint]:
    return {c.tinker_path: c for c in rest.list_checkpoints(run_id).result(timeout=60).checkpoints}


def _expires_in(row: types.Checkpoint, ttl: float, saved_at: float) -> None:
    """``row.expires_at`` is ``ttl`` seconds after the save (which took place after ``saved_at``)."""
    assert row.expires_at is not None
    at = row.expires_at.timestamp()
    assert saved_at + ttl - 1 <= at <= time.time() + ttl + 1, (row.expires_at, saved_at)


def _adapter(directory: Path) -> dict:
    return load_file(directory / "adapter_model.safetensors")


def _same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert (a[k] == b[k]).all(), k


# ------------------------------------------------------------------------------ the in-process clients
@pytest.fixture
def local(tiny_model_dir, tmp_path):
    sc = ServiceClient(store_dir=tmp_path / "store", device="cpu", project_id="proj")
    tc = sc.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    return sc, tc, sc.create_rest_client(), Store(tmp_path / "store")


def test_local_ttl_is_listed_then_the_expired_checkpoint_is_listed_as_expired_once_then_gone(local):
    sc, tc, rest, store = local
    saved_at = time.time()
    state = tc.save_state("short", ttl_seconds=2).result().path
    sampler = tc.save_weights_for_sampler("short", ttl_seconds=2).result().path
    kept = tc.save_state("kept").result().path
    rows = _rows(rest, tc.model_id)
    assert rows[kept].expires_at is None
    for path in (state, sampler):
        _expires_in(rows[path], 2, saved_at)
    _wait_until(max(rows[state].expires_at, rows[sampler].expires_at).timestamp())

    expired = _rows(rest, tc.model_id)  # listed once more, as expired ...
    assert {state, sampler} <= expired.keys()
    assert all(expired[p].expires_at.timestamp() <= time.time() for p in (state, sampler))
    assert _rows(rest, tc.model_id).keys() == {kept}  # ... then gone
    for path in (state, sampler):
        assert not store.directory(CheckpointPath.parse(path)).exists()
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path=sampler).result()
    # one that nobody lists is removed by access, and by the sweep saves run now and then
    other = tc.save_weights_for_sampler("unlisted", ttl_seconds=1).result().path
    again = tc.save_weights_for_sampler("unlisted-2", ttl_seconds=1).result().path
    _wait_until(time.time() + 1)
    with pytest.raises(tinker.NotFoundError, match="expired"):
        sc.create_sampling_client(model_path=other).result()
    assert not store.directory(CheckpointPath.parse(other)).exists()
    assert store.directory(CheckpointPath.parse(again)).exists()
    assert store.sweep() == [again] and not store.directory(CheckpointPath.parse(again)).exists()


def test_local_clients_raise_the_sdks_exception_types(local, tiny_model_dir):
    """What the SDK raises for a status, the in-process clients raise too (each a ValueError, as before)."""
    sc, tc, rest, _ = local
    tc.save_state("a").result()
    with pytest.raises(tinker.ConflictError, match="already exists") as conflict:
        tc.save_state("a").result()
    assert isinstance(conflict.value, ValueError) and conflict.value.status_code == 409
    assert tc.save_state("a", overwrite=True).result().path.endswith("/weights/a")
    missing = f"tinker://{tc.model_id}/sampler_weights/none"
    for call in (lambda: sc.create_sampling_client(model_path=missing).result(),
                 lambda: sc.create_training_client_from_state(missing.replace("sampler_", "")).result(),
                 lambda: rest.delete_checkpoint_from_tinker_path(missing).result(),
                 lambda: rest.get_training_run("nobody:train:0").result()):
        with pytest.raises(tinker.NotFoundError) as err:
            call()
        assert isinstance(err.value, ValueError) and err.value.status_code == 404
    for ttl in (0, -5, 11 * 365 * 24 * 3600, 1.5):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            tc.save_state(f"ttl-{ttl}", ttl_seconds=ttl).result()
    assert not any("ttl-" in p for p in _rows(rest, tc.model_id))
    path = tc.save_weights_for_sampler("s").result().path
    rest.publish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.ConflictError, match="already public"):
        rest.publish_checkpoint_from_tinker_path(path).result()
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.ConflictError, match="already private"):
        rest.unpublish_checkpoint_from_tinker_path(path).result()


CHECKPOINT_METHODS = [  # the SDK RestClient's training-run and checkpoint methods (the rest need a service)
    "get_server_capabilities", "get_training_run", "get_training_run_by_tinker_path",
    "get_weights_info_by_tinker_path", "list_training_runs", "list_checkpoints", "list_user_checkpoints",
    "get_external_weights_urls", "delete_checkpoint", "delete_checkpoint_from_tinker_path", "copy_weights",
    "publish_checkpoint_from_tinker_path", "unpublish_checkpoint_from_tinker_path",
    "set_checkpoint_ttl_from_tinker_path",
]


def test_local_rest_client_has_the_sdks_checkpoint_and_training_run_methods(local, tmp_path):
    from polyrl.local import RestClient

    sdk_methods = {n for n, _ in inspect.getmembers(tinker.RestClient, inspect.isfunction)
                   if not n.startswith("_")}
    assert set(CHECKPOINT_METHODS) <= sdk_methods
    for name in CHECKPOINT_METHODS:
        ours = list(inspect.signature(getattr(RestClient, name)).parameters)
        theirs = list(inspect.signature(getattr(tinker.RestClient, name)).parameters)
        assert ours == theirs, name
        if f"{name}_async" in sdk_methods:
            assert hasattr(RestClient, f"{name}_async"), name

    sc, tc, rest, store = local
    state = tc.save_state("st", user_metadata={"k": "v"}).result().path
    sampler = tc.save_weights_for_sampler("sa").result().path
    assert tc.load_state_with_optimizer(state).result().path == state
    assert tc.load_state(state).result().path == state
    run = rest.get_training_run(tc.model_id).result()
    assert (run.lora_rank, run.last_checkpoint.tinker_path, run.last_sampler_checkpoint.tinker_path) == \
        (4, state, sampler)
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    assert rest.get_weights_info_by_tinker_path(sampler).result().lora_rank == 4
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [tc.model_id]
    page = rest.list_user_checkpoints(limit=1, offset=1).result()
    assert len(page.checkpoints) == 1 and page.cursor.total_count == 2

    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    _expires_in(_rows(rest, tc.model_id)[state], 3600, time.time() - 1)
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    assert _rows(rest, tc.model_id)[state].expires_at is None

    # copies: in a new run of the destination project, files linked (not duplicated), ttl not inherited
    with pytest.raises(ValueError, match="destination_project_id"):
        RestClient(sc.engine).copy_weights(state)
    copy = sc.copy_weights(state, ttl_seconds=3600).result()
    copy_run = CheckpointPath.parse(copy).run_id
    assert copy_run != tc.model_id and copy.endswith("/weights/st")
    original, copied = (store.resolve(p)[1] / "adapter_model.safetensors" for p in (state, copy))
    assert original.stat().st_ino == copied.stat().st_ino
    assert [r.training_run_id for r in rest.list_training_runs(project_id="proj").result().training_runs] == \
        [copy_run]
    rest.delete_checkpoint(tc.model_id, "weights/st").result()
    assert sc.create_training_client_from_state(copy).result().get_info().lora_rank == 4

    # external weights: file:// URLs that urllib fetches, plain or age-encrypted
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    plain = tc.save_weights_external("plain").result().path
    recipient = str(identity.to_public())
    sealed = tc.save_weights_external("sealed", age_encryption_recipients=[recipient]).result().path
    with pytest.raises(ValueError, match="external weights"):
        rest.get_external_weights_urls(sampler)
    urls = rest.get_external_weights_urls(plain).result()
    assert set(urls.urls) == {"adapter_model.safetensors", "adapter_config.json"}
    out = tmp_path / "dl"
    out.mkdir()
    for name, url in urls.urls.items():
        urllib.request.urlretrieve(url, out / name)
    _same_tensors(_adapter(out), _adapter(store.resolve(sampler)[1]))
    sealed_urls = rest.get_external_weights_urls(sealed).result().urls
    assert set(sealed_urls) == {"adapter_model.safetensors.age", "adapter_config.json.age"}
    urllib.request.urlretrieve(sealed_urls["adapter_model.safetensors.age"], out / "sealed.age")
    pyrage.decrypt_file(str(out / "sealed.age"), str(out / "sealed.safetensors"), [identity])
    assert (out / "sealed.safetensors").read_bytes() == (out / "adapter_model.safetensors").read_bytes()
    with pytest.raises(tinker.BadRequestError, match="external weights"):
        sc.create_sampling_client(model_path=plain).result()
    with pytest.raises(tinker.BadRequestError, match="age recipient"):
        tc.save_weights_external("bad", age_encryption_recipients=["not-a-key"]).result()
    with pytest.raises(tinker.ConflictError):
        tc.save_weights_external("plain").result()


def test_local_store_size_cap_refuses_a_save_and_keeps_nothing_of_it(tiny_model_dir, tmp_path):
    probe = ServiceClient(store_dir=tmp_path / "probe", device="cpu")
    tc = probe.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    probed = Store(tmp_path / "probe").resolve(tc.save_weights_for_sampler("x").result().path)[1]
    one = sum(f.stat().st_size for f in probed.iterdir())  # a sampler checkpoint's bytes

    sc = ServiceClient(store_dir=tmp_path / "store", device="cpu", max_store_bytes=int(2.5 * one))
    tc = sc.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    first = tc.save_weights_for_sampler("one").result().path
    tc.save_weights_for_sampler("two").result()
    with pytest.raises(tinker.PermissionDeniedError, match="does not fit the store's cap") as full:
        tc.save_weights_for_sampler("three").result()
    assert isinstance(full.value, CheckpointWriteError)
    store = Store(tmp_path / "store")
    assert store.used_bytes() <= int(2.5 * one)
    assert not store.directory(CheckpointPath(tc.model_id, "sampler_weights", "three")).exists()
    kind_dir = store.directory(CheckpointPath.parse(first)).parent
    assert not any(p.name.startswith(".tmp") for p in kind_dir.iterdir())
    sc.create_rest_client().delete_checkpoint_from_tinker_path(first).result()
    assert tc.save_weights_for_sampler("three").result().path.endswith("/three")


# ------------------------------------------------------------------------------------- polyrl serve
@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """No periodic sweep while these tests run (an expired checkpoint is listed as expired first), and a
    small in-flight sample limit to reach a 429."""
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("lifecycle-store"), "--long-poll", "1",
               "--sweep-interval", "3600", "--max-samples-in-flight", "8")
    s.store = Path(s.proc.args[s.proc.args.index("--store-dir") + 1])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def training(sdk, tiny_model_dir):
    return sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()


def _rest(served, key: str = KEY) -> tinker.RestClient:
    return tinker.RestClient(base_url=served.url, api_key=key)


def _raw(served, key: str = KEY) -> AsyncTinker:
    """The SDK's own HTTP client without its retries: the status a request gets, as the SDK's exception."""
    return AsyncTinker(base_url=served.url, api_key=key, max_retries=0)


def test_serve_ttl_is_listed_then_the_expired_checkpoint_is_listed_as_expired_once_then_gone(served, sdk,
                                                                                              training):
    rest = _rest(served)
    saved_at = time.time()
    state = training.save_state("ttl-state", ttl_seconds=2).result().path
    sampler = training.save_weights_for_sampler("ttl-sampler", ttl_seconds=2).result().path
    kept = training.save_state("ttl-kept").result().path
    rows = _rows(rest, training.model_id)
    assert rows[kept].expires_at is None
    for path in (state, sampler):
        _expires_in(rows[path], 2, saved_at)
    assert {state, sampler} <= {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    _wait_until(max(rows[state].expires_at, rows[sampler].expires_at).timestamp())

    expired = _rows(rest, training.model_id)
    assert {state, sampler} <= expired.keys()
    assert all(expired[p].expires_at.timestamp() <= time.time() for p in (state, sampler))
    rows = _rows(rest, training.model_id)
    assert state not in rows and sampler not in rows and kept in rows
    with pytest.raises(tinker.NotFoundError):
        sdk.create_sampling_client(model_path=sampler).result(timeout=60)

    # PUT .../ttl: set, remove, refuse out of range (400) or another key's (404)
    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    _expires_in(_rows(rest, training.model_id)[kept], 3600, time.time() - 1)
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
    assert _rows(rest, training.model_id)[kept].expires_at is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(kept, 0).result()
    with pytest.raises(tinker.NotFoundError):
        _rest(served, OTHER_KEY).set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        training.save_state("bad-ttl", ttl_seconds=0).result(timeout=60)


def test_serve_publish_lets_other_keys_load_and_sample(served, sdk, training, tokenizer):
    rest, theirs = _rest(served), _rest(served, OTHER_KEY)
    other = served.sdk(OTHER_KEY)
    try:
        sampler = training.save_weights_for_sampler("pub-s").result().path
        state = training.save_state("pub-w").result().path
        for call in (lambda: other.create_sampling_client(model_path=sampler).result(timeout=60),
                     lambda: theirs.get_weights_info_by_tinker_path(state).result(),
                     lambda: theirs.get_training_run(training.model_id, access_scope="accessible").result()):
            with pytest.raises(tinker.NotFoundError):
                call()
        for path in (sampler, state):
            rest.publish_checkpoint_from_tinker_path(path).result()
        assert all(_rows(rest, training.model_id)[p].public for p in (sampler, state))
        prompt = types.ModelInput.from_ints(_tokens(tokenizer))
        sampled = other.create_sampling_client(model_path=sampler).result(timeout=60).sample(
            prompt, 1, types.SamplingParams(max_tokens=3)).result(timeout=60)
        assert len(sampled.sequences) == 1
        assert other.create_training_client_from_state(state).result(timeout=60).get_info().lora_rank == 4
        assert theirs.get_weights_info_by_tinker_path(state).result().lora_rank == 4
        assert theirs.get_training_run(training.model_id, access_scope="accessible").result().lora_rank == 4
        accessible = theirs.list_training_runs(access_scope="accessible").result().training_runs
        assert training.model_id in {r.training_run_id for r in accessible}
        with pytest.raises(tinker.NotFoundError):  # still not theirs: "owned" views and changes
            theirs.get_training_run(training.model_id).result()
        for call in (lambda: theirs.unpublish_checkpoint_from_tinker_path(sampler).result(),
                     lambda: theirs.delete_checkpoint_from_tinker_path(sampler).result()):
            with pytest.raises(tinker.NotFoundError):
                call()

        async def publish_again() -> None:  # the SDK retries a 409 for five minutes: ask once
            route = f"/api/v1/training_runs/{training.model_id}/checkpoints/sampler_weights/pub-s/publish"
            await _raw(served).post(route, cast_to=type(None))

        with pytest.raises(tinker.ConflictError, match="already public"):
            asyncio.run(publish_again())
        rest.unpublish_checkpoint_from_tinker_path(sampler).result()
        assert not _rows(rest, training.model_id)[sampler].public
        with pytest.raises(tinker.NotFoundError):
            other.create_sampling_client(model_path=sampler).result(timeout=60)
    finally:
        other.close("success").result()


def test_serve_copy_weights_into_a_new_run(served, sdk, training):
    rest, theirs = _rest(served), _rest(served, OTHER_KEY)
    source = training.save_state("to-copy").result().path
    copy = rest.copy_weights(source, "proj", ttl_seconds=3600).result()
    run_id = CheckpointPath.parse(copy).run_id
    assert run_id != training.model_id and copy.endswith("/weights/to-copy")
    rows = _rows(rest, run_id)
    _expires_in(rows[copy], 3600, time.time() - 5)
    assert _rows(rest, training.model_id)[source].expires_at is None
    store = Store(served.store)
    assert (store.resolve(source)[1] / "optimizer.pt").stat().st_ino == \
        (store.resolve(copy)[1] / "optimizer.pt").stat().st_ino  # linked, not duplicated
    in_project = rest.list_training_runs(project_id="proj").result().training_runs
    assert [r.training_run_id for r in in_project] == [run_id]
    resumed = sdk.create_training_client_from_state_with_optimizer(copy).result(timeout=60)
    assert resumed.get_info().lora_rank == 4
    with pytest.raises(tinker.NotFoundError):  # another key cannot copy what it cannot read ...
        theirs.copy_weights(source, "theirs").result()
    mine = theirs.copy_weights(source, "theirs", weights_access_token=KEY).result()  # ... unless given a key
    assert theirs.get_training_run(CheckpointPath.parse(mine).run_id).result().lora_rank == 4
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(CheckpointPath.parse(mine).run_id).result()

    async def twice() -> list[str]:  # one idempotency key: one copy
        raw, headers = _raw(served), {"X-Idempotency-Key": "same-copy"}
        request = types.CopyWeightsRequest(source_path=source, destination_project_id="proj")
        return [(await raw.models.copy_weights(request=request, extra_headers=headers)).tinker_path
                for _ in range(2)]

    first, second = asyncio.run(twice())
    assert first == second != copy


def test_serve_answers_each_error_with_the_status_and_sdk_exception_tinker_uses(served, sdk, training,
                                                                                  tokenizer, tiny_model_dir):
    """Each at the request, as the SDK's exception for its status. The SDK retries 409s and 429s for up to
    five minutes, so those are asked once, with the SDK's own HTTP client and no retries."""
    http, rest = served.http, _rest(served)
    session = http.post("/create_session", json={"tags": []}).json()["session_id"]

    def create_model(seq: int) -> str:
        return http.post("/create_model", json={"session_id": session, "model_seq_id": seq,
                                                "base_model": tiny_model_dir,
                                                "lora_config": {"rank": 4}}).json()["model_id"]

    # 409 ConflictError for a name that exists; a retry (same seq_id) gets it again; the model goes on
    model_id = create_model(0)
    saved = http.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "taken"}).json()
    assert _retrieve(served, saved["request_id"])["path"].endswith("/weights/taken")

    async def save_taken() -> list[str]:
        raw, errors = _raw(served), []
        for _ in range(2):
            try:
                request = types.SaveWeightsRequest(model_id=model_id, path="taken", seq_id=2)
                await raw.weights.save(request=request)
            except tinker.ConflictError as e:
                errors.append(str(e))
        return errors

    errors = asyncio.run(save_taken())
    assert len(errors) == 2 and all("already exists" in e for e in errors), errors
    step = {"adam_params": {"learning_rate": 1e-3}}
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 3, **step})
    assert "metrics" in _retrieve(served, r.json()["request_id"])

    # 400 BadRequestError
    with pytest.raises(tinker.BadRequestError, match="checkpoint name"):
        training.save_state("no/slashes").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="age recipient"):
        training.save_weights_external("x", age_encryption_recipients=["age1nope"]).result(timeout=60)

    # 404 NotFoundError: an unknown path, run or model
    missing = f"tinker://{training.model_id}/weights/never-saved"
    for call in (lambda: sdk.create_training_client_from_state(missing).result(timeout=60),
                 lambda: sdk.create_sampling_client(model_path=missing).result(timeout=60),
                 lambda: training.load_state(missing).result(timeout=60),
                 lambda: rest.get_training_run("nobody:train:0").result(),
                 lambda: rest.delete_checkpoint_from_tinker_path(missing).result()):
        with pytest.raises(tinker.NotFoundError):
            call()
    assert training.save_state("after-404").result(timeout=60)  # the refused load_state held nothing up
    with pytest.raises(tinker.NotFoundError, match="unknown model_id"):
        asyncio.run(_raw(served).weights.save(request=types.SaveWeightsRequest(model_id="x:train:0", path="a",
                                                                               seq_id=1)))

    # 429 RateLimitError with Retry-After: this key's samples in flight (held by a sampler of weights that
    # an operation waiting for seq_id 1 will save) leave no room for one more
    held_model = create_model(1)
    assert http.post("/save_weights_for_sampler", json={"model_id": held_model, "seq_id": 2,
                                                        "sampling_session_seq_id": 0}).status_code == 200
    prompt = types.ModelInput.from_ints(_tokens(tokenizer))
    held = http.post("/asample", json={"sampling_session_id": f"{session}:sample:0", "num_samples": 8,
                                       "prompt": prompt.model_dump(), "sampling_params": {"max_tokens": 2}})
    assert held.status_code == 200, held.text

    async def one_more() -> None:
        await _raw(served).sampling.asample(request=types.SampleRequest(
            sampling_session_id=f"{session}:sample:0", num_samples=1, prompt=prompt,
            sampling_params=types.SamplingParams(max_tokens=2)))

    with pytest.raises(tinker.RateLimitError, match="in flight") as limited:
        asyncio.run(one_more())
    assert float(limited.value.response.headers["Retry-After"]) > 0
    r = http.post("/optim_step", json={"model_id": held_model, "seq_id": 1, **step})
    assert "metrics" in _retrieve(served, r.json()["request_id"])
    assert len(_retrieve(served, held.json()["request_id"])["sequences"]) == 8


def test_serve_sessions_over_rest_and_load_state(served, sdk, training):
    kept = training.save_state("reload-me").result().path
    assert training.load_state(kept).result().path == kept
    assert training.load_state_with_optimizer(kept).result().path == kept
    rest, session = _rest(served), training.model_id.rsplit(":train:", 1)[0]
    got = rest.get_session(session).result()
    assert training.model_id in got.training_run_ids
    assert session in rest.list_sessions(limit=1000).result().sessions
    assert session not in _rest(served, OTHER_KEY).list_sessions().result().sessions
    with pytest.raises(tinker.NotFoundError):
        _rest(served, OTHER_KEY).get_session(session).result()


def test_cookbook_weights_download_of_a_checkpoint_trained_through_serve(served, sdk, tiny_model_dir,
                                                                         tokenizer, tmp_path, monkeypatch):
    """``tinker_cookbook.weights.download``, unmodified: a training checkpoint (exported to external weights
    encrypted to a key it makes, fetched from signed URLs, decrypted, the export deleted) and an external
    one."""
    from tinker_cookbook import weights

    tc = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=2).result()
    tc.forward_backward([_datum(_tokens(tokenizer), "cross_entropy")], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("trained").result().path
    external = tc.save_weights_external("exported").result().path
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    out = weights.download(tinker_path=state, output_dir=str(tmp_path / "from-state"), base_url=served.url)
    assert sorted(p.name for p in Path(out).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    store = Store(served.store)
    _same_tensors(_adapter(Path(out)), _adapter(store.resolve(state)[1]))
    rest = _rest(served)
    exports = [c for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
               if c.checkpoint_type == "external" and c.checkpoint_id == "external_weights/download"]
    assert exports == []  # the temporary export was deleted
    out = weights.download(tinker_path=external, output_dir=str(tmp_path / "external"), base_url=served.url)
    _same_tensors(_adapter(Path(out)), _adapter(store.resolve(state)[1]))
    # the URLs need no key, but a valid signature, and die with their checkpoint
    url = rest.get_external_weights_urls(external).result().urls["adapter_config.json"]
    assert urllib.request.urlopen(url).status == 200
    for bad in (url.replace("signature=", "signature=0"), url.replace("expires=", "expires=1")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad)
        assert err.value.code == 403
    rest.delete_checkpoint_from_tinker_path(external).result()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url)
    assert err.value.code == 404


def test_serve_sweeps_expired_checkpoints_and_caps_the_store(tiny_model_dir, tmp_path):
    """With --sweep-interval 1 an expired checkpoint leaves the disk though nobody asks for it; with
    --max-store-bytes a save past the cap is a 403 (PermissionDeniedError, at the request) until some go."""
    probe = ServiceClient(store_dir=tmp_path / "probe", device="cpu")
    probed = probe.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    path = probed.save_weights_for_sampler("x").result().path
    one = sum(f.stat().st_size for f in Store(tmp_path / "probe").resolve(path)[1].iterdir())
    store_dir = tmp_path / "store"
    cap = str(int(2.5 * one))  # two sampler checkpoints fit, a third does not
    served = Served(tiny_model_dir, store_dir, "--sweep-interval", "1", "--max-store-bytes", cap)
    sc = served.sdk(KEY)
    try:
        tc = sc.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
        short = Store(store_dir).directory(CheckpointPath.parse(
            tc.save_weights_for_sampler("short", ttl_seconds=2).result().path))
        assert short.is_dir()
        deadline = time.monotonic() + 30
        while short.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not short.exists(), "the periodic sweep did not remove the expired checkpoint within 30 s"

        first = tc.save_weights_for_sampler("one").result().path
        tc.save_weights_for_sampler("two").result()
        with pytest.raises(tinker.PermissionDeniedError, match="--max-store-bytes"):
            tc.save_weights_for_sampler("three").result(timeout=60)
        assert not (store_dir / os.listdir(store_dir)[0] / "sampler_weights" / "three").exists()
        _rest(served).delete_checkpoint_from_tinker_path(first).result()
        assert tc.save_weights_for_sampler("three").result(timeout=60).path.endswith("/three")
    finally:
        sc.close("success").result()
        served.stop()


@pytest.mark.slow
def test_a_client_that_retries_under_another_name_on_conflict_works(served, sdk, tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """The Minds RL runner's save: ``checkpoint_utils.save_checkpoint_async``, and on ``tinker.ConflictError``
    the same under ``<name>_1``, ``_2``, ... Tinker answers a taken name with 409 at the request; the SDK
    retries 409s for five minutes (by its wall clock) before it raises ConflictError. That clock is the one
    thing sped up here: each reading is 400 s after the last, so the SDK gives up after its first retry
    instead of five minutes later; the server's answers and the client's code are the real ones."""
    import types as pytypes

    import tinker.lib.internal_client_holder as holder_module
    from tinker_cookbook import checkpoint_utils

    real_time = holder_module.time
    readings = iter(range(10**6))
    fast = pytypes.SimpleNamespace(**{k: getattr(real_time, k) for k in dir(real_time)
                                      if not k.startswith("_")})
    fast.time = lambda: real_time.time() + 400.0 * next(readings)
    monkeypatch.setattr(holder_module, "time", fast)

    async def save_checkpoint_async(**kwargs):  # written as the runner writes it
        base_name = kwargs.get("name", "ckpt")
        try:
            return await checkpoint_utils.save_checkpoint_async(**kwargs)
        except tinker.ConflictError:
            pass
        for i in range(1, 1000):
            kwargs["name"] = f"{base_name}_{i}"
            try:
                return await checkpoint_utils.save_checkpoint_async(**kwargs)
            except tinker.ConflictError:
                continue
        raise RuntimeError(f"Could not save checkpoint '{base_name}' after 1000 attempts.")

    tc = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=3).result()

    async def run() -> list[dict]:
        first = await save_checkpoint_async(training_client=tc, name="000000", log_path=str(tmp_path),
                                            loop_state={"batch": 0}, kind="both")
        again = await save_checkpoint_async(training_client=tc, name="000000", log_path=str(tmp_path),
                                            loop_state={"batch": 0}, kind="state")
        return [first, again]

    first, again = asyncio.run(run())
    assert first["state_path"].endswith("/weights/000000")
    assert again["state_path"].endswith("/weights/000000_1")
    listed = {c.checkpoint_id for c in _rest(served).list_checkpoints(tc.model_id).result().checkpoints}
    assert listed == {"weights/000000", "sampler_weights/000000", "weights/000000_1"}
