"""``polyrl serve``: the official tinker SDK (and tinker-cookbook, and ``polyrl train``) against the
local engine over real HTTP on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from polyrl.envs.base import EnvBuilder, Observation, StepResult, register_env
from polyrl.local import losses
from polyrl.serve.protocol import RequestError
from polyrl.serve.state import Futures, OrderedOps

KEY = "tml-serve-test-key"
OTHER_KEY = "tml-serve-test-other-key"


# ---------------------------------------------------------------------------------------- helpers
class Served:
    """A ``polyrl serve`` subprocess on 127.0.0.1 with an OS-chosen port; ``http`` speaks with ``KEY``,
    ``other`` with ``OTHER_KEY``; ``sdk(key)`` opens the official SDK's client on it."""

    def __init__(self, model_dir: str, store: Path, *extra: str, cwd: Path | None = None):
        self.model_dir = model_dir
        cmd = [sys.executable, "-m", "polyrl.serve", "--port", "0", "--models", model_dir, "--api-key", KEY,
               "--api-key", OTHER_KEY, "--store-dir", str(store), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        deadline = time.monotonic() + 120
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "listening on" in line:
                self.url = line.rsplit(" ", 1)[-1].strip()
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError(f"polyrl serve did not start: {self.proc.stderr.read()[-2000:]}")
        self.http = self.client(KEY)
        self.other = self.client(OTHER_KEY)
        self.sdks: list[tinker.ServiceClient] = []

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api/v1", headers={"X-API-Key": key}, timeout=60)

    def rss_bytes(self) -> int:
        """The server process's resident memory."""
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def sdk(self, key: str = KEY) -> tinker.ServiceClient:
        """The official SDK's ServiceClient on this server; its session is finished when the server stops
        (an open client keeps beating its session's heartbeat, and warns once the server is gone)."""
        self.sdks.append(tinker.ServiceClient(base_url=self.url, api_key=key))
        return self.sdks[-1]

    def stop(self) -> None:
        for sdk in self.sdks:  # closing twice is a no-op; a dead server fails the finish request
            with contextlib.suppress(Exception):
                sdk.close("success").result(timeout=30)
        self.http.close()
        self.other.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc.poll() is None and self.http.get("/healthz").json() == {"status": "ok"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("serve-store"), "--long-poll", "1", "--max-body-mb",
               "1", "--seq-gap-timeout", "6")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def service(served):
    sc = served.sdk(KEY)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def training(service, tiny_model_dir):
    return service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()


def _tokens(tokenizer, text="the answer is 42") -> list[int]:
    return tokenizer.encode(text)


def _datum(tokens: list[int], loss: str) -> types.Datum:
    n = len(tokens)
    target = tokens[1:] + [tokens[0]]
    inputs = {"target_tokens": types.TensorData(data=target, dtype="int64", shape=[n])}
    if loss == "cross_entropy":
        inputs["weights"] = types.TensorData(data=[0.5] * n, dtype="float32", shape=[n])
    else:
        inputs["logprobs"] = types.TensorData(data=[-6.0] * n, dtype="float32", shape=[n])
        inputs["advantages"] = types.TensorData(data=[1.0, -0.5] * (n // 2) + [1.0] * (n % 2),
                                                dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _session(served: Served, http: httpx.Client | None = None) -> str:
    http = http or served.http
    return http.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]


def _create_model(served: Served, tiny_model_dir: str, session: str, seq: int = 0,
                  http: httpx.Client | None = None) -> str:
    http = http or served.http
    r = http.post("/create_model", json={"session_id": session, "model_seq_id": seq,
                                         "base_model": tiny_model_dir, "lora_config": {"rank": 4, "seed": 0}})
    assert r.status_code == 200, r.text
    result = _retrieve(served, r.json()["request_id"], http=http)
    return result["model_id"]


def _retrieve(served: Served, request_id: str, proto: bool = False, deadline_s: float = 60,
              http: httpx.Client | None = None):
    http = http or served.http
    headers = {"Accept": "application/x-protobuf"} if proto else {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": request_id}, headers=headers)
        if r.status_code == 408:
            continue
        assert r.status_code == 200, r.text
        return r.content if r.headers["content-type"].startswith("application/x-protobuf") else r.json()
    raise TimeoutError(request_id)


def _fwdbwd_body(model_id: str, seq_id: int, datums: list[types.Datum], loss="cross_entropy") -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn=loss), model_id=model_id,
        seq_id=seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf"}


# ------------------------------------------------------------------------ the SDK, end to end
def test_sdk_training_and_sampling(served, service, training, tokenizer):
    info = training.get_info()
    assert info.model_id.endswith(":train:0") and info.lora_rank == 4 and info.model_data.tokenizer_id
    tokens = _tokens(tokenizer)
    n = len(tokens)
    for loss in sorted(name for name, spec in losses.LOSSES.items() if not spec.provenance):  # (*)
        out = training.forward_backward([_datum(tokens, loss), _datum(tokens[:-1], loss)], loss).result()
        assert "loss:sum" in out.metrics and np.isfinite(out.metrics["loss:sum"]), loss
        assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[n], [n - 1]]
        assert all(np.all(o["logprobs"].to_numpy() <= 0) for o in out.loss_fn_outputs)
    before = training.forward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
    # forward_backward_custom: the SDK's forward pass, a client-side loss, then a weighted backward
    custom = training.forward_backward_custom(
        [_datum(tokens, "cross_entropy")],
        lambda data, lps: (-0.5 * sum(lp.sum() for lp in lps), {"n:sum": 1.0})).result()
    assert custom.metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    opt = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert opt.metrics["grad_norm:mean"] > 0
    after = training.forward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
    assert after.metrics["loss:sum"] != before.metrics["loss:sum"]

    sampler = training.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == training.get_info().model_data.model_name
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    res = sampler.sample(types.ModelInput.from_ints(tokens), num_samples=3, sampling_params=params).result()
    assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
    for s in res.sequences:
        assert (1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens)
                and s.stop_reason in ("stop", "length"))
    again = sampler.sample(types.ModelInput.from_ints(tokens), num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # seeded
    # the sampler's logprobs are the learner's: forward on a sampled sequence gives the same numbers
    seq = res.sequences[0]
    full = tokens + list(seq.tokens)
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert lp[0] is None and len(lp) == len(full)
    np.testing.assert_allclose(lp[n:], seq.logprobs, atol=1e-4)
    m = len(full) - 1
    lm = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                     loss_fn_inputs={"target_tokens": types.TensorData(data=full[1:], dtype="int64",
                                                                       shape=[m])})
    learner = training.forward([lm], "cross_entropy").result()
    np.testing.assert_allclose(learner.loss_fn_outputs[0]["logprobs"].to_numpy()[n - 1:], seq.logprobs,
                               atol=1e-4)


def test_checkpoints_resume_and_rest(served, service, training, tokenizer):
    tokens = _tokens(tokenizer, "resume me please")
    state = training.save_state("ckpt-a", user_metadata={"note": "x"}).result()
    assert state.path == f"tinker://{training.model_id}/weights/ckpt-a"
    named = training.save_weights_for_sampler("samp-a").result()
    ref = training.forward([_datum(tokens, "cross_entropy")], "cross_entropy").result()

    resumed = service.create_training_client_from_state_with_optimizer(state.path).result()
    assert resumed.model_id != training.model_id
    got = resumed.forward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
    np.testing.assert_allclose(got.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               ref.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-6)
    # same weights and optimizer state: one identical step on each keeps them identical
    for client in (training, resumed):
        client.forward_backward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a = training.forward([_datum(tokens, "cross_entropy")],
                         "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    b = resumed.forward([_datum(tokens, "cross_entropy")],
                        "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), atol=1e-5)
    fresh = service.create_training_client_from_state(state.path).result()  # weights only
    assert fresh.get_info().lora_rank == 4

    from_path = service.create_sampling_client(model_path=named.path).result()
    assert from_path.get_base_model() == training.get_info().model_data.model_name
    assert len(from_path.sample(types.ModelInput.from_ints(tokens), 2,
                                types.SamplingParams(max_tokens=3)).result().sequences) == 2

    rest = tinker.RestClient(base_url=served.url, api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [training.get_info().model_data.model_name]
    assert served.http.get("/get_server_capabilities").json()["supported_loss_fns"] == sorted(losses.LOSSES)
    cps = rest.list_checkpoints(training.model_id).result().checkpoints
    assert {c.checkpoint_id for c in cps} == {"weights/ckpt-a", "sampler_weights/samp-a"}
    assert next(c for c in cps if c.checkpoint_id == "weights/ckpt-a").user_metadata == {"note": "x"}
    run = rest.get_training_run(training.model_id).result()
    assert run.lora_rank == 4 and run.last_checkpoint.checkpoint_id == "weights/ckpt-a"
    runs = rest.list_training_runs().result()
    assert training.model_id in {r.training_run_id for r in runs.training_runs}
    rest.delete_checkpoint(training.model_id, "sampler_weights/samp-a").result()
    assert {c.checkpoint_id
            for c in rest.list_checkpoints(training.model_id).result().checkpoints} == {"weights/ckpt-a"}


def test_unsupported_loss_is_a_user_error_and_the_client_goes_on(training, tokenizer):
    tokens = _tokens(tokenizer)
    with pytest.raises(tinker.RequestFailedError) as err:
        training.forward_backward([_datum(tokens, "ppo")], "custom").result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.User
    assert "'custom' is one of Tinker's losses but is not implemented" in str(err.value)
    assert "importance_sampling" in str(err.value) and "stable_reinforce" in str(err.value)
    out = training.forward_backward([_datum(tokens, "ppo")], "ppo").result(timeout=60)  # still usable
    assert "loss:sum" in out.metrics


def test_a_non_finite_update_comes_back_as_the_sdks_user_error(service, tiny_model_dir, tokenizer):
    """A finite but huge advantage (1e30) overflows the gradient: the SDK's optim_step raises the engine's
    one-line refusal as a user error, the weights stay as they were, and the client trains on."""
    training = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=3).result()
    tokens = _tokens(tokenizer)
    before = training.save_weights_for_sampler("before-huge").result().path
    huge = _datum(tokens, "importance_sampling")
    n = len(tokens)
    huge.loss_fn_inputs["advantages"] = types.TensorData(data=[1e30] * n, dtype="float32", shape=[n])
    training.forward_backward([huge], "importance_sampling").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError) as err:
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.User
    assert "optim_step refused" in str(err.value) and "unchanged" in str(err.value), str(err.value)
    sampler_before = service.create_sampling_client(model_path=before).result()
    sampler_after = training.save_weights_and_get_sampling_client("after-huge").result()
    prompt = types.ModelInput.from_ints(tokens)
    assert sampler_before.compute_logprobs(prompt).result(timeout=60) == \
        sampler_after.compute_logprobs(prompt).result(timeout=60)
    training.forward_backward([_datum(tokens, "importance_sampling")], "importance_sampling").result(60)
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert step.metrics["grad_norm:mean"] > 0


