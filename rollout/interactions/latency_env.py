"""A slow environment: answers every assistant turn after a configurable latency.

The workload of the async-vs-sync benchmark: environment/tool time comparable to or longer than
generation time, which is exactly where a synchronous trainer leaves the engines idle. Each reply is a
short observation; after `num_turns` replies the episode ends with the configured score.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from streamrl.rollout.interactions.base import BaseInteraction, num_replies, register_interaction


class LatencyEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(1.0, ge=0)
    jitter_s: float = Field(0.0, ge=0)
    num_turns: int = Field(2, ge=1)
    final_score: float = 0.0
    seed: int = 0


@register_interaction("latency_env")
class LatencyEnvironment(BaseInteraction):
    config_model = LatencyEnvConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)

    async def restore(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        instance_id = await self.start_interaction(instance_id, **kwargs)
        self.instance_state(instance_id)["turns"] = num_replies(messages)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instance_state(instance_id)
        cfg = self.config
        delay = max(cfg.latency_s + self._rng.uniform(-cfg.jitter_s, cfg.jitter_s), 0.0)
        await asyncio.sleep(delay)
        state["turns"] = state.get("turns", 0) + 1
        done = state["turns"] >= cfg.num_turns
        reply = f"Observation {state['turns']}: the environment changed; continue."
        return done, reply, cfg.final_score if done else 0.0, {"latency_s": delay}
