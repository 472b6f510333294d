"""Minds RL's TOML run configs, run by ``polyrl train --config_path configs/train.toml`` unmodified.

A file whose top-level tables are Minds RL's (``[env]`` or ``[[envs]]``, ``[trainer]``, ``[model]``,
``[tinker]``, ``[inference]``) is translated key by key (Minds RL -> polyrl):

- ``[env] id = "./environments/my_task"`` and ``[env.args]`` -> an environment ``my_task`` of type
  ``module:./environments/my_task`` with those ``args``; each ``[[envs]]`` entry (``id``, ``name``,
  ``weight``/``ratio``, ``args``) -> one environment with that ``weight``;
- ``[trainer] rollouts_per_example`` (or ``rollouts``) -> every environment's ``num_rollouts``;
  ``loss_fn`` -> ``loss_fn``; ``groups_per_batch``/``batch_size`` -> ``batch_size`` (default 1: one
  prompt a step, as the harness sampled); ``total_batches``/``num_batches`` -> ``max_steps``
  (default 100); ``learning_rate``, ``training_rank`` -> ``learning_rate``, ``lora_rank``;
  ``save_every``/``save_every_n_steps`` -> ``save_every``; ``eval_every``, ``seed`` as they are
  (in ``[trainer]`` or ``[trainer.args]``);
- ``[trainer.args] max_new_tokens`` (or ``[inference.args]``) -> ``max_tokens``;
- ``[model] base_model`` (or ``name``) -> ``model_name``; ``renderer_name``/``renderer`` -> ``renderer``;
- ``[tinker] api_key`` / ``api_key_env`` -> ``backend: tinker`` with that key (below);
  ``resume_checkpoint_id``/``resume_from`` -> ``resume_from``; ``base_url`` -> ``base_url``;
- the harness's output directory -> ``log_path: outputs/<config file stem>`` with
  ``outputs.metrics_json: true``: ``metrics.json`` there is the list of ``{"reward", "loss", "step"}``
  rows the harness wrote, beside polyrl's own files.

The key (``api_key`` inline, or the variable ``api_key_env`` names, default ``TINKER_API_KEY``) is
exported as ``TINKER_API_KEY`` for the Tinker SDK and never written into the config, its dump or the
logs. When no key is set the run goes to polyrl's local engine (a note says so); ``--overrides
backend=local`` forces that. Keys some version of the harness read but polyrl has no use for
(``kl_beta``, ``update_sampler_every_n_steps``, ``[inference] gpus`` ...) become notes; any other key
is an error naming it. ``--overrides`` apply to the translated config, with polyrl's key names.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from polyrl.compat import Translation
from polyrl.config.files import set_dotted
from polyrl.config.schema import ConfigError

SECTIONS = ("env", "envs", "trainer", "model", "tinker", "inference")
_TRAINER_KEYS = {
    "rollouts_per_example": "num_rollouts", "rollouts": "num_rollouts", "loss_fn": "loss_fn",
    "groups_per_batch": "batch_size", "batch_size": "batch_size", "total_batches": "max_steps",
    "num_batches": "max_steps", "max_steps": "max_steps", "learning_rate": "learning_rate",
    "training_rank": "lora_rank", "save_every": "save_every", "save_every_n_steps": "save_every",
    "eval_every": "eval_every", "seed": "seed", "max_new_tokens": "max_tokens",
    "async_off_policy_steps": "off_policy.max_steps",
}
_UNUSED = {  # read by some version of the harness; what polyrl does instead
    "kl_beta": "no reference-KL penalty in this translation",
    "use_lora": "polyrl always trains a LoRA adapter",
    "gradient_accumulation_steps": "each step is one forward_backward over the whole batch",
    "micro_batch_size": "the engine packs sequences itself",
    "run_name": "the run is named by log_path",
    "update_sampler_every_n_steps": "polyrl samples from the latest weights every step",
    "stream_minibatches": "it counts minibatches per batch; polyrl's off_policy.stream_minibatches counts "
                          "groups per minibatch",
    "gpus": "the local engine uses `local.device`",
    "enforce_eager": "no vLLM here", "max_model_len": "no vLLM here",
}


def is_minds_config(data: dict[str, Any]) -> bool:
    """A Minds RL config: an ``env``/``envs`` table and no key outside Minds RL's sections."""
    return ("env" in data or "envs" in data) and all(key in SECTIONS for key in data)


