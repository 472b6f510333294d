"""Which chat format a model needs, when the config does not say (``renderer:``).

1. Tinker's model lineup: tinker-cookbook's ``model_info`` names each model's recommended renderer.
   The model is looked up by its hub id, and for a local directory by what it tells of its origin
   (``config.json``/``tokenizer_config.json`` names, a hub-cache ``models--org--name`` path, an
   ``org/name`` or ``name`` at the end of the path), names compared without case.
2. Otherwise the tokenizer's special tokens, for local and tiny models: a Qwen3-VL model directory
   (``model_type: qwen3_vl``) -> ``qwen3_vl`` when its template thinks (``<think>``), else
   ``qwen3_vl_instruct``; Llama 3 header tokens -> ``llama3``; ChatML -> ``qwen3`` when the template is
   Qwen3's (``<think>`` / JSON ``<tool_call>``), else ``chatml``. A ChatML template with Qwen3.5-style
   XML tool calls, or a name of a Qwen after Qwen3, is not guessed at: Qwen3.5, Qwen3.8 and Nemotron 3
   all look like that and differ.
3. Anything else is an error naming the model and the renderer choices: a wrong format silently
   ruins training.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

from polyrl.errors import UserInputError
from polyrl.renderers.base import Renderer, get_renderer, renderer_names, single_token_id

_AFTER_QWEN3 = re.compile(r"qwen[-_ ]?3\.\d|qwen[-_ ]?3[-_]?vl|qwen[4-9]", re.IGNORECASE)
_HUB_CACHE = re.compile(r"models--([^/\\]+?)--([^/\\]+)")


def resolve_renderer(configured: str | None, model_name: str, tokenizer: Any) -> Renderer:
    """The renderer a run uses: ``configured`` if set, else the one inferred for ``model_name``.
    Every problem (an unknown name, a model whose format is unknown, a tokenizer the format cannot
    use) is a one-line :class:`UserInputError`."""
    name = configured or infer_renderer(model_name, tokenizer)
    if name not in renderer_names():
        raise UserInputError(f"unknown renderer {name!r} (known: {', '.join(renderer_names())})")
    try:
        return get_renderer(name, tokenizer)
    except UserInputError:
        raise
    except ValueError as e:
        raise UserInputError(str(e)) from None


def infer_renderer(model_name_or_path: str, tokenizer: Any) -> str:
    """The renderer name for a model (see the module docstring); raises :class:`UserInputError`
    (a ``ValueError``) when the model's format is not known."""
    names = _candidate_names(str(model_name_or_path))
    for name in names:
        if (found := lineup_renderer(name)) is not None:
            return found
    template = str(getattr(tokenizer, "chat_template", None) or "")

    def has(token: str) -> bool:
        return single_token_id(tokenizer, token) is not None

    choices = f"set `renderer:` in the config to one of: {', '.join(renderer_names())}"
    if _model_type(str(model_name_or_path)) == "qwen3_vl" and has("<|image_pad|>"):
        return "qwen3_vl" if "<think>" in template else "qwen3_vl_instruct"
    if has("<|im_start|>") and has("<|im_end|>"):
        if "<function=" in template or any(_AFTER_QWEN3.search(n) for n in names):
            raise UserInputError(
                f"cannot infer the chat format of model {model_name_or_path!r}: it is not in "
                f"tinker-cookbook's model list, and ChatML models of its kind (Qwen3.5, Qwen3.8, Nemotron 3) "
                f"need different formats; {choices}"
            )
        return "qwen3" if "<think>" in template or "<tool_call>" in template else "chatml"
    if has("<|start_header_id|>") and has("<|eot_id|>"):
        return "llama3"
    raise UserInputError(
        f"cannot infer the chat format of model {model_name_or_path!r}: it is not in tinker-cookbook's model "
        f"list and its tokenizer has no chat tokens polyrl recognizes; {choices}"
    )


def lineup_renderer(name: str) -> str | None:
    """The cookbook's recommended renderer for a model of Tinker's lineup (``org/name`` or ``name``,
    any case, an optional ``:checkpoint`` suffix; a mirror's ``org`` is the same model), or None (also
    without tinker-cookbook)."""
    index = _lineup_index()
    key = name.split(":", 1)[0].strip().lower()
    return index.get(key) or index.get(key.rsplit("/", 1)[-1])


@functools.cache
def _lineup_index() -> dict[str, str]:
    """``org/name`` and ``name`` (lower case) -> recommended renderer, from tinker-cookbook's model lists."""
    try:
        from tinker_cookbook import model_info
    except ImportError:
        return {}
    index: dict[str, str] = {}
    for table in [getattr(model_info, f) for f in dir(model_info) if re.fullmatch(r"get_\w+_info", f)]:
        for version, attrs in table().items():
            renderer = attrs.recommended_renderers[0]
            index[f"{attrs.organization}/{version}".lower()] = renderer
            index.setdefault(version.lower(), renderer)
    return index


def _model_type(model: str) -> str | None:
    """``model_type`` of a local model directory's ``config.json``, if it has one."""
    try:
        with open(os.path.join(os.path.expanduser(model), "config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def _candidate_names(model: str) -> list[str]:
    """Names the model may go by: as given, and for a local directory the names it records and the
    ones its path shows."""
    names = [model]
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return names
    recorded = (("config.json", ("_name_or_path", "name_or_path")),
                ("tokenizer_config.json", ("name_or_path",)))
    for file, keys in recorded:
        try:
            with open(os.path.join(path, file)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            names += [str(data[k]) for k in keys if isinstance(data.get(k), str) and data[k]]
    real = os.path.realpath(path)
    if match := _HUB_CACHE.search(real):
        names.append(f"{match.group(1)}/{match.group(2)}")
    parts = [p for p in re.split(r"[/\\]", real.rstrip("/\\")) if p]
    if len(parts) >= 2:
        names.append(f"{parts[-2]}/{parts[-1]}")
    if parts:
        names.append(parts[-1])
    return names
