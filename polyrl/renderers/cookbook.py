"""The chat formats of Tinker's model lineup, from tinker-cookbook's renderers (the reference its
authors maintain), behind polyrl's :class:`~polyrl.renderers.base.Renderer` interface.

One adapter, :class:`CookbookRenderer`, serves every cookbook renderer name (``qwen3_5``,
``deepseekv3``, ``gpt_oss_medium_reasoning``, ``kimi_k25``, ``glm5_3_max_reasoning``, ``nemotron3``,
``role_colon``, ...); tinker-cookbook is imported only when one is built. Messages are converted both
ways (OpenAI-style dicts with ``reasoning_content`` and ``tool_calls`` <-> the cookbook's thinking /
text parts and ``ToolCall`` objects).

The multi-turn contract: ``initial_prompt`` is the cookbook's generation prompt; after the sampled
tokens, ``continuation`` appends exactly what the format writes after an assistant turn. It is read
off the cookbook's own rendering of a probe conversation (a user turn, an assistant turn, then the new
messages), as the part after the assistant turn's end. Earlier turns are never re-rendered: where a
format rewrites history (drops reasoning, ``<|return|>`` -> ``<|end|>`` in harmony), the sampled tokens
stay as sampled and only what follows them comes from the format.

Two formats end a turn with the next message's own marker, and the continuation assumes the turn
ended as the format says it does: GLM (``<|observation|>`` before tool results, ``<|user|>`` before a
user turn) and ``role_colon`` (a turn stops at ``\\n\\nUser:``, so only a user message can follow).

Images: the vision-language formats (``qwen3_vl``, ``qwen3_vl_instruct``, ``qwen3_5*``) take image parts.
The cookbook renders each as an ``ImageChunk`` (JPEG bytes, ``expected_tokens`` from the model's own image
processor, loaded offline from the tokenizer's directory or hub id on the first image); the adapter
returns a :class:`~polyrl.renderers.base.Rendered` whose image positions hold ``<|image_pad|>``. A
continuation renders only the new messages' images: an earlier image is never rendered again.
"""

from __future__ import annotations

import json
import re
from typing import Any

from polyrl import images
from polyrl.errors import UserInputError
from polyrl.renderers.base import (
    Message,
    Rendered,
    Renderer,
    ToolSpec,
    message_text,
    register_factory,
    tool_call_from_json,
)

COOKBOOK_VERSION = "0.6.1"
# The cookbook's renderer names that polyrl serves through this adapter. ``qwen3``,
# ``qwen3_disable_thinking`` and ``llama3`` are polyrl's own renderers (see polyrl/renderers/chatml.py
# and llama3.py): the same tokens on the conversations both render.
NAMES = (
    "role_colon",
    "qwen3_instruct", "qwen3_vl", "qwen3_vl_instruct",
    "qwen3_5", "qwen3_5_disable_thinking", "qwen3_5_preserve_thinking",
    "qwen3_8_xhigh_reasoning", "qwen3_8_medium_reasoning", "qwen3_8_low_reasoning",
    "qwen3_8_disable_thinking",
    "deepseekv3", "deepseekv3_disable_thinking", "deepseekv3_thinking",
    "deepseekv4_1", "deepseekv4_1_low_reasoning", "deepseekv4_1_max_reasoning",
    "deepseekv4_1_disable_thinking", "deepseekv4_1_preserve_thinking",
    "gpt_oss_no_sysprompt", "gpt_oss_low_reasoning", "gpt_oss_medium_reasoning", "gpt_oss_high_reasoning",
    "kimi_k2", "kimi_k25", "kimi_k25_disable_thinking", "kimi_k26", "kimi_k26_disable_thinking",
    "kimi_k26_preserve_thinking",
    "kimi_k31_pro_max_reasoning", "kimi_k31_pro_high_reasoning", "kimi_k31_pro_low_reasoning",
    "kimi_k31_pro_disable_thinking", "kimi_k31_pro_no_reasoning_effort",
    "glm5_3_max_reasoning", "glm5_3_low_reasoning", "glm5_3_high_reasoning",
    "nemotron3", "nemotron3_low_thinking", "nemotron3_disable_thinking", "nemotron3_preserve_thinking",
    "nemotron3_ultra", "nemotron3_ultra_disable_thinking", "nemotron3_ultra_medium_thinking",
    "nemotron3_ultra_preserve_thinking",
    "tml_v0",
)
# Renderers the cookbook implements with the ``tml-renderers`` wheel, which is not on the package
# registry: named here so that picking one says why it cannot be built.
NEEDS_TML_RENDERERS = frozenset(n for n in NAMES if n.startswith("kimi_k31_pro") or n == "tml_v0")