# ------------------------------------------------------------------------------- the protocol
def test_api_key_required(served):
    for headers in ({}, {"X-API-Key": "tml-wrong"}):
        for method, path in (("GET", "/healthz"), ("POST", "/create_session"), ("GET", "/training_runs")):
            r = httpx.request(method, served.url + "/api/v1" + path, headers=headers, json={})
            assert r.status_code == 401 and "X-API-Key" in r.json()["error"]
    assert served.http.get("/healthz").status_code == 200


def test_sessions_heartbeats_and_finish(served, tiny_model_dir):
    http = served.http
    assert http.post("/client/config",
                     json={"sdk_version": "0.38.0"}).json()["parallel_fwdbwd_chunks"] is True
    session = _session(served)
    assert http.post("/session_heartbeat",
                     json={"session_id": session, "type": "session_heartbeat"}).status_code == 200
    model_id = _create_model(served, tiny_model_dir, session)
    assert http.post("/telemetry",
                     json={"events": [], "session_id": session}).json() == {"status": "accepted"}
    assert http.post(f"/sessions/{session}/finish", json={"reason": {"type": "success"}}).status_code == 200
    # stops the SDK's loop
    assert http.post("/session_heartbeat", json={"session_id": session}).status_code == 410
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
    assert r.status_code == 404 and "unknown model_id" in r.json()["error"]  # its models were released
    r = http.post("/create_model", json={"session_id": session, "model_seq_id": 1,
                                         "base_model": tiny_model_dir})
    assert r.status_code == 410
    # the run is still listed
    assert http.get(f"/training_runs/{model_id}").json()["training_run_id"] == model_id


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(served, tiny_model_dir, tokenizer):
    http = served.http
    session = _session(served)
    model_id = _create_model(served, tiny_model_dir, session, seq=0)
    cases = [
        (http.post("/forward_backward", content=b"\xff\xff\xff not a protobuf", headers=PROTO), 400,
         "protobuf"),
        (http.post("/forward_backward",
                   content=_fwdbwd_body("nope:train:0", 1, [_datum([1, 2, 3], "cross_entropy")]),
                   headers=PROTO), 404, "unknown model_id"),
        (http.post("/create_model", json={"session_id": session, "model_seq_id": "x", "base_model": 5}), 400,
         "model_seq_id"),
        (http.post("/create_model", json={"session_id": session, "model_seq_id": 9,
                                          "base_model": "/not/served"}), 400, "not served"),
        (http.post("/create_model", json={"session_id": "sess-missing", "model_seq_id": 0,
                                          "base_model": tiny_model_dir}), 404, "unknown session_id"),
        (http.post("/create_model", content=b"{not json", headers={"Content-Type": "application/json"}), 400,
         "JSON"),
        (http.post("/create_session", json=[1, 2]), 400, "JSON object"),
        (http.post("/optim_step", json={"model_id": model_id, "seq_id": 1,
                                        "adam_params": {"learning_rate": "fast"}}), 400, "learning_rate"),
        (http.post("/optim_step", json={"model_id": "ghost:train:3", "seq_id": 1, "adam_params": {}}), 404,
         "unknown model_id"),
        (http.post("/asample", json={"sampling_session_id": "nope", "seq_id": 0, "num_samples": 1,
                                     "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                                     "sampling_params": {"max_tokens": 2}}), 404, "sampling_session_id"),
        (http.post("/asample", json={"sampling_session_id": "nope", "num_samples": -1, "prompt": "hi",
                                     "sampling_params": {}}), 400, "num_samples"),
        (http.post("/retrieve_future", json={"request_id": "0" * 32}), 404, "request_id"),
        (http.post("/load_weights", json={"session_id": session, "model_seq_id": 5,
                                          "path": "tinker://../weights/x", "optimizer": True}),
         400, "run id"),
        (http.post("/load_weights", json={"session_id": session, "model_seq_id": 5,
                                          "path": f"tinker://{model_id}/weights/missing",
                                          "optimizer": False}), 404, "not found"),
        (http.get("/training_runs/no-such-run"), 404, "not found"),
        (http.delete(f"/training_runs/{model_id}/checkpoints/weights/missing"), 404, "not found"),
        (http.get("/training_runs", params={"limit": "many"}), 400, "limit"),
        (http.post("/no_such_endpoint", json={}), 404, "not an endpoint"),
        (http.post("/forward_backward", content=b"\0" * (2 << 20), headers=PROTO), 413, "limit"),
        (http.post("/asample", content=json.dumps({"pad": "x" * (2 << 20)}),
                   headers={"Content-Type": "application/json"}), 413, "limit"),
    ]
    for r, status, words in cases:
        assert r.status_code == status, (r.request.url, r.status_code, r.text[:300])
        body = r.json()
        assert words in body["error"] and body["category"] == "user", (r.request.url, body)
    # a forward_backward whose data is malformed uses up its seq_id: the next operation still runs
    bad = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    d = bad.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2], dtype=np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].dense = b"\x01\x02\x03"  # not a whole number of int64s
    d.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    r = http.post("/forward_backward", content=bad.SerializeToString(), headers=PROTO)
    assert r.status_code == 400 and "data[0]" in r.json()["error"]
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                       "adam_params": {"learning_rate": 1e-3}})
    assert "metrics" in _retrieve(served, r.json()["request_id"])
    # zstd bodies (the SDK's proto_compress_fwdbwd) are accepted, and bombs stopped at the size limit
    import zstandard

    zstd = {**PROTO, "Content-Encoding": "zstd"}
    body = zstandard.ZstdCompressor().compress(_fwdbwd_body(model_id, 3,
                                                            [_datum(_tokens(tokenizer), "cross_entropy")]))
    r = http.post("/forward_backward", content=body, headers=zstd)
    assert "loss:sum" in _retrieve(served, r.json()["request_id"])["metrics"]
    r = http.post("/forward_backward", content=zstandard.ZstdCompressor().compress(b"\0" * (3 << 20)),
                  headers=zstd)
    assert r.status_code == 413
    r = http.post("/forward_backward", content=b"not zstd", headers=zstd)
    assert r.status_code == 400 and "zstd" in r.json()["error"]
    assert served.alive()


# ------------------------------------------------------------------- two keys, bad values, bounds
def test_one_key_cannot_see_or_touch_another_keys_work(served, tiny_model_dir, tokenizer):
    """Everything a key makes is invisible to another key: the same 404 as for an id that never existed."""
    mine, theirs = served.http, served.other
    session = _session(served)
    model_id = _create_model(served, tiny_model_dir, session)
    tokens = _tokens(tokenizer)
    fb = mine.post("/forward_backward", content=_fwdbwd_body(model_id, 1, [_datum(tokens, "cross_entropy")]),
                   headers=PROTO)
    r = mine.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "private"})
    path = _retrieve(served, r.json()["request_id"])["path"]
    mine.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                "base_model": tiny_model_dir})
    sampler_id = f"{session}:sample:0"
    sample = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
              "sampling_params": {"max_tokens": 2}}
    assert mine.post("/asample", json=sample).status_code == 200

    ghost_session = "sess-000000000000"
    ghost = {session: ghost_session, model_id: model_id.replace(session, ghost_session),
             fb.json()["request_id"]: "0" * 32, sampler_id: sampler_id.replace(session, ghost_session),
             path: path.replace(session, ghost_session)}

    def swap(value):
        if isinstance(value, str):
            for real, fake in ghost.items():
                value = value.replace(real, fake)
            return value
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    def send(http, method, url, body):
        if isinstance(body, bytes):
            return http.request(method, url, content=body, headers=PROTO)
        return http.request(method, url, json=body) if body is not None else http.request(method, url)

    probes = [
        ("POST", "/session_heartbeat", {"session_id": session}),
        ("POST", "/create_model", {"session_id": session, "model_seq_id": 7, "base_model": tiny_model_dir}),
        ("POST", "/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 7,
                                              "base_model": tiny_model_dir}),
        ("POST", "/get_info", {"model_id": model_id}),
        ("POST", "/forward_backward", _fwdbwd_body(model_id, 3, [_datum(tokens, "cross_entropy")])),
        ("POST", "/optim_step", {"model_id": model_id, "seq_id": 3,
                                 "adam_params": {"learning_rate": 1e-2}}),
        ("POST", "/optim_step", {"model_id": model_id, "seq_id": 3,
                                 "adam_params": {"learning_rate": "fast"}}),
        ("POST", "/save_weights", {"model_id": model_id, "seq_id": 3, "path": "stolen"}),
        ("POST", "/save_weights_for_sampler", {"model_id": model_id, "seq_id": 3,
                                               "sampling_session_seq_id": 5}),
        ("POST", "/load_weights", {"model_id": model_id, "seq_id": 3, "path": path, "optimizer": True}),
        ("POST", "/load_weights", {"session_id": _session(served, theirs), "model_seq_id": 0, "path": path,
                                   "optimizer": True}),
        ("POST", "/create_sampling_session", {"session_id": _session(served, theirs),
                                              "sampling_session_seq_id": 0, "model_path": path}),
        ("POST", "/weights_info", {"tinker_path": path}),
        ("POST", "/retrieve_future", {"request_id": fb.json()["request_id"]}),
        ("POST", "/asample", {**sample, "seq_id": 1}),
        ("GET", f"/samplers/{sampler_id}", None),
        ("GET", f"/training_runs/{model_id}", None),
        ("GET", f"/training_runs/{model_id}/checkpoints", None),
        ("DELETE", f"/training_runs/{model_id}/checkpoints/weights/private", None),
        ("POST", f"/sessions/{session}/finish", {}),
    ]
    for method, url, body in probes:
        real = send(theirs, method, url, body)
        fake = send(theirs, method, swap(url), swap(body) if not isinstance(body, bytes) else
                    _fwdbwd_body(ghost[model_id], 3, [_datum(tokens, "cross_entropy")]))
        assert 400 <= real.status_code < 500 and real.json()["category"] == "user", (url, body,
                                                                                     real.text[:300])
        # the answer is exactly the one for an id that never existed: nothing tells the other key it exists
        assert (real.status_code, swap(real.json()["error"])) == (fake.status_code,
                                                                  fake.json()["error"]), (url, body)
    listed = theirs.get("/training_runs").text + theirs.get("/checkpoints").text
    assert session not in listed

    # the owner's work is untouched: its seq_id 3 was not used up, its checkpoint and session are still there
    r = mine.post("/optim_step", json={"model_id": model_id, "seq_id": 3,
                                       "adam_params": {"learning_rate": 1e-2}})
    assert _retrieve(served, r.json()["request_id"])["metrics"]["grad_norm:mean"] > 0
    assert "loss:sum" in _retrieve(served, fb.json()["request_id"])["metrics"]
    listed = mine.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [c["tinker_path"] for c in listed] == [path]
    assert path in mine.get("/checkpoints").text and model_id in mine.get("/training_runs").text
    assert mine.post("/session_heartbeat", json={"session_id": session}).status_code == 200
    assert mine.get(f"/samplers/{sampler_id}").status_code == 200
    # and through the SDK, the other key cannot load the checkpoint
    sdk = served.sdk(OTHER_KEY)
    try:
        with pytest.raises(Exception, match="not found"):
            sdk.create_training_client_from_state(path).result(timeout=60)
    finally:
        sdk.close("success").result()


