"""Inference engines behind one interface (`InferenceEngine`), and the factory that builds them.

`make_engine(cfg, engine_id)` returns a `VLLMEngine` in this process (`placement="local"`) or a
`RayEngineClient` whose `EngineActor` hosts the engine elsewhere (`placement="ray"`). Heavy modules
(vLLM, Ray) are imported only when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl.rollout.engine.base import (
    BusyClock,
    EngineStats,
    GenerationOutput,
    ImageInput,
    InferenceEngine,
    PauseMode,
    PromptMismatchError,
    SamplingParams,
)
from streamrl.rollout.engine.config import EngineConfig
from streamrl.rollout.engine.fake import FakeEngine, fake_logprob

if TYPE_CHECKING:
    from streamrl.rollout.engine.ray_engine import EngineActor, RayEngineClient
    from streamrl.rollout.engine.vllm_engine import VLLMEngine

__all__ = [
    "BusyClock",
    "EngineActor",
    "EngineConfig",
    "EngineStats",
    "FakeEngine",
    "GenerationOutput",
    "ImageInput",
    "InferenceEngine",
    "PauseMode",
    "PromptMismatchError",
    "RayEngineClient",
    "SamplingParams",
    "VLLMEngine",
    "fake_logprob",
    "make_engine",
]


def make_engine(cfg: EngineConfig, engine_id: str, *, policy_version: int = 0) -> InferenceEngine:
    """Build one engine as configured. Local: blocks until vLLM is up (~15 s on CPU). Ray: returns at
    once; the first call waits for the actor's engine (bounded by `cfg.startup_timeout_s`)."""
    if cfg.placement == "ray":
        from streamrl.rollout.engine.ray_engine import RayEngineClient

        return RayEngineClient.launch(cfg, engine_id, policy_version=policy_version)
    from streamrl.rollout.engine.vllm_engine import VLLMEngine

    return VLLMEngine(cfg, engine_id, policy_version=policy_version)


def __getattr__(name: str) -> object:
    # Lazy exports: importing rollout.engine must not import vLLM or Ray.
    if name == "VLLMEngine":
        from streamrl.rollout.engine.vllm_engine import VLLMEngine

        return VLLMEngine
    if name in ("EngineActor", "RayEngineClient"):
        from streamrl.rollout.engine import ray_engine

        return getattr(ray_engine, name)
    raise AttributeError(f"module 'rollout.engine' has no attribute {name!r}")
