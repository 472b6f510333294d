"""Keeping API keys out of logs, config dumps and trajectory files.

``redact`` / ``redact_text`` replace the *current* values of secret environment variables with
``***`` wherever they appear inside strings, and blank the values of dict keys that name a secret.
Call them on anything written to disk or printed.
"""

from __future__ import annotations

import os
import re
from typing import Any

SECRET_ENV_VARS = ("TINKER_API_KEY", "OPENREWARD_API_KEY", "WANDB_API_KEY", "OPENAI_API_KEY")
MASK = "***"
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary text


def is_sensitive_key(name: str) -> bool:
    """Whether a key (dict key or environment variable name) names a secret.

    Matches ``api_key``/``apikey``, ``secret`` and ``password`` anywhere, and ``token`` as the final
    word (``hf_token``, ``accessToken``), so counters like ``max_tokens`` or ``token_ids`` are kept.
    """
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    if any(part in words for part in ("api_key", "apikey", "secret", "password")):
        return True
    return re.split(r"[^a-z0-9]+", words.strip("_- "))[-1] == "token"


def secret_values() -> list[str]:
    """Current values of the known secret variables and of any variable named like a secret, longest first."""
    values = {
        value
        for name, value in os.environ.items()
        if (name in SECRET_ENV_VARS or is_sensitive_key(name)) and len(value) >= _MIN_SECRET_LEN
    }
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, _values: list[str] | None = None) -> str:
    """``text`` with every occurrence of a current secret value replaced by ``***``."""
    for value in secret_values() if _values is None else _values:
        text = text.replace(value, MASK)
    return text


def redact(obj: Any) -> Any:
    """A deep copy of a JSON-like object (dicts, lists, tuples, strings) with secrets masked."""
    return _redact(obj, secret_values())


def _redact(obj: Any, values: list[str]) -> Any:
    if isinstance(obj, str):
        return redact_text(obj, values)
    if isinstance(obj, dict):
        return {
            _redact(key, values): MASK if isinstance(key, str) and is_sensitive_key(key) and value is not None
            else _redact(value, values)
            for key, value in obj.items()
        }
    if isinstance(obj, list):
        return [_redact(item, values) for item in obj]
    if isinstance(obj, tuple):
        return tuple(_redact(item, values) for item in obj)
    return obj
