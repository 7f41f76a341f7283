"""The images of the report's trajectory viewer: read from the buffer's image log and shown as chips
`[image W×H, N tokens]` with an inline PNG thumbnail (longest side capped, a byte budget per report).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.observability.report_tokens import ImageTokens, load_image_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredImage:
    """One row of the buffer's image log (`buffer/images.py` IMAGE_SCHEMA)."""

    width: int
    height: int
    data: bytes  # encoded bytes


def read_image_log(buffer_dir: Path, wanted: set[str], problems: list[str]) -> dict[str, StoredImage]:
    """The `wanted` images of a buffer directory's image log, read with the buffer's own segment
    reader (read-only: a live run's buffer is not disturbed). Unreadable frames are problems."""
    from streamrl.buffer.images import IMAGE_SCHEMA, IMAGES_PREFIX
    from streamrl.buffer.log import read_segments
    from streamrl.buffer.types import RecoveryReport

    if not buffer_dir.is_dir():
        problems.append(f"buffer directory {buffer_dir} not found: images are shown as missing")
        return {}
    report, found = RecoveryReport(), {}
    for _, batch in read_segments(buffer_dir, prefix=IMAGES_PREFIX, schema=IMAGE_SCHEMA, report=report):
        for row in batch.to_pylist():
            if row["sha256"] in wanted:
                found.setdefault(row["sha256"], StoredImage(width=row["width"], height=row["height"], data=row["data"]))
    problems.extend(f"buffer image log: {line}" for line in (*report.torn_tails, *report.corrupt, *report.missing))
    return found


def thumbnail_png(data: bytes, max_px: int) -> bytes:
    """PNG of the image with its longest side at most `max_px` (never enlarged)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
        img.thumbnail((max_px, max_px))
        out = io.BytesIO()
        img.save(out, format="PNG", optimize=True)
    return out.getvalue()


@dataclass(kw_only=True, slots=True)
class ViewerImages:
    """The viewer's image side for one report: token ids, stored images, thumbnail budget, and the
    problems found while rendering (appended to the report's list)."""

    tokens: ImageTokens
    stored: dict[str, StoredImage]
    max_px: int = 128
    budget_bytes: int = 2 * 1024 * 1024  # base64 thumbnail bytes per report
    used_bytes: int = 0
    num_chips: int = 0
    num_not_shown: int = 0
    problems: list[str] = field(default_factory=list)
    _thumbs: dict[str, str | None] = field(default_factory=dict)  # sha256 -> data URL (None: undecodable)

    def chip(self, sha256: str | None, num_tokens: int, where: str) -> dict[str, Any]:
        """The template's chip: label, hover title, thumbnail data URL ("" if none), missing flag."""
        self.num_chips += 1
        stored = self.stored.get(sha256) if sha256 else None
        if sha256 is None or stored is None:
            why = (
                "image_refs do not match the placeholder runs"
                if sha256 is None
                else f"sha256 {sha256} is not in the buffer's image log"
            )
            return {
                "label": f"[missing image, {num_tokens} tokens]",
                "title": f"{where} · {why}",
                "src": "",
                "missing": True,
            }
        title = f"{where} · sha256 {sha256[:12]}… · {stored.width}×{stored.height} · {num_tokens} image tokens"
        src = self._thumbnail(sha256, stored)
        if src is None:
            return {
                "label": f"[unreadable image {stored.width}×{stored.height}, {num_tokens} tokens]",
                "title": title,
                "src": "",
                "missing": True,
            }
        if self.used_bytes + len(src) > self.budget_bytes:
            src, title = "", title + " · thumbnail not shown (report image budget)"
            self.num_not_shown += 1
        self.used_bytes += len(src)
        return {
            "label": f"[image {stored.width}×{stored.height}, {num_tokens} tokens]",
            "title": title,
            "src": src,
            "missing": False,
        }

    def _thumbnail(self, sha256: str, stored: StoredImage) -> str | None:
        if sha256 not in self._thumbs:
            try:
                png = thumbnail_png(stored.data, self.max_px)
                self._thumbs[sha256] = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            except Exception as exc:  # the world: bytes that passed the hash check but are no image
                self.problems.append(f"image {sha256[:12]}… could not be decoded ({type(exc).__name__})")
                self._thumbs[sha256] = None
        return self._thumbs[sha256]

    @property
    def note(self) -> str:
        return (
            f"{self.num_not_shown} images not shown: the report's thumbnail budget "
            f"({self.budget_bytes // 1024} KiB) is spent"
            if self.num_not_shown
            else ""
        )

    def row_chips(self, row: dict[str, Any], spans: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
        """One chip per span of `prompt_ids + response_ids`, in placeholder order; a row whose
        `image_refs` count disagrees with its runs gets unlooked-up chips and a problem line."""
        refs = [str(r) for r in row.get("image_refs") or []]
        counts = list(row.get("num_image_tokens") or [])
        tid = row.get("trajectory_id", "?")
        if len(refs) != len(spans):
            self.problems.append(
                f"trajectory {tid}: {len(spans)} image placeholder runs but {len(refs)} image_refs; "
                "its images are shown without lookup"
            )
            refs = [None] * len(spans)
        elif [n for _, _, n in spans] != counts:
            self.problems.append(
                f"trajectory {tid}: placeholder run lengths {[n for _, _, n in spans]} "
                f"differ from num_image_tokens {counts}"
            )
        return [
            self.chip(ref, n, f"image {k + 1} of {len(spans)}") for k, (ref, (_, _, n)) in enumerate(zip(refs, spans))
        ]


def load_viewer_images(
    model_path: str | None,
    tokenizer: Any,
    buffer_dir: Path,
    rows: Sequence[dict[str, Any]],
    problems: list[str],
    *,
    max_px: int = 128,
    budget_bytes: int = 2 * 1024 * 1024,
) -> ViewerImages | None:
    """The image side of the viewer, or None for a text model (the viewer then renders as before);
    reads the image log only if some row references an image."""
    tokens = load_image_tokens(model_path, tokenizer)
    with_refs = [r for r in rows if r.get("image_refs")]
    if tokens is None:
        if with_refs:
            problems.append(
                f"{len(with_refs)} sampled trajectories reference images but model {model_path} has no "
                "image token (config.json without vision_config): placeholders are shown as text"
            )
        return None
    wanted = {str(ref) for r in with_refs for ref in r["image_refs"]}
    stored = read_image_log(buffer_dir, wanted, problems) if wanted else {}
    if wanted - stored.keys():
        problems.append(
            f"{len(wanted - stored.keys())} image(s) referenced by sampled trajectories are not in the "
            f"buffer's image log ({buffer_dir}): shown as missing"
        )
    return ViewerImages(tokens=tokens, stored=stored, max_px=max_px, budget_bytes=budget_bytes)
