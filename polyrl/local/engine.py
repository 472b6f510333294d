"""The local engine: one worker thread that owns the models and runs every operation.

Training operations run strictly in submission order (so ``forward_backward`` then ``optim_step``
submitted back to back keep their order). Sampling requests against fixed weight snapshots do not
depend on that order, so the worker gathers every sampling request waiting in the queue and
generates them in one batch (see :mod:`polyrl.local.sampler`). Work is submitted on behalf of an owner
(``polyrl serve``'s API keys); owners take turns, and a long decode pauses between slices for another
owner's work (see :meth:`Engine._run`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import io
import itertools
import logging
import math
import queue
import shutil
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

import torch
from tinker import types

from polyrl.errors import NonFiniteUpdateError
from polyrl.local import losses
from polyrl.local.allocator import heap_for_the_pass, return_large_blocks_to_the_os
from polyrl.local.checkpoints import (
    CheckpointPath,
    CheckpointRequestError,
    Store,
    age_recipients,
    check_name,
    check_ttl,
    encrypt_files,
)
from polyrl.local.compute import packed_logprobs
from polyrl.local.datums import PreparedDatum, batch_loss, prepare_datum, reduce_metrics
from polyrl.local.model import BaseModel, LoraSpec, select_device
from polyrl.local.optim import DimuonSettings, check_kind, configure, make_optimizer
from polyrl.local.packing import CPU_CALL_TOKENS, MicroBatch, micro_batch_budget, micro_batches
from polyrl.local.sampler import SampleJob, SamplingStopped, generate_steps
from polyrl.local.sampler_copy import DTYPES
from polyrl.local.stability import SampledInputs
from polyrl.local.vision import keyed
from polyrl.local.vllm import ADAPTER_FILES, VllmSampler
from polyrl.samplers import VllmSettings, check_python

log = logging.getLogger("polyrl.local")

# Sampling requests are batched: after each one, the worker waits BATCH_GAP_S for another, up to
# BATCH_MAX_WAIT_S after the first. An RL step's requests (one per episode) come from one event loop a few
# milliseconds apart, longer apart on a busy machine; a fixed window of a few milliseconds split a step's
# 64 rollouts into two or three decodes run one after another.
BATCH_GAP_S = 0.010
BATCH_MAX_WAIT_S = 0.100
MAX_BATCH_ROWS = 512
# How long a sampling batch decodes before another owner's waiting work gets its turn (see Engine._run): at
# least SLICE_S seconds, and once resumed at least SWITCH_SHARE times what resuming cost (putting its weights
# back into the sampling model), so that owners taking turns spend at most a fifth of the time switching.
SLICE_S = 0.02
SWITCH_SHARE = 4


@dataclass
class TrainerState:
    """One training client's adapter, optimizer and identity."""

    model_id: str
    base: BaseModel
    adapter: str
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    optimizer_type: str = "adamw"  # fixed when the client is created: "adamw" or "dimuon"
    steps: int = 0
    bad_loss: float | None = None  # a non-finite loss among the forward_backward calls since the last step


@dataclass(eq=False)
class SamplerState:
    """Weights a sampling client samples from: a frozen adapter snapshot, or the bare base model."""

    base: BaseModel
    spec: LoraSpec | None
    weights: list[torch.Tensor] | None
    model_path: str | None = None
    sampler_id: str = field(default_factory=lambda: f"sampler-{uuid.uuid4().hex[:12]}")
    adapter_name: str | None = None  # under which vLLM holds this adapter (the vLLM sampler only)


_STOP = object()  # queued by Engine.stop: the worker ends once it takes it
STOP_TIMEOUT_S = 30.0  # how long interpreter exit waits for the operation the worker is running


@dataclass
class _Op:
    fn: Callable[[], Any]
    future: Future
    owner: str = ""


@dataclass
class _SampleOp:
    sampler: SamplerState
    job: SampleJob
    future: Future
    owner: str = ""


@dataclass
class _Decoding:
    """A sampling batch under way: one sampler's requests in one decode loop, run a slice at a time."""

    owner: str
    ops: list[_SampleOp]
    steps: Generator | None = None  # generate_steps, once started


