"""Vision-language models in the local engine: a ``ModelInput``'s ``ImageChunk`` s become the model's
placeholder tokens, pixel values (the model's own image processor) and multimodal rotary positions (the
model's own rope index), so ``forward``, ``forward_backward``, ``sample`` and ``compute_logprobs`` take
images.

Each ``ImageChunk`` is decoded within the bounds of :mod:`polyrl.images` (a malformed or oversized image is
one ``ValueError`` naming it) and stands for ``expected_tokens`` placeholder tokens: a count other than the
processor's is refused (the model would see other positions than the caller laid out). Pixel values are
bounded per image by the processor's own ``max_pixels`` and kept in a small cache by content, so a GRPO
group's samples, the sampler and the learner process a picture once.

Positions: Qwen-VL models rotate each token by (time, height, width) positions; an image's tokens get
their grid, the text after it continues from the largest (so does an image right after another image).
``rope`` gives a sequence's ``[3, length]`` positions and its delta (how far the last position is from the
token count); decoding continues at ``length + delta``. Supported: the Qwen2-VL family's layout (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and its MoE).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from polyrl import images

ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
CACHE_BYTES = 256 << 20  # processed pixel values kept for reuse


@dataclass(frozen=True)
class ModelImage:
    """An image of a sequence as the model takes it."""

    start: int  # first placeholder position
    length: int  # placeholder tokens (the processor's count)
    key: str  # content hash of the encoded bytes
    pixel_values: torch.Tensor  # [patches, patch_dim] float32, CPU
    grid_thw: torch.Tensor  # [3] int64: the patch grid (time, height, width)

    @property
    def end(self) -> int:
        return self.start + self.length


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


class Vision:
    """The image side of one vision-language base model."""

    def __init__(self, hf_model: Any, path: str, config: Any,
                 limits: images.ImageLimits = images.DEFAULT_LIMITS):
        from transformers import AutoImageProcessor

        kind = getattr(config, "model_type", "?")
        if kind not in ARCHITECTURES:
            raise ValueError(f"the local engine runs vision-language models of the Qwen2-VL family "
                             f"({', '.join(ARCHITECTURES)}), not {kind!r}")
        try:
            self.processor = AutoImageProcessor.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - a missing or unreadable preprocessor_config.json
            raise ValueError(f"vision-language model {path!r} has no image processor that loads "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        self.inner = hf_model.model  # the vision tower and the language model, under the unembedding
        self.image_token_id = int(config.image_token_id)
        # tokens that stand for pixels: never text of a prompt or datum, never sampled (a sampled one would
        # read as a picture with no pixels when the sequence is trained on)
        ids = {config.image_token_id, getattr(config, "video_token_id", None)} - {None}
        self.placeholder_ids = tuple(sorted(int(i) for i in ids))
        self.merge = int(config.vision_config.spatial_merge_size)
        self.limits = limits
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # requests are prepared on the callers' threads

    # ---- chunks -> tokens and images ------------------------------------------------------------
    def read_chunks(self, chunks: list, where: str) -> tuple[list[int], list[ModelImage]]:
        """The tokens (placeholders at image positions) and images of a ``ModelInput``'s chunks."""
        tokens: list[int] = []
        found: list[ModelImage] = []
        for k, chunk in enumerate(chunks):
            kind = getattr(chunk, "type", None)
            if kind == "encoded_text":
                text = [int(t) for t in chunk.tokens]
                placeholder = next((t for t in text if t in self.placeholder_ids), None)
                if placeholder is not None:
                    raise ValueError(f"{where} chunk {k} holds token {placeholder}, the model's image or "
                                     "video placeholder; a picture goes in an ImageChunk (its bytes)")
                tokens.extend(text)
            elif kind == "image":
                try:  # the declared format against the bytes' signature, as polyrl serve checks it
                    images.check_format(bytes(chunk.data), str(chunk.format))
                except images.ImageError as e:
                    raise ValueError(f"{where} chunk {k}: {e}") from None
                image = self.image(chunk.data, chunk.expected_tokens, len(tokens), f"{where} chunk {k}")
                found.append(image)
                tokens.extend([self.image_token_id] * image.length)
            else:
                raise ValueError(f"{where} has a {kind!r} chunk (chunk {k}); send images as ImageChunk "
                                 "(the image's bytes)")
        return tokens, found

    def image(self, data: bytes, expected_tokens: int | None, start: int, where: str) -> ModelImage:
        try:
            key = images.content_hash(bytes(data))
            pixel_values, grid = self._pixels(key, bytes(data))
        except images.ImageError as e:
            raise ValueError(f"{where}: {e}") from None
        length = int(grid.prod()) // self.merge**2
        if expected_tokens is None or int(expected_tokens) != length:
            raise ValueError(f"{where}: expected_tokens={expected_tokens} but the model's image processor "
                             f"makes {length} tokens of this image ({int(grid[2]) * self.patch} x "
                             f"{int(grid[1]) * self.patch} pixels after resizing)")
        return ModelImage(start, length, key, pixel_values, grid)

    @property
    def patch(self) -> int:
        return int(getattr(self.processor, "patch_size", 14))

    def _pixels(self, key: str, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        picture = images.decode(data, self.limits)
        out = self.processor(images=[picture], return_tensors="pt")
        pixel_values = out["pixel_values"].float().contiguous()
        grid = out["image_grid_thw"][0].long()
        with self._lock:
            self._cache[key] = (pixel_values, grid)
            self._cache_bytes += pixel_values.numel() * 4
            while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, (old, _) = self._cache.popitem(last=False)
                self._cache_bytes -= old.numel() * 4
        return pixel_values, grid

    # ---- positions ------------------------------------------------------------------------------------
    def rope(self, tokens: list[int], found: list[ModelImage]) -> tuple[torch.Tensor, int]:
        """``[3, len(tokens)]`` multimodal positions of a sequence and its delta, by the model's own rope
        index (text only: every axis the token's index, delta 0)."""
        if not found:
            return torch.arange(len(tokens)).unsqueeze(0).expand(3, -1), 0
        # The rope index reads each run of image tokens as one image, so two images side by side would
        # read as one picture of both grids. A text token between them keeps them apart; it is dropped
        # after, and every later position moves back by one for it: each image keeps its own grid, placed
        # where the previous one ended, and the text after continues from the largest position.
        ids, kinds, spacer = list(tokens), [0] * len(tokens), [False] * len(tokens)
        for image in found:
            kinds[image.start:image.end] = [1] * image.length
        for image, before in reversed(list(zip(found[1:], found))):
            if image.start == before.end:
                ids.insert(image.start, 0)
                kinds.insert(image.start, 0)
                spacer.insert(image.start, True)
        grids = torch.stack([image.grid_thw for image in found])
        positions, _ = self.inner.get_rope_index(torch.tensor([ids], dtype=torch.long),
                                                 mm_token_type_ids=torch.tensor([kinds], dtype=torch.int32),
                                                 image_grid_thw=grids)
        spacer_T = torch.tensor(spacer)
        positions = (positions[:, 0].cpu() - spacer_T.cumsum(0))[:, ~spacer_T]  # [3, T]
        return positions, int(positions.max()) + 1 - len(tokens)  # the delta as the rope index computes it

    def inputs(self, found: list[ModelImage], device: torch.device) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of images in the order their placeholders appear."""
        return {"pixel_values": torch.cat([im.pixel_values for im in found]).to(device),
                "image_grid_thw": torch.stack([im.grid_thw for im in found]).to(device)}


def keyed(tokens: list[int], found: list[ModelImage], keys: dict[tuple[str, int], int]) -> list[int]:
    """``tokens`` with each image's positions holding a negative key for (its content, its place): two
    sequences then share a prefix only where they show the same images at the same places (shared-prefix
    packing and the sampler's prompt grouping compare these)."""
    if not found:
        return tokens
    out = list(tokens)
    for image in found:
        key = keys.setdefault((image.key, image.start), -1 - len(keys))
        out[image.start:image.end] = [key] * image.length
    return out
