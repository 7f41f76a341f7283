"""Model folders without a hub: `resolve_model("tiny" | "smollm2" | PATH) -> HF folder path`.

Built folders are cached under `$STREAMRL_CACHE` (default `~/.cache/streamrl`) keyed by the builder's
version, and built with a file lock + atomic rename so concurrent processes never see a half folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from streamrl.core.atomic import build_once

BUILDER_VERSION = "1"


def cache_root() -> Path:
    return Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))


BUILT_IN = {
    "tiny": "tiny",
    "tiny-moe": "tiny-moe",
    "tiny-vlm": "tiny-vlm",
    "smollm2": "smollm2-135m-instruct",
}  # name -> cache folder stem


def _cache_folder(stem: str) -> Path:
    return cache_root() / "models" / f"{stem}-v{BUILDER_VERSION}"


def ready_model(name_or_path: str) -> Path | None:
    """The folder `resolve_model` returns when it needs no build (a HF folder, or a built-in already in
    the cache), found without importing a builder; None when something must be built first."""
    folder = _cache_folder(BUILT_IN[name_or_path]) if name_or_path in BUILT_IN else Path(name_or_path).expanduser()
    return folder if (folder / "config.json").exists() else None


def _cached_build(name: str, build: Callable[[Path], object]) -> Path:
    return build_once(_cache_folder(name), build)


def resolve_model(name_or_path: str) -> Path:
    """Return a HF model folder for a built-in name or an existing path (a built-in is built once)."""
    ready = ready_model(name_or_path)
    if ready is not None:
        return ready
    if name_or_path == "tiny":
        from streamrl.models.tiny import build_tiny_model

        return _cached_build(BUILT_IN["tiny"], build_tiny_model)
    if name_or_path == "tiny-moe":  # a random-weight Qwen3-MoE (models/tiny_moe.py, docs/moe.md)
        from streamrl.models.tiny_moe import build_tiny_moe_model

        return _cached_build(BUILT_IN["tiny-moe"], build_tiny_moe_model)
    if name_or_path == "tiny-vlm":  # a random-weight Idefics3 (models/tiny_vlm.py, docs/multimodal.md)
        from streamrl.models.tiny_vlm import resolve_tiny_vlm

        return resolve_tiny_vlm()
    if name_or_path == "smollm2":
        from streamrl.models.smollm2 import convert_smollm2

        return _cached_build(BUILT_IN["smollm2"], convert_smollm2)
    raise ValueError(
        f"model {name_or_path!r} is neither a built-in ({', '.join(repr(n) for n in BUILT_IN)}) "
        "nor a HF folder with config.json"
    )
