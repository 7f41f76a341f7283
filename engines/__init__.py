"""Inference engines behind one interface (`InferenceEngine`), and the factory that builds them.

`make_engine(cfg, engine_id)` returns a `VLLMEngine` in this process (`streamrl rollout`, `streamrl
eval`, tests), or with `backend = "vllm_server" | "sglang_server"` a `ServerEngine` driving the
inference server at `server_urls[0]` (docs/inference-server.md). A training run hosts each engine
in a Ray actor instead (`streaming.actors.engine`: `EngineActor` and its client `RayEngineClient`,
the same interface). vLLM is imported only when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl.engines.base import (
    BusyClock,
    EngineStats,
    GenerationOutput,
    ImageInput,
    InferenceEngine,
    PauseMode,
    PromptMismatchError,
    SamplingParams,
)
from streamrl.engines.config import EngineConfig
from streamrl.engines.fake import FakeEngine, fake_logprob

if TYPE_CHECKING:
    from streamrl.engines.vllm_engine import VLLMEngine

__all__ = [
    "BusyClock",
    "EngineConfig",
    "EngineStats",
    "FakeEngine",
    "GenerationOutput",
    "ImageInput",
    "InferenceEngine",
    "PauseMode",
    "PromptMismatchError",
    "SamplingParams",
    "VLLMEngine",
    "fake_logprob",
    "make_engine",
]


def make_engine(cfg: EngineConfig, engine_id: str, *, policy_version: int = 0) -> InferenceEngine:
    """Build one engine in this process; blocks until vLLM (~15 s on CPU) or the server is up."""
    if cfg.backend != "vllm":
        from streamrl.engines.http_server import make_server_engine

        return make_server_engine(cfg.for_engine(0), engine_id, policy_version=policy_version)
    from streamrl.engines.vllm_engine import VLLMEngine

    return VLLMEngine(cfg, engine_id, policy_version=policy_version)


def __getattr__(name: str) -> object:
    # Lazy export: importing streamrl.engines must not import vLLM.
    if name == "VLLMEngine":
        from streamrl.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'streamrl.engines' has no attribute {name!r}")