def test_a_far_seq_id_is_refused_not_queued(served, tiny_model_dir, tokenizer):
    """A seq_id millions ahead must not make the server hold (or later fail) one entry per missing id."""
    http = served.http
    model_id = _create_model(served, tiny_model_dir, _session(served))
    for body in ({"model_id": model_id, "seq_id": 3_000_000, "adam_params": {"learning_rate": 1e-2}},
                 {"model_id": model_id, "seq_id": 3_000_000, "adam_params": {"learning_rate": "fast"}}):
        r = http.post("/optim_step", json=body)
        assert r.status_code == 400 and r.json()["category"] == "user", r.text
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 3_000_000, "adam_params": {}})
    assert "seq_id 3000000" in r.json()["error"] and "ahead" in r.json()["error"]
    r = http.post("/forward_backward", headers=PROTO,
                  content=_fwdbwd_body(model_id, 3_000_000, [_datum(_tokens(tokenizer), "cross_entropy")]))
    assert r.status_code == 400 and "seq_id" in r.json()["error"]
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 1,
                                       "adam_params": {"learning_rate": 1e-2}})
    assert "metrics" in _retrieve(served, r.json()["request_id"])  # nothing was queued behind a gap


def test_ordered_ops_bound_the_gap():
    futures = Futures()
    ops = OrderedOps(lambda fn: Future(), futures, max_ahead=8)
    with pytest.raises(RequestError, match="ahead"):
        ops.submit(10, lambda: None, dict)
    ops.refuse(3_000_000, RequestError(400, "bad body"))
    assert not ops.waiting and len(futures) == 0
    ops.submit(8, lambda: None, dict)
    ops.check_gap(timeout=1, now=ops.gap_since + 2)
    assert len(futures) <= 8 and ops.next_seq == 9


def _raw(http: httpx.Client, url: str, text: str) -> httpx.Response:
    return http.post(url, content=text.encode(), headers={"Content-Type": "application/json"})


def test_bad_values_get_a_clear_4xx(served, tiny_model_dir, tokenizer):
    http = served.http
    session = _session(served)
    model_id = _create_model(served, tiny_model_dir, session)
    http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                "base_model": tiny_model_dir})
    sampler_id = f"{session}:sample:0"
    tokens = _tokens(tokenizer)

    def sample(params: str) -> str:
        return (f'{{"sampling_session_id": "{sampler_id}", "num_samples": 1, '
                f'"prompt": {{"chunks": [{{"type": "encoded_text", "tokens": {tokens}}}]}}, '
                f'"sampling_params": {params}}}')

    def optim(seq: int, params: str) -> str:
        return f'{{"model_id": "{model_id}", "seq_id": {seq}, "adam_params": {params}}}'

    deep = "[" * 100_000 + "]" * 100_000
    cases = [
        (_raw(http, "/optim_step", optim(1, '{"learning_rate": ' + "9" * 5000 + "}")), "number"),
        (_raw(http, "/create_session", '{"tags": [], "user_metadata": {"n": ' + "9" * 5000 + "}}"), "number"),
        (_raw(http, "/create_session", '{"tags": ' + deep + "}"), "nested"),
        (_raw(http, "/asample", sample('{"max_tokens": 2, "temperature": NaN}')), "NaN"),
        (_raw(http, "/asample", sample('{"max_tokens": 2, "temperature": 1e999}')), "temperature"),
        (_raw(http, "/asample", sample('{"max_tokens": 2, "seed": 99999999999999999999999}')), "seed"),
        (_raw(http, "/asample", sample('{"max_tokens": 2, "top_k": 99999999999999999999999}')), "top_k"),
        (_raw(http, "/optim_step", optim(1, '{"learning_rate": NaN}')), "NaN"),
        (_raw(http, "/optim_step", optim(1, '{"learning_rate": Infinity}')), "Infinity"),
        (_raw(http, "/optim_step", optim(1, '{"learning_rate": 1e999}')), "learning_rate"),
        (_raw(http, "/optim_step", optim(1, '{"learning_rate": -0.01}')), "learning_rate"),
        (_raw(http, "/optim_step", optim(1, '{"learning_rate": 0.01, "beta2": 1.5}')), "beta2"),
        (http.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "c" * 300}), "name"),
        (http.post("/save_weights", json={"model_id": model_id, "seq_id": 1, "path": ".hidden"}), "name"),
        (http.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 1, "path": "a b"}),
         "name"),
        (http.post("/create_model", json={"session_id": session, "model_seq_id": 10 ** 30,
                                          "base_model": tiny_model_dir}), "model_seq_id"),
        (http.get("/training_runs", params={"limit": "9" * 5000}), "limit"),
    ]
    for r, words in cases:
        assert 400 <= r.status_code < 500, (r.request.content[:120], r.status_code, r.text[:300])
        body = r.json()
        assert words in body["error"] and body["category"] == "user", (r.request.content[:120], body)
    d = _datum(tokens, "importance_sampling")
    d.loss_fn_inputs["advantages"] = types.TensorData(data=[float("nan")] * len(tokens), dtype="float32",
                                                      shape=[len(tokens)])
    r = http.post("/forward_backward", content=_fwdbwd_body(model_id, 1, [d], "importance_sampling"),
                  headers=PROTO)
    assert r.status_code == 400 and "advantages" in r.json()["error"] and "finite" in r.json()["error"]
    # none of it reached the model: it still trains, and its weights are finite
    r = http.post("/forward_backward", content=_fwdbwd_body(model_id, 2, [_datum(tokens, "cross_entropy")]),
                  headers=PROTO)
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 3,
                                       "adam_params": {"learning_rate": 1e-2}})
    assert np.isfinite(_retrieve(served, r.json()["request_id"])["metrics"]["grad_norm:mean"])
    r = http.post("/save_weights", json={"model_id": model_id, "seq_id": 4, "path": "fine_name-1.0"})
    path = _retrieve(served, r.json()["request_id"])["path"]
    assert http.post("/weights_info", json={"tinker_path": path}).status_code == 200  # a saved name loads
    r = http.post("/asample", content=sample('{"max_tokens": 2, "temperature": 0.5, "seed": 3}').encode())
    assert len(_retrieve(served, r.json()["request_id"])["sequences"][0]["tokens"]) >= 1


def _sparse(shape: list[int], rows: int | None = None) -> types.TensorData:
    """A sparse loss input that declares ``shape`` and lists no value: small on the wire, huge if
    densified."""
    rows = shape[0] if rows is None else rows
    return types.TensorData(data=[], dtype="float32", shape=shape, sparse_crow_indices=[0] * (rows + 1),
                            sparse_col_indices=[])


