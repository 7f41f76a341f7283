"""Trajectory viewer of the run report (report.py): sampled trajectories as coloured token text.

Each response token is decoded with the run's own tokenizer (never re-encoded: what is shown is the
token sequence the learner trained on) and classed for the template by response mask (policy-sampled
vs observation) and by policy_version, with a marker wherever the version changes inside a response
— the visible trace of an interrupt and resume. Tool calls and observations are also pulled out of
the text into a readable call/response table. All text is escaped by the template (autoescape).

Images (a VLM run: the model folder's config has a `vision_config`): each placeholder run — the
maximal run of the image token plus the adjacent wrapper tokens, e.g. Idefics3's
`<fake_token_around_image><global-img>` — is one chip `[image W×H, N tokens]` (N = image tokens)
with a thumbnail (PNG, longest side capped, base64 inline, a byte budget per report), looked up by
the row's `image_refs` (placeholder order over prompt + response) in the buffer's image log. An
observation image sits inside its observation span. A text-only run renders exactly as before.
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VERSION_COLORS = [  # light, distinguishable backgrounds; version v uses index v % len
    "#cfe2ff",
    "#ffe0b3",
    "#c8f0c8",
    "#ffc9c9",
    "#e3d4f5",
    "#f5dcc8",
    "#fbd3ec",
    "#e0e0a8",
    "#c4eef2",
    "#d6e4b0",
]
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
TOOL_RESPONSE_RE = re.compile(r"<tool_response>(.*?)(?:</tool_response>|$)", re.S)
IMAGE_WRAPPER_RE = re.compile(r"image|img|vision", re.IGNORECASE)  # special tokens around an image's placeholders


def fmt_number(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None or not np.isfinite(value) else format(value, spec)


class FastTokenizerFile:
    """A HF folder's `tokenizer.json` through the `tokenizers` library: the same decoder pipeline
    the transformers fast tokenizer runs, without importing transformers and torch (seconds)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.all_special_ids = [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]

    def added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: Any) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = False, **_: Any) -> list[str]:
        return self._tok.decode_batch([list(s) for s in seqs], skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_path: str | None, problems: list[str]) -> Any:
    """The run's tokenizer (its tokenizer.json directly when there is one, else transformers'
    AutoTokenizer), or None with the reason recorded (the viewer then shows token ids)."""
    if not model_path:
        problems.append("run_info.json has no model_path: trajectories show token ids")
        return None
    if not Path(model_path).is_dir():  # never let transformers treat it as a hub id and go online
        problems.append(f"model folder {model_path} not found: trajectories show token ids")
        return None
    fast_file = Path(model_path) / "tokenizer.json"
    try:
        if fast_file.exists():
            return FastTokenizerFile(fast_file)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # the world: a moved or partial model folder still gets a report
        problems.append(
            f"tokenizer at {model_path} could not be loaded ({type(exc).__name__}): trajectories show token ids"
        )
        return None


# -- images ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageTokens:
    """How a VLM's ids mark an image: one run of `image_token_id` per image, with `wrapper_ids`
    (special tokens whose text names an image, e.g. Idefics3's `<global-img>`) next to it."""

    image_token_id: int
    wrapper_ids: frozenset[int]


