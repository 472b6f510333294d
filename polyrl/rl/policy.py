"""Opening a policy -- its service, one client, the tokenizer and the chat format -- for every command,
and resolving what ``polyrl export``, ``chat`` and ``play`` are pointed at.

:func:`open_policy` is how ``train``, ``sft``, ``eval``, ``chat`` and ``play`` open the policy they
train or sample, with the renderer :func:`polyrl.renderers.resolve_renderer` picks.

A user names a trained policy the way they met it: a ``tinker://<run>/sampler_weights/<name>`` path
printed by training, a checkpoint directory in the local store, or the run's ``log_path`` (its latest
checkpoint, and the renderer the run trained with). ``chat`` and ``play`` also take a bare model
directory or hub id, to talk to the untrained base model.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from polyrl.backend import make_service_client
from polyrl.config.schema import LocalEngineConfig, PolicyConfig
from polyrl.errors import UserInputError
from polyrl.local.checkpoints import CheckpointPath, Store
from polyrl.renderers import Renderer, resolve_renderer


@dataclass
class OpenPolicy:
    """What a command trains or samples through: the service, the client it opened (a training client
    for train and sft, a sampler otherwise), that client's tokenizer and the chat format."""

    service: Any
    client: Any
    tokenizer: Any
    renderer: Renderer


async def open_policy(config: PolicyConfig, connect: Callable[[Any], Any] | None = None, *,
                      model_path: str | None = None) -> OpenPolicy:
    """Open ``config``'s service (``backend``, ``base_url``, ``local``) and one client of it:
    ``connect(service)`` (its result awaited if it is awaitable), else a sampler of the checkpoint
    ``model_path`` or, without one, of the base model. The renderer is ``config.renderer``, else the one
    inferred from the model."""
    service = make_service_client(config)
    if connect is None:
        where = {"model_path": model_path} if model_path else {"base_model": config.model_name}
        client = service.create_sampling_client(**where)
    else:
        client = connect(service)
    if inspect.isawaitable(client):
        client = await client
    tokenizer = client.get_tokenizer()
    renderer = resolve_renderer(config.renderer, config.model_name, tokenizer)
    return OpenPolicy(service, client, tokenizer, renderer)

ACCEPTED = ("a tinker://<run>/sampler_weights/<name> (or weights) path, a checkpoint directory "
            "or a run's log_path")


@dataclass(frozen=True)
class Policy:
    """A base model plus, for a trained policy, the checkpoint directory holding its LoRA adapter."""

    base_model: str
    checkpoint_dir: Path | None = None
    tinker_path: str | None = None
    store_dir: Path | None = None
    renderer: str | None = None  # the run's renderer, when the run's config says

    @property
    def label(self) -> str:
        return self.tinker_path or self.base_model


def resolve_policy(target: str, store_dir: str | None = None, allow_base: bool = True) -> Policy:
    """The policy ``target`` names (see the module docstring); a clear :class:`UserInputError` when it
    names nothing usable. ``store_dir`` is the local checkpoint store for ``tinker://`` paths."""
    if target.startswith("tinker://"):
        store = Store(store_dir)
        cp, directory = store.resolve(target)
        return _from_checkpoint_dir(directory, store.root, str(cp))
    path = Path(target).expanduser()
    if path.is_dir():
        if (path / "polyrl.json").is_file():
            return _from_checkpoint_dir(path, None, None)
        if (path / "checkpoints.jsonl").is_file() or (path / "metrics.jsonl").is_file():
            return _from_run_dir(path, store_dir)
        if allow_base and (path / "config.json").is_file():
            return Policy(base_model=str(path))
        kinds = ACCEPTED + (" or a model directory" if allow_base else "")
        raise UserInputError(f"{target} is not a checkpoint: expected {kinds}")
    if allow_base and not path.exists() and target.count("/") == 1 and not target.startswith((".", "~", "/")):
        return Policy(base_model=target)  # a hub id; loading it fails clearly if it is not one
    kinds = ACCEPTED + (", a model directory or a hub id" if allow_base else "")
    raise UserInputError(f"checkpoint {target} not found: expected {kinds}")


