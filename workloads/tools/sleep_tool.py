"""A tool with configurable latency that echoes its input: the workload of tool-heavy benchmarks.

It stands in for a slow external environment (a sandbox, a search API) so benchmarks can measure how
much tool time the asynchronous design hides behind generation and weight syncs. Latency is
`latency_s` plus a uniform jitter in `[-jitter_s, +jitter_s]` (clipped at zero), drawn from a
per-tool RNG seeded by `seed` so benchmark runs are repeatable.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from streamrl.tools.base import BaseTool, ToolExecution
from streamrl.tools.schema import OpenAIFunctionToolSchema


class SleepToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(0.1, ge=0.0, le=600.0)
    jitter_s: float = Field(0.0, ge=0.0, le=600.0)
    seed: int = 0
    max_echo_chars: int = Field(1024, gt=0)


class SleepTool(BaseTool):
    config_model = SleepToolConfig
    config: SleepToolConfig
    idempotent = True  # an echo: no side effect, only latency

    def __init__(self, config: dict[str, Any] | BaseModel | None = None, tool_schema: Any = None) -> None:
        super().__init__(config, tool_schema)
        self._rng = random.Random(self.config.seed)

    @classmethod
    def default_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.one_string_argument(
            "sleep",
            "Wait a while, then return the given text unchanged.",
            "text",
            "text to echo back",
        )

    def next_latency_s(self) -> float:
        cfg = self.config
        jitter = self._rng.uniform(-cfg.jitter_s, cfg.jitter_s) if cfg.jitter_s > 0 else 0.0
        return max(0.0, cfg.latency_s + jitter)

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        latency_s = self.next_latency_s()
        await asyncio.sleep(latency_s)
        text = str(parameters.get("text", ""))[: self.config.max_echo_chars]
        return ToolExecution(text=text, metrics={"sleep/latency_s": latency_s})
