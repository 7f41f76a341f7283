"""Session-wide fixtures: tiny model folder, one local Ray cluster, one vLLM engine (fixtures/).

Environment is set before anything heavy imports: wandb offline, gloo on loopback, vLLM in-process
(uni executor, no engine-core subprocess) with a small CPU KV cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("STREAMRL_CACHE", str(REPO / ".cache" / "streamrl"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

pytest_plugins = ["tests.fixtures.vllm", "tests.fixtures.ray_cluster"]


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from streamrl.rollout.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
