"""GEM's Tinker trainer command line, run by ``polyrl train``: the same ``key=value`` arguments.

``polyrl train env_id=game:GuessTheNumber-v0-easy max_steps=20 gamma=0.9 use_rebn=true template=qwen3_game``
trains what GEM's ``examples/train_tinker/tinker_train.py`` (REINFORCE with return batch
normalization) would, with its defaults for every argument not given; the arguments of GEM's
tinker-cookbook script (``group_size``, ``groups_per_batch``, ``n_batches``, ``env_kwargs_json`` ...)
are accepted too. GEM argument -> polyrl key:

- ``env_id`` (default ``rg:simple_equations``) -> one environment of type ``gem:<env_id>``;
  ``env_kwargs_json`` -> its ``args.env_kwargs``; ``env_wrappers`` (default ``concat``) -> its
  ``args.wrappers``, less the history-concatenating ones (``concat*``): polyrl's episodes carry the
  whole conversation already;
- ``use_rebn`` (default true) -> ``advantages.estimator: rebn`` (per-turn discounted returns normalized
  over the batch); ``gamma`` (default 0.9) -> ``advantages.gamma``. ``use_rebn=false`` (raw returns) has
  no polyrl estimator: it becomes ``grpo``, which needs ``group_size`` > 1;
- ``batch_size`` (default 128) -> ``batch_size``: GEM counts turns, polyrl counts episodes (groups of
  ``group_size``, default 1): the same for single-turn environments, more turns per step for
  multi-turn ones. ``groups_per_batch`` -> ``batch_size``; ``group_size`` -> ``num_rollouts``;
- ``template`` (default ``qwen3_general``) -> ``renderer`` (polyrl has GEM's templates: ``qwen3_game``,
  ``qwen3_general``, ``no``); ``renderer_name`` -> ``renderer``;
- ``model_name`` (``Qwen/Qwen3-8B-Base``), ``learning_rate`` (4e-5), ``lora_rank`` (32), ``max_tokens``
  (2048), ``seed`` (0), ``max_steps`` (200; ``n_batches``), ``eval_every``, ``base_url`` -> the same names;
- ``save_every`` (-1: never) -> ``save_every`` (0: at the end only); ``load_checkpoint_path`` ->
  ``resume_from``;
- ``wandb_project`` / ``wandb_name`` -> ``wandb_project_name`` / ``wandb_run_name``; ``log_dir`` /
  ``log_path`` -> ``log_path`` (default ``runs/gem-<env>``);
- ``max_steps_off_policy`` -> ``off_policy.max_steps`` (asynchronous training); ``kl_penalty_coef`` ->
  ``kl.penalty_coef``;
- ``num_env`` (parallel environments), ``prompt_type``, ``compute_post_kl``, ``num_substeps``,
  ``behavior_if_log_dir_exists``: notes (polyrl runs a step's episodes concurrently and resumes an
  existing log_path).

Episodes run until the environment ends them (``max_turns: 100``), as GEM's loop does. The backend is
Tinker when ``TINKER_API_KEY`` or ``base_url`` is set, else polyrl's local engine (a note says so).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from polyrl.compat import Translation
from polyrl.config.files import parse_scalar, set_dotted
from polyrl.config.schema import ConfigError

DEFAULTS: dict[str, Any] = {  # tinker_train.Config
    "model_name": "Qwen/Qwen3-8B-Base", "batch_size": 128, "learning_rate": 4e-5, "lora_rank": 32,
    "max_tokens": 2048, "seed": 0, "max_steps": 200, "save_every": -1, "env_id": "rg:simple_equations",
    "num_env": 4, "env_wrappers": "concat", "template": "qwen3_general", "gamma": 0.9, "use_rebn": True,
}
SAME_NAME = ("model_name", "learning_rate", "lora_rank", "max_tokens", "seed", "max_steps", "eval_every",
             "base_url")
RENAMED = {"n_batches": "max_steps", "groups_per_batch": "batch_size", "batch_size": "batch_size",
           "template": "renderer", "renderer_name": "renderer", "load_checkpoint_path": "resume_from",
           "wandb_project": "wandb_project_name", "wandb_name": "wandb_run_name", "log_dir": "log_path",
           "log_path": "log_path", "kl_penalty_coef": "kl.penalty_coef",
           "max_steps_off_policy": "off_policy.max_steps"}
NOTES = {
    "num_env": "polyrl runs all of a step's episodes concurrently",
    "prompt_type": "the renderer (template) shapes the prompt",
    "compute_post_kl": "polyrl logs the sampler/learner KL every step",
    "num_substeps": "one optimizer step per batch",
    "behavior_if_log_dir_exists": "polyrl resumes from an existing log_path",
}
HANDLED = {"env_id", "env_kwargs_json", "env_wrappers", "use_rebn", "gamma", "group_size", "save_every"}
_HISTORY_WRAPPERS = ("concat", "concat_chat", "concat_with_action", "concat_chat_on_reset")


def parse_args(args: list[str]) -> dict[str, Any]:
    """``key=value`` strings as a dict (values parsed like ``--overrides``); errors name the argument."""
    known = set(DEFAULTS) | set(SAME_NAME) | set(RENAMED) | set(NOTES) | HANDLED
    parsed: dict[str, Any] = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"argument {arg!r}: expected key=value (GEM trainer style)")
        if key not in known:
            raise ConfigError(f"argument {key!r}: not a GEM trainer argument (known: "
                              f"{', '.join(sorted(known))}); polyrl's own keys go in --overrides")
        parsed[key] = parse_scalar(text)
    return parsed


def translate(args: list[str]) -> Translation:
    given = parse_args(args)
    gem = {**DEFAULTS, **given}
    notes: list[str] = []
    data: dict[str, Any] = {"save_every": max(0, int(gem["save_every"]))}
    for key in SAME_NAME:
        if key in gem:
            data[key] = gem[key]
    for key, target in RENAMED.items():
        if key in gem and not (key in ("kl_penalty_coef", "max_steps_off_policy") and not gem[key]):
            set_dotted(data, target, gem[key])
    for key, why in NOTES.items():
        if key in given:
            notes.append(f"{key}={given[key]!r} is not used: {why}")

    env_id = str(gem["env_id"])
    name = re.sub(r"\W+", "_", env_id.split(":")[-1]).strip("_") or "gem"
    env: dict[str, Any] = {"type": f"gem:{env_id}", "num_rollouts": int(gem.get("group_size", 1)),
                           "max_turns": 100}
    wrappers = [w.strip() for w in str(gem["env_wrappers"] or "").split(",") if w.strip()]
    dropped = [w for w in wrappers if w in _HISTORY_WRAPPERS]
    if dropped:
        notes.append(f"env_wrappers {', '.join(dropped)} left out: polyrl's episodes carry the conversation")
    wrappers = [w for w in wrappers if w not in _HISTORY_WRAPPERS]
    args_: dict[str, Any] = {"wrappers": wrappers} if wrappers else {}
    if gem.get("env_kwargs_json"):
        try:
            args_["env_kwargs"] = json.loads(str(gem["env_kwargs_json"]))
        except ValueError as exc:
            raise ConfigError(f"env_kwargs_json: not valid JSON ({exc})") from exc
    if args_:
        env["args"] = args_
    data["environments"] = {name: env}
    data.setdefault("log_path", f"runs/gem-{name}")

    if gem["use_rebn"] is True or str(gem["use_rebn"]).lower() == "true":
        data["advantages"] = {"estimator": "rebn", "gamma": gem["gamma"]}
    else:
        if env["num_rollouts"] < 2:
            raise ConfigError("use_rebn=false: polyrl has no raw-return estimator; its group baseline (grpo) "
                              "needs group_size >= 2 (or keep use_rebn=true)")
        data["advantages"] = {"estimator": "grpo"}
        if "gamma" in given:
            data["advantages"]["gamma"] = given["gamma"]  # grpo refuses gamma != 1 with a clear error
        notes.append("use_rebn=false: grpo (reward minus the group's mean) instead of raw returns")
    if os.environ.get("TINKER_API_KEY") or data.get("base_url"):
        data["backend"] = "tinker"
    else:
        notes.append("no Tinker API key (TINKER_API_KEY is not set): training on polyrl's local engine")
        data["backend"] = "local"
    notes.append(f"batch_size={data['batch_size']} counts episodes here (GEM counts turns)")
    return Translation(f"GEM trainer arguments: {' '.join(args)}", data, notes)