def _from_checkpoint_dir(directory: Path, store_root: Path | None, tinker_path: str | None) -> Policy:
    """A store directory ``<root>/<run>/<kind>/<name>``: the store root is three levels up."""
    meta = Store.meta(directory)
    if not (directory / "adapter_model.safetensors").is_file():
        raise UserInputError(f"checkpoint {directory} has no adapter_model.safetensors")
    tinker_path = tinker_path or meta.get("tinker_path")
    parents = directory.resolve().parents
    if store_root is None and tinker_path and len(parents) >= 3:
        root = parents[2]
        if Store(root).directory(CheckpointPath.parse(tinker_path)).resolve() == directory.resolve():
            store_root = root
    return Policy(meta["base_model"], directory, tinker_path, store_root)


def _from_run_dir(run_dir: Path, store_dir: str | None) -> Policy:
    """A run's ``log_path``: its last sampler checkpoint, in the store and with the renderer of its config."""
    from polyrl.tracking.files import read_jsonl

    config: dict[str, Any] = {}
    if (run_dir / "config.json").is_file():
        config = json.loads((run_dir / "config.json").read_text())
    rows = [r for r in read_jsonl(run_dir / "checkpoints.jsonl")
            if r.get("sampler_path") or r.get("state_path")]
    if not rows:
        raise UserInputError(f"run {run_dir} has no checkpoint yet (checkpoints.jsonl is empty or missing)")
    if config.get("backend", "local") != "local":
        raise UserInputError(f"run {run_dir} trained on a Tinker service (backend {config['backend']!r}); "
                             "its checkpoints are not in the local store")
    path = rows[-1].get("sampler_path") or rows[-1]["state_path"]
    local = config.get("local") or {}
    store_dir = store_dir or local.get("store_dir") or config.get("store_dir")  # a run of the flat layout too
    policy = resolve_policy(path, store_dir, allow_base=False)
    return Policy(policy.base_model, policy.checkpoint_dir, policy.tinker_path, policy.store_dir,
                  config.get("renderer"))


def open_trained(policy: Policy, device: str = "auto", dtype: str = "auto",
                 renderer: str | None = None, sampler_dtype: str = "auto") -> OpenPolicy:
    """``policy`` (its adapter, or the bare base model) opened on the local engine, with ``renderer``,
    else the run's, else the one inferred from the base model."""
    if policy.checkpoint_dir is not None and (policy.store_dir is None or policy.tinker_path is None):
        raise UserInputError(f"checkpoint {policy.checkpoint_dir} is not inside a checkpoint store "
                             "(<store>/<run>/<kind>/<name>); give its tinker:// path and --store_dir")
    store_dir = str(policy.store_dir) if policy.store_dir is not None else None
    config = PolicyConfig(model_name=policy.base_model, renderer=renderer or policy.renderer,
                          local=LocalEngineConfig(device=device, dtype=dtype, store_dir=store_dir,
                                                  sampler_dtype=sampler_dtype))
    try:
        return asyncio.run(open_policy(config, model_path=policy.tinker_path))
    except (OSError, ValueError) as e:
        if isinstance(e, UserInputError):
            raise
        raise UserInputError(f"cannot load {policy.label}: {e}") from None


def open_sampler(policy: Policy, device: str = "auto", dtype: str = "auto", sampler_dtype: str = "auto"):
    """A local-engine ``SamplingClient`` for ``policy`` (its adapter, or the bare base model)."""
    return open_trained(policy, device, dtype, sampler_dtype=sampler_dtype).client


def renderer_for(policy: Policy, tokenizer: Any, override: str | None = None) -> Renderer:
    """The renderer: ``override``, else the run's, else the one inferred from the base model."""
    return resolve_renderer(override or policy.renderer, policy.base_model, tokenizer)
