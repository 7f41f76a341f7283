"""Engines in other processes or nodes: `EngineActor` (a Ray async actor hosting one engine: a
`VLLMEngine`, or a `ServerEngine` client of an inference server)
and `RayEngineClient` (the `InferenceEngine` interface, implemented by awaiting actor calls).

The actor is async with a high `max_concurrency`, so `abort` / `pause` run while `generate` calls
are pending in the same actor. Every remote call is awaited with a timeout; a `generate` that
times out is aborted on the actor and surfaces as `TimeoutError` (the `ServerManager` then treats
the engine as unhealthy). Construction is lazy: `launch` returns at once and the first call waits
for the engine to come up (bounded by `startup_timeout_s`).

A call that times out at the client keeps running on the actor: weight-sync calls carry the sync's
fencing token (`epoch`) so such late calls are harmless (`SyncFence` in the engine).

`stats()` is synchronous by interface, so the client reports what it observes itself (its requests
in flight, tokens, aborts); `remote_stats()` asks the actor for the engine's own numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from streamrl.core import trace
from streamrl.engines.base import (
    EngineCounters,
    EngineStats,
    GenerationOutput,
    ImageInput,
    InferenceEngine,
    PauseMode,
    SamplingParams,
)
from streamrl.engines.config import EngineConfig

if TYPE_CHECKING:
    from streamrl.streaming.config import ActorTimeouts

logger = logging.getLogger(__name__)

MAX_CONCURRENCY = 4096  # concurrent actor calls: every in-flight generate holds one slot
_IDS_KEPT = 65536  # request ids remembered for the abort-before-generate race


def _remember(lru: OrderedDict[str, None], key: str) -> None:
    lru[key] = None
    lru.move_to_end(key)
    while len(lru) > _IDS_KEPT:
        lru.popitem(last=False)


class EngineActor:
    """Ray async actor body: one engine (`make_engine`) per actor process (wrap with `ray.remote` to use)."""

    def __init__(self, cfg: EngineConfig, engine_id: str, policy_version: int = 0, weights: str | None = None) -> None:
        """`weights`: a folder the engine serves as `policy_version` before it answers any call (a resumed
        run's checkpoint). An in-process engine builds its model from `cfg.model`, which names it too; a
        server serves what it was started with, so a server engine loads it into its server first."""
        self._cfg = cfg
        self._engine_id = engine_id
        self._policy_version = policy_version
        self._weights = weights
        self._engine: Any = None
        self._starting: asyncio.Task[Any] | None = None
        # Aborts that arrived before their generate (calls may interleave in an async actor) are
        # honoured when the generate shows up; ids already started are never recorded, so an abort
        # of a finished request cannot hit a later request reusing its id.
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._started_ids: OrderedDict[str, None] = OrderedDict()
        self._in_flight = 0  # generate calls running: the lifecycle trace's `busy` spans
        self._busy_since = 0.0
        self._busy_requests = 0

    async def start(self) -> str:
        """Build the engine (idempotent; concurrent callers share one build). Returns the device."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._build())
        await self._starting
        return self._engine.device

    async def _build(self) -> None:
        from streamrl.engines import make_engine

        if self._cfg.cpu_cores is not None:  # before vLLM starts its threads (it fixes torch's pool size)
            from streamrl.streaming.placement import pin_part

            pin_part(self._cfg.cpu_cores)
        engine = make_engine(self._cfg, self._engine_id, policy_version=self._policy_version)
        if self._weights is not None and not self._cfg.builds_model:
            # every call awaits this build: nothing is sampled under the label before the weights are in
            await engine.load_weights_from_path(self._weights, self._policy_version)
        self._engine = engine

    async def _ready(self) -> Any:
        await self.start()
        return self._engine

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput] | None = None
    ) -> GenerationOutput:
        from streamrl.core.faults import hit

        hit("engine.generate")
        engine = await self._ready()
        _remember(self._started_ids, request_id)
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            return GenerationOutput(
                token_ids=[], logprobs=[], policy_versions=[], finish_reason="abort", num_prompt_tokens=len(prompt_ids)
            )
        self._request_started()
        try:
            return await engine.generate(request_id, prompt_ids, sampling, images=images)
        finally:
            self._request_ended()

    async def score(self, request_id: str, token_ids: list[int], start: int) -> list[float]:
        engine = await self._ready()
        self._request_started()
        try:
            return await engine.score(request_id, token_ids, start)
        finally:
            self._request_ended()

    def _request_started(self) -> None:
        if self._in_flight == 0:
            self._busy_since, self._busy_requests = time.time(), 0
        self._in_flight += 1
        self._busy_requests += 1

    def _request_ended(self) -> None:
        """A busy span ends when the last request in flight ends (the engine had work throughout)."""
        self._in_flight -= 1
        if self._in_flight == 0:
            trace.complete("busy", "engine", self._engine_id, self._busy_since, requests=self._busy_requests)

    async def abort(self, request_id: str) -> None:
        engine = await self._ready()
        if engine.has_request(request_id):
            await engine.abort(request_id)
        elif request_id not in self._started_ids:
            _remember(self._early_aborts, request_id)

    async def pause(self, mode: str = PauseMode.ABORT, epoch: int | None = None) -> None:
        from streamrl.core.faults import hit

        hit("sync.pause")
        await (await self._ready()).pause(PauseMode(mode), epoch=epoch)

    async def resume(self, epoch: int | None = None) -> None:
        await (await self._ready()).resume(epoch=epoch)

    async def commit_weights(self, policy_version: int, epoch: int, timeout_s: float | None = None) -> None:
        from streamrl.core.faults import hit

        hit("sync.commit")
        await (await self._ready()).commit_weights(policy_version, epoch=epoch, timeout_s=timeout_s)

    async def ping(self) -> int:
        return await (await self._ready()).ping()

    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        await (await self._ready()).load_weights_from_path(path, policy_version)

    async def set_policy_version(self, policy_version: int) -> None:
        await (await self._ready()).set_policy_version(policy_version)

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        return await (await self._ready()).collective_rpc(method, args=args, kwargs=kwargs, timeout=timeout)

    async def reset_prefix_cache(self) -> bool:
        return await (await self._ready()).reset_prefix_cache()

    async def stats(self) -> EngineStats:
        return (await self._ready()).stats()

    async def node_id(self) -> str:
        """The Ray node this actor runs on (the driver records placement in RUN_DIR/placement.json)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This engine's process id (where its threads' placement can be read, `/proc/<pid>/task`)."""
        import os

        return os.getpid()

    async def memory(self) -> dict[str, float]:
        """`memory/engine_peak_gb`: this part's peak since it started (`core.memory.part_memory`)."""
        from streamrl.core.memory import part_memory

        return part_memory("engine")

    async def shutdown(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown()
            self._engine = None
            self._starting = None


class RayEngineClient(InferenceEngine):
    """`InferenceEngine` backed by an `EngineActor` handle: the one client of an engine actor.

    Rollout workers, the weight sync and the held-out evaluation generate through it (each call
    waits for the engine to be up, then `call_timeout_s`); the driver also probes the actor with it
    (`actor_stats`, `memory`, `node_id`: never waiting for the engine to load, bounded by
    `trainer.actor_timeouts`) and ends it (`kill`)."""

    def __init__(
        self,
        actor: Any,
        engine_id: str,
        *,
        cfg: EngineConfig,
        policy_version: int = 0,
        timeouts: ActorTimeouts | None = None,
    ) -> None:
        from streamrl.streaming.config import ActorTimeouts

        self.actor = actor
        self.engine_id = engine_id
        self._acknowledged = policy_version
        self.cfg = cfg
        self.timeouts = timeouts or ActorTimeouts()
        self._started: asyncio.Future[Any] | None = None
        self.counters = EngineCounters()

    @property
    def handle(self) -> Any:
        return self.actor

    @property
    def policy_version(self) -> int:  # type: ignore[override]
        """The label the engine actor last acknowledged (a commit, a load, a relabel or a ping answered):
        a read-only copy of what the engine holds, never a second owner of it."""
        return self._acknowledged

    async def _probe(self, method: str, timeout_s: float) -> Any:
        return await asyncio.wait_for(getattr(self.actor, method).remote(), timeout_s)

    async def actor_stats(self) -> EngineStats:
        """The actor's own stats (liveness: a dead actor raises `RayActorError`)."""
        return await self._probe("stats", self.timeouts.query_s)

    async def memory(self) -> dict[str, float]:
        """`memory/engine_peak_gb` of the actor's process and its children."""
        return await self._probe("memory", self.timeouts.probe_s)

    async def node_id(self) -> str:
        return await self._probe("node_id", self.timeouts.query_s)

    def kill(self) -> None:
        """End the actor now, without restart."""
        import ray

        ray.kill(self.actor, no_restart=True)

    @classmethod
    def launch(
        cls,
        cfg: EngineConfig,
        engine_id: str,
        *,
        policy_version: int = 0,
        weights: str | None = None,
        timeouts: ActorTimeouts | None = None,
    ) -> RayEngineClient:
        """Create the actor (needs `ray.init` done); returns without waiting for the engine to load.
        `weights`: what it serves as `policy_version` before its first call (`EngineActor`)."""
        import ray

        actor_cls = ray.remote(EngineActor).options(
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            resources=cfg.resources or None,
            max_concurrency=MAX_CONCURRENCY,
        )
        actor = actor_cls.remote(cfg, engine_id, policy_version, weights)
        return cls(actor, engine_id, cfg=cfg, policy_version=policy_version, timeouts=timeouts)

    async def _call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        await self.wait_ready()
        ref = getattr(self.actor, method).remote(*args, **kwargs)
        return await asyncio.wait_for(ref, timeout or self.cfg.call_timeout_s)

    async def wait_ready(self) -> str:
        """Wait (bounded by `startup_timeout_s`) until the actor's engine is up; returns its device."""
        if self._started is None:
            self._started = asyncio.ensure_future(
                asyncio.wait_for(self.actor.start.remote(), self.cfg.startup_timeout_s)
            )
        return await asyncio.shield(self._started)

    async def _generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, images: list[ImageInput]
    ) -> GenerationOutput:
        try:  # image bytes travel in the call (~tens of KB each)
            return await self._call("generate", request_id, list(prompt_ids), sampling, images or None)
        except TimeoutError:
            try:  # don't leave the request running on the actor; keep the timeout as the error
                await self._call("abort", request_id, timeout=30.0)
            except Exception as exc:  # fault boundary: the actor may be wedged or dead
                logger.warning("engine %s: abort after timeout failed: %s", self.engine_id, exc)
            raise

    async def score(self, request_id: str, token_ids: list[int], start: int) -> list[float]:
        return await self._call("score", request_id, list(token_ids), start)

    async def abort(self, request_id: str) -> None:
        await self._call("abort", request_id)

    async def pause(self, mode: PauseMode = PauseMode.ABORT, *, epoch: int | None = None) -> None:
        await self._call("pause", str(PauseMode(mode)), epoch)

    async def resume(self, *, epoch: int | None = None) -> None:
        await self._call("resume", epoch)

    async def commit_weights(self, policy_version: int, *, epoch: int, timeout_s: float | None = None) -> None:
        call_timeout = None if timeout_s is None else timeout_s + 30.0  # the engine-side timeout fires first
        await self._call("commit_weights", policy_version, epoch, timeout_s, timeout=call_timeout)
        self._acknowledged = policy_version

    async def ping(self) -> int:
        self._acknowledged = await self._call("ping")
        return self._acknowledged

    async def load_weights_from_path(self, path: str, policy_version: int) -> None:
        await self._call("load_weights_from_path", str(path), policy_version)
        self._acknowledged = policy_version

    async def set_policy_version(self, policy_version: int) -> None:
        await self._call("set_policy_version", policy_version)
        self._acknowledged = policy_version

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        call_timeout = None if timeout is None else timeout + 30.0  # the worker-side timeout fires first
        return await self._call("collective_rpc", method, tuple(args), kwargs, timeout, timeout=call_timeout)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def remote_stats(self) -> EngineStats:
        return await self._call("stats")

    async def shutdown(self) -> None:
        """Shut the engine down and end the actor process."""
        import ray

        try:
            await asyncio.wait_for(self.actor.shutdown.remote(), 60.0)
        except Exception as exc:  # fault boundary: the actor may already be dead; kill it anyway
            logger.warning("engine %s shutdown failed: %s", self.engine_id, exc)
        ray.kill(self.actor, no_restart=True)


# The version an engine launched during a run announces until a sync commits the current weights in
# it: below every real label, so routing never takes it for a current engine (`streaming.elastic`).
JOINING_VERSION = -1


def engine_clients(
    handles: list[Any], cfg: EngineConfig, policy_version: int = 0, ids: list[str] | None = None
) -> list[RayEngineClient]:
    """One client per engine actor, named by `ids`, else `engine-{i}` in the order of `handles` (the
    name the sync, the routing and the rollout workers all use)."""
    names = ids if ids is not None else [f"engine-{i}" for i in range(len(handles))]
    if len(names) != len(handles):
        raise ValueError(f"{len(handles)} engine handles for {len(names)} ids")
    return [RayEngineClient(h, n, cfg=cfg, policy_version=policy_version) for n, h in zip(names, handles, strict=True)]