def test_declared_shapes_are_checked_before_anything_is_allocated(served, training, tiny_model_dir,
                                                                   tokenizer):
    """A small request whose sparse ``weights`` declares [20000, 20000] (1.6 GB dense) is a 400 naming the
    field, the shape and the bound, and the server's memory stays where it was; so is every other shape
    that does not fit its datum. A sparse input that fits trains."""
    tokens = _tokens(tokenizer)
    n = len(tokens)
    rss_before = served.rss_bytes()
    huge = _datum(tokens, "cross_entropy")
    huge.loss_fn_inputs["weights"] = _sparse([20000, 20000])
    assert len(_fwdbwd_body(training.model_id, 1, [huge])) > 150_000  # the row offsets are most of it
    with pytest.raises(tinker.BadRequestError) as err:  # the real SDK sends it
        training.forward_backward([huge], "cross_entropy").result(timeout=60)
    assert "loss_fn_inputs['weights']" in str(err.value) and "[20000, 20000]" in str(err.value), \
        str(err.value)
    assert f"the datum's {n} tokens" in str(err.value)

    def with_input(name: str, td: types.TensorData) -> types.Datum:
        d = _datum(tokens, "cross_entropy")
        d.loss_fn_inputs[name] = td
        return d

    unsorted = types.TensorData(data=[1.0, 1.0], dtype="float32", shape=[n, 4],
                                sparse_crow_indices=[0, 2] + [2] * n, sparse_col_indices=[3, 1])
    cases = [  # (datum, the field, what the error says)
        (with_input("weights", _sparse([60000, 60000])), "weights",
         f"[60000, 60000]; a loss input is (N,) or (N, K) with N the datum's {n} tokens"),
        (with_input("weights", _sparse([n, 10**6])), "weights",
         f"[{n}, 1000000]; its K (second dimension) must be between 1 and 128"),
        (with_input("weights", _sparse([n, 0])), "weights", "between 1 and 128"),
        (with_input("weights", _sparse([n, -4])), "weights", "between 1 and 128"),
        (with_input("weights", _sparse([n], rows=n)), "weights", f"sparse but declares shape [{n}]"),
        (with_input("weights", _sparse([n, 4], rows=n + 5)), "weights", "not a valid sparse (CSR) tensor"),
        (with_input("weights", unsorted), "weights", "not a valid sparse (CSR) tensor"),
        (with_input("weights", types.TensorData(data=[0.5] * n * 200, dtype="float32", shape=[n, 200])),
         "weights", "between 1 and 128"),
        (with_input("weights", types.TensorData(data=[0.5] * 8 * n, dtype="float32", shape=[n, 2, 4])),
         "weights", f"[{n}, 2, 4]"),
        (with_input("target_tokens", types.TensorData(data=tokens + [1], dtype="int64", shape=[n + 1])),
         "target_tokens", f"[{n + 1}]"),
        (with_input("target_tokens", types.TensorData(data=tokens + [1, 2], dtype="int64")), "target_tokens",
         f"[{n + 2}]"),
        (with_input("unused_extra", _sparse([30000, 30000])), "unused_extra", "[30000, 30000]"),
    ]
    http = served.http
    model_id = _create_model(served, tiny_model_dir, _session(served))
    for seq, (datum, field, words) in enumerate(cases, start=1):
        r = http.post("/forward_backward", content=_fwdbwd_body(model_id, seq, [datum]), headers=PROTO)
        error = r.json()["error"]
        assert r.status_code == 400 and f"loss_fn_inputs[{field!r}]" in error and words in error, (seq, error)
        assert error.startswith("data[0]: ") and "\n" not in error
    grown = served.rss_bytes() - rss_before
    assert grown < 200 << 20, f"server memory grew by {grown >> 20} MiB"
    # a sparse (N, 1) weights input that fits is used as it is; the model trains on
    weights = types.TensorData(data=[0.5] * n, dtype="float32", shape=[n, 1],
                               sparse_crow_indices=list(range(n + 1)), sparse_col_indices=[0] * n)
    out = training.forward_backward([with_input("weights", weights)], "cross_entropy").result(timeout=60)
    assert np.isfinite(out.metrics["loss:sum"])
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": len(cases) + 1,
                                       "adam_params": {"learning_rate": 1e-3}})
    assert "metrics" in _retrieve(served, r.json()["request_id"])  # the refused requests held nothing up


# ------------------------------------------------------------- limits: per request, per key, slow clients
@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    """A server with small limits, to reach each of them."""
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("limited-store"), "--long-poll", "1",
               "--max-request-tokens", "64", "--max-request-datums", "4", "--max-target-k", "4",
               "--max-tokens-in-flight", "128", "--max-samples-in-flight", "8", "--max-checkpoints", "3",
               "--header-timeout", "1", "--body-timeout", "1")
    yield s
    s.stop()


def _post_until_admitted(http: httpx.Client, url: str, **kwargs) -> httpx.Response:
    """POST, waiting out 429s as the SDK does (a key's in-flight amounts are released just after its
    requests finish)."""
    for _ in range(100):
        r = http.post(url, **kwargs)
        if r.status_code != 429:
            return r
        time.sleep(float(r.headers["Retry-After"]) / 10)
    raise AssertionError(f"{url} still refused: {r.text}")


def test_request_limits_are_400s_and_the_sdk_splits_its_batches_under_them(limited, tiny_model_dir):
    http = limited.http
    session = _session(limited)
    model_id = _create_model(limited, tiny_model_dir, session)
    long = list(range(5, 70))  # 65 tokens

    def wide(n: int) -> types.Datum:  # 16 tokens, three (16, 4) inputs: 192 values
        d = _datum(list(range(5, 5 + n)), "cross_entropy")
        for name in ("target_tokens", "weights", "mask"):
            d.loss_fn_inputs[name] = types.TensorData(data=[1] * n * 4,
                                                      dtype="int64" if name == "target_tokens" else "float32",
                                                      shape=[n, 4])
        return d

    narrow = _datum([5, 6, 7, 8, 9], "cross_entropy")
    too_wide = _datum([5, 6, 7, 8, 9], "cross_entropy")
    too_wide.loss_fn_inputs["weights"] = types.TensorData(data=[1.0] * 25, dtype="float32", shape=[5, 5])
    cases = [
        ([narrow] * 5, "holds 5 datums; this server takes at most 4 per request (--max-request-datums)"),
        ([_datum(long, "cross_entropy")], "holds 65 tokens; this server takes at most 64 per request"),
        ([too_wide], "declares shape [5, 5]; its K (second dimension) must be between 1 and 4 "
                     "(--max-target-k)"),
        ([wide(16)] * 4, "hold 768 values (sparse ones counted dense); this server takes at most 512 "
                         "per request"),
        # a datum costs a token at least, so the limits on tokens bound datums too
        ([narrow, types.Datum(model_input=types.ModelInput(chunks=[]), loss_fn_inputs={})],
         "data[1]: model_input is empty"),
    ]
    for seq, (data, words) in enumerate(cases, start=1):
        r = http.post("/forward_backward", content=_fwdbwd_body(model_id, seq, data), headers=PROTO)
        assert r.status_code == 400 and words in r.json()["error"], (seq, r.text)
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": len(cases) + 1,
                                       "adam_params": {"learning_rate": 1e-3}})
    assert "metrics" in _retrieve(limited, r.json()["request_id"])  # the refused ones used up their seq_ids
    http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                "base_model": tiny_model_dir})
    for tokens, n, words in ((long, 1, "prompt of 65 tokens is longer than this server takes (64"),
                             ([5, 6], 9, "num_samples 9 is more than this server lets a key have in flight "
                                         "(8")):
        r = http.post("/asample", json={"sampling_session_id": f"{session}:sample:0", "num_samples": n,
                                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                                        "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 400 and words in r.json()["error"] and r.json()["category"] == "user", r.text

    config = http.post("/client/config", json={}).json()
    assert config["fwdbwd_max_chunk_len"] == 4 and config["fwdbwd_max_chunk_bytes_count"] == 12 * 64
    sdk = limited.sdk(KEY)
    tc = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
    data = [_datum([5 + i, 6, 7, 8, 9], "cross_entropy") for i in range(10)]
    data += [_datum(list(range(5 + i, 35 + i)), "cross_entropy") for i in range(3)]  # 30 tokens each
    out = tc.forward_backward(data, "cross_entropy").result(timeout=120)  # 13 datums, 240 tokens in all
    assert len(out.loss_fn_outputs) == 13 and np.isfinite(out.metrics["loss:sum"])
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [5] * 10 + [30] * 3
    sdk.close("success").result()


def test_a_key_with_too_many_samples_in_flight_gets_429_and_the_sdk_waits(limited, tiny_model_dir):
    """Past a key's samples in flight, sampling requests get 429 with Retry-After (the SDK backs off and
    resubmits); another key samples on meanwhile."""
    http, other = limited.http, limited.other
    session = _session(limited)
    model_id = _create_model(limited, tiny_model_dir, session)
    # a sampler of weights that an operation waiting for seq_id 1 will save: its samples stay in flight
    r = http.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 2,
                                                     "sampling_session_seq_id": 0})
    assert r.status_code == 200, r.text
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}

    def asample(client: httpx.Client, sampler: str, n: int) -> httpx.Response:
        return client.post("/asample", json={"sampling_session_id": sampler, "num_samples": n,
                                             "prompt": prompt, "sampling_params": {"max_tokens": 2}})

    held = asample(http, f"{session}:sample:0", 5)
    assert held.status_code == 200, held.text
    r = asample(http, f"{session}:sample:0", 4)
    assert r.status_code == 429 and float(r.headers["Retry-After"]) > 0, r.text
    assert "this key has 5 samples in flight; 4 more would pass its limit of 8 (--max-samples-in-flight)" in \
        r.json()["error"] and r.json()["category"] == "user"
    other_session = _session(limited, other)
    other.post("/create_sampling_session", json={"session_id": other_session, "sampling_session_seq_id": 0,
                                                 "base_model": tiny_model_dir})
    r = asample(other, f"{other_session}:sample:0", 8)
    assert len(_retrieve(limited, r.json()["request_id"], http=other)["sequences"]) == 8

    sdk = limited.sdk(KEY)
    waiting = sdk.create_sampling_client(base_model=tiny_model_dir).result().sample(
        types.ModelInput.from_ints([5, 6, 7]), 4, types.SamplingParams(max_tokens=2)).future()
    time.sleep(2)
    assert not waiting.done()  # refused (429) and retrying: nothing can finish while the 5 samples are held
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 1,
                                       "adam_params": {"learning_rate": 1e-3}})
    assert "metrics" in _retrieve(limited, r.json()["request_id"])  # seq_id 1 came: the held samples run
    assert len(_retrieve(limited, held.json()["request_id"])["sequences"]) == 5
    assert len(waiting.result(timeout=120).sequences) == 4
    sdk.close("success").result()


def test_a_key_with_too_many_tokens_in_flight_gets_429_or_400_for_data_that_would_wait(limited,
                                                                                       tiny_model_dir):
    """A key's forward_backward data and prompts not yet done count against its tokens in flight. Past it,
    a request that would run now gets 429 (the SDK waits and resubmits); data that would wait for an
    earlier seq_id gets 400 (the SDK sends a call's first chunk only once its later ones are accepted, so
    a 429 would hang the call); the operation others wait for is always let in."""
    http = limited.http
    session = _session(limited)
    model_id = _create_model(limited, tiny_model_dir, session)
    sixty = list(range(5, 65))

    def fwdbwd(seq: int) -> httpx.Response:
        return http.post("/forward_backward", headers=PROTO,
                         content=_fwdbwd_body(model_id, seq, [_datum(sixty, "cross_entropy")]))

    queued = [fwdbwd(2), fwdbwd(3)]  # both wait for seq_id 1: 120 tokens
    assert all(r.status_code == 200 for r in queued), [r.text for r in queued]
    r = fwdbwd(4)
    assert r.status_code == 400 and "waiting for earlier seq_ids would reach 180 tokens, past its limit " \
        "of 128 (--max-tokens-in-flight)" in r.json()["error"], r.text
    first = fwdbwd(1)
    assert first.status_code == 200, first.text
    for r in [first, *queued]:
        assert "loss:sum" in _retrieve(limited, r.json()["request_id"])["metrics"]

    # two sampling prompts held in flight (their sampler waits for another model's seq_id 1) ...
    other_model = _create_model(limited, tiny_model_dir, session, seq=1)
    http.post("/save_weights_for_sampler", json={"model_id": other_model, "seq_id": 2,
                                                 "sampling_session_seq_id": 0})
    held = [http.post("/asample", json={"sampling_session_id": f"{session}:sample:0", "num_samples": 1,
                                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": sixty}]},
                                        "sampling_params": {"max_tokens": 1}}) for _ in range(2)]
    assert all(r.status_code == 200 for r in held), [r.text for r in held]
    r = fwdbwd(5)  # ... so data that would run now waits: 429
    assert r.status_code == 429 and float(r.headers["Retry-After"]) > 0, r.text
    assert "this key has 120 tokens (forward_backward data and sampling prompts) in flight; 60 more " \
           "would pass its limit of 128 (--max-tokens-in-flight)" in r.json()["error"]
    http.post("/optim_step", json={"model_id": other_model, "seq_id": 1,
                                   "adam_params": {"learning_rate": 1e-3}})
    for r in held:
        assert len(_retrieve(limited, r.json()["request_id"])["sequences"]) == 1
    r = _post_until_admitted(http, "/forward_backward", headers=PROTO,
                             content=_fwdbwd_body(model_id, 5, [_datum(sixty, "cross_entropy")]))
    assert "loss:sum" in _retrieve(limited, r.json()["request_id"])["metrics"]


