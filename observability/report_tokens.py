"""How the run report reads token ids: the run's own tokenizer (or its tokenizer.json alone), the text
of each token, and where a VLM's ids hold an image (its placeholder run plus wrapper tokens).

The viewer (report_viewer.py) never re-encodes text: it shows the very ids the learner trained on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_WRAPPER_RE = re.compile(r"image|img|vision", re.IGNORECASE)  # special tokens around an image's placeholders


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
