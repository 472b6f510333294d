"""Sampling through vLLM: the local engine's rollouts on the field's inference engine, with only the LoRA
adapter crossing over.

vLLM runs as its own process, from an interpreter of its own environment (``make vllm`` builds one at
``.venv-vllm``; vLLM's pins never touch polyrl's), or as servers that already run, given by URL (replicas on
other GPUs or nodes; requests spread over them). Every sampler snapshot the engine makes is written as a
PEFT adapter and loaded into each server under its own name (``polyrl-<sampler id>``) before the first
sample is drawn from it; a snapshot nobody holds any more is unloaded, and the prefix cache is reset after
each load. Requests go to vLLM's OpenAI-compatible completions endpoint with token-id prompts and come back
as token ids with each token's logprob (the model's own, temperature 1, as polyrl's sampler gives).

What vLLM cannot answer is left to polyrl's own sampler (:meth:`VllmSampler.answers`): prompt logprobs and
the prompt queries built on them, ``compute_logprobs``, and images.

Faults: a started server that dies is restarted (at most ``restarts`` times) and given back the adapters in
use; a server given by URL that stops answering is retried, then dropped from the set with a warning, the
run going on with the rest. A process that cannot start is one line naming why.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from tinker import types

from polyrl.errors import RunStoppedError
from polyrl.samplers import VllmSettings, VllmStartError, check_python, find_python

if TYPE_CHECKING:
    from polyrl.local.sampler import SampleJob

SamplerState = Any  # polyrl.local.engine.SamplerState (which imports this module)

log = logging.getLogger(__name__)

BASE_NAME = "base"  # the served name of the base model in a server polyrl starts
MAX_TOPK = 20  # vLLM's default --max-logprobs: the widest top-K of sample logprobs it returns
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT adapter directory
URL_FAILURES = 3  # a URL that fails this many requests in a row is dropped from the set


class VllmError(RunStoppedError):
    """vLLM could not answer: every server is gone, or a started one died more often than allowed. The run
    stops with this one line (it is not an environment's failure, to be counted against a budget)."""


# ------------------------------------------------------------------------------------------ processes

_started: "weakref.WeakSet[VllmProcess]" = weakref.WeakSet()


# The process polyrl starts: a watchdog in the server's own process group that runs the server as its
# child, passes on its exit code, and kills the whole group the moment polyrl is gone, however polyrl
# ended (a SIGKILL included), which the server's own shutdown cannot be relied on for. It ignores SIGTERM:
# a stop (SIGTERM to the group) lets the server shut down, and the watchdog ends with it.
WATCHDOG = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
parent = os.getppid()
server = subprocess.Popen(sys.argv[1:], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
while server.poll() is None:
    if os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)
    time.sleep(0.5)
sys.exit(server.returncode)
"""


_exiting = threading.Event()  # set once the process exits: a failed request then restarts nothing


def _stop_all() -> None:
    _exiting.set()
    for proc in list(_started):
        proc.stop()


def _on_signal(signum, frame) -> None:
    """SIGTERM and Ctrl-C: the servers stop at once (the samples in flight on them fail now, rather than
    holding up the run's exit until they finish), then the process unwinds as Ctrl-C does."""
    if _started:
        _stop_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def stop_on_sigterm() -> None:
    """Make SIGTERM end this process through its exit handlers rather than at once, where nothing else
    handles it, and make SIGTERM and Ctrl-C stop the vLLM servers it started first thing. Call from the
    main thread (signals are set there), before servers start."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_signal)


# Before the interpreter joins thread pools (requests in flight to a server would hold it up until they
# end), where the runtime allows; at exit otherwise.
getattr(threading, "_register_atexit", atexit.register)(_stop_all)


def _context(model_dir: str) -> int:
    """The model's context length from its config (8192 when it does not say)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 8192
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 8192)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmProcess:
    """A vLLM OpenAI-compatible server polyrl started for one base model, on 127.0.0.1, in a process
    group of its own, under :data:`WATCHDOG` (stopped with polyrl: at exit, on SIGTERM, and by the watchdog
    if polyrl is killed)."""

    def __init__(self, model_dir: str, device: str, dtype: str, settings: VllmSettings):
        self.model_dir, self.device, self.dtype, self.settings = model_dir, device, dtype, settings
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log_path = Path(tempfile.gettempdir()) / f"polyrl-vllm-{uuid.uuid4().hex[:8]}.log"
        self._log_start = 0  # where this start's lines begin in the log (restarts append)

    def command(self, port: int) -> list[str]:
        s = self.settings
        share = s.gpu_memory_utilization or (0.4 if self.device.startswith("cuda") else 0.1)
        rank = next((r for r in LORA_RANKS if r >= s.max_lora_rank), LORA_RANKS[-1])
        cmd = [find_python(s.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", BASE_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", self.dtype, "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "4",
               "--gpu-memory-utilization", f"{share:g}", "--max-logprobs", str(MAX_TOPK),
               "--disable-uvicorn-access-log"]
        length = s.max_model_len
        if not self.device.startswith("cuda"):
            # vLLM's CPU build: no torch.compile (minutes per new shape on a fresh machine, no faster here),
            # and whole prefills only: a seeded request whose prefill is split over steps kills its engine
            # ("CPU Generator does not use offset"), and RL rollouts are all seeded
            length = length or min(_context(self.model_dir), 32768)
            cmd += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(length)]
        if length:
            cmd += ["--max-model-len", str(length)]
        return cmd

    def start(self) -> str:
        """Start the server and wait until it answers; its URL. One line naming why when it cannot."""
        import httpx

        check_python(self.settings.python)
        port = _free_port()
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1",
               "PYTHONUNBUFFERED": "1"}
        if not self.device.startswith("cuda"):
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        if ":" in self.device:
            env["CUDA_VISIBLE_DEVICES"] = self.device.split(":", 1)[1]
        with open(self.log_path, "ab") as out:
            self._log_start = out.tell()
            self.proc = subprocess.Popen([sys.executable, "-c", WATCHDOG, *self.command(port)], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        _started.add(self)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.settings.start_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.stop()
                    raise VllmStartError(f"vLLM could not start for {self.model_dir}: {self.why()} "
                                         f"(its log: {self.log_path})")
                try:
                    healthy = http.get(f"{self.url}/health").status_code == 200
                except httpx.TransportError:
                    healthy = False
                if healthy:
                    self._first_token(http)
                    return self.url
                time.sleep(0.5)
        self.stop()
        raise VllmStartError(f"vLLM did not start for {self.model_dir} within "
                             f"{self.settings.start_timeout_s:g}s (local.vllm.start_timeout_s; its log: "
                             f"{self.log_path})")

    def _first_token(self, http: Any) -> None:
        """A server is up once it has sampled: some failures (an attention kernel the model's shapes lack)
        only show on the first request. One line naming vLLM's reason when it cannot."""
        import httpx

        try:
            r = http.post(f"{self.url}/v1/completions", timeout=self.settings.start_timeout_s,
                          json={"model": BASE_NAME, "prompt": [0], "max_tokens": 1, "temperature": 0.0})
            ok = r.status_code == 200
        except httpx.TransportError:
            ok = False
        if not ok:
            self.stop()
            raise VllmStartError(f"vLLM could not start for {self.model_dir}: {self.why()} "
                                 f"(its log: {self.log_path})")

    def why(self) -> str:
        """The first error of this start in the server's log (what made it fail)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return "no log"
        lines = [ln for ln in lines if " WARNING " not in ln]
        errors = [ln for ln in lines if re.search(r"\w+(Error|Exception): ", ln)
                  and "EngineDead" not in ln and "stack trace" not in ln]
        marked = [ln for ln in lines if "ERROR" in ln]
        text = errors[0] if errors else (marked or lines or ["exited with no output"])[-1]
        return " ".join(re.sub(r"^.*?\] ", "", text).split())[-300:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and every process it started (its whole process group)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # what the group's other members (vLLM's engine core, its workers) left running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------ servers


class _Server:
    """One vLLM server: its URL, its base model's served name, the adapters it holds, its failures."""

    def __init__(self, url: str, process: VllmProcess | None = None):
        self.url = url.rstrip("/")
        self.process = process
        self.base_name = BASE_NAME if process else ""
        self.loaded: set[str] = set()
        self.failures = 0
        self.lock = threading.Lock()  # held while adapters are loaded into it


class VllmSampler:
    """Samples for one base model on a set of vLLM servers (started, or given by URL)."""

    def __init__(self, model_dir: str, device: str, dtype: str, settings: VllmSettings):
        self.model_dir, self.settings = model_dir, settings
        self.device = device
        self.dtype = dtype
        self._servers: list[_Server] = []
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._restarts = 0
        self._dirs = Path(tempfile.mkdtemp(prefix="polyrl-vllm-adapters-"))
        self._adapters: dict[str, Path] = {}  # adapter name -> its PEFT directory, while its snapshot lives
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="polyrl-vllm")
        self._http: Any = None
        self.counts = {"requests": 0, "loads": 0, "unloads": 0, "restarts": 0, "dropped_urls": 0}
        # Adapters released by the garbage collector, for one thread to unload (see ``_release``).
        self._released: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        weakref.finalize(self, shutil.rmtree, self._dirs, True)
        threading.Thread(target=self._start, name="polyrl-vllm-start", daemon=True).start()
        threading.Thread(target=self._unload_released, name="polyrl-vllm-unload", daemon=True).start()

    # ---- start-up ------------------------------------------------------------------------------
    def _start(self) -> None:
        import httpx

        try:
            self._http = httpx.Client(timeout=httpx.Timeout(self.settings.request_timeout_s, connect=10.0),
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
            if self.settings.urls:
                servers = [_Server(u) for u in self.settings.urls]
                for s in servers:
                    s.base_name = self._served_base(s.url)
            else:
                proc = VllmProcess(self.model_dir, self.device, self.dtype, self.settings)
                servers = [_Server(proc.start(), proc)]
            with self._lock:
                self._servers = servers
        except BaseException as e:  # noqa: BLE001 - handed to every waiting request
            self._start_error = e
        finally:
            self._ready.set()

    def _served_base(self, url: str) -> str:
        """The name a server given by URL serves its base model under (the model without a parent)."""
        import httpx

        try:
            models = self._http.get(f"{url.rstrip('/')}/v1/models", timeout=30.0).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise VllmStartError(f"local.vllm.urls: {url} does not answer as a vLLM server "
                                 f"({type(e).__name__}: {e})") from None
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise VllmStartError(f"local.vllm.urls: {url} serves no base model")
        return bases[0]

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the servers answer (or raise what kept them from it)."""
        if not self._ready.wait(timeout):
            raise VllmError("vLLM is still starting")
        if self._start_error is not None:
            raise self._start_error

    # ---- what vLLM answers -------------------------------------------------------------------------
    @staticmethod
    def answers(job: "SampleJob") -> bool:
        """Whether vLLM can answer ``job`` (else polyrl's own sampler does): plain sampling with the
        sampled tokens' logprobs and up to MAX_TOPK top-K of them; no prompt logprobs, no images."""
        return not (job.prompt_only or job.wants_prompt or job.images or job.topk_sample > MAX_TOPK)

    def submit(self, state: SamplerState, job: "SampleJob") -> Future:
        return self._pool.submit(self._sample, state, job)

    # ---- adapters ------------------------------------------------------------------------------
    def export(self, state: SamplerState, write: Callable[[Path], None]) -> None:
        """Write ``state``'s adapter (``write(directory)`` makes the PEFT files) for the servers to load;
        it is unloaded from them once ``state`` is gone."""
        name = f"polyrl-{state.sampler_id}"
        directory = self._dirs / name
        directory.mkdir()
        write(directory)
        state.adapter_name = name
        self._adapters[name] = directory
        weakref.finalize(state, self._release, name)

    def _release(self, name: str) -> None:
        # A weakref callback: the garbage collector runs it inside whatever code allocated, holding
        # whatever locks that code holds (a thread pool's submit holds concurrent.futures' global lock,
        # which submitting here would take again, and wait on forever). So it takes no lock at all:
        # SimpleQueue.put is reentrant.
        self._released.put(name)

    def _unload_released(self) -> None:
        while (name := self._released.get()) is not None:
            directory = self._adapters.pop(name, None)
            if directory is not None:
                self._unload(name, directory)

    def _unload(self, name: str, directory: Path) -> None:
        for server in list(self._servers):
            with server.lock:
                if name in server.loaded:
                    server.loaded.discard(name)
                    try:
                        self._http.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name},
                                        timeout=30.0)
                        self.counts["unloads"] += 1
                    except Exception as e:  # noqa: BLE001 - a server gone holds nothing
                        log.debug("unloading %s from %s: %s", name, server.url, e)
        shutil.rmtree(directory, ignore_errors=True)

    def _ensure_loaded(self, server: _Server, name: str) -> None:
        if name in server.loaded:
            return
        with server.lock:
            if name in server.loaded:
                return
            directory = self._adapters.get(name)
            if directory is None:
                raise VllmError(f"adapter {name} was released before it was sampled")
            r = self._http.post(f"{server.url}/v1/load_lora_adapter",
                                json={"lora_name": name, "lora_path": str(directory)}, timeout=120.0)
            if r.status_code != 200:  # every sample of this policy would fail alike: the run stops
                raise VllmError(f"vLLM at {server.url} refused adapter {name}: {_message(r)}")
            server.loaded.add(name)
            self.counts["loads"] += 1
            try:  # cached prefixes belong to the weights that computed them
                self._http.post(f"{server.url}/reset_prefix_cache", timeout=30.0)
            except Exception as e:  # noqa: BLE001 - a cache left as it is costs nothing but memory
                log.debug("reset_prefix_cache at %s: %s", server.url, e)

    # ---- requests ------------------------------------------------------------------------------
    def _body(self, model: str, job: "SampleJob") -> dict:
        p = job.params
        body: dict[str, Any] = {
            "model": model, "prompt": list(job.prompt), "n": job.num_samples, "max_tokens": job.max_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
            "logprobs": job.topk_sample, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
            "stop_token_ids": sorted(job.stop_ids), "include_stop_str_in_output": True,
        }
        if job.stop_strings:
            body["stop"] = list(job.stop_strings)
        if p.seed is not None:
            body["seed"] = int(p.seed) & (2**63 - 1)
        return body

    def _pick(self) -> _Server:
        with self._lock:
            if not self._servers:
                raise VllmError("no vLLM server is left to sample on (each stopped answering)")
            return self._servers[next(self._next) % len(self._servers)]

    def _sample(self, state: SamplerState, job: "SampleJob") -> types.SampleResponse:
        import httpx

        self.wait_ready()
        name = getattr(state, "adapter_name", None) if state.weights is not None else None
        if state.weights is not None and name is None:
            raise VllmError("this sampler's adapter was never written for vLLM")
        last: BaseException | None = None
        for _ in range(max(4, 2 * len(self._servers) + self.settings.restarts + 1)):
            server = self._pick()
            try:
                if name is not None:
                    self._ensure_loaded(server, name)
                body = self._body(name or server.base_name, job)
                r = self._http.post(f"{server.url}/v1/completions", json=body)
                if r.status_code == 400 or r.status_code == 404:
                    raise ValueError(f"vLLM refused the request: {_message(r)}")
                if r.status_code != 200:
                    raise httpx.HTTPStatusError(f"{r.status_code}: {_message(r)}", request=r.request,
                                                response=r)
                server.failures = 0
                self.counts["requests"] += 1
                return _response(r.json(), job)
            except (httpx.TransportError, httpx.HTTPStatusError) as e:
                last = e
                self._failed(server, e)
        raise VllmError(f"vLLM could not answer a sample request: {type(last).__name__}: {last}")

    def _failed(self, server: _Server, exc: BaseException) -> None:
        """A request to ``server`` failed: restart it (started), or drop it after URL_FAILURES in a row
        (given by URL)."""
        if _exiting.is_set():
            raise VllmError("the process is exiting: vLLM's servers were stopped")
        if server.process is not None:
            with self._lock:
                if server not in self._servers:
                    return
                if server.process.alive() and not _engine_dead(exc):
                    server.failures += 1
                    if server.failures < URL_FAILURES:
                        return
                if self._restarts >= self.settings.restarts:
                    self._servers.remove(server)
                    server.process.stop()
                    raise VllmError(f"the vLLM server for {self.model_dir} stopped working after "
                                    f"{self._restarts} restarts (local.vllm.restarts): "
                                    f"{server.process.why()} (its log: {server.process.log_path})")
                self._restarts += 1
                self.counts["restarts"] += 1
                log.warning("the vLLM server for %s stopped working (%s); restarting it (%d of %d)",
                            self.model_dir, server.process.why(), self._restarts, self.settings.restarts)
                server.process.stop()
                try:
                    server.url = server.process.start()
                except VllmStartError as e:
                    self._servers.remove(server)
                    raise VllmError(f"the vLLM server for {self.model_dir} died and could not be started "
                                    f"again: {e}") from None
                server.loaded.clear()
                server.failures = 0
            return
        server.failures += 1
        if server.failures >= URL_FAILURES:
            with self._lock:
                if server in self._servers and len(self._servers) > 0:
                    self._servers.remove(server)
                    self.counts["dropped_urls"] += 1
                    log.warning("vLLM server %s stopped answering (%s: %s); dropped, sampling goes on with "
                                "the %d left", server.url, type(exc).__name__, exc, len(self._servers))
        else:
            time.sleep(0.2 * server.failures)

    def describe(self, learner_dtype: str) -> dict[str, Any]:
        """What samples (for the run's attempt log and its console), once the servers answer."""
        urls = [s.url for s in self._servers]
        where = (f"a vLLM server polyrl started at {urls[0]}" if not self.settings.urls
                 else f"{len(urls)} vLLM server(s) at {', '.join(urls)}")
        dtype = "the server's" if self.settings.urls else self.dtype
        return {"sampler": "vllm", "sampler_dtype": dtype, "copy_bytes": 0, "vllm_urls": urls,
                "note": f"{self.model_dir}: sampling on {where} ({dtype} weights; the learner computes in "
                        f"{learner_dtype}); only the LoRA adapter crosses over"}

    def metrics(self) -> dict[str, float]:
        """Counts since the sampler started, as ``sampler/vllm_<count>:sum`` (each optimizer step reports
        them)."""
        return {f"sampler/vllm_{k}:sum": float(v) for k, v in self.counts.items()}

    def close(self) -> None:
        self._released.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for server in self._servers:
            if server.process is not None:
                server.process.stop()


