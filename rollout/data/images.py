"""verl multimodal rows (`RLHFDataset`, e.g. geo3k): the `images` column and the `<image>` placeholders
of string contents, as content parts the agent loop admits (`agent_loop/image_prompt.py`).

Used by `data.py` for every loaded row; a row without images passes through unchanged.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_IMAGE, _VIDEO = "<image>", "<video>"  # verl's placeholders in string contents


def with_images(messages: list[dict[str, Any]], row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The messages of a verl multimodal row: each `<image>` of a string content replaced by the next
    entry of the row's `images` (verl's order: messages in turn, placeholders left to right). Content
    that is already parts is left as it is, as verl does. A row with no images is returned unchanged."""
    if videos := row.get("videos"):
        count = f"{len(videos)} video(s)" if isinstance(videos, list) else f"a {type(videos).__name__}"
        raise ValueError(f"{where}: field 'videos' holds {count}; video is not supported")
    images = row.get("images")
    if not images:
        return messages
    if not isinstance(images, list):
        raise ValueError(f"{where}: field 'images' must be a list of images, got {type(images).__name__}")
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    if any(_VIDEO in text for text in texts):
        raise ValueError(f"{where}: a message has a {_VIDEO!r} placeholder; video is not supported")
    num_placeholders = sum(text.count(_IMAGE) for text in texts)
    if num_placeholders != len(images):
        raise ValueError(
            f"{where}: the string contents of 'prompt' have {num_placeholders} {_IMAGE!r} placeholder(s) "
            f"but field 'images' holds {len(images)} image(s); there must be one placeholder per image"
        )
    sources = iter([_image_source(image, f"{where}: images[{i}]") for i, image in enumerate(images)])
    return [{**m, "content": _image_parts(m["content"], sources)} if _has_placeholder(m) else m for m in messages]


def _has_placeholder(message: dict[str, Any]) -> bool:
    return isinstance(message.get("content"), str) and _IMAGE in message["content"]


def _image_parts(content: str, sources: Iterator[str]) -> list[dict[str, Any]]:
    """`"<image>text"` -> `[{"type": "image", "image": next source}, {"type": "text", "text": "text"}]`."""
    segments = [s for s in re.split(f"({re.escape(_IMAGE)})", content) if s]
    return [{"type": "image", "image": next(sources)} if s == _IMAGE else {"type": "text", "text": s} for s in segments]


def _image_source(image: Any, where: str) -> str:
    """One `images` entry as a source the agent loop reads (`models.images.load_image_source`).

    Entries come as HF datasets' Image feature stores them in parquet (`{"bytes": ..., "path": ...}`:
    the bytes, when present, are the image and become a base64 data URL, so nothing is lost when the
    row travels as JSON), as a path string (also `file://...`) or a data URL, or as a PIL image (an HF
    dataset's decoded rows). A path stays a path, made absolute so a worker in another directory
    finds the same file. Every image is identified here (header only), so a broken dataset fails at
    load naming the row, not mid-run."""
    if isinstance(image, dict):
        data, path = image.get("bytes"), image.get("path")
        if isinstance(data, (bytes, bytearray)):
            return _data_url(bytes(data), where)
        if isinstance(path, str) and path:
            return _path_source(path, where)
        raise ValueError(f"{where}: an image entry needs 'bytes' or a 'path', got keys {sorted(image)}")
    if isinstance(image, str):
        return _checked_data_url(image, where) if image.startswith("data:") else _path_source(image, where)
    from PIL import Image as PILImage

    if isinstance(image, PILImage.Image):
        from streamrl.models.images import encode_png

        return _data_url(encode_png(image), where)
    raise ValueError(
        f"{where}: unsupported image entry {type(image).__name__} (expected {{'bytes', 'path'}}, a path, a data URL "
        "or a PIL image)"
    )


def _path_source(path: str, where: str) -> str:
    if path.startswith(("http://", "https://")):
        raise ValueError(f"{where}: image {path!r} is a URL; download the images and give local paths")
    local = Path(path.removeprefix("file://")).absolute()
    if not local.is_file():
        raise ValueError(f"{where}: image file {str(local)!r} does not exist")
    _describe(local.read_bytes(), where)
    return str(local)


def _checked_data_url(url: str, where: str) -> str:
    from streamrl.models.images import load_image_source

    try:
        data = load_image_source(url)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    _describe(data, where)
    return url


def _data_url(data: bytes, where: str) -> str:
    return f"data:{_describe(data, where)};base64,{base64.b64encode(data).decode()}"


def _describe(data: bytes, where: str) -> str:
    """The mime type of encoded image bytes; ValueError naming the entry if PIL cannot identify them."""
    from streamrl.models.images import describe_image

    try:
        return describe_image(data).mime
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
