"""polyrl's vLLM sampler (``local.sampler: vllm``) against vLLM's own CPU build, in the environment of its
own that ``make vllm`` builds at ``.venv-vllm`` (``make test`` builds it first). Real vLLM servers on
127.0.0.1, started by polyrl or by the test (as servers that already run), on the ``small-hd32`` tiny model
(head_dim 32: vLLM's CPU attention refuses polyrl's narrower test models) and on SmolLM2-135M-Instruct.

Where polyrl's own sampler is the reference, it answers through the same sampling client: a request with
prompt logprobs is one vLLM does not take, so the engine samples it itself from the same snapshot.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tinker import types

from polyrl.local import ServiceClient
from polyrl.local.vllm import VllmError, VllmProcess
from polyrl.samplers import VllmSettings

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = str(REPO / ".venv-vllm" / "bin" / "python")
SETTINGS = VllmSettings(python=VLLM_PYTHON, max_lora_rank=8)
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _vllm_built():
    assert Path(VLLM_PYTHON).exists(), "vLLM's environment is missing: `make vllm` builds it (make test does)"


@pytest.fixture(scope="module")
def hd32_dir(tmp_path_factory) -> str:
    from polyrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("small-hd32"), "small-hd32", seed=0))


@pytest.fixture(scope="module")
def server(hd32_dir):
    """A vLLM server that already runs (as a user's would), for the tests that give servers by URL."""
    proc = VllmProcess(hd32_dir, "cpu", "float32", SETTINGS)
    proc.start()
    yield proc
    proc.stop()


def _service(tmp_path: Path, **settings) -> ServiceClient:
    return ServiceClient(store_dir=tmp_path / "store", dtype="float32", sampler_dtype="float32",
                         sampler="vllm", vllm=VllmSettings(**{**SETTINGS.__dict__, **settings}))


def _own(sampler, prompt: types.ModelInput, params=GREEDY) -> list[int]:
    """What polyrl's own sampler draws from ``sampler``'s weights (vLLM takes no prompt logprobs)."""
    return list(sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result().sequences[0].tokens)


def _vllm(sampler, prompt: types.ModelInput, params=GREEDY) -> types.SampledSequence:
    return sampler.sample(prompt, 1, params).result().sequences[0]


def _train_towards(training, prompt: list[int], target: int, steps: int = 1) -> None:
    """``steps`` optimizer steps of cross-entropy on ``target`` after ``prompt`` (a big learning rate, so
    each step moves the greedy answer)."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt),
                        loss_fn_inputs={"target_tokens": types.TensorData(
                            data=prompt[1:] + [target], dtype="int64", shape=[len(prompt)]),
                            "weights": types.TensorData(data=[0.0] * (len(prompt) - 1) + [1.0],
                                                        dtype="float32", shape=[len(prompt)])})
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()


def _served_adapters(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def test_each_step_samples_its_own_adapter_while_older_ones_stay_until_dropped(hd32_dir, server, tmp_path):
    """After every optimizer step the new snapshot samples on vLLM under its own name: its greedy answer is
    polyrl's own sampler's from the same weights, and changes as the steps do. The previous version, still
    held (as ``max_steps_off_policy: 1`` holds it for groups in flight), keeps answering as itself beside
    the new one; a version nobody holds is unloaded from the server."""
    service = _service(tmp_path, urls=(server.url,))
    training = service.create_lora_training_client(hd32_dir, rank=8, seed=0).result()
    prompt_ids = training.get_tokenizer().encode("hello there")
    prompt = types.ModelInput.from_ints(prompt_ids)
    previous, answers, names, steps = None, [], [], 0
    for target in [100, 200, 300, 400]:
        for _ in range(8):  # optimizer steps until the greedy answer is the target
            _train_towards(training, prompt_ids, target)
            steps += 1
            sampler = training.save_weights_and_get_sampling_client().result()
            seq = _vllm(sampler, prompt)
            assert list(seq.tokens) == _own(sampler, prompt), steps
            names.append(sampler._state.adapter_name)
            assert names[-1] in _served_adapters(server.url)
            # the sampled tokens' logprobs are the learner's (both in float32 here)
            full = types.ModelInput.from_ints(prompt_ids + list(seq.tokens))
            learner = sampler.compute_logprobs(full).result()
            np.testing.assert_allclose(learner[len(prompt_ids):], seq.logprobs, atol=2e-3)
            if previous is not None:  # both versions at once, interleaved
                results = [(s, s.sample(prompt, 1, GREEDY)) for s in (previous, sampler, previous, sampler)]
                for s, fut in results:
                    assert list(fut.result().sequences[0].tokens) == _own(s, prompt)
            previous = sampler
            if seq.tokens[0] == target:
                break
        answers.append(seq.tokens[0])
    assert answers == [100, 200, 300, 400]  # the greedy answer moved with the steps, and vLLM's with it
    vllm = service.engine.vllm_sampler(hd32_dir)
    assert vllm.counts["loads"] == steps

    def unloaded(n: int) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and vllm.counts["unloads"] < n:
            time.sleep(0.1)
        return vllm.counts["unloads"] == n

    # a version is unloaded once no sampler holds it: all but the two last ones here
    assert unloaded(steps - 2)
    assert set(names) & _served_adapters(server.url) == set(names[-2:])


def test_an_adapter_released_by_the_garbage_collector_inside_a_pool_submit_does_not_deadlock(tmp_path):
    """The garbage collector runs a released snapshot's finalizer inside whatever allocates, such as a
    thread pool's submit, which holds concurrent.futures' global lock. The finalizer must take no lock
    (it once submitted the unload to a pool, and the engine thread waited on that lock forever)."""
    import concurrent.futures.thread as pool_module
    import threading

    from polyrl.local.vllm import VllmSampler

    sampler = VllmSampler("unused", "cpu", "float32", VllmSettings(urls=("http://127.0.0.1:9",)))
    directory = tmp_path / "adapter"
    directory.mkdir()
    sampler._adapters["polyrl-sampler-1"] = directory
    released = threading.Event()

    def release_inside_the_lock():
        with pool_module._global_shutdown_lock:
            sampler._release("polyrl-sampler-1")
        released.set()

    threading.Thread(target=release_inside_the_lock, daemon=True).start()
    assert released.wait(60), "releasing an adapter waited on concurrent.futures' global lock"
    deadline = time.monotonic() + 60
    while directory.exists() and time.monotonic() < deadline:  # the unloading thread removes it
        time.sleep(0.05)
    assert not directory.exists() and "polyrl-sampler-1" not in sampler._adapters
    sampler.close()


def test_sampling_options_map_onto_vllm(hd32_dir, server, tmp_path):
    """Seeds, n, stop tokens and strings, top-k / top-p, max_tokens and top-K sample logprobs."""
    service = _service(tmp_path, urls=(server.url,))
    sampler = service.create_sampling_client(base_model=hd32_dir).result()
    tok = sampler.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("the quick brown fox"))
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=11, top_k=20, top_p=0.9)
    first = sampler.sample(prompt, 4, params, topk_sample_logprobs=5).result()
    again = sampler.sample(prompt, 4, params, topk_sample_logprobs=5).result()
    assert [list(s.tokens) for s in first.sequences] == [list(s.tokens) for s in again.sequences]  # seeded
    assert len(first.sequences) == 4 and len({tuple(s.tokens) for s in first.sequences}) > 1
    for seq in first.sequences:
        assert 1 <= len(seq.tokens) <= 12 and len(seq.logprobs) == len(seq.tokens)
        assert np.all(np.asarray(seq.logprobs) <= 0)
        topk = seq.topk_logprobs_np
        assert topk is not None and topk.logprobs.shape == (len(seq.tokens), 5)
        assert np.all(np.diff(topk.logprobs, axis=1) <= 1e-6)  # best first
        # the sampled token is among its top-5 when its logprob is at least the fifth best
        for i, (t, lp) in enumerate(zip(seq.tokens, seq.logprobs)):
            if lp >= topk.logprobs[i, -1] + 1e-4:
                assert t in topk.token_ids[i]
    # a stop token ends the sequence at its first occurrence (its last token), as polyrl's own sampler does
    drawn = list(first.sequences[0].tokens)
    stop_at = drawn[min(2, len(drawn) - 1)]
    cut = drawn.index(stop_at) + 1
    stopped = sampler.sample(prompt, 4, params.model_copy(update={"stop": [int(stop_at)]})).result()
    assert list(stopped.sequences[0].tokens) == drawn[:cut] and stopped.sequences[0].stop_reason == "stop"
    # a stop string ends it at the token that completes it
    drawn = list(first.sequences[1].tokens)
    word = tok.decode(drawn[:2])
    if word.strip():
        ended = sampler.sample(prompt, 4, params.model_copy(update={"stop": [word]})).result().sequences[1]
        got = list(ended.tokens)
        assert got == drawn[:len(got)] and word in tok.decode(got) and ended.stop_reason == "stop"
        assert word not in tok.decode(got[:-1])
    # what vLLM cannot answer, polyrl's own sampler does: prompt logprobs
    with_prompt = sampler.sample(prompt, 1, GREEDY, include_prompt_logprobs=True).result()
    assert len(with_prompt.prompt_logprobs) == prompt.length


def test_two_servers_share_the_requests_and_losing_one_loses_nothing(hd32_dir, server, tmp_path):
    """Requests spread over the servers given by URL; one killed mid-run is dropped with a warning and every
    request is still answered by the other."""
    second = VllmProcess(hd32_dir, "cpu", "float32", SETTINGS)
    second.start()
    try:
        service = _service(tmp_path, urls=(server.url, second.url))
        training = service.create_lora_training_client(hd32_dir, rank=8, seed=0).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("count with me"))
        params = types.SamplingParams(max_tokens=4, temperature=1.0)
        futures = [sampler.sample(prompt, 2, params) for _ in range(8)]
        assert all(len(f.result().sequences) == 2 for f in futures)
        assert _requests_done(second.url) >= 1  # each served some (vLLM's own request counter)
        assert _requests_done(server.url) >= 1
        second.stop()  # killed while requests keep coming
        futures = [sampler.sample(prompt, 2, params) for _ in range(8)]
        assert all(len(f.result().sequences) == 2 for f in futures)
        vllm = service.engine.vllm_sampler(hd32_dir)
        assert vllm.counts["dropped_urls"] == 1 and [s.url for s in vllm._servers] == [server.url]
    finally:
        second.stop()


def test_a_started_vllm_that_dies_is_restarted_with_the_adapter_then_given_up_on(hd32_dir, tmp_path):
    """polyrl's own vLLM process, killed: started again and given the adapter in use (same answers), at
    most ``restarts`` times; then one line says so."""
    service = _service(tmp_path, restarts=1)
    training = service.create_lora_training_client(hd32_dir, rank=8, seed=0).result()
    prompt_ids = training.get_tokenizer().encode("hello there")
    prompt = types.ModelInput.from_ints(prompt_ids)
    _train_towards(training, prompt_ids, 123, steps=3)
    sampler = training.save_weights_and_get_sampling_client().result()
    before = list(_vllm(sampler, prompt).tokens)
    vllm = service.engine.vllm_sampler(hd32_dir)
    process = vllm._servers[0].process
    os.killpg(process.proc.pid, signal.SIGKILL)
    assert list(_vllm(sampler, prompt).tokens) == before == _own(sampler, prompt)
    assert vllm.counts["restarts"] == 1 and vllm.counts["loads"] == 2
    os.killpg(process.proc.pid, signal.SIGKILL)
    with pytest.raises(VllmError) as info:
        _vllm(sampler, prompt)
    assert "\n" not in str(info.value) and "after 1 restarts (local.vllm.restarts)" in str(info.value)


def _train_cli(config: dict, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "polyrl.cli", "train", "--config_path", str(path)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# A reward a random tiny model earns in varied amounts (so every group has a signal and every step trains):
# the share of the reply's characters that are the letter "a".
LETTERS_ENV = """
from polyrl.envs.base import SingleTurnEnv


def share_of_a(completion: str, answer: str) -> float:
    return completion.count("a") / max(1, len(completion))


def load_environment() -> SingleTurnEnv:
    rows = [{"question": f"Write the letter a, {i} times.", "answer": ""} for i in range(32)]
    return SingleTurnEnv(dataset=rows, rubric=share_of_a)
"""


def _run_config(model_dir: str, tmp_path: Path, **over) -> dict:
    return {"model_name": model_dir, "lora_rank": 4, "batch_size": 2, "max_steps": 3, "max_tokens": 4,
            "save_every": 0, "learning_rate": 1e-3, "log_path": str(tmp_path / "run"), "seed": 3,
            "outputs": {"report": False}, "limits": {"max_no_update_frac": 1.0},
            "local": {"store_dir": str(tmp_path / "store"), "sampler": "vllm",
                      "vllm": {"python": VLLM_PYTHON}},
            "environments": {"arithmetic": {"num_rollouts": 2, "max_turns": 1}}, **over}


def test_a_vllm_that_cannot_start_is_one_line(tiny_model_dir, tmp_path):
    """The ``unit`` tiny model (head_dim 16) is one vLLM's CPU attention refuses: the run stops before its
    first step with one line naming vLLM's reason."""
    proc = _train_cli(_run_config(tiny_model_dir, tmp_path), tmp_path)
    _, err = proc.communicate(timeout=300)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith("error: vLLM could not start for ") and "its log:" in lines[-1], lines[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["sigterm", "ctrl-c", "kill"])
def test_train_with_vllm_logs_the_divergence_and_a_stop_leaves_no_process(hd32_dir, tmp_path, stop):
    """``polyrl train`` sampling on vLLM: the sampler/learner divergence is logged every step (small:
    both engines compute in float32 here), IcePop corrects it by default, and SIGTERM, Ctrl-C or even
    SIGKILL ends the run with vLLM's processes, none left behind."""
    import psutil

    (tmp_path / "letters.py").write_text(LETTERS_ENV)
    envs = {"letters": {"type": "module:letters.py", "num_rollouts": 4}}
    config = _run_config(hd32_dir, tmp_path, max_steps=200, max_tokens=8, environments=envs)
    proc = _train_cli(config, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wanted = 3 if stop == signal.SIGTERM else 1  # the divergence is read on the SIGTERM run's rows
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and len(
            metrics.read_text().splitlines() if metrics.exists() else []) < wanted:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()[:wanted]]
    family = psutil.Process(proc.pid).children(recursive=True)
    assert any("vllm" in " ".join(p.cmdline()) for p in family)
    proc.send_signal(stop)
    try:  # a generous bound: a loaded machine unwinds slowly
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"polyrl train still ran 300 s after {stop.name}: "
                             f"{proc.communicate()[1][-3000:]}") from None
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [p.cmdline()[:3] for p in alive]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["off_policy"]["correction"] == "icepop"
    for row in rows:
        assert row["optim/kl_sample_train_v2"] < 1e-4 and row["optim/logprob_diff_max"] < 0.05, row
        assert row["sampler/vllm_requests"] >= 1
    attempts = (tmp_path / "run" / "attempts.jsonl")
    sampler = json.loads(attempts.read_text().splitlines()[0])["sampler"][0]
    assert sampler["sampler"] == "vllm" and sampler["vllm_urls"]


