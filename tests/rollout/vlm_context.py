"""The `AgentContext` the image tests build around the tiny VLM's processor and a (fake or real) engine."""

from __future__ import annotations

from typing import Any

from streamrl.rollout.agent_loop import AgentContext
from streamrl.rollout.agent_loop.observation import ObservationEncoder
from streamrl.rollout.config import AgentConfig
from streamrl.rollout.images import ImageStore
from streamrl.rollout.parsers import get_parser
from streamrl.rollout.server_manager import ServerManager


def vlm_context(
    processor: Any, engine: Any, store: ImageStore | None, *, text_only: bool = False, **fields: Any
) -> AgentContext:
    """A hermes-parsing context on `engine`: a VLM policy with `store`, or (`text_only`) the same
    tokenizer without processor or store. `fields` are `AgentConfig` keys (lengths default to 512 / 600 /
    120) or other `AgentContext` fields (tools, interactions, fetch_images, max_images)."""
    cfg = {"prompt_length": 512, "response_length": 600, "max_tokens_per_turn": 120}
    cfg |= {k: fields.pop(k) for k in list(fields) if k in AgentConfig.model_fields}
    return AgentContext(
        cfg=AgentConfig(**cfg),
        server=ServerManager([engine]),
        tokenizer=processor.tokenizer,
        encoder=ObservationEncoder(processor.tokenizer),
        parser=get_parser("hermes"),
        processor=None if text_only else processor,
        images=None if text_only else store,
        **fields,
    )
