"""In-process stand-ins for engines: a real `WeightSyncWorkerExtension` (real gloo group, real staging,
checksums and commit) whose vLLM `reload_weights` is replaced by a dict, behind a `collective_rpc`
that runs each call in a thread like vLLM's engine-core process would. Plus an engine that never
joins the weight group (a dead peer) and a recording `PausableWorkers`."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from rollout.engine.base import PauseMode
from weight_sync.worker_extension import WeightSyncWorkerExtension


class DictWorker(WeightSyncWorkerExtension):
    def __init__(self) -> None:
        self.rank = 0
        self.loaded: dict[str, torch.Tensor] = {}
        self.num_loads = 0

    def reload_weights(self, weights_iterator) -> None:
        self.num_loads += 1
        for name, tensor in weights_iterator:
            self.loaded[name] = tensor.clone()

    def refresh_packed_embeddings(self) -> int:
        return 0  # no vLLM model here

    def _ws_model_device(self) -> torch.device:
        return torch.device("cpu")


class ThreadEngine:
    """Engine double with the `SyncEngine` surface; logs pause/resume/version calls into `events`."""

    def __init__(self, engine_id: str, events: list[tuple[str, str]] | None = None) -> None:
        self.engine_id = engine_id
        self.policy_version = 0
        self.worker = DictWorker()
        self.events = events if events is not None else []

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout=None) -> list[Any]:
        return [await asyncio.to_thread(getattr(self.worker, method), *args, **(kwargs or {}))]

    async def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self.events.append((self.engine_id, f"pause:{PauseMode(mode)}"))

    async def resume(self) -> None:
        self.events.append((self.engine_id, "resume"))

    async def set_policy_version(self, policy_version: int) -> None:
        self.events.append((self.engine_id, f"version:{policy_version}"))
        self.policy_version = policy_version


class NeverJoinsEngine(ThreadEngine):
    """A dead peer: answers cheap RPCs but never joins the weight group."""

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout=None) -> list[Any]:
        if method == "init_weight_group":
            await asyncio.sleep(3600)
        return await super().collective_rpc(method, args, kwargs, timeout)


class RecordingWorkers:
    def __init__(self, events: list[tuple[str, str]], *, fail_pause: bool = False) -> None:
        self.events = events
        self.fail_pause = fail_pause

    async def pause(self) -> None:
        self.events.append(("workers", "pause"))
        if self.fail_pause:
            raise RuntimeError("a rollout worker crashed while parking")

    async def resume(self) -> None:
        self.events.append(("workers", "resume"))


def toy_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(33, 8, generator=g)),
        ("layer.0.weight", torch.randn(8, 8, generator=g)),
        ("layer.0.bias", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd byte count, 2nd dtype
        ("norm.weight", torch.randn(3, generator=g)),
        ("count", torch.arange(5, dtype=torch.int64)),
    ]
