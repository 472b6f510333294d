"""Other harnesses' run descriptions, translated to polyrl's config.

- :mod:`polyrl.compat.minds_rl`: Minds RL's TOML configs (``[env]``, ``[trainer]``, ``[model]``,
  ``[tinker]``), detected by their sections when ``polyrl train --config_path`` reads them;
- :mod:`polyrl.compat.gem_cli`: GEM's Tinker trainer command line (``env_id=... use_rebn=true``),
  given to ``polyrl train`` as ``key=value`` arguments.

Each translation is a plain dict of polyrl config keys (validated by :class:`polyrl.config.TrainConfig`
like any config) plus notes on what it chose; ``--print-config`` shows both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Translation:
    """A foreign run description as polyrl config data."""

    source: str  # what it was translated from, e.g. "Minds RL config configs/train.toml"
    data: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def translate_run(config_path: str | None, arguments: list[str]) -> Translation | None:
    """The translation for ``polyrl train``'s inputs: GEM-style ``key=value`` ``arguments``, or a
    Minds RL config at ``config_path``; None for polyrl's own configs."""
    if arguments:
        from polyrl.compat import gem_cli
        from polyrl.config.schema import ConfigError

        if config_path:
            raise ConfigError("give either GEM trainer arguments (key=value) or --config_path, not both")
        return gem_cli.translate(arguments)
    if config_path:
        from polyrl.compat import minds_rl
        from polyrl.config.files import read_config_file

        raw = read_config_file(config_path)
        if minds_rl.is_minds_config(raw):
            return minds_rl.translate(raw, config_path)
    return None