# Each family's turn markers, which its model has as single tokens: a tokenizer without them belongs to
# another model (the cookbook would write the markers as plain text and train a format no model knows).
MARKERS = {
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "nemotron3": ("<|im_start|>", "<|im_end|>"),
    "deepseek": ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "gpt_oss": ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"),
    "kimi": ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>"),
    "glm": ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
}

_PROBE_USER = "Hello."
_PROBE_TEXT = "polyrl probe reply"  # content of the probe assistant turn; found in the rendering by text
# The token an image's positions hold, by family (the processor widens it to the image's token count).
IMAGE_PLACEHOLDERS = ("<|image_pad|>",)
# Ids this adapter gives calls the format leaves without one, as Kimi's native ids are: they name the
# function, so a tool reply that carries only the id still renders in harmony, which needs the name.
_NAMED_CALL_ID = re.compile(r"^functions\.(?P<name>[^:]+):\d+$")


def cookbook_modules():
    """tinker_cookbook's ``renderers`` package and ``base`` module, or a one-line error."""
    try:
        from tinker_cookbook import renderers
        from tinker_cookbook.renderers import base
    except ImportError as e:
        raise UserInputError(
            f"this chat format needs tinker-cookbook ({e}): "
            f"pip install --no-deps tinker-cookbook=={COOKBOOK_VERSION}"
        ) from None
    return renderers, base