class Engine:
    """Owns base models, adapters and the worker thread. One per (store, device, dtype, ...)."""

    _shared: dict[tuple, "Engine"] = {}
    _shared_lock = threading.RLock()  # also taken in __init__, which shared() calls holding it
    _running: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # every engine whose worker may run (stop_all)

    @classmethod
    def shared(cls, store_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
               micro_batch_tokens: int | str = "auto",
               gradient_checkpointing: bool | str = "auto", max_store_bytes: int | None = None,
               sampler_dtype: str = "auto", sampler: str = "polyrl",
               vllm: VllmSettings | None = None, attention: str = "auto") -> "Engine":
        key = (str(Store(store_dir).root), device, dtype, micro_batch_tokens, gradient_checkpointing,
               max_store_bytes, sampler_dtype, sampler, vllm, attention)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(store_dir, device, dtype, micro_batch_tokens, gradient_checkpointing,
                                       max_store_bytes, sampler_dtype, sampler, vllm, attention)
            return cls._shared[key]

    def __init__(self, store_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
                 micro_batch_tokens: int | str = "auto",
                 gradient_checkpointing: bool | str = "auto", max_store_bytes: int | None = None,
                 sampler_dtype: str = "auto", sampler: str = "polyrl", vllm: VllmSettings | None = None,
                 attention: str = "auto"):
        if micro_batch_tokens != "auto" and (type(micro_batch_tokens) is not int or micro_batch_tokens < 1):
            raise ValueError(f"micro_batch_tokens must be a positive integer or 'auto', got "
                             f"{micro_batch_tokens!r}")
        if gradient_checkpointing not in ("auto", True, False):
            raise ValueError("gradient_checkpointing must be 'auto', true or false, "
                             f"got {gradient_checkpointing!r}")
        if max_store_bytes is not None and (type(max_store_bytes) is not int or max_store_bytes < 1):
            raise ValueError(f"max_store_bytes must be a positive integer or None, got {max_store_bytes!r}")
        if sampler_dtype != "auto" and sampler_dtype not in DTYPES:
            raise ValueError(f"sampler_dtype must be 'auto' or one of {sorted(DTYPES)}, "
                             f"got {sampler_dtype!r}")
        if sampler not in ("polyrl", "vllm"):
            raise ValueError(f"sampler must be 'polyrl' or 'vllm' (resolve 'auto' first), got {sampler!r}")
        self.vllm_settings = (vllm or VllmSettings()) if sampler == "vllm" else None
        if self.vllm_settings is not None and not self.vllm_settings.urls:
            check_python(self.vllm_settings.python)
        self._vllm: dict[str, VllmSampler] = {}  # base model name -> its vLLM sampler
        return_large_blocks_to_the_os()
        self.store = Store(store_dir, max_store_bytes)
        self.store.reclaim()  # what a killed process left in the store (abandoned saves, half-removed ones)
        self.device_name = device
        self.dtype_name = dtype
        self.sampler_dtype_name = sampler_dtype
        # tokens per forward/backward pass (see micro_batch_budget), where the models will load
        self.micro_batch_tokens = micro_batch_budget(micro_batch_tokens, select_device(device))
        self.gradient_checkpointing = gradient_checkpointing
        self.attention = attention  # local.attention (see BaseModel)
        self._bases: dict[str, BaseModel] = {}
        self._adapter_ids = itertools.count()
        self._queue: queue.Queue = queue.Queue()
        self._work: dict[str, collections.deque] = {}  # the worker's: owner -> its work, first owner next
        self.slice_s, self.switch_share = SLICE_S, SWITCH_SHARE  # a sampling batch's slice (0, 0: one step)
        self._generator: torch.Generator | None = None
        self._stopped = False
        # a daemon thread, so that an operation that never ends cannot keep the process alive; stopped
        # in order at exit (stop_all), as one still running torch code while the interpreter shuts down
        # aborts the process ("terminate called without an active exception")
        self._thread = threading.Thread(target=self._run, name="polyrl-engine", daemon=True)
        with self._shared_lock:
            self._running.add(self)
        self._thread.start()

    # ---- submission -------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], owner: str = "") -> Future:
        """Run ``fn`` on the worker after ``owner``'s earlier work (:meth:`_run`: how owners share it)."""
        return self._put(_Op(fn, Future(), owner))

    def submit_sample(self, sampler: SamplerState, job: SampleJob, owner: str = "") -> Future:
        """Sample ``job`` from ``sampler``'s weights: on vLLM when the engine samples there and vLLM answers
        such a job (:meth:`VllmSampler.answers`), else on the worker with polyrl's own sampler."""
        vllm = self._vllm.get(sampler.base.name)
        if vllm is not None and vllm.answers(job) and (sampler.weights is None or sampler.adapter_name):
            return vllm.submit(sampler, job)
        return self._put(_SampleOp(sampler, job, Future(), owner))

    def _put(self, op: "_Op | _SampleOp") -> Future:
        self._queue.put(op)
        if self._stopped:  # nothing runs it any more
            op.future.cancel()
        return op.future

    # ---- stopping ------------------------------------------------------------------------------
    def stop(self, timeout: float | None = STOP_TIMEOUT_S) -> bool:
        """Stop the worker: operations still queued are cancelled, the one running finishes (sampling
        ends at its next decode step, failing with ``SamplingStopped``). Whether the worker ended within
        ``timeout`` seconds. The engine takes no more work."""
        self._stopped = True
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._shared_lock:
            for key in [k for k, e in self._shared.items() if e is self]:
                del self._shared[key]
            self._running.discard(self)
        return not self._thread.is_alive()

    @classmethod
    def stop_all(cls, timeout: float | None = STOP_TIMEOUT_S) -> bool:
        """Stop every engine (at exit, and on Ctrl-C); whether all ended within ``timeout``."""
        with cls._shared_lock:
            engines = list(cls._running)
        deadline = None if timeout is None else time.monotonic() + timeout
        stopped = True
        for engine in engines:  # each gets what is left of the time
            stopped = engine.stop(None if deadline is None
                                  else max(0.0, deadline - time.monotonic())) and stopped
        return stopped

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker and wait (for set-up work such as loading a model)."""
        return self.submit(fn).result()

    # ---- worker ------------------------------------------------------------------------------
    def _run(self) -> None:
        """Run every owner's work, the owners taking turns.

        Each owner (an API key of ``polyrl serve``; everything in process is one owner, ``""``) has its own
        queue, run in order, except that its sampling requests are gathered into batches ahead of its other
        work, as they arrive together. A turn is one operation, or one slice of a sampling batch: a batch
        decodes to its end unless another owner has work waiting, in which case it pauses at the first
        decode step past its slice (``slice_s``, see :data:`SLICE_S`; its KV cache kept) and goes on at its
        owner's next turn. So one key's small request waits for at most one operation or slice of each other
        key's, however long their decodes are; with one owner, work runs in submission order with no pause,
        as a single queue would."""
        while True:
            if not self._work and not self._take(block=True):
                break
            if not self._take(block=False):
                break
            owner, work = next(iter(self._work.items()))
            task = work[0]
            if isinstance(task, _Op):
                work.popleft()
                self._execute(task.future, task.fn)
            else:
                if isinstance(task, _SampleOp):
                    work.extendleft(reversed(self._gather(owner)))
                if work and isinstance(work[0], _Decoding) and self._run_slice(work[0]):
                    work.popleft()
            del self._work[owner]  # its turn is over: to the back of the line
            if work:
                self._work[owner] = work
            task = work = None  # what the worker waits with pins nothing (a released client's memory)
        self._cancel([])

    def _take(self, block: bool) -> bool:
        """Move queued work to its owner's queue (waiting for some if ``block``); False once stopping."""
        while True:
            try:
                op = self._queue.get(block=block)
            except queue.Empty:
                return not self._stopped
            block = False
            if op is _STOP or self._stopped:
                return False
            self._work.setdefault(op.owner, collections.deque()).append(op)

    def _others_waiting(self, owner: str) -> bool:
        self._take(block=False)
        return any(o != owner and work for o, work in self._work.items())

    def _gather(self, owner: str) -> list[_Decoding]:
        """``owner``'s sampling requests as batches, one per sampler: those already queued and those that
        arrive within ``BATCH_GAP_S`` of each other (for ``BATCH_MAX_WAIT_S`` at most, up to
        ``MAX_BATCH_ROWS`` rows)."""
        work = self._work[owner]
        batch: list[_SampleOp] = []
        last_call = time.monotonic() + BATCH_MAX_WAIT_S
        while True:
            for op in [op for op in work if isinstance(op, _SampleOp)]:
                if sum(o.job.num_samples for o in batch) >= MAX_BATCH_ROWS:
                    break
                work.remove(op)
                batch.append(op)
            wait = min(BATCH_GAP_S, last_call - time.monotonic())
            if sum(o.job.num_samples for o in batch) >= MAX_BATCH_ROWS or wait <= 0:
                break
            try:
                op = self._queue.get(timeout=wait)
            except queue.Empty:
                break
            if op is _STOP:
                self._queue.put(op)  # seen again by the loop, which then stops
                break
            self._work.setdefault(op.owner, collections.deque()).append(op)
        groups: dict[int, list[_SampleOp]] = {}
        for op in batch:
            if op.future.set_running_or_notify_cancel():
                groups.setdefault(id(op.sampler), []).append(op)
        return [_Decoding(owner, ops) for ops in groups.values()]

    def _cancel(self, ops: list) -> None:
        """Cancel ``ops``, everything waiting in the owners' queues and everything still queued; batches
        under way fail with :class:`SamplingStopped`."""
        for work in self._work.values():
            ops.extend(work)
            work.clear()
        while True:
            for op in ops:
                if isinstance(op, _Decoding):
                    stopped = SamplingStopped("the local engine is stopping: sampling ended early")
                    for sample in op.ops:
                        if not sample.future.done():
                            sample.future.set_exception(stopped)
                elif op is not _STOP:
                    op.future.cancel()
            try:
                ops = [self._queue.get_nowait()]
            except queue.Empty:
                return

    @staticmethod
    def _execute(future: Future, fn: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered to the caller through the future
            future.set_exception(e)

    def _run_slice(self, decoding: _Decoding) -> bool:
        """Run ``decoding`` until it ends or, past its slice, another owner has work waiting; whether it ended
        (its futures are then done)."""
        ops = decoding.ops
        sampler = ops[0].sampler
        began = time.perf_counter()
        try:
            base = sampler.base
            adapter = None
            if sampler.weights is not None:  # (again after a pause: another sampler may have used the slot)
                adapter = base.load_snapshot(sampler.spec, sampler.weights, sampler, decoding.owner)
            if self._generator is None:
                self._generator = torch.Generator(device=base.device)
                self._generator.seed()
            with heap_for_the_pass(), base.use_for_sampling(adapter) as model:
                resume, resuming = None, decoding.steps is not None
                if not resuming:
                    decoding.steps = generate_steps(
                        model, [op.job for op in ops], base.tokenizer, base.device, self._generator,
                        logits_fn=base.sampler_logits if base.split_head or base.vision else None,
                        vision=base.vision, decode_fn=base.sampler_decode_step,
                        stopping=lambda: self._stopped)
                else:
                    resume = model
                decoding_from = time.perf_counter()
                switch = self.switch_share * (decoding_from - began) if resuming else 0.0
                budget = max(self.slice_s, switch)
                while True:
                    try:
                        decoding.steps.send(resume)
                    except StopIteration as done:
                        results = done.value
                        break
                    resume = None
                    if time.perf_counter() - decoding_from >= budget and self._others_waiting(decoding.owner):
                        return False
            for op, res in zip(ops, results):
                op.future.set_result(res)
        except BaseException as e:  # noqa: BLE001
            for op in ops:
                if not op.future.done():
                    op.future.set_exception(e)
        return True

    # ---- models (worker thread only) ---------------------------------------------------------
    def base(self, name: str) -> BaseModel:
        if name not in self._bases:
            base = BaseModel(name, self.device_name, self.dtype_name, self.gradient_checkpointing,
                             self.sampler_dtype_name, self.attention)
            log.info("%s: %s", name, base.sampler_note)
            self._bases[name] = base
            if self.vllm_settings is not None:  # starts in the background while the caller goes on
                dtype = str(base.sampler_dtype).removeprefix("torch.")
                self._vllm[name] = VllmSampler(base.path, str(base.device), dtype, self.vllm_settings)
        return self._bases[name]

    def vllm_sampler(self, name: str) -> VllmSampler | None:
        """The vLLM sampler of base model ``name``, when the engine samples on vLLM and has loaded it."""
        return self._vllm.get(name)

    def loaded_models(self) -> list[BaseModel]:
        return list(self._bases.values())

    def create_trainer(self, model_id: str, base_model: str, spec: LoraSpec,
                       optimizer: str = "adamw") -> TrainerState:
        base = self.base(base_model)
        adapter = f"train_{next(self._adapter_ids)}"
        params = base.add_adapter(adapter, spec)
        return TrainerState(model_id, base, adapter, spec, params,
                            make_optimizer(optimizer, params, spec.rank), optimizer)

    # ---- training operations (worker thread only) --------------------------------------------
    def forward_backward(self, st: TrainerState, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: dict | None, backward: bool,
                         provenance: Callable[[list[types.Datum]], Sequence[SampledInputs]] | None = None,
                         ) -> types.ForwardBackwardOutput:
        """``provenance`` resolves the datums' provenance spans against the sequences the caller's
        session recorded (for a loss that needs it, such as ``stable_reinforce``)."""
        spec = losses.get_loss(loss_fn)
        config = dict(loss_fn_config or {})
        losses.check_config_keys(spec, config)
        sampled: Sequence[SampledInputs | None] = [None] * len(data)
        if spec.provenance:
            if provenance is None:
                raise ValueError(f"loss {loss_fn!r} needs sequences recorded by this session's samplers "
                                 "(record_stability_info=True)")
            sampled = provenance(data)
        prepared = [prepare_datum(i, d, spec, st.base, s)
                    for i, (d, s) in enumerate(zip(data, sampled))]
        outputs: list[torch.Tensor | None] = [None] * len(data)
        parts: list[dict[str, float]] = []
        with (_all_or_nothing(st.params), st.base.use(st.adapter, train=backward),
              torch.set_grad_enabled(backward), heap_for_the_pass(not st.base.gradient_checkpointing)):
            for mb in self._micro_batches(st.base, prepared):
                lps = packed_logprobs(st.base, mb, [prepared[i].target for i in mb.datums])
                members = [prepared[i] for i in mb.datums]
                loss, metrics = batch_loss(spec, members, lps, config, st.base.device)
                if backward:
                    loss.backward()
                for i, lp in zip(mb.datums, lps):
                    outputs[i] = lp.detach()
                parts += metrics
        if backward:
            _note_loss(st, [m["loss:sum"] for m in parts if "loss:sum" in m])
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(o.float().cpu())} for o in outputs],
            metrics=reduce_metrics(parts),
        )

    def forward_backward_custom(self, st: TrainerState, data: list[types.Datum],
                                fn) -> types.ForwardBackwardOutput:
        prepared = [prepare_datum(i, d, None, st.base) for i, d in enumerate(data)]
        lps: list[torch.Tensor | None] = [None] * len(data)
        with (_all_or_nothing(st.params), st.base.use(st.adapter, train=True),
              heap_for_the_pass(not st.base.gradient_checkpointing)):
            for mb in self._micro_batches(st.base, prepared):
                for i, lp in zip(mb.datums,
                                 packed_logprobs(st.base, mb, [prepared[i].target for i in mb.datums])):
                    lps[i] = lp
            loss, user_metrics = fn(data, lps)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("a custom loss function must return (scalar tensor, metrics dict)")
            loss.backward()
        metrics = {"loss:sum": float(loss.detach())}
        _note_loss(st, [metrics["loss:sum"]])
        metrics.update({k if ":" in k else f"{k}:sum": float(v) for k, v in (user_metrics or {}).items()})
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(lp.detach().float().cpu())}
                             for lp in lps],
            metrics=metrics,
        )

    def _micro_batches(self, base: BaseModel, prepared: list[PreparedDatum]) -> list[MicroBatch]:
        # on a CPU a padded token costs what a real one does: a short row gets its own call rather than
        # padding to a long one's width
        call_tokens = CPU_CALL_TOKENS if base.device.type == "cpu" else None
        if not any(p.images for p in prepared):
            return micro_batches([p.tokens for p in prepared], self.micro_batch_tokens, base.linear_per_pair,
                                 base.device, call_tokens=call_tokens, tree=base.tree_attention,
                                 flex=base.attention == "flex")
        # images: keyed sequences (shared prefixes only where the images agree), multimodal positions
        keys: dict[tuple[str, int], int] = {}
        sequences = [keyed(p.tokens, p.images, keys) for p in prepared]
        by_key = {keys[(im.key, im.start)]: im for p in prepared for im in p.images}
        mrope = [base.vision.rope(p.tokens, p.images)[0] for p in prepared]
        batches = micro_batches(sequences, self.micro_batch_tokens, base.linear_per_pair, base.device, mrope,
                                base.vision.image_token_id, call_tokens)
        for mb in batches:
            if mb.image_keys:
                mb.vision = base.vision.inputs([by_key[k] for k in mb.image_keys], base.device)
        return batches

    def optim_step(self, st: TrainerState,
                   params: types.AdamParams | DimuonSettings) -> types.OptimStepResponse:
        """One step of the client's optimizer (AdamW or Dimuon, see :mod:`polyrl.local.optim`) on the
        accumulated gradients. A step whose loss, gradient or update is not finite is refused
        (:class:`NonFiniteUpdateError`): weights and optimizer state stay bit for bit (the update is
        checked after ``optimizer.step()`` and undone from a copy of the trained weights and their
        optimizer state), the gradients are dropped, and the next ``forward_backward`` starts a clean
        step."""
        check_kind(st.optimizer_type, params)
        trained = [p for p in st.params if p.grad is not None]
        grads = [p.grad for p in trained]
        total_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        norm = float(total_norm)
        if st.bad_loss is not None or not math.isfinite(norm):
            problem = _update_problem(st.bad_loss, grads, norm, sum(p.numel() for p in st.params))
            st.bad_loss = None
            st.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdateError(f"optim_step refused: {problem}; the weights and optimizer state are "
                                       "unchanged and the accumulated gradients were dropped")
        configure(st.optimizer, params)
        if grads and params.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(trained, params.grad_clip_norm, total_norm)
        kept = _keep(st.optimizer, trained)
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        if problem := _applied_problem(st.optimizer, trained, params):
            _restore(st.optimizer, trained, kept)
            raise NonFiniteUpdateError(f"optim_step refused: {problem}; the weights and optimizer state are "
                                       "unchanged and the accumulated gradients were dropped")
        st.steps += 1
        return types.OptimStepResponse(metrics={"grad_norm:mean": norm,
                                                "learning_rate:mean": params.learning_rate,
                                                **sampler_metrics(st.base), **self._vllm_metrics(st.base)})

    def _vllm_metrics(self, base: BaseModel) -> dict[str, float]:
        vllm = self._vllm.get(base.name)
        return vllm.metrics() if vllm is not None else {}

    # ---- checkpoints (worker thread only) ---------------------------------------------------
    def _meta(self, st: TrainerState, user_metadata: dict | None = None) -> dict:
        return {"base_model": st.base.name, "lora": st.spec.to_dict(), "steps": st.steps,
                "model_id": st.model_id, "user_metadata": user_metadata, "optimizer": st.optimizer_type}

    def save_state(self, st: TrainerState, name: str, overwrite: bool = False,
                   user_metadata: dict | None = None, ttl_seconds: int | None = None) -> str:
        cp = CheckpointPath(st.model_id, "weights", check_name(name))
        check_ttl(ttl_seconds)
        _check_finite(st, f"save_state {name!r}", optimizer=True)

        def write(d: Path) -> None:
            st.base.save_adapter(st.adapter, d)
            buffer = io.BytesIO()  # torch.save's own writer reports a full disk without its reason
            torch.save(st.optimizer.state_dict(), buffer)
            (d / "optimizer.pt").write_bytes(buffer.getbuffer())

        return self.store.write(cp, write, self._meta(st, user_metadata), overwrite, ttl_seconds)

    def save_for_sampler(self, st: TrainerState, name: str, user_metadata: dict | None = None,
                         ttl_seconds: int | None = None) -> str:
        """Sampler weights; a name that exists is replaced (Tinker's sampler saves take no ``overwrite``)."""
        cp = CheckpointPath(st.model_id, "sampler_weights", check_name(name))
        check_ttl(ttl_seconds)
        _check_finite(st, f"save_weights_for_sampler {name!r}", optimizer=False)
        meta = self._meta(st, user_metadata)
        return self.store.write(cp, lambda d: st.base.save_adapter(st.adapter, d), meta, True, ttl_seconds)

    def save_external(self, st: TrainerState, name: str, ttl_seconds: int | None = None,
                      recipients: list[str] | None = None) -> str:
        """``tinker://<run>/external_weights/<name>``: the adapter in Hugging Face's PEFT format, to download,
        each file encrypted to the age ``recipients`` if any (and named ``<file>.age``)."""
        cp = CheckpointPath(st.model_id, "external_weights", check_name(name))
        check_ttl(ttl_seconds)
        parsed = age_recipients(recipients)
        _check_finite(st, f"save_weights_external {name!r}", optimizer=False)

        def write(d: Path) -> None:
            st.base.save_adapter(st.adapter, d)
            if parsed:
                encrypt_files(d, parsed)

        return self.store.write(cp, write, {**self._meta(st), "encrypted": bool(parsed)}, False, ttl_seconds)

    def snapshot_sampler(self, st: TrainerState, model_path: str | None = None) -> SamplerState:
        state = SamplerState(st.base, st.spec, st.base.snapshot(st.adapter), model_path)
        if (vllm := self._vllm.get(st.base.name)) is not None:
            vllm.export(state, lambda d: st.base.save_adapter(st.adapter, d))
        return state

    def _loadable(self, path: str) -> Path:
        cp, directory = self.store.resolve(path)
        if cp.kind == "external_weights":
            raise CheckpointRequestError(f"checkpoint {path} is external weights, made to be downloaded; "
                                         "load the training or sampler checkpoint it was saved from")
        return directory

    def load_trainer(self, model_id: str, path: str, with_optimizer: bool,
                     optimizer: str = "adamw") -> TrainerState:
        """A training client from a checkpoint: with its optimizer state (and so its optimizer), or with a
        fresh ``optimizer``."""
        directory = self._loadable(path)
        meta = self.store.meta(directory)
        if with_optimizer:
            optimizer = meta.get("optimizer", "adamw")
        st = self.create_trainer(model_id, meta["base_model"], LoraSpec(**meta["lora"]), optimizer)
        st.base.load_adapter_weights(st.adapter, directory)
        if with_optimizer:
            if not (directory / "optimizer.pt").exists():
                raise ValueError(f"checkpoint {path} has no optimizer state (it is sampler weights)")
            st.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=st.base.device))
            st.steps = int(meta.get("steps", 0))
        return st

    def load_sampler(self, path: str) -> SamplerState:
        directory = self._loadable(path)
        meta = self.store.meta(directory)
        base = self.base(meta["base_model"])
        spec = LoraSpec(**meta["lora"])
        tmp = f"load_{next(self._adapter_ids)}"
        base.add_adapter(tmp, spec)
        try:
            base.load_adapter_weights(tmp, directory)
            weights = base.snapshot(tmp)
        finally:
            base.delete_adapter(tmp)
        state = SamplerState(base, spec, weights, path)
        if (vllm := self._vllm.get(base.name)) is not None:
            vllm.export(state, lambda d: [shutil.copy(directory / f, d / f) for f in ADAPTER_FILES])
        return state