def test_a_key_keeps_at_most_max_checkpoints(limited, tiny_model_dir):
    """Past --max-checkpoints a save is a 403 saying to delete some (its seq_id used up); replacing a
    checkpoint adds none; deleting one makes room; another key has its own quota."""
    http = limited.http
    model_id = _create_model(limited, tiny_model_dir, _session(limited))
    kept = http.get("/checkpoints").json()["cursor"]["total_count"]
    seq = 1

    def save(path: str, kind: str = "save_weights", client: httpx.Client = http, model: str = model_id):
        nonlocal seq
        r = client.post(f"/{kind}", json={"model_id": model, "seq_id": seq, "path": path})
        seq += 1
        return r

    for i in range(3 - kept):
        r = save(f"c{i}", "save_weights" if i % 2 else "save_weights_for_sampler")
        _retrieve(limited, r.json()["request_id"])
    assert http.get("/checkpoints").json()["cursor"]["total_count"] == 3
    for kind in ("save_weights", "save_weights_for_sampler"):
        r = save("one-too-many", kind)
        assert r.status_code == 403 and r.json()["category"] == "user", r.text
        assert "this key keeps 3 checkpoints, the most this server allows per key (--max-checkpoints 3); " \
            "delete some" in r.json()["error"]
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": seq,
                                       "adam_params": {"learning_rate": 1e-3}})
    seq += 1
    assert "metrics" in _retrieve(limited, r.json()["request_id"])  # the refused saves held nothing up
    r = save("c0", "save_weights_for_sampler")  # replaces one: allowed
    assert _retrieve(limited, r.json()["request_id"])["path"].endswith("/sampler_weights/c0")
    sdk = limited.sdk(KEY)
    tc = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
    with pytest.raises(tinker.PermissionDeniedError, match="delete some"):
        tc.save_state("sdk-save").result(timeout=60)
    http.delete(f"/training_runs/{model_id}/checkpoints/sampler_weights/c0").raise_for_status()
    assert tc.save_state("sdk-save").result(timeout=60).path.endswith("/weights/sdk-save")
    sdk.close("success").result()
    # the other key's quota is its own
    other_model = _create_model(limited, tiny_model_dir, _session(limited, limited.other), http=limited.other)
    seq = 1
    r = save("theirs", client=limited.other, model=other_model)
    assert _retrieve(limited, r.json()["request_id"], http=limited.other)["path"].endswith("/weights/theirs")


def _drip_until_closed(sock, drip: bytes, bound_s: float = 30.0) -> tuple[float, bytes]:
    """Send ``drip`` a byte every 0.2 s, reading meanwhile; (seconds until the server closed the connection,
    what it answered). An AssertionError if it is still open after ``bound_s``."""
    import select

    start, sent, answer = time.monotonic(), 0, b""
    while time.monotonic() - start < bound_s:
        if select.select([sock], [], [], 0.2)[0]:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return time.monotonic() - start, answer
            answer += data
        elif sent < len(drip):
            try:
                sock.sendall(drip[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start, answer
            sent += 1
    raise AssertionError(f"the server kept a slow client's connection open for {bound_s} s "
                         f"({sent} bytes sent)")


def _exchange(sock, request: bytes) -> bytes:
    """One request on a kept-alive connection; the response's status line."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed; got {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_slow_clients_are_closed(limited):
    """A connection whose request headers, or body, trickle in (or never come) is closed once --header-timeout
    or --body-timeout (1 s here) has passed, however steadily it drips; a kept-alive connection that idles
    between requests is not."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(limited.url)
    head = (f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
    cases = {  # what is sent at once, what is dripped
        "silent": (b"", b""),
        "headers": (b"", b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000),
        "body": (head, b"{" + b" " * 99_999),
    }
    for what, (prefix, drip) in cases.items():
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(prefix)
            _, answer = _drip_until_closed(sock, drip)
            if what != "body":
                assert answer.startswith(b"HTTP/1.1 408"), (what, answer)
    healthz = f"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\n\r\n".encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        assert _exchange(sock, healthz) == b"HTTP/1.1 200 OK"
        time.sleep(2.5)  # idle between requests, longer than the header timeout
        assert _exchange(sock, healthz) == b"HTTP/1.1 200 OK"
    assert limited.alive()


def test_finished_and_abandoned_sessions_are_freed_and_base_sampling_goes_on(tiny_model_dir, tmp_path):
    """A session's end releases its models, samplers and results; deleting the last adapter of a base
    model leaves that base model's own sampling working."""
    import asyncio

    from polyrl.config.schema import LocalEngineConfig
    from polyrl.serve import protocol as P
    from polyrl.serve.server import ServeConfig, Server

    server = Server(ServeConfig(models=[tiny_model_dir], api_keys=[KEY],
                                local=LocalEngineConfig(store_dir=str(tmp_path)), preload=False))
    me = "owner-digest"
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}

    async def result(rid: str) -> dict:
        status, body = await server.futures.retrieve(rid, False, me, server.config.long_poll_s)
        assert status == 200 and "error" not in body, body
        return body

    async def sample_base(session: str, seq: int) -> dict:
        server.samplers.create_sampling_session(P.CreateSamplingSessionReq(session_id=session,
                                                                           sampling_session_seq_id=seq,
                                                                           base_model=tiny_model_dir), me)
        rid = server.samplers.sample(P.SampleReq(sampling_session_id=f"{session}:sample:{seq}", prompt=prompt,
                                                 num_samples=2, sampling_params={"max_tokens": 3, "seed": 1}),
                                     me)["request_id"]
        return await result(rid)

    async def use_a_session() -> str:
        session = server.sessions.create([], None, me)["session_id"]
        r = server.training.create_model(P.CreateModelReq(session_id=session, model_seq_id=0,
                                                          base_model=tiny_model_dir,
                                                          lora_config={"rank": 2, "seed": 0}), me)
        await result(r["request_id"])
        await sample_base(session, 0)
        return session

    async def scenario() -> None:
        first = await sample_base(server.sessions.create([], None, me)["session_id"], 0)
        server.finish_session(await use_a_session(), me)
        abandoned = await use_a_session()
        server.sessions[abandoned].last_seen -= server.config.session_timeout_s + 1
        server.tick()
        await asyncio.to_thread(server.engine.call, lambda: None)  # the released adapters are deleted
        again = await sample_base(server.sessions.create([], None, me)["session_id"], 0)
        assert [s["tokens"] for s in again["sequences"]] == [s["tokens"] for s in first["sequences"]]

    asyncio.run(scenario())
    live = set(server.sessions)
    assert len(live) == 2  # the two that only sampled the base model
    assert all(m.session_id in live for m in server.models.values()) and not server.models
    assert all(s.session_id in live for s in server.samplers.values()) and len(server.samplers) == 2
    assert len(server.futures) == 2  # the live sessions' two sampling results
    base = server.engine.base(tiny_model_dir)
    assert not [a for a in base._adapter_specs if a.startswith("train_")]


def test_operations_run_in_seq_order_once_each(served, tiny_model_dir, tokenizer):
    http = served.http
    model_id = _create_model(served, tiny_model_dir, _session(served))
    tokens = _tokens(tokenizer)
    # chunks of one forward_backward (seq 1, 2) and the optimizer step (seq 3) arrive in reverse order
    r3 = http.post("/optim_step", json={"model_id": model_id, "seq_id": 3,
                                        "adam_params": {"learning_rate": 1e-2}})
    r2 = http.post("/forward_backward", content=_fwdbwd_body(model_id, 2, [_datum(tokens, "cross_entropy")]),
                   headers=PROTO)
    # nothing can run before seq 1 arrives: the long poll answers 408 with try_again
    r = http.post("/retrieve_future", json={"request_id": r3.json()["request_id"]})
    assert r.status_code == 408 and r.json()["type"] == "try_again"
    r1 = http.post("/forward_backward", content=_fwdbwd_body(model_id, 1, [_datum(tokens, "cross_entropy")]),
                   headers=PROTO)
    dup = http.post("/forward_backward", content=_fwdbwd_body(model_id, 1, [_datum(tokens, "cross_entropy")]),
                    headers=PROTO)
    assert dup.json()["request_id"] == r1.json()["request_id"]  # a retried POST is not run twice
    out1 = _retrieve(served, r1.json()["request_id"], proto=True)
    out2 = _retrieve(served, r2.json()["request_id"], proto=True)
    from tinker.proto.response_conv import deserialize_forward_backward_output

    f1, f2 = deserialize_forward_backward_output(out1), deserialize_forward_backward_output(out2)
    assert f1.metrics["loss:sum"] == pytest.approx(f2.metrics["loss:sum"], rel=1e-6)  # both before the step
    assert _retrieve(served, r3.json()["request_id"])["metrics"]["grad_norm:mean"] > 0  # both gradients in it
    json_out = _retrieve(served, r1.json()["request_id"])  # without Accept: protobuf, the same result as JSON
    assert json_out["metrics"] == pytest.approx(f1.metrics)
    stale = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}})
    assert stale.json()["request_id"] == r2.json()["request_id"]

    # a seq_id that never arrives holds later operations only until the gap timeout (6 s here)
    r5 = http.post("/optim_step", json={"model_id": model_id, "seq_id": 5,
                                        "adam_params": {"learning_rate": 1e-2}})
    failed = _retrieve(served, r5.json()["request_id"], deadline_s=30)
    assert "seq_id(s) [4]" in failed["error"] and failed["category"] == "user"
    r6 = http.post("/optim_step", json={"model_id": model_id, "seq_id": 6,
                                        "adam_params": {"learning_rate": 1e-2}})
    assert "metrics" in _retrieve(served, r6.json()["request_id"])