def load_image_tokens(model_path: str | None, tokenizer: Any) -> ImageTokens | None:
    """The image token of a VLM model folder (its config.json has a `vision_config`; the id is the
    config's `image_token_id`, else the tokenizer's `<image>`); None for a text model."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text()) if model_path else {}
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    added = _added_tokens(tokenizer)
    image_id = config.get("image_token_id", config.get("image_token_index"))
    if not isinstance(image_id, int):
        image_id = next((i for i, t in added.items() if t == "<image>"), None)
    if image_id is None:
        return None
    wrappers = frozenset(i for i, t in added.items() if i != image_id and IMAGE_WRAPPER_RE.search(t))
    return ImageTokens(image_token_id=image_id, wrapper_ids=wrappers)


def _added_tokens(tokenizer: Any) -> dict[int, str]:
    if isinstance(tokenizer, FastTokenizerFile):
        return tokenizer.added_tokens()
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}


def image_spans(ids: Sequence[int], tokens: ImageTokens) -> list[tuple[int, int, int]]:
    """(start, end, num_image_tokens) per image in `ids`, `ids[start:end]` = the image token run plus
    the wrapper tokens right before it (back to the previous image) and, when no image follows,
    right after it. The image token runs are exactly those `count_image_runs` counts."""
    runs: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == tokens.image_token_id:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
    spans = []
    for k, (a, b) in enumerate(runs):
        floor = spans[-1][1] if spans else 0
        start = a
        while start > floor and ids[start - 1] in tokens.wrapper_ids:
            start -= 1
        end = b
        while end < len(ids) and ids[end] in tokens.wrapper_ids:
            end += 1
        if k + 1 < len(runs) and end == runs[k + 1][0]:  # only wrappers up to the next image: they are its own
            end = b
        spans.append((start, end, b - a))
    return spans


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


def decode_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Text of each token such that "".join(pieces) == decode(ids).

    Decoding tokens one by one breaks multi-byte characters split across byte-level BPE tokens and
    drops SentencePiece's leading spaces, so when the one-by-one pieces don't join to the full
    decode, fall back to incremental detokenization (the text a token adds to a short window of
    its predecessors; an incomplete character is emitted with the token that completes it).
    """
    if not ids:
        return []
    kwargs = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = tokenizer.batch_decode([[i] for i in ids], **kwargs)
    if "".join(pieces) == tokenizer.decode(list(ids), **kwargs) and "\ufffd" not in "".join(pieces):
        return pieces
    pieces, prefix, read = [], 0, 0
    for i in range(len(ids)):
        before = tokenizer.decode(list(ids[prefix:read]), **kwargs)
        after = tokenizer.decode(list(ids[prefix : i + 1]), **kwargs)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before) :])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    return pieces


