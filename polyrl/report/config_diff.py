"""The run's config as a difference from the schema's defaults: the settings a user set or that differ
from :class:`polyrl.config.TrainConfig`'s defaults, each by its nested path (``optimizer.lr``,
``environments.math.num_rollouts``). Works on ``config.json`` as written (redacted), without
validating it: a run's config stays readable when the schema moved on.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from polyrl.config.schema import ConfigProblems, TrainConfig, move_renamed_keys

_NO_DEFAULT = object()  # a required field, or a key the schema does not know: always listed


def _models(annotation: Any) -> tuple[type[BaseModel] | None, type[BaseModel] | None]:
    """The model an annotation holds (``KLConfig | None``) and the model of a ``dict[str, Model]``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [_models(a) for a in args if a is not type(None)]
        return next((m for m, _ in found if m), None), next((d for _, d in found if d), None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, None
    if typing.get_origin(annotation) is dict and len(args) == 2:
        return None, _models(args[1])[0]
    return None, None


def _field_default(field: FieldInfo) -> Any:
    if field.is_required():
        return _NO_DEFAULT
    return to_jsonable_python(field.get_default(call_default_factory=True))


def _entry(path: str, value: Any, default: Any) -> dict:
    return {"path": path, "value": value} if default is _NO_DEFAULT else \
        {"path": path, "value": value, "default": default}


def _diff(value: Any, default: Any, annotation: Any, path: str, out: list[dict]) -> None:
    model, item_model = _models(annotation)
    if model is not None and isinstance(value, dict):
        base = default if isinstance(default, dict) else None
        before = len(out)
        for key, sub in value.items():
            field = model.model_fields.get(key)
            where = f"{path}.{key}" if path else key
            if field is None:
                out.append(_entry(where, sub, _NO_DEFAULT))
                continue
            sub_default = base[key] if base is not None and key in base else _field_default(field)
            _diff(sub, sub_default, field.annotation, where, out)
        if base is None and len(out) == before and path:  # set, though every field is at its default
            out.append(_entry(path, {}, default))
        return
    if isinstance(value, dict) and (item_model is not None or isinstance(default, dict)):
        base = default if isinstance(default, dict) else {}
        for key, sub in value.items():
            where = f"{path}.{key}"
            sub_default = base.get(key, _NO_DEFAULT)
            if item_model is not None and isinstance(sub, dict) and sub_default is _NO_DEFAULT:
                # an entry the user added: its fields against the model's defaults; an environment's
                # type defaults to the entry's name
                named = "type" in item_model.model_fields
                if named and sub.get("type") == key:
                    sub = {k: v for k, v in sub.items() if k != "type"}
                start = len(out)
                _diff(sub, _NO_DEFAULT, item_model, where, out)
                for entry in out[start:] if named else []:
                    if entry["path"] == f"{where}.type":
                        entry["default"] = key
            else:
                _diff(sub, sub_default, item_model or Any, where, out)
        for key, sub_default in base.items():
            if key not in value:  # a default entry left out (splits: {test: null})
                out.append(_entry(f"{path}.{key}", None, sub_default))
        return
    if default is _NO_DEFAULT or value != default:
        out.append(_entry(path, value, default))


def config_diff(config: dict, schema: type[BaseModel] | None = None) -> list[dict]:
    """``[{path, value, default}]`` for each setting of ``config`` (a ``config.json``) that is not the
    ``schema``'s default (:class:`TrainConfig`'s unless given: ``polyrl sft``'s runs pass ``SFTConfig``),
    in the config's order; ``default`` is absent where the schema has none (a required field, an entry
    the user added, a key the schema does not know)."""
    if not config:
        return []
    if any(old in config for old in TrainConfig.RENAMED):
        try:  # a run of an older release: its flat keys where the schema has them now
            config, _ = move_renamed_keys(config, TrainConfig.RENAMED)
        except ConfigProblems:
            pass
    out: list[dict] = []
    _diff(config, None, schema or TrainConfig, "", out)
    return out