def test_ordered_ops_unit():
    ran = []

    def submit(fn):
        fut = Future()
        fut.set_result(fn())
        return fut

    futures = Futures()
    ops = OrderedOps(submit, futures)
    r2 = ops.submit(2, lambda: ran.append(2), dict)
    assert ran == [] and ops.gap_since is not None
    r1 = ops.submit(1, lambda: ran.append(1), dict)
    assert ran == [1, 2] and ops.submit(2, lambda: ran.append(99), dict) == r2 and r1 != r2
    with pytest.raises(RequestError):
        ops.submit(0, lambda: None, dict)
    ops.submit(4, lambda: ran.append(4), dict)
    ops.refuse(3, RequestError(400, "bad body"))
    assert ran == [1, 2, 4]
    ops.submit(6, lambda: ran.append(6), dict)
    ops.check_gap(timeout=10, now=ops.gap_since + 5)
    assert ran == [1, 2, 4] and 6 in ops.waiting
    ops.check_gap(timeout=10, now=ops.gap_since + 11)
    assert ran == [1, 2, 4] and not ops.waiting and ops.next_seq == 7
    assert isinstance(futures.get(ops.seen[5]).future.exception(), RequestError)
    ops.submit(7, lambda: ran.append(7), dict)
    ops.close("released")
    assert ran == [1, 2, 4, 7]
    with pytest.raises(RequestError):
        ops.submit(8, lambda: None, dict)


def test_state_survives_a_restart(tiny_model_dir, tmp_path, tokenizer):
    store = tmp_path / "store"
    tokens = _tokens(tokenizer, "remember this")
    first = Served(tiny_model_dir, store)
    try:
        sc = first.sdk(KEY)
        tc = sc.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=1,
                                            user_metadata={"renderer_name": "qwen3"}).result()
        tc.forward_backward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("before-restart").result()
        sampler_path = tc.save_weights_for_sampler("before-restart").result().path
        ref = tc.forward([_datum(tokens, "cross_entropy")],
                         "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        run_id = tc.model_id
        sc.close("success").result()
    finally:
        first.stop()
    second = Served(tiny_model_dir, store)
    try:
        rest = tinker.RestClient(base_url=second.url, api_key=KEY)
        assert rest.get_training_run(run_id).result().user_metadata == {"renderer_name": "qwen3"}
        assert {c.tinker_path
                for c in rest.list_checkpoints(run_id).result().checkpoints} == {state.path, sampler_path}
        sc = second.sdk(KEY)
        tc = sc.create_training_client_from_state_with_optimizer(state.path).result()
        got = tc.forward([_datum(tokens, "cross_entropy")],
                         "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        np.testing.assert_allclose(got.to_numpy(), ref.to_numpy(), atol=1e-6)
        tc.forward_backward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = sc.create_sampling_client(model_path=sampler_path).result()
        lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        np.testing.assert_allclose(lp[1:], ref.to_numpy()[:-1], atol=1e-4)
        sc.close("success").result()
    finally:
        second.stop()


# ------------------------------------------------------------------- polyrl's own tinker backend
class _LetterEnv:
    """Reward 1 when the reply has an even number of characters: a tiny random model gets it about half
    the time, so nearly every group of 4 has an advantage to train on."""

    def reset(self):
        return Observation([{"role": "user", "content": "Write a word."}])

    def step(self, action):
        return StepResult(reward=float(len(action["content"]) % 2 == 0), done=True)

    def close(self):
        return None


@register_env("serve_test_letter")
class _LetterBuilder(EnvBuilder):
    def make(self, split, index):
        return _LetterEnv()


@pytest.mark.slow
def test_polyrl_train_through_the_server_matches_in_process(served, tiny_model_dir, tmp_path, monkeypatch):
    from polyrl.config.schema import TrainConfig
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    monkeypatch.setenv("TINKER_API_KEY", KEY)

    def run(name, **over):
        cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=8, batch_size=4, max_steps=3, max_tokens=6,
                          save_every=2, learning_rate=3e-3, log_path=str(tmp_path / name), seed=3,
                          environments={"letter": {"type": "serve_test_letter", "num_rollouts": 4}}, **over)
        train(cfg, ConsoleLog(enabled=False))
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    local = run("local", local={"store_dir": str(tmp_path / "store")})
    remote = run("remote", backend="tinker", base_url=served.url)
    assert [r["step"] for r in remote] == [0, 1, 2]
    for a, b in zip(local, remote):
        keys = {k for k in a if not k.startswith("time/")}
        assert keys == {k for k in b if not k.startswith("time/")}
        assert {"reward/mean", "optim/loss", "optim/kl_sample_train_v1", "optim/grad_norm"} <= keys
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["step"], key)
    cps = [json.loads(x) for x in (tmp_path / "remote" / "checkpoints.jsonl").read_text().splitlines()]
    assert cps[-1]["state_path"].startswith("tinker://sess-")
    # the run ended its session (no heartbeats left running in this process, nothing kept alive)
    session = cps[-1]["state_path"].removeprefix("tinker://").split(":train:")[0]
    rest = tinker.RestClient(base_url=served.url, api_key=KEY)
    assert session.startswith("sess-") and session not in rest.list_sessions(limit=1000).result().sessions


# --------------------------------------------------------------------- tinker-cookbook, unmodified
def _cookbook(module: str, served: Served, tmp_path: Path, *args: str, log_dir: str = "delete",
              cwd: Path | None = None, log_dir_arg: bool = True) -> subprocess.CompletedProcess:
    """A tinker-cookbook module run as its users run it, logging to ``tmp_path / 'log'``; ``cwd`` (default
    ``tmp_path``) is where relative model and data set names resolve; ``log_dir_arg=False`` for a recipe
    without a ``behavior_if_log_dir_exists`` option."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets-cache")}
    log_args = [f"behavior_if_log_dir_exists={log_dir}"] if log_dir_arg else []
    cmd = [sys.executable, "-m", module, f"base_url={served.url}", f"log_path={tmp_path / 'log'}", *log_args,
           *args]
    return subprocess.run(cmd, env=env, cwd=cwd or tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cookbook_math_rl_recipe(served, tiny_model_dir, tmp_path):
    common = [f"model_name={tiny_model_dir}", "renderer_name=qwen3", "env=arithmetic", "groups_per_batch=4",
              "group_size=2", "lora_rank=4", "max_tokens=8", "eval_every=0", "save_every=1", "max_steps=2"]
    # at its default loss, stable_reinforce: recording samplers, provenance spans on every datum
    done = _cookbook("tinker_cookbook.recipes.math_rl.train", served, tmp_path, *common)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert any("env/all/reward/total" in r for r in rows)
    cps = [json.loads(x) for x in (tmp_path / "log" / "checkpoints.jsonl").read_text().splitlines()]
    assert cps[-1]["state_path"].startswith("tinker://")
    # resuming: the cookbook loads the last state (weights and optimizer, in a new session) and carries on
    more = _cookbook("tinker_cookbook.recipes.math_rl.train", served, tmp_path, *common[:-1], "max_steps=3",
                     log_dir="resume")
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"Resumed training from {cps[-1]['state_path']}" in more.stderr
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "env/all/reward/total" in r] == [0, 1, 2]


@pytest.mark.slow
def test_cookbook_supervised_recipe(served, tiny_model_dir, tmp_path):
    import tinker_cookbook

    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    done = _cookbook("tinker_cookbook.recipes.chat_sl.train", served, tmp_path,
                     f"model_name={tiny_model_dir}", "renderer_name=qwen3", f"dataset={data}", "batch_size=4",
                     "max_steps=2", "lora_rank=4",
                     "eval_every=0", "save_every=1", "max_length=256")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert any(np.isfinite(r.get("train_mean_nll", np.nan)) for r in rows)


def test_api_keys_from_options_file_and_environment(tmp_path, monkeypatch):
    import argparse

    from polyrl.serve.main import KEYS_ENV, add_arguments, api_keys

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).host == "127.0.0.1"  # loopback unless asked otherwise
    monkeypatch.delenv(KEYS_ENV, raising=False)
    keys, generated = api_keys(p.parse_args([]))
    assert generated and len(keys) == 1 and keys[0].startswith("tml-") and len(keys[0]) > 20
    f = tmp_path / "keys"
    f.write_text("# team keys\ntml-from-file  # alice\n\ntml-second\n")
    monkeypatch.setenv(KEYS_ENV, "tml-env-1, tml-env-2")
    keys, generated = api_keys(p.parse_args(["--api-key", "tml-arg", "--api-key-file", str(f)]))
    assert not generated and keys == ["tml-arg", "tml-from-file", "tml-second", "tml-env-1", "tml-env-2"]


def test_limits_on_the_command_line_default_to_the_servers():
    import argparse
    import dataclasses

    from polyrl.serve.main import add_arguments, config_from_args
    from polyrl.serve.server import ServeConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given, default = config_from_args(parser.parse_args([]), [KEY]), ServeConfig()
    names = [f.name for f in dataclasses.fields(ServeConfig)
             if f.name.startswith("max_") or "timeout" in f.name]
    assert len(names) >= 10
    assert {n: getattr(given, n) for n in names} == {n: getattr(default, n) for n in names}


def test_engine_settings_on_the_command_line_are_the_train_configs():
    """``polyrl serve``'s engine flags fill the same LocalEngineConfig as ``local:`` in a run config."""
    import argparse

    from polyrl.config.schema import LocalEngineConfig, TrainConfig
    from polyrl.serve.main import add_arguments, config_from_args
    from polyrl.serve.server import ServeConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([]), [KEY]).local == LocalEngineConfig() == ServeConfig().local
    assert LocalEngineConfig() == TrainConfig(model_name="m", environments={"arithmetic": {}}).local
    flags = ["--store-dir", "s", "--device", "cpu", "--dtype", "float32", "--micro-batch-tokens", "512",
             "--gradient-checkpointing", "true"]
    assert config_from_args(parser.parse_args(flags), [KEY]).local == LocalEngineConfig(
        store_dir="s", device="cpu", dtype="float32", micro_batch_tokens=512, gradient_checkpointing=True)