class CookbookRenderer(Renderer):
    """polyrl's renderer interface over the tinker-cookbook renderer called ``name``."""

    def __init__(self, tokenizer: Any, name: str):
        super().__init__(tokenizer)
        self.name = name
        if name in NEEDS_TML_RENDERERS:
            raise UserInputError(
                f"renderer {name!r} is built on the tml-renderers package, which is not on the package "
                f"registry; polyrl cannot render this format"
            )
        markers = next((m for prefix, m in MARKERS.items() if name.startswith(prefix)), ())
        if missing := [m for m in markers if self.single_token_id(m) is None]:
            raise UserInputError(
                f"renderer {name!r} needs the model's special tokens {' '.join(markers)} as single tokens; "
                f"this tokenizer lacks {' '.join(missing)} (a model of another family?)"
            )
        cookbook, self._cb = cookbook_modules()
        try:
            self.ref = cookbook.get_renderer(name, tokenizer)
            stops = self.ref.get_stop_sequences()
            self._probe_continuation([{"role": "user", "content": _PROBE_USER}], True)
        except UserInputError:
            raise
        except Exception as e:  # noqa: BLE001 - a tokenizer without the format's tokens fails in many ways
            raise UserInputError(
                f"renderer {name!r} cannot render with this tokenizer (does it carry the model's special "
                f"tokens?): {type(e).__name__}: {e}"
            ) from None
        self._stops = list(stops)
        tail = self.decode(self.ref.build_generation_prompt([self._cb_user(_PROBE_USER)]).to_ints()[-4:])
        self._prefill_opens_thinking = tail.rstrip().endswith("<think>")
        self.image_placeholder_id = next(
            (tid for tid in map(self.single_token_id, IMAGE_PLACEHOLDERS) if tid is not None), None)
        self._image_processor = None

    # -- the interface ---------------------------------------------------------------------------

    def initial_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> list[int]:
        return self.render_prompt(messages, tools).ints()

    def continuation(self, messages: list[Message], assistant_finished: bool = True) -> list[int]:
        return self.render_continuation(messages, assistant_finished).ints()

    def render_prompt(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> Rendered:
        return self._rendered(self.ref.build_generation_prompt(self._conversation(messages, tools)))

    def render_continuation(self, messages: list[Message], assistant_finished: bool = True) -> Rendered:
        return self._probe_continuation(messages, assistant_finished)

    def stop_sequences(self) -> list[int] | list[str]:
        return list(self._stops)

    def parse_response(self, tokens: list[int]) -> Message:
        tokens = list(tokens)
        try:
            parsed, termination = self.ref.parse_response(tokens)
            if not termination.is_clean:  # cut by max_tokens
                text = self.decode(tokens)
                if self._cut_while_thinking(text):  # nothing but (unfinished) reasoning
                    reasoning = text.split("<think>")[-1].strip()
                    return {"role": "assistant", "content": "", "reasoning_content": reasoning,
                            "tool_calls": [], "tool_call_errors": []}
                parsed, _ = self.ref.parse_response(tokens + self._stop_tokens())  # as if it had ended there
            return self._from_cookbook(parsed)
        except Exception:  # noqa: BLE001 - model output never raises; keep the text
            text = self.decode(tokens)
            return {"role": "assistant", "content": text, "tool_calls": [], "tool_call_errors": []}

    def supervised(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[list[int], list[float]]:
        rendered, weights = self.render_supervised(messages, tools)
        return rendered.ints(), weights

    def render_supervised(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> tuple[Rendered, list[float]]:
        """Built as a rollout would be: the initial prompt, each assistant turn as the model would
        sample it after its generation prompt (weight 1), and the continuation between turns."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        end = turns[0] if turns else len(messages)
        rendered = self.render_prompt(messages[:end], tools)
        weights = [0.0] * len(rendered)
        for k, i in enumerate(turns):
            if k:
                env = self.render_continuation(messages[turns[k - 1] + 1 : i], assistant_finished=True)
                rendered += env
                weights += [0.0] * len(env)
            sampled = self.assistant_tokens_in_context(messages[: i + 1], tools)
            rendered += Rendered(sampled)
            weights += [1.0] * len(sampled)
        return rendered, weights

    def assistant_tokens_in_context(
        self, messages: list[Message], tools: list[ToolSpec] | None = None
    ) -> list[int]:
        """The tokens the model samples for ``messages[-1]`` (an assistant turn) after the generation
        prompt of the messages before it: the cookbook's supervised rendering of the conversation
        minus that prompt."""
        conversation = self._conversation(messages, tools)
        prompt = self._rendered(self.ref.build_generation_prompt(conversation[:-1])).tokens
        try:
            full, _ = self.ref.build_supervised_example(conversation)
        except Exception as e:  # noqa: BLE001 - e.g. reasoning in a turn of a thinking-disabled format
            raise UserInputError(f"renderer {self.name!r} cannot train on this conversation: {e}") from None
        full = self._rendered(full).tokens
        if full[: len(prompt)] != prompt:
            raise UserInputError(
                f"renderer {self.name!r}: assistant message {len(messages) - 1} is written differently from "
                f"what the model samples after its generation prompt (the format disagrees with itself here, "
                f"as nemotron3 does for a turn without reasoning), so it cannot be trained token-exactly"
            )
        return full[len(prompt) :]

    # -- the continuation, read off a probe conversation ------------------------------------------

    def _probe_continuation(self, messages: list[Message], finished: bool) -> Rendered:
        new = [self._to_cookbook(m) for m in messages]
        leading_tools = []
        for m in new:
            if m["role"] != "tool":
                break
            leading_tools.append(m)
        # A turn followed by tool results made the calls (formats end such turns differently); a cut
        # turn is closed as a plain one.
        assistant = self._cb.Message(role="assistant", content=_PROBE_TEXT)
        if finished and leading_tools:
            assistant["tool_calls"] = [
                self._cb.ToolCall(
                    id=m.get("tool_call_id") or f"call_{k}",
                    function=self._cb.ToolCall.FunctionBody(name=m.get("name") or "tool", arguments="{}"),
                )
                for k, m in enumerate(leading_tools)
            ]
        prefix = [self._cb_user(_PROBE_USER)]
        rendering = self._rendered(self.ref.build_generation_prompt([*prefix, assistant, *new]))
        full = rendering.tokens
        ctx = self._cb.RenderContext(
            idx=len(prefix), is_last=not new, prev_message=prefix[-1], next_message=new[0] if new else None,
            last_user_index=len(prefix) - 1,
        )
        rendered = self.ref.render_message(assistant, ctx)
        output = [t for chunk in rendered.output for t in chunk.tokens]
        tail = output[self._text_end(output) :]  # the turn's end as history writes it (+ tool calls)
        start = self._text_end(full)
        end = start + len(tail)
        if full[start:end] != tail:
            raise ValueError(
                f"renderer {self.name!r}: cannot find where an assistant turn ends in its rendering, so "
                f"it cannot continue a conversation token-exactly"
            )
        if not finished:  # the model wrote no end of turn: close it as history does
            return rendering.suffix(start)
        overlap = list(rendered.stop_overlap.tokens) if rendered.stop_overlap else []
        if overlap:  # the stop sequence ran into the next message's header (role_colon's "User:")
            if full[end : end + len(overlap)] != overlap:
                raise ValueError(
                    f"renderer {self.name!r}: a turn ends with {self.decode(overlap)!r}, so only a message "
                    f"that starts that way (a user message) can follow it"
                )
            end += len(overlap)
        return rendering.suffix(end)

    def _text_end(self, tokens: list[int]) -> int:
        """The index just after the probe reply's text in ``tokens`` (the first prefix whose decoding
        contains it; binary search, as containment only grows with the prefix)."""
        lo, hi = 1, len(tokens)
        if _PROBE_TEXT not in self.decode(tokens):
            raise ValueError(f"renderer {self.name!r}: the probe reply is not in its own rendering")
        while lo < hi:
            mid = (lo + hi) // 2
            if _PROBE_TEXT in self.decode(tokens[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- message shapes ----------------------------------------------------------------------------

    def _conversation(self, messages: list[Message], tools: list[ToolSpec] | None) -> list:
        """``messages`` as cookbook messages, with the format's tool declaration in front."""
        conversation = [self._to_cookbook(m) for m in messages]
        if not tools:
            return conversation
        system = ""
        if conversation and conversation[0]["role"] == "system":
            system, conversation = message_text(conversation[0]), conversation[1:]
        specs = []
        for tool in tools:
            spec = dict(tool.get("function", tool))
            spec.setdefault("description", "")
            spec.setdefault("parameters", {"type": "object", "properties": {}})
            specs.append(spec)
        try:
            prefix = self.ref.create_conversation_prefix_with_tools(specs, system)
        except NotImplementedError:
            raise UserInputError(
                f"renderer {self.name!r} has no tool-calling format; use one that does"
            ) from None
        return [*prefix, *conversation]

    def _cb_user(self, text: str):
        return self._cb.Message(role="user", content=text)

    # -- images -------------------------------------------------------------------------------------

    def _rendered(self, model_input) -> Rendered:
        """A cookbook ``ModelInput`` as tokens (each image's positions holding the placeholder) and spans."""
        tokens, spans = images.flatten(model_input.chunks, self.image_placeholder_id or 0)
        return Rendered(tokens, spans)

    def _image_parts(self, content: list) -> list:
        """Content parts for the cookbook: text parts, and each image part as an RGB PIL image."""
        if self.image_placeholder_id is None or not hasattr(self.ref, "image_processor"):
            raise UserInputError(f"renderer {self.name!r} has no image format; use a vision-language "
                                 "renderer (qwen3_vl, qwen3_vl_instruct, qwen3_5, ...) with its model")
        if self.ref.image_processor is None:
            self.ref.image_processor = self.image_processor
        parts: list = []
        for part in content:
            if images.is_image_part(part):
                picture = images.read_image(images.part_source(part))
                parts.append(self._cb.ImagePart(type="image", image=picture))
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                parts.append(self._cb.TextPart(type="text", text=str(part.get("text", ""))))
        return parts

    @property
    def image_processor(self):
        """The model's own image processor (``AutoImageProcessor`` of the tokenizer's directory or hub id),
        which counts each image's tokens."""
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            where = getattr(self.tokenizer, "name_or_path", "") or ""
            try:
                self._image_processor = AutoImageProcessor.from_pretrained(where)
            except Exception as e:  # noqa: BLE001 - a missing file, no network, an unknown processor
                raise UserInputError(
                    f"renderer {self.name!r} needs the model's image processor to render images, and none "
                    f"loads from {where!r} ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                ) from None
        return self._image_processor

    def _to_cookbook(self, message: Message):
        """An OpenAI-style message as a cookbook message."""
        role = message.get("role")
        content = message.get("content")
        text = message_text(message)
        out = self._cb.Message(role=role, content=text)
        if isinstance(content, list) and any(images.is_image_part(p) for p in content):
            out["content"] = self._image_parts(content)
        if role == "assistant":
            reasoning = message.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                parts: list = [self._cb.ThinkingPart(type="thinking", thinking=reasoning)]
                if text:
                    parts.append(self._cb.TextPart(type="text", text=text))
                out["content"] = parts
            calls = []
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                arguments = args if isinstance(args, str) else json.dumps(args)
                body = self._cb.ToolCall.FunctionBody(name=str(fn.get("name", "")), arguments=arguments)
                calls.append(self._cb.ToolCall(id=call.get("id") or None, function=body))
            if calls:
                out["tool_calls"] = calls
        elif role == "tool":
            if message.get("tool_call_id"):
                out["tool_call_id"] = str(message["tool_call_id"])
            name = message.get("name")
            if not name and type(self.ref).__name__ == "GptOssRenderer":
                # harmony writes a tool result under its function's name; this adapter's call ids carry it
                match = _NAMED_CALL_ID.match(str(message.get("tool_call_id") or ""))
                name = match.group("name") if match else None
            if name:
                out["name"] = str(name)
        return out

    def _from_cookbook(self, parsed) -> Message:
        """A cookbook assistant message as an OpenAI-style one."""
        content = parsed["content"]
        thinking = None
        if isinstance(content, str):
            text = content
        else:
            text = "".join(p["text"] for p in content if p["type"] == "text")
            if any(p["type"] == "thinking" for p in content):
                thinking = "".join(p["thinking"] for p in content if p["type"] == "thinking")
        message: Message = {"role": "assistant", "content": text}
        if thinking is not None:
            message["reasoning_content"] = thinking
        calls: list[Message] = []
        errors: list[str] = []
        for k, call in enumerate(parsed.get("tool_calls") or []):
            name = call.function.name
            try:
                args = json.loads(call.function.arguments) if call.function.arguments else {}
            except json.JSONDecodeError as e:
                errors.append(f"tool call {name!r}: invalid JSON arguments ({e.msg})")
                continue
            parsed_call, error = tool_call_from_json(
                {"name": name, "arguments": args}, call.id or f"functions.{name}:{k}")
            if parsed_call is not None:
                calls.append(parsed_call)
            else:
                errors.append(error or "invalid tool call")
        for bad in parsed.get("unparsed_tool_calls") or []:
            errors.append(f"{bad.error}: {bad.raw_text[:200]!r}")
        message.update(tool_calls=calls, tool_call_errors=errors)
        return message

    def _cut_while_thinking(self, text: str) -> bool:
        """Whether a reply cut by ``max_tokens`` stopped inside its reasoning block."""
        opened, closed = text.rfind("<think>"), text.rfind("</think>")
        if opened >= 0:
            return opened > closed
        return self._prefill_opens_thinking and closed < 0

    def _stop_tokens(self) -> list[int]:
        stop = self._stops[0]
        return [stop] if isinstance(stop, int) else self.encode(stop)


def _factory(name: str):
    return lambda tokenizer: CookbookRenderer(tokenizer, name)


for _name in NAMES:
    register_factory(_name, _factory(_name))
