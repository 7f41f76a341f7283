"""Session-wide fixtures: tiny model folder, one local Ray cluster, one vLLM engine (fixtures/).

Environment is set before anything heavy imports: wandb offline, gloo on loopback, vLLM's uni executor
(the model runs in the engine-core process, no extra worker processes) with a small CPU KV cache.
Under `make test` each xdist worker is its own session: its own Ray cluster and engines.
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
    from streamrl.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _cost(item: pytest.Item) -> int:
    """2: an end-to-end run (`slow`); 1: a real engine or Ray cluster; 0: in-process logic."""
    return (
        2
        if item.get_closest_marker("slow")
        else 1
        if item.get_closest_marker("vllm") or item.get_closest_marker("ray")
        else 0
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules in order of cost, the heaviest first, each kept whole (stable sort). `make test` runs
    two xdist workers handing out whole modules in this order (`--dist loadscope
    --no-loadscope-reorder`): the long end-to-end runs start at once, and the light modules fill the
    gaps they leave, instead of one long run starting last on a worker while the other idles."""
    module = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    module_cost: dict[str, int] = {}
    for item in items:
        module_cost[module(item)] = max(module_cost.get(module(item), 0), _cost(item))
    items.sort(key=lambda item: -module_cost[module(item)])