def test_serve_command_line_errors_are_one_line(tmp_path):
    """Each mistake is named, before anything binds the port: the other cases ask for a port in use, and
    still hear about their own mistake."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = ["--port", str(busy.getsockname()[1])]
    try:
        cases = [
            (["--port", "70000"], "--port"),
            (taken, "in use"),
            ([*taken, "--models", str(tmp_path / "no-such-model")], "no such model directory"),
            ([*taken, "--api-key-file", str(tmp_path / "no-keys")], "no-keys"),
            ([*taken, "--device", "warp-drive"], "--device"),
            ([*taken, "--max-checkpoints", "0"], "--max-checkpoints must be a positive integer"),
            ([*taken, "--max-lora-rank", "0"], "--max-lora-rank must be a positive integer"),
            ([*taken, "--header-timeout", "-1"], "--header-timeout must be a positive number of seconds"),
            ([*taken, "--micro-batch-tokens", "0"], "--micro-batch-tokens must be a positive integer"),
            ([*taken, "--sampler", "vllm", "--vllm-python", str(tmp_path / "no-python")],
             "vLLM's interpreter"),
            ([*taken, "--vllm-url", "localhost:8000"], "--vllm-url 'localhost:8000' is not an http(s) URL"),
        ]
        for args, words in cases:
            done = subprocess.run([sys.executable, "-m", "polyrl.cli", "serve", "--api-key", KEY,
                                   "--no-preload", "--store-dir", str(tmp_path / "store"), *args],
                                  capture_output=True, text=True, timeout=120)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, (args, done.returncode, done.stderr[-2000:])
            assert lines[0].startswith("error: ") and words in lines[0], (args, lines)
    finally:
        busy.close()


# ------------------------------------------------------------------------------------------ fuzzing
class Raw(str):
    """JSON text spliced into a request body as it is (NaN, a 5,000-digit number, deep nesting)."""


EVIL = [Raw("9" * 5000), Raw("-1"), Raw("0"), Raw("3000000"), Raw(str(2**63)), Raw(str(10**30)), Raw("NaN"),
        Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-0.0"), Raw("1.5"), Raw('""'),
        Raw(json.dumps("x" * 300)), Raw('".hidden"'), Raw('"../../etc"'), Raw('"a/b"'),
        Raw('"tinker://../weights/x"'), Raw("null"), Raw("[]"),
        Raw("{}"), Raw("true"), Raw(json.dumps("\u00e9\u0000\U0001f600")), Raw("[" * 3000 + "]" * 3000),
        Raw('{"type": "dimuon"}'), Raw('[1e308, -1e308]')]
EVIL_IDS = ["..", "%2e%2e", "a" * 300, "sess-0:train:0", "\u00e9", "-", "x" * 5000, "%00", "sess-0:sample:0"]


def _dumps(tree) -> str:
    raws: list[Raw] = []

    def mark(x):
        if isinstance(x, Raw):
            raws.append(x)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(x, dict):
            return {k: mark(v) for k, v in x.items()}
        if isinstance(x, list):
            return [mark(v) for v in x]
        return x

    text = json.dumps(mark(tree))
    for i, r in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', r, 1)
    return text


def _slots(tree) -> list[tuple[object, object]]:
    """(container, key) of every value in a JSON tree."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for k, v in items:
        out.append((tree, k))
        out.extend(_slots(v))
    return out


