"""A pydantic :class:`ValidationError` of a run config as one line: ``dotted.key: reason`` for each
problem, joined with '; ', an unknown key with the closest known one, secrets masked."""

from __future__ import annotations

import difflib
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from polyrl.config.schema import ConfigProblems
from polyrl.optim_ranges import number
from polyrl.secrets import redact_text

# pydantic's error types of a numeric bound: the bound's key in the error's context, and its words
BOUNDS = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "greater than or equal to"),
          "less_than": ("lt", "less than"), "less_than_equal": ("le", "less than or equal to")}


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line: ``dotted.key: reason`` for each error, joined with '; '."""
    lines: list[str] = []
    unions: dict[str, int] = {}  # a union field's key -> its line, which each member's reason joins
    for err in exc.errors():
        loc = [str(part) for part in err["loc"] if part != "[key]"]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigProblems):
            lines += [error_line(loc + key.split("."), msg) for key, msg in cause.problems]
            continue
        msg = err["msg"]
        if err["type"] in BOUNDS:  # pydantic prints a bound in full: 1e300 as 301 digits
            kind, words = BOUNDS[err["type"]]
            msg = f"Input should be {words} {number(err['ctx'][kind])}"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif err["type"] == "extra_forbidden":
            match = difflib.get_close_matches(loc[-1], _fields_at(model, loc[:-1]), n=1)
            msg = "unknown key" + (f" (did you mean {match[0]}?)" if match else "")
        cut = _union_at(model, loc)
        if cut is not None:  # one error per member of the union, its tag in the location: one line
            key = ".".join(loc[:cut])
            if key in unions:
                lines[unions[key]] += " or " + one_line(msg.removeprefix("Input should be "))
                continue
            unions[key], loc = len(lines), loc[:cut]
        lines.append(error_line(loc, msg))
    return redact_text("; ".join(dict.fromkeys(lines)))


def problems_line(problems: list[tuple[str, str]]) -> str:
    """``(dotted key, reason)`` pairs as the same one line, secrets masked."""
    return redact_text("; ".join(dict.fromkeys(error_line(key.split("."), msg) for key, msg in problems)))


def error_line(loc: list[str], msg: str) -> str:
    msg = msg.replace("; ", ", ")  # '; ' only separates errors
    key = ".".join(loc)
    return f"{key}: {one_line(msg)}" if key else one_line(msg)


def one_line(text: str) -> str:
    return " ".join(text.split())


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    """Field names of the model found at ``path`` below ``model`` (dict keys are skipped over)."""
    tp: Any = model
    for part in path:
        tp = strip_optional(tp)
        if is_model(tp):
            field = tp.model_fields.get(part)
            if field is None:
                return []
            tp = field.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return []
    tp = strip_optional(tp)
    return list(tp.model_fields) if is_model(tp) else []


def _union_at(model: type[BaseModel], loc: list[str]) -> int | None:
    """Where ``loc`` runs through a field whose type is a union (``None`` aside), the length of that
    field's own key: pydantic puts the tag of the union's member that failed after it."""
    tp: Any = model
    for i, part in enumerate(loc):
        tp = strip_optional(tp)
        if get_origin(tp) in (Union, types.UnionType):
            return i
        if is_model(tp):
            field = tp.model_fields.get(part)
            if field is None:
                return None
            tp = field.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return None
    return None


def strip_optional(tp: Any) -> Any:
    """``X`` for ``X | None``; any other type as it is."""
    if get_origin(tp) in (Union, types.UnionType):
        rest = [arg for arg in get_args(tp) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)