def translate(raw: dict[str, Any], path: str | Path) -> Translation:
    """``raw`` (a parsed Minds RL TOML file at ``path``) as polyrl config data."""
    path = Path(path)
    notes: list[str] = []
    data: dict[str, Any] = {"log_path": f"outputs/{path.stem}", "outputs": {"metrics_json": True},
                            "batch_size": 1, "max_steps": 100}
    trainer = _table(raw, "trainer")
    sources = [("trainer", trainer), ("trainer.args", _table(trainer, "args", "trainer")),
               ("inference.args", _table(_table(raw, "inference"), "args", "inference"))]
    num_rollouts = None
    for where, table in sources:
        for key, value in table.items():
            if key == "args" and where == "trainer":
                continue
            target = _TRAINER_KEYS.get(key)
            if target == "num_rollouts":
                num_rollouts = value
            elif target is not None:
                set_dotted(data, target, value)
            else:
                _note_unused(notes, path, where, key, value)
    for key, value in _table(raw, "inference").items():
        if key != "args":
            _note_unused(notes, path, "inference", key, value)

    model = _table(raw, "model")
    for key, value in model.items():
        if key in ("base_model", "name"):
            data["model_name"] = value
        elif key in ("renderer_name", "renderer"):
            data["renderer"] = value
        else:
            raise ConfigError(f"{path}: [model] {key}: unknown Minds RL key (known: base_model, "
                              "renderer_name)")
    if "model_name" not in data:
        raise ConfigError(f"{path}: [model] base_model is required")

    data["environments"] = _environments(raw, path, num_rollouts)
    data.update(_tinker(_table(raw, "tinker"), path, notes))
    return Translation(f"Minds RL config {path}", data, notes)


def _environments(raw: dict[str, Any], path: Path, num_rollouts: Any) -> dict[str, Any]:
    entries = []
    if "env" in raw:
        entries.append(("env", _table(raw, "env")))
    envs = raw.get("envs") or []
    if not isinstance(envs, list):
        raise ConfigError(f"{path}: envs must be an array of tables ([[envs]])")
    entries += [(f"envs[{i}]", entry) for i, entry in enumerate(envs)]
    environments: dict[str, Any] = {}
    for where, entry in entries:
        if not isinstance(entry, dict) or not str(entry.get("id", "")).strip():
            raise ConfigError(f"{path}: [{where}] id is required (a module or ./environments/<name> "
                              "directory)")
        unknown = sorted(set(entry) - {"id", "args", "name", "weight", "ratio"})
        if unknown:
            raise ConfigError(f"{path}: [{where}] {unknown[0]}: unknown Minds RL key "
                              "(known: id, args, name, weight)")
        env_id = str(entry["id"]).strip()
        stem = str(entry.get("name") or Path(env_id.rstrip("/")).name)
        name = re.sub(r"\W+", "_", stem).strip("_") or "env"
        while name in environments:
            name += "_"
        env: dict[str, Any] = {"type": f"module:{env_id}", "args": dict(entry.get("args") or {})}
        if num_rollouts is not None:
            env["num_rollouts"] = num_rollouts
        if "weight" in entry or "ratio" in entry:
            env["weight"] = entry.get("weight", entry.get("ratio"))
        environments[name] = env
    return environments


def _tinker(tinker: dict[str, Any], path: Path, notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    known = {"api_key", "api_key_env", "resume_checkpoint_id", "resume_from", "base_url"}
    unknown = sorted(set(tinker) - known)
    if unknown:
        raise ConfigError(f"{path}: [tinker] {unknown[0]}: unknown Minds RL key "
                          "(known: api_key, api_key_env, resume_checkpoint_id, base_url)")
    resume = tinker.get("resume_checkpoint_id") or tinker.get("resume_from")
    if resume:
        out["resume_from"] = resume
    if tinker.get("base_url"):
        out["base_url"] = tinker["base_url"]
    variable = str(tinker.get("api_key_env") or "TINKER_API_KEY")
    key = tinker.get("api_key") or os.environ.get(variable) or os.environ.get("TINKER_API_KEY")
    if key:
        os.environ["TINKER_API_KEY"] = str(key)  # for the SDK; secrets.redact masks it everywhere
        out["backend"] = "tinker"
    elif tinker.get("base_url"):
        out["backend"] = "tinker"
    else:
        notes.append(f"no Tinker API key ({variable} is not set): training on polyrl's local engine")
        out["backend"] = "local"
    return out


def _table(parent: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"[{where + '.' if where else ''}{key}] must be a table")
    return value


def _note_unused(notes: list[str], path: Path, where: str, key: str, value: Any) -> None:
    """A note for a key polyrl has no use for; an error for a key Minds RL never had."""
    if key not in _UNUSED:
        known = ", ".join(sorted({*_TRAINER_KEYS, *_UNUSED}))
        raise ConfigError(f"{path}: [{where}] {key}: unknown Minds RL key (known: {known})")
    notes.append(f"[{where}] {key} = {value!r} is not used: {_UNUSED[key]}")
