"""Image prompts for the agent loops: admission of a prompt row's images and the expanded prompt ids.

How a prompt row carries an image: a content part `{"type": "image", "image": SOURCE}` in one of its
messages, where SOURCE is a local file path, a `data:image/...;base64,...` URL, or a plain base64
string of the encoded bytes (PNG, JPEG: anything PIL reads). A part `{"type": "image", "image_ref":
sha256}` names an image already stored (in the worker's `ImageStore` or the buffer's image log).
At admission (the loop's PENDING step) every image part is put into the worker's store and replaced
by `{"type": "image", "image_ref": sha256}`, so `AgentData.messages` never hold bytes or paths after
PENDING and `AgentData.images` lists the refs in placeholder order.

The prompt is rendered with the model's own chat template (`ObservationEncoder.encode_prompt`,
exactly as for text, so tools and the generation prompt behave the same), which emits one image
token per image part; each is then expanded to the model's placeholder run by the processor's rule
(`models.multimodal.expand_image_tokens`): the ids the model sees, which vLLM reports back
and the learner uses. A chat without image parts never comes here (text prompts are unchanged).
`template_messages` and `expand_images` are shared with observations that carry images (tool and
interaction responses, `image_observation.py` and `AgentLoopBase.append_observation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamrl.models.images import ImageRef, load_image_source

if TYPE_CHECKING:
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.images import ImageStore


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"]) for m in messages
    )


def image_part_refs(messages: list[dict[str, Any]]) -> list[str]:
    """The `image_ref` hashes of already admitted image parts, in order."""
    return [
        p["image_ref"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image" and "image_ref" in p
    ]


def admit_images(messages: list[dict[str, Any]], store: ImageStore) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Put every image part's bytes into `store`; returns the messages with `image_ref` parts only and
    the refs in template order. `image_ref` parts must already be in the store."""
    out: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if part.get("type") != "image":
                parts.append(part)
                continue
            ref = (
                store.ref(part["image_ref"]) if "image_ref" in part else store.put(load_image_source(part.get("image")))
            )
            parts.append({"type": "image", "image_ref": ref.sha256})
            refs.append(ref)
        out.append({**message, "content": parts})
    return out, refs


def encode_image_prompt(
    encoder: ObservationEncoder,
    processor: Any,
    messages: list[dict[str, Any]],
    images: list[bytes],
    tools: list[dict] | None,
) -> list[int]:
    """Expanded prompt ids of an admitted chat (`image_ref` parts) whose image bytes are `images`."""
    return expand_images(processor, encoder.encode_prompt(template_messages(messages), tools), images)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat as the template sees it: each image part a bare `{"type": "image"}` (one image token)."""
    return [
        {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]


def expand_images(processor: Any, ids: list[int], images: list[bytes]) -> list[int]:
    """Replace the one image token per image that the template rendered in `ids` by each image's
    placeholder run (the processor's rule). The count must match: text that itself renders the image
    token (a literal "<image>" in a message) would otherwise shift every later image."""
    from streamrl.models.images import decode_image
    from streamrl.models.multimodal import expand_image_tokens, image_vision_inputs

    found = sum(t == processor.image_token_id for t in ids)
    if found != len(images):
        raise ValueError(f"chat template rendered {found} image tokens for {len(images)} images")
    if not images:
        return list(ids)
    vision_inputs = image_vision_inputs(processor, [decode_image(b) for b in images])
    expanded, _ = expand_image_tokens(processor, ids, vision_inputs)
    return expanded
