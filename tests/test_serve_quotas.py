"""What one API key may keep on a shared ``polyrl serve``: LoRA rank, training clients, their adapters'
memory, live sessions, and the tokens its sampling requests may decode at once. Past each, a 4xx that
names the limit; the other key is untouched, and freeing what the key holds makes room again."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import tinker
from test_serve import KEY, OTHER_KEY, Served, _retrieve, _session
from tinker import types

from polyrl.local.engine import Engine
from polyrl.local.model import LoraSpec
from polyrl.serve.quotas import ADAPTER_BYTES_PER_PARAMETER


@pytest.fixture(scope="module")
def rank_8_parameters(tiny_model_dir) -> int:
    """Parameters of a rank-8 LoRA on every layer of the tiny model (the count is checked below)."""
    from polyrl.local.model import BaseModel

    return BaseModel(tiny_model_dir, "cpu").lora_parameters(LoraSpec(8))


@pytest.fixture(scope="module")
def endless_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with no end-of-sequence id: its samples run to ``max_tokens``."""
    path = tmp_path_factory.mktemp("endless")
    for item in Path(tiny_model_dir).iterdir():
        if item.name != "generation_config.json":
            (path / item.name).symlink_to(item)
    config = json.loads((Path(tiny_model_dir) / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    return str(path)


@pytest.fixture(scope="module")
def quota(endless_model, tmp_path_factory, rank_8_parameters):
    """A server whose keys may each hold one and a half rank-8 adapters."""
    s = Served(endless_model, tmp_path_factory.mktemp("quota-store"), "--long-poll", "1",
               "--max-sessions", "3", "--max-models", "2", "--max-lora-rank", "64",
               "--max-adapter-bytes", str(int(1.5 * ADAPTER_BYTES_PER_PARAMETER * rank_8_parameters)),
               "--max-decode-tokens-in-flight", "20000")
    yield s
    s.stop()


def _create(http: httpx.Client, session: str, seq: int, model: str, rank: int) -> httpx.Response:
    return http.post("/create_model", json={"session_id": session, "model_seq_id": seq, "base_model": model,
                                            "lora_config": {"rank": rank, "seed": 0}})


def _finish(http: httpx.Client, session: str) -> None:
    assert http.post(f"/sessions/{session}/finish", json={}).status_code == 200


def test_the_adapter_size_the_server_admits_is_the_adapters(tmp_path, endless_model, rank_8_parameters):
    engine = Engine(tmp_path, device="cpu")
    try:
        st = engine.call(lambda: engine.create_trainer("x:train:0", endless_model, LoraSpec(8), "adamw"))
        assert sum(p.numel() for p in st.params) == rank_8_parameters
        attn_only = LoraSpec(3, train_mlp=False, train_unembed=False)
        st = engine.call(lambda: engine.create_trainer("y:train:0", endless_model, attn_only, "adamw"))
        assert sum(p.numel() for p in st.params) == st.base.lora_parameters(attn_only)
    finally:
        engine.stop()


def test_lora_rank_is_bounded_by_the_server_and_the_model(quota, endless_model):
    session = _session(quota)
    r = _create(quota.http, session, 0, endless_model, 100_000)
    assert r.status_code == 400 and "lora rank 100000 is more than this server allows (--max-lora-rank 64)" \
        in r.json()["error"], r.text
    r = _create(quota.http, session, 1, endless_model, 40)
    error = r.json()["error"]
    assert r.status_code == 400 and "more than model" in error and "width (32)" in error, r.text
    _finish(quota.http, session)


def test_training_clients_and_their_memory_are_bounded_per_key(quota, endless_model):
    session = _session(quota)
    r = _create(quota.http, session, 0, endless_model, 8)
    assert r.status_code == 200, r.text
    _retrieve(quota, r.json()["request_id"])
    # a second rank-8 adapter would hold more than the key's memory; a rank-2 one fits
    r = _create(quota.http, session, 1, endless_model, 8)
    assert r.status_code == 403 and "(--max-adapter-bytes)" in r.json()["error"], r.text
    r = _create(quota.http, session, 2, endless_model, 2)
    assert r.status_code == 200, r.text
    # two training clients are the most a key may have
    r = _create(quota.http, session, 3, endless_model, 1)
    assert r.status_code == 403 and "this key has 2 training clients" in r.json()["error"] \
        and "(--max-models 2)" in r.json()["error"], r.text
    # the other key's quota is its own
    theirs = _session(quota, quota.other)
    r = _create(quota.other, theirs, 0, endless_model, 8)
    assert r.status_code == 200, r.text
    _finish(quota.other, theirs)
    # a finished session gives its clients' places and memory back
    _finish(quota.http, session)
    session = _session(quota)
    r = _create(quota.http, session, 0, endless_model, 8)
    assert r.status_code == 200, r.text
    assert "model_id" in _retrieve(quota, r.json()["request_id"])
    _finish(quota.http, session)


def test_live_sessions_are_bounded_per_key_and_the_sdk_hears_why(quota, endless_model):
    sessions = [_session(quota) for _ in range(3)]
    r = quota.http.post("/create_session", json={"tags": [], "sdk_version": "test"})
    assert r.status_code == 403 and "this key has 3 live sessions" in r.json()["error"] \
        and "(--max-sessions 3)" in r.json()["error"], r.text
    mine = tinker.ServiceClient(base_url=quota.url, api_key=KEY)  # (its session is made on first use)
    with pytest.raises(tinker.PermissionDeniedError, match="--max-sessions 3"):
        mine.create_sampling_client(base_model=endless_model)
    theirs = tinker.ServiceClient(base_url=quota.url, api_key=OTHER_KEY)  # the other key is untouched
    theirs.create_sampling_client(base_model=endless_model)
    theirs.close("success").result()
    _finish(quota.http, sessions[0])
    sessions[0] = _session(quota)
    for s in sessions:
        _finish(quota.http, s)


def test_tokens_to_decode_are_bounded_per_request_and_per_key(quota, endless_model):
    http = quota.http
    session = _session(quota)
    r = _create(http, session, 0, endless_model, 2)
    model_id = _retrieve(quota, r.json()["request_id"])["model_id"]
    # a sampler of weights that an operation waiting for seq_id 1 will save: its samples stay in flight
    r = http.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 2,
                                                     "sampling_session_seq_id": 0})
    assert r.status_code == 200, r.text
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}

    def asample(n: int, max_tokens: int) -> httpx.Response:
        return http.post("/asample", json={"sampling_session_id": f"{session}:sample:0", "num_samples": n,
                                           "prompt": prompt, "sampling_params": {"max_tokens": max_tokens}})

    r = asample(6, 4000)
    assert r.status_code == 400 and "6 samples of up to 4000 tokens" in r.json()["error"] \
        and "--max-decode-tokens-in-flight" in r.json()["error"], r.text
    held = asample(5, 2000)
    assert held.status_code == 200, held.text
    r = asample(5, 2100)  # 10000 held, 10500 more would pass 20000: wait (the SDK retries a 429)
    assert r.status_code == 429 and "this key has 10000 tokens to decode" in r.json()["error"], r.text
    _finish(http, session)  # the held request goes with its session, undecoded


def test_a_small_request_of_one_key_is_not_held_behind_another_keys_long_decode(quota, endless_model):
    """Keys take turns on the engine: key B's 3-token sample is answered while key A's 16,000-token
    decode goes on (without turns it waited for all of it)."""
    session = _session(quota)
    r = quota.http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                          "base_model": endless_model})
    assert r.status_code == 200, r.text
    long = quota.http.post("/asample", json={
        "sampling_session_id": f"{session}:sample:0", "num_samples": 4,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 4000, "temperature": 1.0}})
    assert long.status_code == 200, long.text
    theirs = quota.sdk(OTHER_KEY)
    sampler = theirs.create_sampling_client(base_model=endless_model)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result()
    assert len(out.sequences[0].tokens) == 3
    # key A's decode is still under way (408: not done within the long poll)
    r = quota.http.post("/retrieve_future", json={"request_id": long.json()["request_id"]})
    assert r.status_code == 408, r.text[:300]
    theirs.close("success").result()
    _finish(quota.http, session)
