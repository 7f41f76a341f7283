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
The tokenizer side lives in report_tokens.py, the image log and thumbnails in report_images.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrl.observability.report_images import ViewerImages
from streamrl.observability.report_tokens import decode_pieces, image_spans

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


def fmt_number(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None or not np.isfinite(value) else format(value, spec)


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
    response_chips = _place_response_chips(spans, chips, num_prompt, shown, pieces)
    prompt_parts = _prompt_parts(
        tokenizer, prompt_ids, [(a, b, c) for (a, b, _), c in zip(spans, chips) if a < num_prompt]
    )
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).tolist()
    text = "".join(pieces)
    in_call = _span_mask(offsets, [m.span() for m in TOOL_CALL_RE.finditer(text)])
    columns = _Columns(ids=ids, mask=mask, versions=versions, logprobs=logprobs, in_call=in_call)
    tokens = _token_spans(pieces, columns, response_chips, n=n, step=step, special_ids=special_ids)
    sampled_versions = sorted({int(v) for m, v in zip(mask[:n], versions[:n]) if m})
    headline, facts = _headline_and_facts(
        row, sampled_versions, aligned=len(ids) == len(mask) == len(versions) == len(logprobs)
    )
    return {
        "headline": headline,
        "facts": facts,
        "calls": _calls_table(text),
        "prompt": prompt,
        "prompt_parts": prompt_parts,
        "num_prompt_tokens": len(row.get("prompt_ids", [])),
        "tokens": tokens,
        "num_hidden": n - shown,
        "versions": sampled_versions,
    }


@dataclass(frozen=True, slots=True)
class _Columns:
    """A response's per-token columns, as the viewer reads them (`in_call`: inside a <tool_call>)."""

    ids: list[int]
    mask: list[Any]
    versions: list[Any]
    logprobs: list[Any]
    in_call: list[bool]


def _place_response_chips(
    spans: list[tuple[int, int, int]], chips: list[dict[str, Any]], num_prompt: int, shown: int, pieces: list[str]
) -> dict[int, tuple[int, dict[str, Any] | None]]:
    """{response start: (end, chip)} of the images that reach into the response (chip None for one
    that starts in the prompt); their token pieces become the chip's label (the calls table reads
    the chip, not <image>×N)."""
    response_chips: dict[int, tuple[int, dict[str, Any] | None]] = {}
    for (a, b, _), chip in zip(spans, chips):
        if b > num_prompt:
            start = max(a - num_prompt, 0)
            response_chips[start] = (b - num_prompt, chip if a >= num_prompt else None)
            for j in range(start, min(b - num_prompt, shown)):
                pieces[j] = chip["label"] if j == start and a >= num_prompt else ""
    return response_chips


def _token_spans(
    pieces: list[str],
    columns: _Columns,
    response_chips: dict[int, tuple[int, dict[str, Any] | None]],
    *,
    n: int,
    step: Any,
    special_ids: set[int],
) -> list[dict[str, Any]]:
    """The template's spans of the shown response: one per sampled token (version-coloured, with a
    hover title and a marker where the version changes), one per observation run, one per image."""
    mask, versions = columns.mask, columns.versions
    tokens: list[dict[str, Any]] = []
    prev_version = None
    skip_to = 0
    for i in range(len(pieces)):
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
                title = f"observation (mask 0) #{i}–#{i}"
                tokens.append({"text": pieces[i], "cls": "obs", "title": title, "marker": "", "parts": []})
            continue
        v = int(versions[i])
        classes = [f"v{v % len(VERSION_COLORS)}"]
        if columns.ids[i] in special_ids:
            classes.append("special")
        if columns.in_call[i]:
            classes.append("call")
        marker = f"v{prev_version}→v{v}" if prev_version is not None and v != prev_version else ""
        prev_version = v
        lag = f" · lag {int(step) - v}" if isinstance(step, int | float) else ""
        title = f"#{i} · id {columns.ids[i]} · policy_version {v}{lag} · logprob {float(columns.logprobs[i]):.3f}"
        tokens.append({"text": pieces[i], "cls": " ".join(classes), "title": title, "marker": marker, "parts": []})
    return tokens


def _calls_table(text: str) -> list[tuple[str, str]]:
    """(tool call, tool response) pairs pulled out of the response text, in order."""
    calls = [_pretty(m.group(1)) for m in TOOL_CALL_RE.finditer(text)]
    responses = [m.group(1).strip() for m in TOOL_RESPONSE_RE.finditer(text)]
    return [
        (calls[j] if j < len(calls) else "", responses[j] if j < len(responses) else "")
        for j in range(max(len(calls), len(responses)))
    ]


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
