"""A Minds RL environment package: ``load_environment`` re-exported by a relative import, as that
harness lays environments out (``environments/<name>/__init__.py``)."""

from .shout import load_environment

__all__ = ["load_environment"]
