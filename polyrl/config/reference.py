"""``polyrl train --help-config``: every field of a config model as ``dotted.name  (type, default)``
and its description, sub-models and environment entries included."""

from __future__ import annotations

import json
import textwrap
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from polyrl.config.checks import registered_kind, registered_names
from polyrl.config.errors import is_model, strip_optional
from polyrl.config.schema import TrainConfig


def config_reference(model: type[BaseModel] = TrainConfig) -> str:
    """Every field as ``dotted.name  (type, default)`` plus its description, nested models included."""
    lines = [f"{model.__name__}: set in the config file or with --overrides key.path=value", ""]
    _describe(model, "", lines)
    return "\n".join(lines)


def _describe(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        key = prefix + name
        if field.is_required():
            default = "required"
        elif is_model(field.annotation):  # a section: its fields and their defaults follow
            default = "a section"
        else:
            default = "default " + _show(field.get_default(call_default_factory=True))
        lines.append(f"{key}  ({_type_name(field.annotation)}{_bounds(field)}, {default})")
        description = field.description or ""
        if kind := registered_kind(field):  # the choices are the registry's, not the schema's
            description += f" Registered choices: {', '.join(registered_names(kind))}."
        lines += textwrap.wrap(description, width=100, initial_indent="    ", subsequent_indent="    ",
                               break_on_hyphens=False)  # "per-step" stays one word when the lines are joined
        tp = strip_optional(field.annotation)
        if is_model(tp):
            _describe(tp, key + ".", lines)
        elif get_origin(tp) is dict and is_model(get_args(tp)[1]):
            key_type, value_type = get_args(tp)
            placeholder = "|".join(get_args(key_type)) if get_origin(key_type) is Literal else "name"
            _describe(value_type, f"{key}.<{placeholder}>.", lines)


def _bounds(field: FieldInfo) -> str:
    found = _bound_texts(field.metadata)
    return ", " + ", ".join(found) if found else ""


def _bound_texts(metadata: list[Any]) -> list[str]:
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return [f"{op} {getattr(m, attr)}" for m in metadata for attr, op in ops.items() if hasattr(m, attr)]


def _show(value: Any) -> str:
    return json.dumps(to_jsonable_python(value))


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:  # a union member with bounds of its own, e.g. int >= 1 | "auto"
        inner, *metadata = args
        metadata = [m for item in metadata for m in getattr(item, "metadata", [item])]  # a Field(...) too
        return " ".join([_type_name(inner), *_bound_texts(metadata)])
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))