def _span_mask(text_offsets: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """For each token starting at text_offsets[i] (ending at text_offsets[i+1]): inside any span?"""
    out = []
    for i in range(len(text_offsets) - 1):
        a, b = text_offsets[i], text_offsets[i + 1]
        out.append(any(a < e and s < max(b, a + 1) for s, e in spans))
    return out


def _pretty(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=1, ensure_ascii=False)
    except ValueError:
        return text.strip()


def _headline_and_facts(row: dict[str, Any], sampled_versions: list[int], *, aligned: bool) -> tuple[str, list]:
    """The trajectory's one-line headline and its (name, value) facts table."""
    ids, mask = row.get("response_ids", []), row.get("response_mask", [1] * len(row.get("response_ids", [])))
    headline = (
        f"{row.get('trajectory_id', '?')} · step {row.get('learner_step')} · reward {fmt_number(row.get('reward'))} · "
        f"{row.get('status', '?')}/{row.get('finish_reason', '?')} · {row.get('num_turns', 0)} turns · "
        f"{row.get('num_tool_calls', 0)} tool calls · versions {sampled_versions} · "
        f"{row.get('num_interrupts', 0)} interrupts"
    )
    facts = [
        ("group / sample", f"{row.get('group_id', '?')} / {row.get('sample_index', '?')}"),
        ("agent", str(row.get("agent_name", "?"))),
        (
            "tokens (prompt / response / sampled)",
            f"{len(row.get('prompt_ids', []))} / {len(ids)} / {sum(1 for m in mask if m)}",
        ),
        ("generate s / tool s", f"{fmt_number(row.get('generate_s'), '.2f')} / {fmt_number(row.get('tool_s'), '.2f')}"),
        ("turn scores / tool rewards", f"{row.get('turn_scores', [])} / {row.get('tool_rewards', [])}"),
    ]
    if not aligned:
        facts.append(("warning", "per-token arrays have different lengths; showing the common prefix"))
    return headline, facts


def render_trajectory(
    row: dict[str, Any], tokenizer: Any, *, special_ids: set[int], max_tokens: int, images: ViewerImages | None = None
) -> dict[str, Any]:
    """The template's view of one sampled trajectory: per-token text, classes, hover titles; with
    `images`, each image's placeholder span is one chip (in the prompt or inside its token span)."""
    ids = [int(i) for i in row.get("response_ids", [])]
    mask = list(row.get("response_mask", [1] * len(ids)))
    versions = list(row.get("policy_versions", [0] * len(ids)))
    logprobs = list(row.get("behavior_logprobs", [0.0] * len(ids)))
    n = min(len(ids), len(mask), len(versions), len(logprobs))
    shown = min(n, max_tokens)
    step = row.get("learner_step")
    prompt_ids = [int(i) for i in row.get("prompt_ids", [])]
    spans = image_spans(prompt_ids + ids, images.tokens) if images is not None else []
    chips = images.row_chips(row, spans) if images is not None and (spans or row.get("image_refs")) else []
    if tokenizer is not None:
        pieces = decode_pieces(tokenizer, ids[:shown])
        prompt = tokenizer.decode(row.get("prompt_ids", []), skip_special_tokens=False)
    else:
        pieces = [f"⟨{i}⟩" for i in ids[:shown]]
        prompt = " ".join(str(i) for i in row.get("prompt_ids", []))
    num_prompt = len(prompt_ids)
    response_chips: dict[int, tuple[int, dict[str, Any] | None]] = {}  # response start -> (end, chip)
    for (a, b, _), chip in zip(spans, chips):
        if b > num_prompt:
            start = max(a - num_prompt, 0)
            response_chips[start] = (b - num_prompt, chip if a >= num_prompt else None)
            for j in range(start, min(b - num_prompt, shown)):  # the calls table reads the chip, not <image>×N
                pieces[j] = chip["label"] if j == start and a >= num_prompt else ""
    prompt_parts = _prompt_parts(
        tokenizer, prompt_ids, [(a, b, c) for (a, b, _), c in zip(spans, chips) if a < num_prompt]
    )
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).tolist()
    text = "".join(pieces)
    in_call = _span_mask(offsets, [m.span() for m in TOOL_CALL_RE.finditer(text)])
    tokens: list[dict[str, Any]] = []
    prev_version = None
    skip_to = 0
    for i in range(shown):
        if i < skip_to:
            continue
        if i in response_chips:
            skip_to, chip = response_chips[i]
            if chip is not None:
                prev_version = _add_chip(
                    tokens,
                    chip,
                    i,
                    min(skip_to, n) - 1,
                    mask=mask[i],
                    version=int(versions[i]),
                    prev_version=prev_version,
                )
            continue
        if not mask[i]:  # one span per observation run: no per-token facts worth a hover there
            if tokens and tokens[-1]["cls"] == "obs":
                _extend_obs(tokens[-1], pieces[i], i)
            else:
                tokens.append(
                    {
                        "text": pieces[i],
                        "cls": "obs",
                        "title": f"observation (mask 0) #{i}–#{i}",
                        "marker": "",
                        "parts": [],
                    }
                )
            continue
        v = int(versions[i])
        classes = [f"v{v % len(VERSION_COLORS)}"]
        if ids[i] in special_ids:
            classes.append("special")
        if in_call[i]:
            classes.append("call")
        marker = f"v{prev_version}→v{v}" if prev_version is not None and v != prev_version else ""
        prev_version = v
        lag = f" · lag {int(step) - v}" if isinstance(step, int | float) else ""
        title = f"#{i} · id {ids[i]} · policy_version {v}{lag} · logprob {float(logprobs[i]):.3f}"
        tokens.append({"text": pieces[i], "cls": " ".join(classes), "title": title, "marker": marker, "parts": []})
    calls = [_pretty(m.group(1)) for m in TOOL_CALL_RE.finditer(text)]
    responses = [m.group(1).strip() for m in TOOL_RESPONSE_RE.finditer(text)]
    pairs = [
        (calls[j] if j < len(calls) else "", responses[j] if j < len(responses) else "")
        for j in range(max(len(calls), len(responses)))
    ]
    sampled_versions = sorted({int(v) for m, v in zip(mask[:n], versions[:n]) if m})
    headline, facts = _headline_and_facts(
        row, sampled_versions, aligned=len(ids) == len(mask) == len(versions) == len(logprobs)
    )
    return {
        "headline": headline,
        "facts": facts,
        "calls": pairs,
        "prompt": prompt,
        "prompt_parts": prompt_parts,
        "num_prompt_tokens": len(row.get("prompt_ids", [])),
        "tokens": tokens,
        "num_hidden": n - shown,
        "versions": sampled_versions,
    }


