"""Model folders without a hub: `resolve_model("tiny" | "smollm2" | PATH) -> HF folder path`.

Built folders are cached under `$STREAMRL_CACHE` (default `~/.cache/streamrl`) keyed by the builder's
version, and built with a file lock + atomic rename so concurrent processes never see a half folder.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from streamrl.rollout.atomic import atomic_dir

BUILDER_VERSION = "1"


def cache_root() -> Path:
    return Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))


def _cached_build(name: str, build: Callable[[Path], object]) -> Path:
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-v{BUILDER_VERSION}"
    if (final / "config.json").exists():
        return final
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").exists():
            return final
        return atomic_dir(final, build)


def resolve_model(name_or_path: str) -> Path:
    """Return a HF model folder for a built-in name or an existing path."""
    if name_or_path == "tiny":
        from streamrl.rollout.models.tiny import build_tiny_model

        return _cached_build("tiny", build_tiny_model)
    if name_or_path == "tiny-vlm":  # a random-weight Idefics3 (rollout/models/tiny_vlm.py, docs/multimodal.md)
        from streamrl.rollout.models.tiny_vlm import resolve_tiny_vlm

        return resolve_tiny_vlm()
    if name_or_path == "smollm2":
        from streamrl.rollout.models.smollm2 import convert_smollm2

        return _cached_build("smollm2-135m-instruct", convert_smollm2)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(
            f"model {name_or_path!r} is neither a built-in ('tiny', 'tiny-vlm', 'smollm2') nor a HF folder with config.json"
        )
    return path
