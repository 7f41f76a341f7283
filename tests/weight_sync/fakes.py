"""In-process stand-ins for engines: a real `WeightSyncWorkerExtension` (real gloo group, real staging,
checksums and commit) whose vLLM `reload_weights` is replaced by a dict, behind a `FakeEngine` whose
`collective_rpc` runs each call in a thread like vLLM's engine-core process would (so pause, commit
and resume go through the real `SyncFence`). Plus dead peers (one that never joins the weight group,
one whose actor died, one that never answers), `ActorLike` (Ray call semantics: a caller's timeout
does not stop the call) and a recording `PausableWorkers`."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import torch

from streamrl.engines.base import PauseMode
from streamrl.engines.fake import FakeEngine
from streamrl.weight_sync.worker_extension import WeightSyncWorkerExtension


class DictWorker(WeightSyncWorkerExtension):
    """`reload_delay_s` makes a load slow; `fail_loads` makes that many loads raise after copying
    half of the tensors (a load that dies midway)."""

    def __init__(self) -> None:
        self.rank = 0
        self.loaded: dict[str, torch.Tensor] = {}
        self.num_loads = 0
        self.reload_delay_s = 0.0
        self.fail_loads = 0

    def reload_weights(self, weights_iterator) -> None:
        import time

        time.sleep(self.reload_delay_s)
        self.num_loads += 1
        weights = list(weights_iterator)
        if self.fail_loads > 0:
            self.fail_loads -= 1
            for name, tensor in weights[: len(weights) // 2]:
                self.loaded[name] = tensor.clone()
            raise RuntimeError("reload died midway")
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()

    def refresh_packed_embeddings(self) -> int:
        return 0  # no vLLM model here

    def _ws_model_device(self) -> torch.device:
        return torch.device("cpu")


class ThreadEngine(FakeEngine):
    """FakeEngine over one `DictWorker`; logs pause/resume/version events into `events`."""

    def __init__(self, engine_id: str, events: list[tuple[str, str]] | None = None) -> None:
        super().__init__(engine_id)
        self.worker = DictWorker()
        self.events = events if events is not None else []

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, timeout=None
    ) -> list[Any]:
        return [await asyncio.to_thread(getattr(self.worker, method), *args, **(kwargs or {}))]

    async def pause(self, mode: PauseMode = PauseMode.ABORT, **kwargs) -> None:
        self.events.append((self.engine_id, f"pause:{PauseMode(mode)}"))
        await super().pause(mode, **kwargs)

    async def resume(self, **kwargs) -> None:
        self.events.append((self.engine_id, "resume"))
        await super().resume(**kwargs)

    async def commit_weights(self, policy_version: int, **kwargs) -> None:
        await super().commit_weights(policy_version, **kwargs)
        self.events.append((self.engine_id, f"version:{policy_version}"))


class NeverJoinsEngine(ThreadEngine):
    """A dead peer: answers cheap RPCs but never joins the weight group."""

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, timeout=None
    ) -> list[Any]:
        if method == "init_weight_group":
            await asyncio.sleep(3600)
        return await super().collective_rpc(method, args, kwargs, timeout)


class ActorDiedError(RuntimeError):
    """Stands in for `ray.exceptions.RayActorError`."""


class DyingEngine(ThreadEngine):
    """Alive until `die()`; then every call raises like a dead Ray actor (`hang=False`) or never
    answers (`hang=True`)."""

    def __init__(self, engine_id: str, events: list[tuple[str, str]] | None = None, *, hang: bool = False) -> None:
        super().__init__(engine_id, events)
        self.hang = hang
        self.dead = False

    def die(self) -> None:
        self.dead = True

    async def _gone(self) -> None:
        if self.dead:
            if self.hang:
                await asyncio.sleep(3600)
            raise ActorDiedError(f"the actor of engine {self.engine_id} died")

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, timeout=None
    ) -> list[Any]:
        await self._gone()
        return await super().collective_rpc(method, args, kwargs, timeout)

    async def pause(self, mode: PauseMode = PauseMode.ABORT, **kwargs) -> None:
        await self._gone()
        await super().pause(mode, **kwargs)

    async def resume(self, **kwargs) -> None:
        await self._gone()
        await super().resume(**kwargs)

    async def commit_weights(self, policy_version: int, **kwargs) -> None:
        await self._gone()
        await super().commit_weights(policy_version, **kwargs)

    async def ping(self) -> int:
        await self._gone()
        return await super().ping()


class ActorLike:
    """Ray actor call semantics around an in-process engine: every coroutine method runs as its own
    task, so a caller that times out (asyncio.wait_for) stops waiting but the call still completes.
    `call_delays[method]` delays the start of that method's calls (a call stuck in the actor's queue)."""

    def __init__(self, engine: Any, *, call_delays: dict[str, float] | None = None) -> None:
        self._engine = engine
        self._delays = dict(call_delays or {})
        self.calls: list[asyncio.Task] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            async def run() -> Any:
                await asyncio.sleep(self._delays.get(name, 0.0))
                return await attr(*args, **kwargs)

            task = asyncio.ensure_future(run())
            self.calls.append(task)
            return await asyncio.shield(task)

        return call

    async def settle(self) -> None:
        """Wait until every call made so far has finished on the 'actor'."""
        await asyncio.gather(*self.calls, return_exceptions=True)


class RecordingWorkers:
    def __init__(self, events: list[tuple[str, str]], *, fail_pause: bool = False) -> None:
        self.events = events
        self.fail_pause = fail_pause
        self.epochs: list[tuple[str, int | None]] = []

    async def pause(self, epoch: int | None = None) -> None:
        self.events.append(("workers", "pause"))
        self.epochs.append(("pause", epoch))
        if self.fail_pause:
            raise RuntimeError("a rollout worker crashed while parking")

    async def resume(self, epoch: int | None = None) -> None:
        self.events.append(("workers", "resume"))
        self.epochs.append(("resume", epoch))


def toy_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(33, 8, generator=g)),
        ("layer.0.weight", torch.randn(8, 8, generator=g)),
        ("layer.0.bias", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd byte count, 2nd dtype
        ("norm.weight", torch.randn(3, generator=g)),
        ("count", torch.arange(5, dtype=torch.int64)),
    ]


class PauseWhen:
    """A rollout worker as the coordinator sees it, whose pause waits until `ready()` holds.

    A real-engine test that needs a sync to land in a given state (a loop mid-generation, a cell
    running) cannot get it by polling before `coordinator.sync`: the weights are staged first while
    generation goes on, and by the pause the state may be gone. Here the check and the worker's
    cancel happen in one step of the event loop (`RolloutWorker.pause` sets its Event before its first
    await), so the pause lands in the state `ready` saw; `at_pause()` runs at that moment too. Only the
    first pause waits; later ones (the sync restoring the weights) go straight through."""

    def __init__(self, worker: Any, ready: Any, at_pause: Any = None, timeout_s: float = 20.0) -> None:
        self.worker, self.ready, self.at_pause, self.timeout_s = worker, ready, at_pause, timeout_s
        self.fired = False

    async def pause(self, epoch: int | None = None) -> None:
        if self.fired:
            return await self.worker.pause(epoch=epoch)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while not self.ready():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the state the test syncs in did not come within {self.timeout_s}s")
            await asyncio.sleep(0.002)
        self.fired = True
        if self.at_pause is not None:
            self.at_pause()
        await self.worker.pause(epoch=epoch)

    async def resume(self, epoch: int | None = None) -> None:
        await self.worker.resume(epoch=epoch)
