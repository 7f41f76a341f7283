"""Trajectory viewer of the run report (report.py): sampled trajectories as coloured token text.

Each response token is decoded with the run's own tokenizer (never re-encoded: what is shown is the
token sequence the learner trained on) and classed for the template by response mask (policy-sampled
vs observation) and by policy_version, with a marker wherever the version changes inside a response
— the visible trace of an interrupt and resume. Tool calls and observations are also pulled out of
the text into a readable call/response table. All text is escaped by the template (autoescape).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

VERSION_COLORS = [  # light, distinguishable backgrounds; version v uses index v % len
    "#cfe2ff", "#ffe0b3", "#c8f0c8", "#ffc9c9", "#e3d4f5", "#f5dcc8", "#fbd3ec", "#e0e0a8", "#c4eef2", "#d6e4b0",
]
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
TOOL_RESPONSE_RE = re.compile(r"<tool_response>(.*?)(?:</tool_response>|$)", re.S)


def fmt_number(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None or not np.isfinite(value) else format(value, spec)


class FastTokenizerFile:
    """A HF folder's `tokenizer.json` through the `tokenizers` library: the same decoder pipeline
    the transformers fast tokenizer runs, without importing transformers and torch (seconds)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.all_special_ids = [i for i, t in self._tok.get_added_tokens_decoder().items() if t.special]

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
        problems.append(f"tokenizer at {model_path} could not be loaded ({type(exc).__name__}): trajectories show token ids")
        return None


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
        after = tokenizer.decode(list(ids[prefix:i + 1]), **kwargs)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
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


def render_trajectory(row: dict[str, Any], tokenizer: Any, *, special_ids: set[int], max_tokens: int) -> dict[str, Any]:
    """The template's view of one sampled trajectory: per-token text, classes, hover titles."""
    ids = [int(i) for i in row.get("response_ids", [])]
    mask = list(row.get("response_mask", [1] * len(ids)))
    versions = list(row.get("policy_versions", [0] * len(ids)))
    logprobs = list(row.get("behavior_logprobs", [0.0] * len(ids)))
    n = min(len(ids), len(mask), len(versions), len(logprobs))
    shown = min(n, max_tokens)
    step = row.get("learner_step")
    if tokenizer is not None:
        pieces = decode_pieces(tokenizer, ids[:shown])
        prompt = tokenizer.decode(row.get("prompt_ids", []), skip_special_tokens=False)
    else:
        pieces = [f"⟨{i}⟩" for i in ids[:shown]]
        prompt = " ".join(str(i) for i in row.get("prompt_ids", []))
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).tolist()
    text = "".join(pieces)
    in_call = _span_mask(offsets, [m.span() for m in TOOL_CALL_RE.finditer(text)])
    tokens: list[dict[str, str]] = []
    prev_version = None
    for i in range(shown):
        if not mask[i]:  # one span per observation run: no per-token facts worth a hover there
            if tokens and tokens[-1]["cls"] == "obs":
                tokens[-1]["text"] += pieces[i]
                tokens[-1]["title"] = tokens[-1]["title"].rsplit("–", 1)[0] + f"–#{i}"
            else:
                tokens.append({"text": pieces[i], "cls": "obs", "title": f"observation (mask 0) #{i}–#{i}", "marker": ""})
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
        tokens.append({"text": pieces[i], "cls": " ".join(classes), "title": title, "marker": marker})
    calls = [_pretty(m.group(1)) for m in TOOL_CALL_RE.finditer(text)]
    responses = [m.group(1).strip() for m in TOOL_RESPONSE_RE.finditer(text)]
    pairs = [(calls[j] if j < len(calls) else "", responses[j] if j < len(responses) else "")
             for j in range(max(len(calls), len(responses)))]
    sampled_versions = sorted({int(v) for m, v in zip(mask[:n], versions[:n]) if m})
    headline = (f"{row.get('trajectory_id', '?')} · step {step} · reward {fmt_number(row.get('reward'))} · "
                f"{row.get('status', '?')}/{row.get('finish_reason', '?')} · {row.get('num_turns', 0)} turns · "
                f"{row.get('num_tool_calls', 0)} tool calls · versions {sampled_versions} · "
                f"{row.get('num_interrupts', 0)} interrupts")
    facts = [
        ("group / sample", f"{row.get('group_id', '?')} / {row.get('sample_index', '?')}"),
        ("agent", str(row.get("agent_name", "?"))),
        ("tokens (prompt / response / sampled)", f"{len(row.get('prompt_ids', []))} / {len(ids)} / {sum(1 for m in mask if m)}"),
        ("generate s / tool s", f"{fmt_number(row.get('generate_s'), '.2f')} / {fmt_number(row.get('tool_s'), '.2f')}"),
        ("turn scores / tool rewards", f"{row.get('turn_scores', [])} / {row.get('tool_rewards', [])}"),
    ]
    if not (len(ids) == len(mask) == len(versions) == len(logprobs)):
        facts.append(("warning", "per-token arrays have different lengths; showing the common prefix"))
    return {"headline": headline, "facts": facts, "calls": pairs, "prompt": prompt,
            "num_prompt_tokens": len(row.get("prompt_ids", [])), "tokens": tokens, "num_hidden": n - shown,
            "versions": sampled_versions}


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

