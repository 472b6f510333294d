"""Images as content: the forms an image may take, its bounds, decoding, the one encoding it travels in,
its content hash, and where images sit in a token sequence.

An image part of a message is ``{"type": "image", "image": X}`` (tinker-cookbook's ``ImagePart``) or
OpenAI's ``{"type": "image_url", "image_url": {"url": X}}``; X is a PIL image, PNG/JPEG (or WEBP, GIF, BMP)
bytes, a file path, a ``data:`` URI, or a Hugging Face data set's ``{"bytes": ..., "path": ...}``.

Bounds come before pixels: the encoded size is checked before anything is read, the width and height
(read from the header) before a pixel is decoded, so a decompression bomb (a small file declaring
50,000 x 50,000 pixels), an empty image, a truncated file or an unknown format is one :class:`ImageError`
naming the problem, never a crash or a gigabyte allocation.

The encoding: JPEG (Pillow's default quality) of the RGB pixels, as tinker-cookbook's ``image_to_chunk``
writes it, so a request polyrl builds is the one the cookbook would, byte for byte. JPEG keeps width and
height, and the model's processor counts tokens from those alone, so the count a renderer announces
(``ImageChunk.expected_tokens``) is the count the engine computes from the decoded bytes. The content hash
(SHA-256 of the encoded bytes) names the file a run stores each image in once (``images/<hash>.jpeg``).

In a token sequence an image is an :class:`ImageSpan`: the positions it fills (``expected_tokens`` of them,
holding the model's image placeholder id) and its encoded bytes. :func:`model_input` turns tokens and
spans into the Tinker ``ModelInput`` (text chunks and ``ImageChunk`` s) of any prefix.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import stat
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image as PILImage
    from tinker import types

# Defaults of the bounds (LimitsConfig.max_image_bytes / max_image_pixels; polyrl serve's own).
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 36_000_000  # 6000 x 6000
MAX_ASPECT_RATIO = 200  # Qwen-VL's processors refuse images more elongated than this
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow may open (never its rarer, riskier parsers)
ENCODING = "jpeg"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SIGNATURES = {"png": (_PNG_SIGNATURE,), "jpeg": (b"\xff\xd8\xff",), "gif": (b"GIF87a", b"GIF89a"),
               "bmp": (b"BM",)}  # first bytes of each format (WEBP's sit at 0 and 8: see signature())


class ImageError(ValueError):
    """An image that cannot be used: its message is one line naming the problem."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS


DEFAULT_LIMITS = ImageLimits()


# ---- image parts of messages ----------------------------------------------------------------------
def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def part_source(part: dict) -> Any:
    """What an image part holds: the ``image`` of a cookbook part, the URL of an OpenAI one."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def image_parts(messages: list[dict]) -> Iterator[dict]:
    """Every image part of ``messages``, in order."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from (p for p in content if is_image_part(p))


def has_images(messages: list[dict]) -> bool:
    return next(image_parts(messages), None) is not None


