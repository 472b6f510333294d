"""The registries of polyrl's pluggable parts, each loaded when first asked for.

Losses and advantage estimators register themselves as their modules load, and those modules import
torch (seconds): a config check that needs them asks here, after the checks that need nothing heavy, so
a mistake such as a mistyped model path is reported in well under a second.
"""

from __future__ import annotations

from types import ModuleType


def losses() -> ModuleType:
    """:mod:`polyrl.local.losses`: ``LOSSES`` by name, with each loss's inputs, config keys and correction
    role."""
    from polyrl.local import losses as module

    return module


def advantages() -> ModuleType:
    """:mod:`polyrl.rl.advantages`: ``ESTIMATORS`` by name, with the settings each uses."""
    from polyrl.rl import advantages as module

    return module


def renderers() -> ModuleType:
    """:mod:`polyrl.renderers`: the chat formats by name (``renderer_names``)."""
    from polyrl import renderers as module

    return module
