"""Image bytes and their reference: what every package that handles an image shares.

An image travels as encoded bytes (PNG unless a source gave another format) named by the sha256 of
those bytes; `ImageRef` is that name with the size and format, and it is all a trajectory, a tool
result or a message ever holds (never pixels). This module reads the JSON-safe sources that prompt
rows and tool / interaction responses use (`load_image_source`: path, data URL, base64), describes
bytes as an `ImageRef`, encodes PIL images losslessly and decodes bytes for the engines' and the
learner's processors. The rollout worker's content-addressed store is `rollout.images.ImageStore`.

Decompression bombs: a few KB of PNG can declare 10000 x 10000 pixels (400 MB decoded, on every
generate, in the learner and in the report). Every image is measured from its header before it is
decoded, and one of more than `max_pixels` (`DEFAULT_MAX_IMAGE_PIXELS` unless the store or the caller
says otherwise) is refused with `ImageTooLarge` (a ValueError: a tool returning one gets an error
observation, a dataset row holding one fails at load). PIL's own `DecompressionBombWarning` is an
error in this process too (the filter below), so a decode site that forgets the cap still refuses.
PIL is imported only when an image is encoded or inspected.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from PIL.Image import Image


class ImageRef(BaseModel):
    """One image of a trajectory, by content. The encoded bytes live in a content-addressed store
    (`rollout.images.ImageStore`, later the buffer's image log) under `sha256`; `AgentData` and the
    messages only ever hold this reference, never pixels, so JSON round-trips stay lossless."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # hex digest of the encoded bytes
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    mime: str = "image/png"


# 4096 x 4096: far above what a VLM's processor keeps (it resizes to a few hundred pixels a side) and
# below PIL's own warning threshold (~89 megapixels), so the explicit cap is always the first to act.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
# PIL's DecompressionBombWarning (its message; matching it needs no PIL import) as an error.
warnings.filterwarnings("error", message=r"Image size \(\d+ pixels\) exceeds limit")


class ImageTooLarge(ValueError):
    """An image with more pixels than the cap (a decompression bomb, or simply too big to show)."""


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image of {width} x {height} = {width * height} pixels is over the limit of {max_pixels} pixels "
            "(max_image_pixels); it was not decoded"
        )


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image:
    """Encoded bytes -> a loaded RGB PIL image (what the engine's and the learner's processors take);
    `ImageTooLarge` before decoding an image of more than `max_pixels`."""
    image = open_image(data, max_pixels)
    image.load()
    return image.convert("RGB") if image.mode != "RGB" else image


def open_image(data: bytes, max_pixels: int) -> Image:
    """PIL's lazy open (the header only) with the pixel cap checked."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        image = PILImage.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        raise ValueError(f"not an image ({len(data)} bytes): {exc}") from exc
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as exc:
        raise ImageTooLarge(f"image refused as a decompression bomb: {exc}") from exc
    except (OSError, SyntaxError) as exc:  # how PIL reports a header cut short or broken
        raise ValueError(f"image of {len(data)} bytes cannot be read: {exc}") from exc
    try:
        check_pixels(*image.size, max_pixels)
    except ImageTooLarge:
        image.close()
        raise
    return image


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_png(image: Image) -> bytes:
    """Lossless, deterministic bytes for a PIL image (same pixels and mode -> same bytes and hash)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def describe_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageRef:
    """The `ImageRef` of encoded bytes (reads the header for size and format; raises ValueError if the
    bytes are not an image PIL can read, `ImageTooLarge` if it has more than `max_pixels`)."""
    from PIL import Image as PILImage

    with open_image(data, max_pixels) as image:
        width, height = image.size
        mime = PILImage.MIME.get(image.format or "", "application/octet-stream")
    return ImageRef(sha256=image_sha256(data), width=width, height=height, mime=mime)


def is_content_parts(value: Any) -> bool:
    """True for a list of chat content parts, each `{"type": "text", ...}` or `{"type": "image", ...}`:
    how tools and interactions return text with images."""
    return isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in ("text", "image") for p in value)


def load_image_source(source: Any) -> bytes:
    """Encoded bytes of a JSON-safe image source: a local path, a base64 data URL or plain base64
    (how prompt rows and tool / interaction responses name an image)."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"image part needs 'image' as a path or base64 string, got {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64") or not payload:
            raise ValueError(f"image data URL must be base64 ('data:image/png;base64,...'), got {header!r}")
        return base64.b64decode(payload, validate=True)
    if len(source) < 4096 and Path(source).is_file():
        return Path(source).read_bytes()
    try:
        return base64.b64decode(source, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"image {source[:80]!r} is neither an existing file nor base64 bytes") from None


def read_response_image(source: Any, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> bytes:
    """Encoded bytes of an image a tool or interaction returned, fully decoded once so a corrupt or
    truncated file is refused here (ValueError) and never reaches the engine. Besides the JSON-safe
    sources of `load_image_source`, in-process code may hand encoded `bytes` or a PIL image (stored
    as PNG). More than `max_pixels` is refused (`ImageTooLarge`) before anything is decoded."""
    from PIL import Image as PILImage

    if isinstance(source, PILImage.Image):
        check_pixels(*source.size, max_pixels)
        return encode_png(source)
    data = bytes(source) if isinstance(source, (bytes, bytearray)) else load_image_source(source)
    describe_image(data, max_pixels)
    try:
        decode_image(data, max_pixels)
    except (OSError, SyntaxError, PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as exc:
        raise ValueError(f"image of {len(data)} bytes cannot be decoded: {exc}") from exc
    return data
