"""Images in tool and interaction responses: what the observation message holds, and when an image
is refused.

Return shapes (docs/multimodal.md, "Images in your own data"):
- a tool returns `ToolExecution(text=..., images=[SOURCE, ...])` (a function tool may also return a
  list of content parts, see `tools.function.to_execution`); SOURCE is a local path, a
  `data:image/...;base64,` URL, plain base64, encoded bytes or a PIL image. The executor admits the
  images into the worker's `ImageStore` (`ToolResult.images`); the tool message shows them first, then
  the (truncated) text: `{"role": "tool", ..., "content": [{"type": "image", "image_ref": sha256}, ...,
  {"type": "text", "text": ...}]}` (verl's layout). A result without images keeps string content, so
  text-only trajectories are unchanged.
- an interaction's `generate_response` returns as its response a string, or a list of content parts
  `[{"type": "text", "text": ...}, {"type": "image", "image": SOURCE}, ...]` that becomes the user
  message's content in that order, each image part replaced by `{"type": "image", "image_ref": sha256}`.

Refusals never fail the trajectory and never let an image in half-way: a response whose images cannot
all be shown (no image store: a text-only policy; an image that cannot be decoded; more images than
the trajectory may still hold, `AgentContext.max_images`) becomes an error observation, "Error: <why>"
followed by the response's text, with none of its images. `AgentLoopBase.append_observation` then
templates the message (one image token per image part), expands each token by the processor rule and
appends the refs to `AgentData.images` together with the ids, so placeholder order == `images` order.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from streamrl.rollout.agent_loop.observation import truncate_text
from streamrl.tools.types import ToolResult

if TYPE_CHECKING:
    from streamrl.rollout.config import AgentConfig
    from streamrl.rollout.images import ImageStore


def tool_message(result: ToolResult, cfg: AgentConfig) -> dict[str, Any]:
    """The tool message of one result: string content, or its images then its text as parts."""
    text = truncate_text(result.text, cfg.max_tool_response_chars, cfg.tool_response_truncate)
    message: dict[str, Any] = {"role": "tool", "tool_call_id": result.call_id, "name": result.name, "content": text}
    if result.images:
        parts: list[dict[str, Any]] = [{"type": "image", "image_ref": ref.sha256} for ref in result.images]
        message["content"] = [*parts, {"type": "text", "text": text}]
    return message


def cap_tool_images(results: list[ToolResult], num_images: int, max_images: int | None) -> list[ToolResult]:
    """`results` (in observation order) with every result whose images would take the trajectory past
    `max_images` (it holds `num_images` already) turned into an error result without images."""
    out: list[ToolResult] = []
    for result in results:
        n = len(result.images)
        if n and max_images is not None and num_images + n > max_images:
            why = over_limit(f"tool '{result.name}'", n, num_images, max_images)
            result = result.model_copy(update={"images": [], "is_error": True, "text": f"Error: {why}\n{result.text}"})
        num_images += len(result.images)
        out.append(result)
    return out


def over_limit(who: str, n: int, num_images: int, max_images: int) -> str:
    return (
        f"{who} returned {n} image(s) but this conversation already holds {num_images} of at most "
        f"{max_images} images; no image was shown"
    )


async def reply_content(
    reply: Any, store: ImageStore | None, num_images: int, max_images: int | None
) -> str | list[dict[str, Any]]:
    """The user message content of an interaction's response (see module doc): the string itself, the
    parts with admitted `image_ref`s, or an error text when its images cannot all be shown."""
    if isinstance(reply, str):
        return reply
    from streamrl.models.images import is_content_parts

    if not is_content_parts(reply):
        raise TypeError(f"interaction response must be a string or a list of text / image parts, got {reply!r:.200}")
    sources = [p.get("image") for p in reply if p["type"] == "image"]
    if not sources:
        return reply
    blobs_or_why = await _read_all(sources, store, num_images, max_images)
    if isinstance(blobs_or_why, str):
        text = "\n".join(p.get("text", "") for p in reply if p["type"] == "text")
        return f"Error: {blobs_or_why}" + (f"\n{text}" if text else "")
    assert store is not None
    refs = iter([store.put(blob) for blob in blobs_or_why])
    return [{"type": "image", "image_ref": next(refs).sha256} if p["type"] == "image" else p for p in reply]


async def _read_all(
    sources: list[Any], store: ImageStore | None, num_images: int, max_images: int | None
) -> list[bytes] | str:
    """Every source's bytes (decoded once off the event loop), or why they cannot all be shown."""
    from streamrl.models.images import read_response_image

    n = len(sources)
    if store is None:
        return f"the interaction returned {n} image(s) but the policy reads text only; they were not shown"
    if max_images is not None and num_images + n > max_images:
        return over_limit("the interaction", n, num_images, max_images)
    blobs: list[bytes] = []
    for i, source in enumerate(sources):
        try:
            blobs.append(await asyncio.to_thread(read_response_image, source))
        except (ValueError, TypeError) as exc:
            return f"the interaction returned an unreadable image (#{i + 1} of {n}): {exc}; no image was shown"
    return blobs
