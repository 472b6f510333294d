"""Where models come from: local directories, GGUF files (imported once into a cache directory,
``polyrl.models.gguf``) or hub ids (``resolve_model_path``), and the tiny models polyrl builds for
tests and the quickstart (``polyrl.models.tiny``)."""

from __future__ import annotations

import os

from polyrl.errors import UserInputError


def resolve_model_path(name: str) -> str:
    """A local directory as given; a ``.gguf`` file as its imported directory (imported on first
    use); anything else must look like a hub id (``org/name``)."""
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(expanded):
            raise UserInputError(f"model {name!r}: no such GGUF file")
        from polyrl.models.gguf import cached_import

        return str(cached_import(expanded))
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.path.exists(expanded):
        raise UserInputError(f"model {name!r}: no such model directory")
    return name  # a hub id like "Qwen/Qwen3-8B"; transformers resolves it or fails clearly
