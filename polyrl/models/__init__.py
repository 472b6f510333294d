"""Where models come from: local directories, GGUF files (imported once into a cache directory,
``polyrl.models.gguf``) or hub ids (``resolve_model_path``), and the tiny models polyrl builds for
tests and the quickstart (``polyrl.models.tiny``)."""

from __future__ import annotations

import os

from polyrl.errors import UserInputError


def resolve_model_path(name: str) -> str:
    """A local directory as given; a ``.gguf`` file as its imported directory (imported on first
    use); anything else must look like a hub id (``org/name``). A name that reads as a path here (it
    starts with ``/``, ``.`` or ``~``, has more than one ``/``, or its first part is a directory here, as
    ``models/`` in ``models/tinyy``) and is no model directory is a one-line error, not a hub look-up."""
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(expanded):
            raise UserInputError(f"model {name!r}: no such GGUF file")
        from polyrl.models.gguf import cached_import

        return str(cached_import(expanded))
    head = name.split("/", 1)[0]
    if (name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.path.exists(expanded)
            or ("/" in name and os.path.isdir(os.path.expanduser(head)))):
        raise UserInputError(f"model {name!r}: no such model directory")
    return name  # a hub id like "Qwen/Qwen3-8B" (see check_hub_model)


def check_hub_model(name: str) -> None:
    """Before hub id ``name`` is loaded: it is in the local Hugging Face cache, or the hub can be reached.
    Offline, a model that is not cached is one line at once, instead of half a minute of the hub client's
    retries and a traceback."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    where = f"model {name!r} is not a local directory, nor in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise UserInputError(f"{where}, and HF_HUB_OFFLINE is set (give a model directory, or download it "
                             "first)")
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        raise UserInputError(f"{where}, and {host} cannot be reached (give a model directory, or download "
                             "it where the hub can be reached)") from None
