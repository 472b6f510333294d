"""The training service behind the Tinker client interface: polyrl's local engine or Tinker's.

The trainer only ever sees a ``ServiceClient`` with the official SDK's methods; which one is one
config field (``backend``).
"""

from __future__ import annotations

import os
from typing import Any


def make_service_client(config: Any) -> Any:
    """A ``ServiceClient`` for ``config.backend``: ``local`` (in-process) or ``tinker`` (the SDK,
    hosted or any Tinker-compatible server at ``base_url``, such as ``polyrl serve``)."""
    if config.backend == "local":
        from polyrl.local import ServiceClient

        return ServiceClient(store_dir=config.store_dir, device=config.device, dtype=config.dtype,
                             micro_batch_tokens=config.micro_batch_tokens,
                             gradient_checkpointing=config.gradient_checkpointing)
    import tinker

    kwargs = {"api_key": os.environ.get("TINKER_API_KEY") or ("tml-local" if config.base_url else None)}
    if config.base_url:
        kwargs["base_url"] = config.base_url
    return tinker.ServiceClient(**kwargs)