def test_auto_samples_with_polyrl_on_a_cpu_and_with_vllm_given_urls(hd32_dir, server, tmp_path):
    from polyrl.samplers import resolve_sampler

    assert resolve_sampler("auto", "cpu", SETTINGS) == "polyrl"
    assert resolve_sampler("auto", "cpu", VllmSettings(urls=(server.url,))) == "vllm"
    assert resolve_sampler("auto", "cuda", VllmSettings(python=str(tmp_path / "nothing"))) == "polyrl"
    assert resolve_sampler("auto", "cuda", SETTINGS) == "vllm"



def _requests_done(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_polyrl_serve_samples_on_vllm_for_the_sdk_and_the_cookbook(hd32_dir, server, tmp_path):
    """``polyrl serve --sampler vllm``: the official SDK trains and samples (seeded samples repeat, their
    logprobs are the learner's), and tinker-cookbook's math_rl at its default loss (stable_reinforce, which
    trains against the sampler's recorded logprobs) runs, each sample drawn by vLLM."""
    from test_serve import Served, _cookbook

    served = Served(hd32_dir, tmp_path / "store", "--sampler", "vllm", "--vllm-url", server.url)
    try:
        before = _requests_done(server.url)
        training = served.sdk().create_lora_training_client(hd32_dir, rank=4, seed=0)
        tokens = training.get_tokenizer().encode("the answer is 42")
        _train_towards(training, tokens, 7)
        sampler = training.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
        prompt = types.ModelInput.from_ints(tokens)
        res = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]
        seq = res.sequences[0]
        lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens + list(seq.tokens))).result()
        np.testing.assert_allclose(lp[len(tokens):], seq.logprobs, atol=2e-3)
        assert _requests_done(server.url) >= before + 2
        common = [f"model_name={hd32_dir}", "renderer_name=qwen3", "env=arithmetic", "groups_per_batch=4",
                  "group_size=2", "lora_rank=4", "max_tokens=8", "eval_every=0", "save_every=1",
                  "max_steps=2"]
        before = _requests_done(server.url)
        done = _cookbook("tinker_cookbook.recipes.math_rl.train", served, tmp_path, *common)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "env/all/reward/total" in r]
        assert [r["step"] for r in trained] == [0, 1]
        assert all(np.isfinite(r["optim/kl_sample_train_v1"]) for r in trained)
        assert _requests_done(server.url) >= before + 8  # every group's samples, on vLLM
    finally:
        served.stop()
