"""Chat renderers; importing the package registers every renderer.

polyrl's own: ``qwen3`` / ``qwen3_disable_thinking`` / ``chatml`` (chatml.py), ``llama3`` (llama3.py),
GEM's plain templates (plain.py). The formats of Tinker's model lineup come from tinker-cookbook's
renderers through one adapter (cookbook.py). ``resolve_renderer`` is how a command picks one.
"""

from __future__ import annotations

from polyrl.renderers import chatml, cookbook, llama3, plain  # noqa: F401 - registers the renderers
from polyrl.renderers.base import Renderer, get_renderer, register_renderer, renderer_names
from polyrl.renderers.infer import infer_renderer, resolve_renderer

__all__ = [
    "Renderer", "get_renderer", "infer_renderer", "register_renderer", "renderer_names", "resolve_renderer",
]