def _engine_dead(exc: BaseException) -> bool:
    """A 5xx that says vLLM's engine died (it answers, but never will again)."""
    text = str(exc)
    return "EngineCore" in text or "EngineDead" in text


def _message(r: Any) -> str:
    try:
        body = r.json()
        error = body.get("error")
        msg = (error.get("message") if isinstance(error, dict) else body.get("message")) or json.dumps(body)
    except ValueError:
        msg = r.text
    return " ".join(str(msg).split())[:300]


def _token_id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])  # "token_id:123", with return_tokens_as_token_ids


def _response(body: dict, job: "SampleJob") -> types.SampleResponse:
    """vLLM's completions answer as Tinker's ``SampleResponse`` (choices in order of their index)."""
    from polyrl.local.sampler import TopkLogprobs

    sequences = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        tokens = [_token_id(t) for t in lp["tokens"]]
        topk = None
        if job.topk_sample:
            ids = np.zeros((len(tokens), job.topk_sample), np.int32)
            vals = np.zeros((len(tokens), job.topk_sample), np.float32)
            for i, row in enumerate(lp["top_logprobs"]):
                best = sorted(((v, _token_id(k)) for k, v in row.items()), reverse=True)[: job.topk_sample]
                ids[i, : len(best)] = [t for _, t in best]
                vals[i, : len(best)] = [v for v, _ in best]
            topk = TopkLogprobs(token_ids=ids, logprobs=vals)
        sequences.append(types.SampledSequence(
            stop_reason="length" if choice["finish_reason"] == "length" else "stop",
            sequence_id=uuid.uuid4().hex, tokens_np=np.asarray(tokens, np.int32),
            logprobs_np=np.asarray(lp["token_logprobs"], np.float32), topk_logprobs_np=topk))
    return types.SampleResponse(sequences=sequences)
