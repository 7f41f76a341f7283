"""A slow environment: answers every assistant turn after a configurable latency.

The workload of the async-vs-sync benchmark: environment/tool time comparable to or longer than
generation time, which is exactly where a synchronous trainer leaves the engines idle. Each reply is a
short observation; after `num_turns` replies the episode ends with the configured score.

`distribution = "lognormal"` draws each latency from a long-tailed lognormal with median
`latency_s` and 99th percentile `p99_over_median` times the median (the tool-heavy case where a few
calls take 10x the usual); `min_turns < num_turns` gives each trajectory its own number of replies,
drawn from its instance id (so a trajectory resumed elsewhere keeps it), for lengths that differ a lot.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from streamrl.rollout.interactions.base import BaseInteraction, num_replies, register_interaction


class LatencyEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(1.0, ge=0)  # uniform: the mean; lognormal: the median
    jitter_s: float = Field(0.0, ge=0)  # uniform only: +- this much
    distribution: Literal["uniform", "lognormal"] = "uniform"
    p99_over_median: float = Field(10.0, gt=1.0)  # lognormal only
    num_turns: int = Field(2, ge=1)
    min_turns: int | None = Field(None, ge=1)  # None: every trajectory gets `num_turns` replies
    final_score: float = 0.0
    seed: int = 0


@register_interaction("latency_env")
class LatencyEnvironment(BaseInteraction):
    config_model = LatencyEnvConfig
    config: LatencyEnvConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)
        if self.config.min_turns is not None and self.config.min_turns > self.config.num_turns:
            raise ValueError(f"min_turns ({self.config.min_turns}) must not exceed num_turns ({self.config.num_turns})")

    def draw_latency(self) -> float:
        cfg = self.config
        if cfg.distribution == "lognormal":
            sigma = math.log(cfg.p99_over_median) / 2.3263478740408408  # z of the 99th percentile
            return cfg.latency_s * math.exp(self._rng.gauss(0.0, sigma)) if cfg.latency_s > 0 else 0.0
        return max(cfg.latency_s + self._rng.uniform(-cfg.jitter_s, cfg.jitter_s), 0.0)

    def turns_of(self, instance_id: str) -> int:
        """This trajectory's number of replies: fixed by its id, the same after a resume anywhere."""
        cfg = self.config
        if cfg.min_turns is None:
            return cfg.num_turns
        return random.Random(f"{cfg.seed}:{instance_id}").randint(cfg.min_turns, cfg.num_turns)

    async def restore(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        instance_id = await self.start_interaction(instance_id, **kwargs)
        self.instance_state(instance_id)["turns"] = num_replies(messages)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instance_state(instance_id)
        cfg = self.config
        delay = self.draw_latency()
        await asyncio.sleep(delay)
        state["turns"] = state.get("turns", 0) + 1
        done = state["turns"] >= self.turns_of(instance_id)
        reply = f"Observation {state['turns']}: the environment changed; continue."
        return done, reply, cfg.final_score if done else 0.0, {"latency_s": delay}
