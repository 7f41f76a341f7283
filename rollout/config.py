"""Rollout configuration: the agent loop's limits and sampling, and how many workers/engines run."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.engines.base import SEED_MAX, SEED_MIN
from streamrl.engines.config import EngineConfig
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.mini_swe.config import MiniSweConfig
from streamrl.rollout.verifiers.config import VerifiersConfig


class SamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)


class AgentConfig(BaseModel):
    """Limits of one agent loop (per trajectory). Lengths are in tokens unless named `_chars`."""

    model_config = ConfigDict(extra="forbid")

    default_agent: str = "tool_agent"  # the agent loop of a prompt whose record names none
    prompt_length: int = Field(512, gt=0)  # prompts longer than this are rejected (failed row)
    response_length: int = Field(512, gt=0)  # total budget over all turns, observations included
    max_tokens_per_turn: int = Field(256, gt=0)
    max_assistant_turns: int = Field(4, gt=0)
    max_user_turns: int = Field(4, ge=0)  # tool responses and interaction replies
    max_parallel_calls: int = Field(4, gt=0)
    max_tool_response_chars: int = Field(512, gt=0)
    tool_response_truncate: Literal["left", "right", "middle"] = "middle"
    tool_timeout_s: float = Field(30.0, gt=0)
    tool_parser: Literal["hermes", "gpt-oss"] = "hermes"
    tool_config: str | None = None  # YAML (ours or verl's format)
    interaction_config: str | None = None  # YAML (verl's format accepted)
    default_interaction: str | None = None  # interaction name for prompts that do not name one
    reward_fn: str = "math_answer"  # registered name or "package.module:function"
    # A reward fn runs in a few threads off the worker's event loop; one that takes longer than this
    # fails its trajectory (rollout/agent_loop/scoring.py).
    reward_timeout_s: float = Field(30.0, gt=0)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    # A running trajectory's tokens become durable at least this often (seconds): once this long has
    # passed since its last durable row, a partial row is appended (durably) before its next turn, and
    # a generation still running then is cut there, its streamed tokens kept and the same turn
    # continued by a new request, as after a weight-sync interrupt. A crash then loses at most this
    # much of a trajectory's work. Each cut costs a re-prefill of the trajectory so far. None: rows
    # are written at parks, before non-idempotent tools and at the end only.
    progress_every_s: float | None = Field(None, gt=0)
    gateway: GatewayConfig | None = None  # the `gateway` agent loop's server and user program (docs/gateway.md)
    # A verifiers environment run through the gateway, its dataset the prompt stream (docs/verifiers.md)
    verifiers: VerifiersConfig | None = None
    # The mini-swe-agent coding harness run through the gateway on repository tasks (docs/harness.md)
    mini_swe: MiniSweConfig | None = None

    @model_validator(mode="after")
    def _check_progress(self) -> AgentConfig:
        if self.progress_every_s is not None and self.sampling.seed is not None:
            raise ValueError(
                "rollout.agent.progress_every_s cuts generations at timed points and continues each with a new "
                "request; with rollout.agent.sampling.seed every continuation would restart the same random stream "
                "(its tokens correlated with the turn's first ones) at points that differ from run to run: unset "
                "one of the two"
            )
        return self


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: AgentConfig = Field(default_factory=AgentConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_engines: int = Field(1, gt=0)
    num_workers: int = Field(1, gt=0)
    max_concurrent_per_worker: int = Field(32, gt=0)
    sticky_lru_size: int = Field(4096, gt=0)

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.agent.max_tokens_per_turn > self.agent.response_length:
            raise ValueError("agent.max_tokens_per_turn must be <= agent.response_length")
        urls = self.engine.server_urls
        if self.engine.backend != "vllm" and len(urls) != self.num_engines:
            raise ValueError(
                f'rollout.engine.backend = "{self.engine.backend}" drives one server per engine: '
                f"rollout.num_engines = {self.num_engines} but server_urls lists {len(urls)}"
            )
        return self

    @property
    def max_model_len(self) -> int:
        """prompt_length + response_length: the engine must accept at least this."""
        return self.agent.prompt_length + self.agent.response_length
