"""The tool records: a parsed call, its recorded result, and the journal entry of a call that reaches
a tool. They cross the boundary between the agent loop (which parses calls and appends results as
observations, `rollout.types.AgentData` holds them) and the tool registry that runs them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from streamrl.models.images import ImageRef


class ToolCall(BaseModel):
    """One parsed tool call of an assistant turn (hermes / harmony alike)."""

    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    # Set when parsing or validation failed: the loop answers with an error observation instead.
    error: str | None = None


class ToolResult(BaseModel):
    """The recorded outcome of a tool call; recorded before the observation is appended so a resume
    never executes the same call twice.

    `images` are the images the tool returned, admitted into the worker's `ImageStore` (bytes by
    hash, never in this record); the observation shows them before `text`, and they join
    `AgentData.images` in that order when the observation is appended. Empty for a text-only policy:
    there an image-returning call is an error result instead."""

    call_id: str
    name: str
    text: str
    reward: float = 0.0
    is_error: bool = False
    latency_s: float = 0.0
    images: list[ImageRef] = Field(default_factory=list)  # [num_images]; observation order


class ToolCallStatus(StrEnum):
    INTENT = "intent"  # recorded (durably, via the snapshot hook) before the tool runs; outcome unknown
    DONE = "done"  # the tool returned (or failed/timed out); `result` is what the model sees
    INTERRUPTED = "interrupted"  # in doubt after a resume and not idempotent: never re-run


class ToolJournalEntry(BaseModel):
    """One call that reaches a tool's `execute`; the at-most-once record of its side effect.

    Malformed, unknown or over-the-limit calls never reach a tool and have no entry (their error
    results are in `AgentData.tool_results` only). An entry still in INTENT when a trajectory resumes
    may or may not have had its effect: it is re-run only if the tool is idempotent."""

    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # validated against the tool's schema
    status: ToolCallStatus = ToolCallStatus.INTENT
    result: ToolResult | None = None  # set with the status change away from INTENT

    def call(self) -> ToolCall:
        return ToolCall(call_id=self.call_id, name=self.name, arguments=self.arguments)