class Actor:
    """One API key's client in the fuzz run: its own session, model, sampler and checkpoint, which it
    uses correctly, mutates, or swaps for the other actor's."""

    ID_FIELDS = ("session_id", "model_id", "sampling_session_id", "request_id", "path", "model_path",
                 "tinker_path")

    def __init__(self, served: Served, key: str, seed: int, model_dir: str):
        import random

        self.served, self.key, self.model_dir = served, key, model_dir
        self.http = served.client(key)
        self.rng = random.Random(seed)
        self.sessions: list[str] = []
        self.request_ids: list[str] = []
        self.other: Actor | None = None
        self.failures: list[str] = []
        self.statuses: Counter[int] = Counter()
        self.huge_shapes = 0
        self.sent = 0
        self.n = 0  # for unique names and seq ids of new models / samplers
        self.extra_sessions: list[str] = []  # made by fuzzed create_session requests, left open
        self.limits: Counter[str] = Counter()  # the per-key limits that refused a request (flag -> count)
        self.start_session()

    def start_session(self) -> None:
        r = self.http.post("/create_session", json={"tags": [], "sdk_version": "test"})
        if r.status_code == 403:  # the key has --max-sessions live ones: finish those the fuzzing made
            for extra in self.extra_sessions:
                self.http.post(f"/sessions/{extra}/finish", json={})
            self.extra_sessions = []
            r = self.http.post("/create_session", json={"tags": [], "sdk_version": "test"})
        self.session = r.json()["session_id"]
        self.sessions.append(self.session)
        self.request_ids = []  # a finished session's results are gone
        self.model_id = _create_model(self.served, self.model_dir, self.session, http=self.http)
        self.seq = 1
        for _ in range(20):
            r = self.http.post("/save_weights", json={"model_id": self.model_id, "seq_id": self.next_seq(),
                                                      "path": "seed"})
            if r.status_code != 403:
                break
            # the key keeps as many checkpoints as it may: delete one, as its owner must (the refusal used the
            # seq_id)
            oldest = self.http.get("/checkpoints").json()["checkpoints"][-1]
            run_id = oldest["tinker_path"][len("tinker://"):].split("/")[0]
            self.http.delete(f"/training_runs/{run_id}/checkpoints/{oldest['checkpoint_id']}")
        self.checkpoint = _retrieve(self.served, r.json()["request_id"], http=self.http)["path"]
        self.http.post("/create_sampling_session", json={"session_id": self.session,
                                                         "sampling_session_seq_id": 0,
                                                         "base_model": self.model_dir})
        self.sampler = f"{self.session}:sample:0"

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def ids(self) -> dict[str, str]:
        rid = self.rng.choice(self.request_ids) if self.request_ids else "0" * 32
        return {"session_id": self.session, "model_id": self.model_id, "sampling_session_id": self.sampler,
                "request_id": rid, **dict.fromkeys(("path", "model_path", "tinker_path"), self.checkpoint)}

    # ---- requests, as a correct client sends them ---------------------------------------------------
    def valid(self):
        self.n += 1
        n, rng = self.n, self.rng
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]}
        kinds = [
            ("POST", "/create_session", {"tags": ["fuzz"], "sdk_version": "fuzz",
                                         "user_metadata": {"n": str(n)}}),
            ("POST", "/create_model", {"session_id": self.session, "model_seq_id": 2000 + n,
                                       "base_model": self.model_dir,
                                       # past --max-lora-rank, the model's width, --max-models
                                       "lora_config": {"rank": rng.choice([1, 2, 12, 20, 33, 100_000]),
                                                       "seed": n}}),
            ("POST", "/session_heartbeat", {"session_id": self.session}),
            ("POST", "/get_info", {"model_id": self.model_id}),
            ("POST", "/forward_backward", "fwdbwd"),
            ("POST", "/optim_step", {"model_id": self.model_id, "seq_id": self.seq,
                                     "adam_params": {"learning_rate": 1e-3, "grad_clip_norm": 1.0}}),
            ("POST", "/save_weights", {"model_id": self.model_id, "seq_id": self.seq, "path": f"c{n}"}),
            ("POST", "/save_weights_for_sampler", {"model_id": self.model_id, "seq_id": self.seq,
                                                   "path": f"s{n}"}),
            ("POST", "/save_weights_for_sampler", {"model_id": self.model_id, "seq_id": self.seq,
                                                   "sampling_session_seq_id": 1000 + n}),
            ("POST", "/load_weights", {"session_id": self.session, "model_seq_id": 1000 + n,
                                       "path": self.checkpoint, "optimizer": rng.random() < 0.5}),
            ("POST", "/create_sampling_session", {"session_id": self.session, "sampling_session_seq_id": n,
                                                  "model_path": self.checkpoint}),
            ("POST", "/asample", {"sampling_session_id": self.sampler, "seq_id": n, "prompt": prompt,
                                  # past --max-samples-in-flight: 400 or 429
                                  "num_samples": rng.choice([2, 2, 4, 7]),
                                  "prompt_logprobs": rng.random() < 0.3,
                                  # past --max-decode-tokens-in-flight (20: 2 x 12 is): 400 or 429
                                  "sampling_params": {"max_tokens": rng.choice([3, 3, 3, 12]),
                                                      "temperature": 0.7, "top_k": 5, "seed": n}}),
            ("POST", "/retrieve_future", {"request_id": "?"}),
            ("POST", "/retrieve_future", {"request_id": "?"}),
            ("POST", "/weights_info", {"tinker_path": self.checkpoint}),
            ("GET", f"/samplers/{self.sampler}", None),
            ("GET", "/training_runs", None),
            ("GET", f"/training_runs/{self.model_id}", None),
            ("GET", f"/training_runs/{self.model_id}/checkpoints", None),
            ("GET", "/checkpoints", None),
            ("DELETE", f"/training_runs/{self.model_id}/checkpoints/sampler_weights/"
                       f"s{n - rng.randint(1, 20)}", None),
            ("GET", "/get_server_capabilities", None),
        ]
        method, url, body = rng.choice(kinds)
        if body == "fwdbwd":
            body = self.fwdbwd()
        elif isinstance(body, dict) and body.get("request_id") == "?":
            body = {"request_id": self.ids()["request_id"]}
        if isinstance(body, dict) and "seq_id" in body and body["seq_id"] == self.seq:
            self.next_seq()
        return method, url, body

    def fwdbwd(self) -> bytes:
        loss = self.rng.choice(["cross_entropy", "importance_sampling", "ppo"])
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(_fwdbwd_body(self.model_id, self.next_seq(), [_datum([5, 6, 7, 8, 9], loss)],
                                         loss))
        if self.rng.random() < 0.5:  # mutate the protobuf's fields
            choice = self.rng.randrange(9)
            if choice == 0:
                msg.seq_id = self.rng.choice([0, -5, 3_000_000, 2**31 - 1, self.seq + 2])
            elif choice == 1:
                msg.loss_fn = self.rng.choice(["", "nope", "stable_reinforce", "x" * 1000])
            elif choice == 2:
                t = msg.data[0].loss_fn_inputs["target_tokens"]
                t.dense = np.array([5, 6, 10**9, -1, 7], dtype=np.int64).tobytes()
            elif choice == 3 and "advantages" in msg.data[0].loss_fn_inputs:
                bad = np.array([np.nan, np.inf, 1, 1, 1], np.float32)
                msg.data[0].loss_fn_inputs["advantages"].dense = bad.tobytes()
            elif choice == 4:
                msg.data[0].loss_fn_inputs["target_tokens"].shape[:] = [7, 3]
            elif choice in (5, 6, 7):  # a sparse input declaring a shape gigabytes large, in a few bytes
                self.huge_shapes += 1
                t = msg.data[0].loss_fn_inputs[self.rng.choice(["weights", "advantages", "target_tokens",
                                                                "extra"])]
                t.Clear()
                t.dtype = pb.DTYPE_FLOAT32
                t.shape[:] = self.rng.choice([[20000, 20000], [60000, 60000], [5, 10**9], [5], [-1, 5],
                                              [5, 0]])
                t.sparse_csr.crow_indices = np.zeros(max(t.shape[0], 0) + 1, dtype=np.int64).tobytes()
            else:
                msg.loss_fn_config["clip_low_threshold"] = float("nan")
        body = msg.SerializeToString()
        if self.rng.random() < 0.1:
            cut = self.rng.randrange(len(body))
            body = body[:cut] + bytes([self.rng.randrange(256)]) + body[cut + 1:]
        return body

    # ---- mutations -----------------------------------------------------------------------------------
    def request(self):
        """(method, url, body, foreign): a valid request, often mutated; ``foreign`` when it names the other
        actor's things."""
        method, url, body = self.valid()
        rng, foreign = self.rng, False
        roll = rng.random()
        if roll < 0.2:  # one of the other key's ids instead of ours
            theirs = self.other.ids()
            fields = [f for f in self.ID_FIELDS if isinstance(body, dict) and isinstance(body.get(f), str)]
            if fields:
                field = rng.choice(fields)
                body[field], foreign = theirs[field], True
            elif self.session in url:
                url, foreign = url.replace(self.session, self.other.session), True
            elif isinstance(body, bytes):
                msg = pb.ForwardBackwardRequest()
                try:
                    msg.ParseFromString(body)
                    msg.model_id = self.other.model_id
                    body, foreign = msg.SerializeToString(), True
                except Exception:  # noqa: BLE001 - a body mutated into no protobuf at all
                    pass
        elif roll < 0.55 and isinstance(body, dict):  # an evil value, a missing or an extra field
            slots = _slots(body)
            container, key = rng.choice(slots) if slots else (body, "extra")
            what = rng.random()
            if what < 0.75:
                container[key] = rng.choice(EVIL)
            elif what < 0.9 and isinstance(container, dict):
                del container[key]
            else:
                body[rng.choice(["extra", "type", "seq_id"])] = rng.choice(EVIL)
        elif roll < 0.65:  # odd ids in the URL, odd queries
            if method == "GET" and rng.random() < 0.5:
                limit, offset = (rng.choice(["-1", "9" * 5000, "x", "0", "1000000"]),
                                 rng.choice(["-5", "9" * 30]))
                url += f"?limit={limit}&offset={offset}"
            else:
                parts = url.split("/")
                parts[rng.randrange(1, len(parts))] = rng.choice(EVIL_IDS)
                url = "/".join(parts)
        elif roll < 0.72:  # a broken body
            text = _dumps(body).encode() if isinstance(body, dict) else body or b""
            body = rng.choice([text[: rng.randrange(len(text) + 1)], b"", b"[1, 2]", b"\xff\xfe" + text,
                               text * 2, b'{"a": ' * 2000, bytes(rng.randrange(256) for _ in range(64))])
        return method, url, body, foreign

    def send(self, method: str, url: str, body) -> httpx.Response:
        if isinstance(body, bytes):
            ctype = PROTO["Content-Type"] if url.endswith("forward_backward") else "application/json"
            return self.http.request(method, url, content=body, headers={"Content-Type": ctype})
        if isinstance(body, (dict, list)):
            return self.http.request(method, url, content=_dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return self.http.request(method, url)

    def check(self, method: str, url: str, body, foreign: bool, r: httpx.Response) -> None:
        sent = _dumps(body) if isinstance(body, dict) else repr(body)
        what = f"{method} {url[:120]} {sent[:200]} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 500:
            self.failures.append(f"server error: {what}")
            return
        if foreign and r.status_code < 400:
            self.failures.append(f"reached another key's resource: {what}")
        if r.status_code < 300:
            if any(s in r.text for s in self.other.sessions):
                self.failures.append(f"answer shows another key's session: {what}")
            if r.headers.get("content-type", "").startswith("application/json"):
                payload = r.json()
                if isinstance(payload, dict) and payload.get("category") == "server":
                    self.failures.append(f"a server-side failure: {what}")
                if isinstance(payload, dict) and "request_id" in payload:
                    self.request_ids = (self.request_ids + [payload["request_id"]])[-50:]
        elif r.status_code != 408 or url != "/retrieve_future":
            payload = r.json()
            if not (isinstance(payload.get("error"), str) and payload.get("category") == "user"):
                self.failures.append(f"4xx without a user error: {what}")
            for flag in ("--max-sessions", "--max-models", "--max-lora-rank", "--max-decode-tokens-in-flight",
                         "--max-adapter-bytes"):
                if flag in payload.get("error", ""):
                    self.limits[flag] += 1
        if url == "/create_session" and r.status_code == 200:
            self.extra_sessions.append(r.json()["session_id"])

    def run(self, count: int, deadline: float) -> None:
        while self.sent < count and time.monotonic() < deadline and len(self.failures) < 20:
            if self.rng.random() < 0.01:  # end this session (its model is deleted) and start another
                self.http.post(f"/sessions/{self.session}/finish", json={})
                self.start_session()
            method, url, body, foreign = self.request()
            try:
                r = self.send(method, url, body)
            except httpx.HTTPError as e:
                self.failures.append(f"{method} {url[:120]}: {type(e).__name__}: {e}")
                return
            self.sent += 1
            self.statuses[r.status_code] += 1
            self.check(method, url, body, foreign, r)


@pytest.mark.slow
def test_fuzz_two_keys_then_train_and_sample_with_the_sdk(tiny_model_dir, tmp_path):
    """1,200 seeded, mutated requests from two keys at once: never a 5xx or a server-side failure, never
    another key's things, memory bounded (sparse inputs declaring huge shapes among them), each key's
    checkpoint quota kept and its other limits met (sessions, training clients, LoRA rank, tokens to
    decode); afterwards the official SDK still trains and samples."""
    from concurrent.futures import ThreadPoolExecutor

    served = Served(tiny_model_dir, tmp_path / "store", "--long-poll", "0.2", "--max-body-mb", "1",
                    "--seq-gap-timeout", "1", "--max-samples-in-flight", "6", "--max-checkpoints", "5",
                    "--max-sessions", "6", "--max-models", "4", "--max-lora-rank", "16",
                    "--max-decode-tokens-in-flight", "20")
    try:
        a, b = Actor(served, KEY, 1, tiny_model_dir), Actor(served, OTHER_KEY, 2, tiny_model_dir)
        a.other, b.other = b, a
        rss_before = served.rss_bytes()
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda actor: actor.run(600, started + 150), (a, b)))
        elapsed = time.monotonic() - started
        assert not a.failures + b.failures, "\n".join((a.failures + b.failures)[:20])
        assert a.sent + b.sent >= 1000 and elapsed < 150, (a.sent, b.sent, elapsed)
        time.sleep(2)  # the seq gap timeout (1 s) and housekeeping have run
        grown = served.rss_bytes() - rss_before
        assert grown < 300 << 20, f"server memory grew by {grown >> 20} MiB"
        assert served.alive()
        assert a.huge_shapes + b.huge_shapes >= 3
        assert a.statuses[403] > 0 and b.statuses[403] > 0  # the checkpoint quota was reached ...
        for flag in ("--max-sessions", "--max-models", "--max-lora-rank", "--max-decode-tokens-in-flight"):
            assert a.limits[flag] + b.limits[flag] > 0, (flag, a.limits, b.limits)  # each limit was met
        for actor in (a, b):
            actor.http.post(f"/sessions/{actor.session}/finish", json={})
            kept = actor.http.get("/checkpoints", params={"limit": 1000}).json()["checkpoints"]
            assert len(kept) <= 5, [c["tinker_path"] for c in kept]  # ... and held, per key
            for c in kept:  # make room for the SDK's save below
                run_id = c["tinker_path"][len("tinker://"):].split("/")[0]
                actor.http.delete(
                    f"/training_runs/{run_id}/checkpoints/{c['checkpoint_id']}").raise_for_status()

        tokens = [5, 6, 7, 8, 9]
        paths = {}
        for key in (KEY, OTHER_KEY):
            sdk = served.sdk(key)
            tc = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0)
            before = tc.forward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
            for _ in range(3):
                tc.forward_backward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            after = tc.forward([_datum(tokens, "cross_entropy")], "cross_entropy").result()
            assert after.metrics["loss:sum"] < before.metrics["loss:sum"]
            sampler = tc.save_weights_and_get_sampling_client()
            prompt = types.ModelInput.from_ints(tokens)
            out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=1)).result()
            assert len(out.sequences) == 2 and all(len(s.tokens) >= 1 for s in out.sequences)
            base = sdk.create_sampling_client(base_model=tiny_model_dir)
            assert len(base.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result().sequences) == 1
            paths[key] = tc.save_state("after-fuzz").result().path
            sdk.close("success").result()
        sdk = served.sdk(OTHER_KEY)
        with pytest.raises(Exception, match="not found"):
            sdk.create_training_client_from_state(paths[KEY]).result(timeout=60)
        sdk.close("success").result()
    finally:
        served.stop()
