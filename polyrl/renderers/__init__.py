"""Chat renderers; importing the package registers every renderer."""

from __future__ import annotations

from typing import Any

from polyrl.renderers import chatml, llama3, plain  # noqa: F401 - registers the renderers
from polyrl.renderers.base import Renderer, get_renderer, register_renderer, renderer_names, single_token_id

__all__ = ["Renderer", "get_renderer", "infer_renderer", "register_renderer", "renderer_names"]


def infer_renderer(model_name_or_path: str, tokenizer: Any) -> str:
    """The renderer name for a model when the config does not set ``renderer:``.

    Decided from the tokenizer's special tokens (and chat template), falling back to the model
    name: ChatML tokens -> ``qwen3`` if the template or name looks like Qwen (``<think>`` /
    ``<tool_call>`` / "qwen"), else ``chatml``; Llama 3 header tokens or a Llama-3 name -> ``llama3``.
    Anything else is an error rather than a guess, since a wrong format silently ruins training.
    """
    name = str(model_name_or_path).lower()
    template = str(getattr(tokenizer, "chat_template", None) or "")

    def has(token: str) -> bool:
        return single_token_id(tokenizer, token) is not None

    if has("<|im_start|>") and has("<|im_end|>"):
        qwen_like = "<think>" in template or "<tool_call>" in template or "qwen" in name
        return "qwen3" if qwen_like else "chatml"
    if has("<|start_header_id|>") or any(k in name for k in ("llama-3", "llama3", "llama_3")):
        return "llama3"
    if "qwen" in name:
        return "qwen3"
    raise ValueError(
        f"cannot infer a chat renderer for model {model_name_or_path!r}; set `renderer:` in the config "
        f"to one of: {', '.join(renderer_names())}"
    )
