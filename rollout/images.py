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
Bytes are read, described and decoded by `models.images`, which also holds the pixel cap every
`put` applies (`max_pixels`, refused with `ImageTooLarge`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.core.atomic import atomic_write
from streamrl.engines.base import ImageInput
from streamrl.models.images import DEFAULT_MAX_IMAGE_PIXELS, ImageRef, describe_image, encode_png, image_sha256

if TYPE_CHECKING:
    from PIL.Image import Image


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