atexit.register(Engine.stop_all)  # runs before the interpreter stops its threads


# ---- helpers -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _all_or_nothing(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Gradients of a call are added to the ones already accumulated only if the whole call succeeds:
    a failure in any micro-batch (bad input, out of memory) leaves the accumulated gradients as they
    were, so a following ``optim_step`` never applies half a batch."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        for p, g in zip(params, earlier):
            p.grad = g
        raise
    for p, g in zip(params, earlier):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)


def _note_loss(st: TrainerState, values: list[float]) -> None:
    """Remember a non-finite loss of a ``forward_backward``: the next ``optim_step`` is refused."""
    bad = [v for v in values if not math.isfinite(v)]
    if bad and st.bad_loss is None:
        st.bad_loss = bad[0]


def _count_not_finite(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(NaN entries, infinite entries) of ``tensors``."""
    nan = sum(int(torch.isnan(t).sum()) for t in tensors)
    return nan, sum(int(torch.isinf(t).sum()) for t in tensors)


def _update_problem(bad_loss: float | None, grads: list[torch.Tensor], norm: float, size: int) -> str:
    """Why an update cannot be applied, in words: a non-finite loss, a non-finite gradient, or one whose
    norm overflows float32 (its square would put infinities into Adam's second moment)."""
    problems = []
    if bad_loss is not None:
        problems.append(f"the loss of a forward_backward since the last step is not finite ({bad_loss})")
    nan, inf = _count_not_finite(grads)
    if nan or inf:
        counts = " and ".join(f"{kind} in {n} of {size} entries" for kind, n in (("NaN", nan), ("inf", inf))
                              if n)
        problems.append(f"the gradient is not finite ({counts})")
    elif not math.isfinite(norm):
        largest = max(float(g.abs().max()) for g in grads)
        problems.append(f"the gradient is too large for float32 (its norm overflows; largest entry "
                        f"{largest:.3g})")
    return " and ".join(problems)


def _keep(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list:
    """Copies of ``params`` and of their optimizer state (None where a parameter has none yet), for
    :func:`_restore`, held for one step: the trained adapter and its moments (AdamW: three times the
    adapter's size; 117 MB for SmolLM2-135M at rank 32)."""
    return [(p.detach().clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in optimizer.state[p].items()} if p in optimizer.state else None)
            for p in params]


def _restore(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], kept: list) -> None:
    """Put back what :func:`_keep` copied: the weights in place, the optimizer state as it was."""
    with torch.no_grad():
        for p, (weights, state) in zip(params, kept):
            p.copy_(weights)
            if state is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = state


def _state_tensors(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [v for p in params for v in optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _applied_problem(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                     settings: types.AdamParams | DimuonSettings) -> str:
    """Why the update just applied to ``params`` must be undone ('' if it may stay): a weight or an
    optimizer moment that is not finite."""
    weights = [p.detach() for p in params]
    nan, inf = (0, 0) if _all_finite(weights) else _count_not_finite(weights)
    if not nan and not inf and _all_finite(_state_tensors(optimizer, params)):
        return ""
    size = sum(p.numel() for p in weights)
    problem = (f"the update is not finite (it would make {nan + inf} of {size} adapter weights NaN or inf)"
               if nan or inf else "the update would make the optimizer state not finite")
    eps = getattr(settings, "eps", None)
    if eps is not None and 0 < eps < torch.finfo(torch.float32).tiny:
        problem += f" (adam_params.eps={eps:g} is 0 in float32)"
    return problem


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of ``tensors`` is finite: one fused 2-norm (NaN and inf propagate into it), and
    an exact count only when that norm is not finite (finite entries whose squares overflow)."""
    if not tensors or math.isfinite(float(torch.nn.utils.get_total_norm(tensors))):
        return True
    return not sum(_count_not_finite(tensors))


def _check_finite(st: TrainerState, what: str, optimizer: bool) -> None:
    """Refuse to write a checkpoint holding a non-finite adapter weight (or optimizer state)."""
    nan, inf = _count_not_finite([p.detach() for p in st.params])
    if nan or inf:
        size = sum(p.numel() for p in st.params)
        raise NonFiniteUpdateError(f"{what} refused: {nan + inf} of {size} adapter weights are not finite; "
                                   "nothing was written")
    if optimizer:
        moments = [v for state in st.optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if sum(_count_not_finite(moments)):
            raise NonFiniteUpdateError(f"{what} refused: the optimizer state is not finite; "
                                       "nothing was written")


def sampler_metrics(base: BaseModel) -> dict[str, float]:
    """The sampler's precision (bits per number) and the memory its own copy of the weights holds (MiB;
    0 when it samples from the learner's weights), as the engine reports them with each optimizer step."""
    return {"sampler/dtype_bits:mean": float(torch.finfo(base.sampler_dtype).bits),
            "sampler/copy_mib:mean": base.sampler_bytes / 2**20}