def _extend_obs(token: dict[str, Any], text: str, last: int) -> None:
    """Append text to an observation span (to its parts once an image is inside) and move its end."""
    token["text"] += text
    if token["parts"] and text:
        if token["parts"][-1]["chip"] is None:
            token["parts"][-1]["text"] += text
        else:
            token["parts"].append({"text": text, "chip": None})
    token["title"] = token["title"].rsplit("–", 1)[0] + f"–#{last}"


def _add_chip(
    tokens: list[dict[str, Any]],
    chip: dict[str, Any],
    first: int,
    last: int,
    *,
    mask: int,
    version: int,
    prev_version: int | None,
) -> int | None:
    """An image chip covering response tokens first..last: inside the current observation span (mask
    0, the usual case: a tool response's image) or as its own version-coloured span. Returns the
    version the next sampled token compares against."""
    part = {"text": "", "chip": chip}
    if not mask:
        if tokens and tokens[-1]["cls"] == "obs":
            if not tokens[-1]["parts"] and tokens[-1]["text"]:
                tokens[-1]["parts"].append({"text": tokens[-1]["text"], "chip": None})
            tokens[-1]["parts"].append(part)
            _extend_obs(tokens[-1], "", last)
        else:
            tokens.append(
                {
                    "text": "",
                    "cls": "obs",
                    "title": f"observation (mask 0) #{first}–#{last}",
                    "marker": "",
                    "parts": [part],
                }
            )
        return prev_version
    marker = f"v{prev_version}→v{version}" if prev_version is not None and version != prev_version else ""
    tokens.append(
        {
            "text": "",
            "cls": f"v{version % len(VERSION_COLORS)} image",
            "marker": marker,
            "parts": [part],
            "title": f"#{first}–#{last} · policy_version {version} · {chip['title']}",
        }
    )
    return version


def _prompt_parts(
    tokenizer: Any, prompt_ids: list[int], chips: list[tuple[int, int, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The prompt as text and chip parts; empty when the prompt has no image (the template then
    shows the plain decoded prompt)."""
    if not chips:
        return []

    def decode(seg: list[int]) -> str:
        return (
            tokenizer.decode(seg, skip_special_tokens=False) if tokenizer is not None else " ".join(str(i) for i in seg)
        )

    parts, pos = [], 0
    for a, b, chip in chips:
        if a > pos:
            parts.append({"text": decode(prompt_ids[pos:a]), "chip": None})
        parts.append({"text": "", "chip": chip})
        pos = min(b, len(prompt_ids))
    if pos < len(prompt_ids):
        parts.append({"text": decode(prompt_ids[pos:]), "chip": None})
    return parts


def pick_samples(samples: Sequence[dict[str, Any]], max_n: int) -> list[dict[str, Any]]:
    """Up to `max_n` samples: half from those whose policy_version changes mid-response (the
    interesting ones), the rest evenly spread over the run; in learner-step order."""
    if len(samples) <= max_n:
        return list(samples)

    def mixed(row: dict[str, Any]) -> bool:
        return len({v for m, v in zip(row.get("response_mask", []), row.get("policy_versions", [])) if m}) > 1

    chosen = [i for i, row in enumerate(samples) if mixed(row)][: max_n // 2]
    rest = [i for i in range(len(samples)) if i not in set(chosen)]
    need = max_n - len(chosen)
    chosen += [rest[j] for j in np.linspace(0, len(rest) - 1, num=need).round().astype(int)] if need > 0 else []
    return [samples[i] for i in sorted(set(chosen))]