def map_images(messages: list[dict], fn) -> list[dict]:
    """``messages`` with each image part replaced by ``fn(part)`` (a new part), in order; the rest shared."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(is_image_part(p) for p in content):
            message = {**message, "content": [fn(p) if is_image_part(p) else p for p in content]}
        out.append(message)
    return out


def decoded_parts(messages: list[dict], limits: ImageLimits = DEFAULT_LIMITS) -> list[dict]:
    """``messages`` with every image part as ``{"type": "image", "image": <RGB PIL image>}``: each image
    read, bounded and decoded once (:func:`read_image`), so renderers and stores get checked pixels."""
    return map_images(messages, lambda p: {"type": "image", "image": read_image(part_source(p), limits)})


# ---- reading ------------------------------------------------------------------------------------
def read_image(value: Any, limits: ImageLimits = DEFAULT_LIMITS) -> PILImage.Image:
    """An RGB PIL image from any accepted form (see the module docstring), within ``limits``."""
    from PIL import Image

    if isinstance(value, Image.Image):
        _check_size(value.size, limits, value.format or "")
        return value if value.mode == "RGB" else value.convert("RGB")
    data = image_bytes(value, limits)
    try:
        return decode(data, limits)
    except ImageError as e:
        path = _path_of(value)
        if path is None:
            raise
        raise ImageError(f"image file {_named(path)}: {e}") from None


def _path_of(value: Any) -> Path | None:
    """The file an image given as a path (a string, ``file://``, ``{"path": ...}``) is read from."""
    if isinstance(value, dict) and not value.get("bytes"):
        value = value.get("path")
    if isinstance(value, str) and value.startswith("data:"):
        return None
    if isinstance(value, (str, os.PathLike)):
        return Path(str(value).removeprefix("file://")).expanduser()
    return None


def _named(path: Path) -> str:
    """A file's name for a message (its path, never its content)."""
    return repr(str(path)[:200])


def image_bytes(value: Any, limits: ImageLimits = DEFAULT_LIMITS) -> bytes:
    """The encoded bytes of an image given as bytes, a path, a ``data:`` URI or ``{"bytes", "path"}``,
    refused past ``limits.max_bytes`` before they are read whole."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        _check_bytes(len(data), limits)
        return data
    if isinstance(value, str) and value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            raise ImageError("a data: URI image must be base64-encoded (data:image/png;base64,...)")
        _check_bytes(len(payload) * 3 // 4, limits)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data: URI image is not valid base64") from None
    url = isinstance(value, str) and re.match(r"^[a-z][a-z0-9+.-]*://", value) is not None
    if url and not value.startswith("file://"):
        raise ImageError(f"image URLs are not fetched ({value[:60]!r}): give a file path, the bytes, a data: "
                         "URI or a PIL image")
    if isinstance(value, (str, os.PathLike)):
        path = Path(str(value).removeprefix("file://")).expanduser()
        try:
            info = path.stat()
            if not stat.S_ISREG(info.st_mode):  # a folder, a device or a pipe: nothing to read as an image
                raise ImageError(f"image file {_named(path)} is not a regular file")
            try:
                _check_bytes(info.st_size, limits)
            except ImageError as e:
                raise ImageError(f"image file {_named(path)}: {e}") from None
            return path.read_bytes()
        except ImageError:
            raise
        except (OSError, ValueError) as exc:
            raise ImageError(f"cannot read the image file {_named(path)}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    raise ImageError(f"an image must be a PIL image, PNG/JPEG bytes, a file path or a data: URI, "
                     f"not {type(value).__name__}")


def decode(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> PILImage.Image:
    """Decoded RGB pixels of encoded ``data``: the format and the declared size are checked from the
    header before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    _check_bytes(len(data), limits)
    if data.startswith(_PNG_SIGNATURE) and len(data) >= 24:  # a PNG's size sits at a fixed place: first
        _check_size(struct.unpack(">II", data[16:24]), limits, "PNG")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except UnidentifiedImageError:
            raise ImageError(_unknown_format(data)) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            pixels = re.search(r"\((\d+) pixels\)", str(exc))
            declared = f"{int(pixels.group(1)):,} pixels" if pixels else "too many pixels"
            raise ImageError(f"the image declares {declared}, more than max_image_pixels="
                             f"{limits.max_pixels:,} (a decompression bomb?)") from None
        except (OSError, SyntaxError, ValueError, struct.error, EOFError) as exc:
            raise ImageError(f"the image is corrupt or truncated ({_reason(exc)})") from None
        fmt = image.format or "image"
        _check_size(image.size, limits, fmt)
        try:
            image.load()  # the only step that decodes pixels
        except (OSError, SyntaxError, ValueError, struct.error, EOFError, Image.DecompressionBombError,
                Image.DecompressionBombWarning) as exc:
            raise ImageError(f"the {fmt} image is corrupt or truncated ({_reason(exc)})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def check_header(data: bytes, limits: ImageLimits = DEFAULT_LIMITS, declared: str | None = None
                 ) -> tuple[int, int]:
    """(width, height) of encoded ``data`` read from its header alone, within ``limits``, and in the
    ``declared`` format when one is given: what a server checks before it queues an image (no pixel is
    decoded here)."""
    from PIL import Image, UnidentifiedImageError

    _check_bytes(len(data), limits)
    if declared is not None:
        check_format(data, declared)
    if data.startswith(_PNG_SIGNATURE) and len(data) >= 24:
        _check_size(struct.unpack(">II", data[16:24]), limits, "PNG")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                _check_size(image.size, limits, image.format or "")
                return image.size
        except ImageError:
            raise
        except UnidentifiedImageError:
            raise ImageError(_unknown_format(data)) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageError(f"the image declares more than max_image_pixels={limits.max_pixels:,} pixels "
                             "(a decompression bomb?)") from None
        except (OSError, SyntaxError, ValueError, struct.error, EOFError) as exc:
            raise ImageError(f"the image is corrupt or truncated ({_reason(exc)})") from None


def signature(data: bytes) -> str | None:
    """The format whose signature ``data`` starts with (png, jpeg, gif, webp, bmp), None for another."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((fmt for fmt, starts in _SIGNATURES.items() if data.startswith(starts)), None)


def check_format(data: bytes, declared: str) -> None:
    """An :class:`ImageError` unless ``data`` starts with the signature of the ``declared`` format."""
    found = signature(data)
    if found == declared.lower():
        return
    what = f"a {found.upper()} image" if found else _unknown_format(data)
    raise ImageError(f"the chunk declares format {declared!r} but its bytes are {what}")


def _unknown_format(data: bytes) -> str:
    return f"not an image in a known format ({', '.join(FORMATS)}; {len(data):,} bytes)"


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _check_bytes(size: int, limits: ImageLimits) -> None:
    if size > limits.max_bytes:
        raise ImageError(f"the image holds {size:,} bytes, more than max_image_bytes={limits.max_bytes:,}")
    if size == 0:
        raise ImageError("the image is empty (0 bytes)")


def _check_size(size: tuple[int, int], limits: ImageLimits, fmt: str) -> None:
    width, height = size
    what = f"the {fmt} image" if fmt else "the image"
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} is {width} x {height} pixels: it has no pixels")
    if width * height > limits.max_pixels:
        raise ImageError(f"{what} is {width:,} x {height:,} pixels, more than max_image_pixels="
                         f"{limits.max_pixels:,}")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageError(f"{what} is {width} x {height} pixels: more elongated than {MAX_ASPECT_RATIO}:1, "
                         "which vision-language processors refuse")


# ---- the encoding and the hash ----------------------------------------------------------------------
def encode(image: PILImage.Image) -> bytes:
    """The canonical encoding of an image: JPEG of its RGB pixels, as tinker-cookbook's ``image_to_chunk``."""
    buffer = io.BytesIO()
    (image if image.mode == "RGB" else image.convert("RGB")).save(buffer, format="JPEG")
    return buffer.getvalue()


def content_hash(data: bytes) -> str:
    """The name an encoded image is stored under: 32 hex digits of its SHA-256."""
    return hashlib.sha256(data).hexdigest()[:32]


def stored_name(data: bytes, fmt: str) -> str:
    """``images/<hash>.<format>``: where a run keeps an image, relative to its ``log_path``."""
    return f"images/{content_hash(data)}.{fmt}"


# ---- images in token sequences ----------------------------------------------------------------------
@dataclass(frozen=True)
class ImageSpan:
    """An image in a token sequence: it fills positions ``start .. start + length - 1``."""

    start: int
    length: int  # the model processor's token count for it (ImageChunk.expected_tokens)
    data: bytes  # encoded
    format: str = ENCODING

    @property
    def end(self) -> int:
        return self.start + self.length

    @cached_property
    def name(self) -> str:
        return stored_name(self.data, self.format)

    def shifted(self, offset: int) -> ImageSpan:
        return ImageSpan(self.start + offset, self.length, self.data, self.format)

    def size(self) -> tuple[int, int]:
        """(width, height), read from the encoded header."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data), formats=FORMATS) as image:
            return image.size


def check_spans(spans: list[ImageSpan], length: int) -> None:
    """Spans in order, not overlapping, within a sequence of ``length`` tokens."""
    last = 0
    for span in spans:
        if span.length < 1 or span.start < last or span.end > length:
            raise ValueError(f"image span [{span.start}, {span.end}) is out of order or outside a sequence "
                             f"of {length} tokens")
        last = span.end


def model_input(tokens: list[int], spans: list[ImageSpan] = (), end: int | None = None) -> types.ModelInput:
    """The Tinker ``ModelInput`` of ``tokens[:end]``: text chunks between ``ImageChunk`` s. A span cut by
    ``end`` is an error (an image is all of its tokens or none)."""
    from tinker import types

    end = len(tokens) if end is None else end
    chunks: list = []
    at = 0
    for span in spans:
        if span.start >= end:
            break
        if span.end > end:
            raise ValueError(f"the prefix of {end} tokens cuts the image at [{span.start}, {span.end})")
        if span.start > at:
            chunks.append(types.EncodedTextChunk(tokens=list(tokens[at:span.start])))
        chunks.append(types.ImageChunk(data=span.data, format=span.format, expected_tokens=span.length))
        at = span.end
    if end > at:
        chunks.append(types.EncodedTextChunk(tokens=list(tokens[at:end])))
    return types.ModelInput(chunks=chunks)


def flatten(chunks: list, placeholder: int) -> tuple[list[int], list[ImageSpan]]:
    """Tokens and image spans of ``ModelInput`` chunks: each image's positions hold ``placeholder``."""
    tokens: list[int] = []
    spans: list[ImageSpan] = []
    for chunk in chunks:
        kind = getattr(chunk, "type", None)
        if kind == "encoded_text":
            tokens.extend(int(t) for t in chunk.tokens)
        elif kind == "image":
            if not chunk.expected_tokens:
                raise ValueError("an ImageChunk without expected_tokens has no known length")
            spans.append(ImageSpan(len(tokens), int(chunk.expected_tokens), bytes(chunk.data), chunk.format))
            tokens.extend([placeholder] * int(chunk.expected_tokens))
        else:
            raise ValueError(f"a {kind!r} chunk cannot be placed in a token sequence")
    return tokens, spans


def next_token_inputs(tokens: list[int], spans: list[ImageSpan] = ()) -> tuple[types.ModelInput, list[int]]:
    """A Datum's input and targets for a whole sequence: the ``ModelInput`` of ``tokens[:-1]`` and the
    targets ``tokens[1:]`` (0 at image positions, as tinker-cookbook writes them)."""
    return model_input(tokens, spans, len(tokens) - 1), without_images(tokens, spans)[1:]


def without_images(tokens: list[int], spans: list[ImageSpan], fill: int = 0) -> list[int]:
    """``tokens`` with every image position set to ``fill`` (tinker-cookbook's target tokens write 0
    there: an image position is never a target)."""
    if not spans:
        return list(tokens)
    out = list(tokens)
    for span in spans:
        out[span.start:span.end] = [fill] * span.length
    return out
