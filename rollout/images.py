"""Content-addressed image bytes: where a rollout worker finds an image by its `ImageRef.sha256`.

Trajectories never hold pixels: `AgentData.images` and the messages carry `ImageRef`s, and the
encoded bytes (PNG unless a source gave another format) live here, keyed by the sha256 of the bytes.
A resumed trajectory looks its images up by hash and re-submits them with its ids
(`inputs(refs)` -> the engine's `ImageInput`s). `put` is idempotent: the 8 samples of one image prompt
store the bytes once.

`ImageStore` keeps the bytes in memory and, given a directory, also writes each image once as
`<dir>/<sha256[:2]>/<sha256>` (write-then-rename, so a crash never leaves a partial file); a store
opened on the same directory in another process finds them there. It is the worker's small local
store; the buffer's durable image log (docs/multimodal.md, "How an image travels") holds them for training and resume.
Given `max_bytes` the memory part is an LRU cache: past the bound the least recently used images go,
except those `pinned()` names (a rollout worker pins the images of every trajectory it holds: their
rows still carry the bytes to the buffer) and the `KEEP_NEWEST` newest (a prompt's images between
being put and being referenced). An evicted image is read back from the directory, or fetched from
the buffer's image log by hash when a trajectory needs it again (`AgentLoopBase._ensure_images`).
`load_image_source` reads the JSON-safe sources that prompt rows and tool / interaction responses
use (path, data URL, base64); `read_response_image` also takes bytes / PIL and decodes fully, so a
corrupt image from a tool is refused before it reaches a trajectory.
PIL is imported only when an image is encoded or inspected.

Decompression bombs: a few KB of PNG can declare 10000 x 10000 pixels (400 MB decoded, on every
generate, in the learner and in the report). Every image is measured from its header before it is
decoded, and one of more than `max_pixels` (`DEFAULT_MAX_IMAGE_PIXELS` unless the store or the caller
says otherwise) is refused with `ImageTooLarge` (a ValueError: a tool returning one gets an error
observation, a dataset row holding one fails at load). PIL's own `DecompressionBombWarning` is an
error in this process too (the filter below), so a decode site that forgets the cap still refuses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.atomic import atomic_write
from streamrl.rollout.engine.base import ImageInput
from streamrl.rollout.types import ImageRef

if TYPE_CHECKING:
    from PIL.Image import Image

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


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_png(image: Image) -> bytes:
    """Lossless, deterministic bytes for a PIL image (same pixels and mode -> same bytes and hash)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image:
    """Encoded bytes -> a loaded RGB PIL image (what the engine's and the learner's processors take);
    `ImageTooLarge` before decoding an image of more than `max_pixels`."""
    image = _open(data, max_pixels)
    image.load()
    return image.convert("RGB") if image.mode != "RGB" else image


def describe_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageRef:
    """The `ImageRef` of encoded bytes (reads the header for size and format; raises ValueError if the
    bytes are not an image PIL can read, `ImageTooLarge` if it has more than `max_pixels`)."""
    from PIL import Image as PILImage

    with _open(data, max_pixels) as image:
        width, height = image.size
        mime = PILImage.MIME.get(image.format or "", "application/octet-stream")
    return ImageRef(sha256=image_sha256(data), width=width, height=height, mime=mime)


def _open(data: bytes, max_pixels: int) -> Image:
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


KEEP_NEWEST = 64  # images an LRU-bounded store never evicts, newest first


class ImageStore:
    """Encoded image bytes by sha256, in memory (LRU-bounded by `max_bytes` if given) and optionally
    in `directory` (see module doc)."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        max_bytes: int | None = None,
        pinned: Callable[[], set[str]] | None = None,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        if max_pixels <= 0:
            raise ValueError(f"max_pixels must be positive, got {max_pixels}")
        self.max_pixels = max_pixels  # `put` refuses larger images (ImageTooLarge)
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.pinned = pinned  # hashes that must stay in memory (None: none)
        self._bytes: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._refs: dict[str, ImageRef] = {}
        self.num_bytes = 0  # held in memory
        self.num_evicted = 0

    def _path(self, sha256: str) -> Path:
        assert self.directory is not None
        return self.directory / sha256[:2] / sha256

    def put(self, data: bytes) -> ImageRef:
        """Store encoded bytes (idempotent) and return their reference; `ImageTooLarge` above the cap."""
        ref = describe_image(data, self.max_pixels)
        self._remember(ref.sha256, data)
        self._refs.setdefault(ref.sha256, ref)
        if self.directory is not None and not self._path(ref.sha256).exists():
            self._path(ref.sha256).parent.mkdir(exist_ok=True)
            atomic_write(self._path(ref.sha256), data)
        return ref

    def put_image(self, image: Image) -> ImageRef:
        """Store a PIL image as PNG."""
        return self.put(encode_png(image))

    def get(self, sha256: str) -> bytes:
        """The bytes of `sha256`; KeyError if neither memory nor the directory has them."""
        data = self._bytes.get(sha256)
        if data is None and self.directory is not None and self._path(sha256).exists():
            data = self._path(sha256).read_bytes()
            if image_sha256(data) != sha256:
                raise ValueError(f"image file {self._path(sha256)} does not hash to its name")
            self._remember(sha256, data)
        if data is None:
            raise KeyError(f"image {sha256} is not in the store" + (f" ({self.directory})" if self.directory else ""))
        self._bytes.move_to_end(sha256)
        return data

    def _remember(self, sha256: str, data: bytes) -> None:
        if sha256 in self._bytes:
            self._bytes.move_to_end(sha256)
            return
        self._bytes[sha256] = data
        self.num_bytes += len(data)
        if self.max_bytes is not None and self.num_bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used images until within `max_bytes`, sparing pinned and the newest."""
        assert self.max_bytes is not None
        pinned = self.pinned() if self.pinned is not None else set()
        candidates = list(self._bytes)[: max(len(self._bytes) - KEEP_NEWEST, 0)]
        for sha in candidates:
            if self.num_bytes <= self.max_bytes:
                return
            if sha in pinned:
                continue
            self.num_bytes -= len(self._bytes.pop(sha))
            self._refs.pop(sha, None)
            self.num_evicted += 1

    def ref(self, sha256: str) -> ImageRef:
        """The `ImageRef` (size, mime) of a stored image; KeyError if absent."""
        ref = self._refs.get(sha256)
        if ref is None:
            ref = self._refs[sha256] = describe_image(self.get(sha256), self.max_pixels)
        return ref

    def __contains__(self, sha256: object) -> bool:
        if not isinstance(sha256, str):
            return False
        return sha256 in self._bytes or (self.directory is not None and self._path(sha256).exists())

    def __len__(self) -> int:
        """Images held in memory (those only on disk are loaded on first `get`)."""
        return len(self._bytes)

    def inputs(self, refs: list[ImageRef]) -> list[ImageInput]:
        """The engine's image inputs for a trajectory's `images`, in the same order."""
        return [ImageInput(sha256=ref.sha256, data=self.get(ref.sha256)) for ref in refs]
