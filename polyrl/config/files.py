"""Run configs from files and the command line: YAML, TOML or JSON files, dotted overrides and ``.env``.

``load_config("run.yaml", ["batch_size=64", "environments.arithmetic.num_rollouts=8"])`` reads the
file (format by extension), applies each ``key.path=value`` override (value parsed as YAML), loads
``.env``, validates against the schema (:mod:`polyrl.config.schema`) and runs the checks that need
environments, renderers and models (:mod:`polyrl.config.checks`). Every problem -- unknown key, wrong
type, impossible combination -- comes back as one :class:`ConfigError` line naming the dotted key.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml
from dotenv import load_dotenv
from pydantic import ValidationError

from polyrl.config.checks import check_config
from polyrl.config.errors import format_validation_error, one_line
from polyrl.config.schema import ConfigError, PolicyConfig, TrainConfig
from polyrl.secrets import redact_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

M = TypeVar("M", bound=PolicyConfig)



#: Nodes that YAML aliases may add to a document when expanded. Anchors and merge keys in a config
#: add a few hundred; an alias bomb ("billion laughs") adds billions.
MAX_ALIAS_NODES = 10_000


class _AliasBomb(yaml.YAMLError):
    """A document whose aliases expand past :data:`MAX_ALIAS_NODES` nodes."""


def _check_alias_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases would expand it by more than :data:`MAX_ALIAS_NODES` nodes
    (everything downstream -- validation, redaction, dumps -- walks the expanded tree), or that holds
    a recursive alias. An alias is the very node object its anchor made, so each object's expanded
    size is computed once, depth first without recursion."""
    sizes: dict[int, int] = {}  # expanded size of each node object
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            ancestors.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _yaml_children(node))
        elif id(node) in ancestors:
            raise _AliasBomb("a YAML alias refers to a node that contains it (a recursive alias)")
        elif id(node) not in sizes:
            ancestors.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in _yaml_children(node)]
    if sizes[id(root)] - len(sizes) > MAX_ALIAS_NODES:
        raise _AliasBomb(f"YAML aliases expand the document by more than {MAX_ALIAS_NODES:,} nodes (an alias "
                         "bomb?); write the repeated values out or use fewer aliases")


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent numbers without a dot (``2e-5``, ``1E6``) as floats,
    refuses a key given twice in one mapping (YAML would silently keep the last) and refuses aliases
    that expand the document past :data:`MAX_ALIAS_NODES` nodes."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_alias_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first + 1})",
                    key_node.start_mark)
            lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class _JsonProblem(ValueError):
    """What :func:`json.loads` accepts but a config must not hold."""


def _json_mapping(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` would silently keep the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _JsonProblem(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_constant(name: str) -> Any:
    raise _JsonProblem(f"{name} is not a number JSON allows")


def parse_scalar(text: str) -> Any:
    """An override value as YAML: ``8`` -> 8, ``2e-5`` -> 2e-05, ``true`` -> True, ``null`` -> None,
    ``[1, 2]`` -> list.

    Text that is not valid YAML stays a string.
    """
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``key.path=value`` set, creating intermediate mappings as needed."""
    data = copy.deepcopy(data)
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not all(part.strip() for part in key.strip().split(".")):
            raise ConfigError(redact_text(f"override {override!r}: expected key.path=value"))
        try:
            set_dotted(data, key.strip(), parse_scalar(text))
        except ValueError as exc:
            raise ConfigError(redact_text(f"override {override!r}: {exc}")) from None
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``key`` ``a.b.c``, creating intermediate mappings as needed."""
    parts = key.split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[: depth + 1])} is not a mapping")
        node = child
    node[parts[-1]] = value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a ``.yaml``/``.yml``/``.json`` or ``.toml`` file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            with path.open("rb") as f:
                data = tomllib.load(f)
        elif suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_json_mapping,
                              parse_constant=_json_constant)
        elif suffix in (".yaml", ".yml"):
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader) or {}  # noqa: S506
        else:
            raise ConfigError(f"{path}: unsupported config format {suffix!r} (use .yaml, .yml or .toml)")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); save the file as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {one_line(str(exc))}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
    except _JsonProblem as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from exc
    except _AliasBomb as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {_yaml_reason(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return one_line(str(exc))
    return f"line {mark.line + 1}, column {mark.column + 1}: {one_line(problem)}"


def load_dotenv_file(path: str | Path = ".env") -> bool:
    """Load ``path`` (relative to the working directory) into ``os.environ``; variables already set win."""
    path = Path(path)
    return path.is_file() and load_dotenv(path, override=False)


def load_config(
    path: str | Path | None,
    overrides: Iterable[str] = (),
    *,
    model: type[M] = TrainConfig,  # type: ignore[assignment]
    base: dict[str, Any] | None = None,
) -> M:
    """Read ``path`` (over ``base``, if given), apply ``overrides``, load ``.env``, validate and check.

    Raises :class:`ConfigError` with one line naming every offending dotted key. Old flat keys the
    config was given are in its ``renamed_warnings``.
    """
    load_dotenv_file()
    data = copy.deepcopy(base) if base else {}
    if path is not None:
        data = _merge(data, read_config_file(path))
    data = apply_overrides(data, overrides)
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model)) from exc
    return check_config(config)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged
