"""Keeping API keys out of logs, config dumps and trajectory files.

``redact`` / ``redact_text`` replace the *current* values of secret environment variables with
``***`` wherever they appear inside strings (dict keys included), and blank the values of dict keys
that name a secret; ``redact_config`` also blanks a config's settings named like a key or token
(``api_token: sk-...`` in an environment's args). Every sink that writes or sends run data calls
them (``polyrl.tracking``, the report); :func:`redact_logs` covers what any code logs or warns, since
an environment may put a key into a reward, a metric name or an error message.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
import warnings
from typing import Any, Callable

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


# A config setting named with one of these as its last word holds a secret (``api_token``, ``access_key``,
# ``X-Api-Key``, ``Authorization``); plurals and compounds (``max_tokens``, ``num_keys``, ``key_column``,
# ``tokenizer``) do not match. Any word among SECRET_WORDS matches wherever it is (``client_secret_id``).
SECRET_LAST_WORDS = ("key", "token", "auth", "authorization", "cookie")
SECRET_WORDS = ("secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
                "apikey")


def words_of(name: str) -> list[str]:
    """The lower-case words of a name in snake_case, kebab-case, camelCase or dotted form."""
    return [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]


def is_secret_setting(name: str) -> bool:
    """Whether a config setting's name (a key of an environment's ``args``, a header) says its value is a
    secret: :func:`is_sensitive_key`'s names, and those whose last word is a key, token or credential.
    Broader than the rule for environment variables, whose values are masked in every text."""
    words = words_of(name)
    return is_sensitive_key(name) or bool(words) and (
        words[-1] in SECRET_LAST_WORDS or any(w in SECRET_WORDS for w in words))


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


def redact(obj: Any, mask_sensitive_keys: bool = True) -> Any:
    """A deep copy of a JSON-like object (dicts, lists, tuples, strings) with secrets masked.

    ``mask_sensitive_keys=False`` keeps the values of keys named like a secret (for rows of numbers
    whose keys an environment or the user chose, such as metrics: ``password_correct: 1.0``)."""
    return _redact(obj, secret_values(), _sensitive_key if mask_sensitive_keys else None)


def redact_config(obj: Any) -> Any:
    """A run config (its JSON-like dump) as :func:`redact` masks it, and the values of settings named
    like a secret (:func:`is_secret_setting`) masked too: literal keys in an environment's ``args``
    never reach ``--print-config``, ``config.json``, the report or W&B. The names of the environments
    are labels, not settings: an environment named ``password_game`` is masked inside, not as a whole.
    The config the run uses keeps every value."""
    values = secret_values()
    if not isinstance(obj, dict):
        return _redact(obj, values, _secret_setting)
    out = {}
    for key, value in obj.items():
        if key == "environments" and isinstance(value, dict):
            out[key] = {_redact(name, values, None): _redact(env, values, _secret_setting)
                        for name, env in value.items()}
        else:
            out.update(_redact({key: value}, values, _secret_setting))
    return out


def _secret_setting(key: str, value: Any) -> bool:
    return is_secret_setting(key) and value is not None


def _sensitive_key(key: str, value: Any) -> bool:
    return is_sensitive_key(key) and value is not None


def _redact(obj: Any, values: list[str], masked: Callable[[str, Any], bool] | None = _sensitive_key) -> Any:
    """``obj`` with ``values`` masked in its strings and the value of each key ``masked`` picks blanked."""
    if isinstance(obj, str):
        return redact_text(obj, values)
    if isinstance(obj, dict):
        return {
            _redact(key, values, masked): MASK
            if masked is not None and isinstance(key, str) and masked(key, value)
            else _redact(value, values, masked)
            for key, value in obj.items()
        }
    if isinstance(obj, list):
        return [_redact(item, values, masked) for item in obj]
    if isinstance(obj, tuple):
        return tuple(_redact(item, values, masked) for item in obj)
    return obj


def redact_pieces(pieces: list[str], _values: list[str] | None = None) -> list[str]:
    """Token texts (one string per token) with every piece that helps spell a secret masked: the
    piece where the secret starts becomes ``***``, the rest of it ``""``. The list keeps its length,
    so it stays aligned with the token ids."""
    text = "".join(pieces)
    values = secret_values() if _values is None else _values
    spans = []
    for value in values:
        start = text.find(value)
        while start != -1:
            spans.append((start, start + len(value)))
            start = text.find(value, start + 1)
    if not spans:
        return list(pieces)
    out, pos = [], 0
    for piece in pieces:
        end = pos + len(piece)
        overlapping = [(s, e) for s, e in spans if s < end and pos < e]
        if not overlapping:
            out.append(piece)
        else:
            out.append(MASK if any(pos <= s for s, _ in overlapping) else "")
        pos = end
    return out


# ------------------------------------------------------------------------- logs, warnings, tracebacks

_logs_redacted = False


def redact_logs() -> None:
    """From now on, every log record (whoever logs it, whichever handler prints it) and every Python
    warning has current secret values masked. Records without a secret are left untouched. Idempotent."""
    global _logs_redacted
    if _logs_redacted:
        return
    _logs_redacted = True
    make_record = logging.getLogRecordFactory()

    def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        _redact_record(record)
        return record

    logging.setLogRecordFactory(redacting_factory)
    format_warning = warnings.formatwarning

    def redacting_formatwarning(*args: Any, **kwargs: Any) -> str:
        return redact_text(format_warning(*args, **kwargs))

    warnings.formatwarning = redacting_formatwarning


def _redact_record(record: logging.LogRecord) -> None:
    values = secret_values()
    if not values:
        return
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record: logging reports it when it is emitted
        return
    clean = redact_text(message, values)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[0] is not None:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        clean = redact_text(text, values)
        if clean != text:  # a formatter uses exc_text, when set, instead of formatting exc_info
            record.exc_text = clean


def redact_tracebacks() -> None:
    """Uncaught exceptions (of the main thread and of other threads) print their traceback with
    secrets masked; for the command line, which owns the process."""
    import threading

    show, show_thread = sys.excepthook, threading.excepthook

    def redacting_excepthook(kind, value, tb) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        if redact_text(text) == text:
            show(kind, value, tb)
        else:
            sys.stderr.write(redact_text(text))

    def redacting_thread_excepthook(args) -> None:
        if args.exc_type is SystemExit:
            return
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        if redact_text(text) == text:
            show_thread(args)
        else:
            name = args.thread.name if args.thread is not None else "?"
            sys.stderr.write(f"Exception in thread {name}:\n" + redact_text(text))

    redacting_excepthook.redacts = redacting_thread_excepthook.redacts = True  # type: ignore[attr-defined]
    if not getattr(sys.excepthook, "redacts", False):  # installed once, however often main() runs
        sys.excepthook = redacting_excepthook
    if not getattr(threading.excepthook, "redacts", False):
        threading.excepthook = redacting_thread_excepthook
