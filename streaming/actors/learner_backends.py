"""The two learners behind `LearnerActor`: one process, or an FSDP2 group of Ray actors.

`LocalLearner` (`learner.num_workers = 1`): the `TrainingEngine` and the `WeightPublisher` live in
the LearnerActor's own process; the sync reads the live parameters (no copy).

`GroupLearner` (`learner.num_workers > 1`): a `LearnerGroup` whose rank 0 is a
`PublishingLearnerWorker`, i.e. learner rank 0 is also rank 0 of the weight-sync transport. A
publish is one lockstep call on every rank: rank 0 iterates `named_parameters_for_sync()` (each
parameter is all-gathered on its own) keeping the full tensors, ranks 1..M-1 iterate the same
gathers and drop each result at once, then rank 0 alone runs the transactional sync (pause ->
broadcast -> verify -> commit -> resume). Only rank 0 ever holds unsharded weights, once, and in
the engines' dtype when they serve bf16/fp16 (halving that copy and the bytes on the wire; the
engines would round identically on load). The gathers are bounded by the process-group timeout,
every sync phase by `weight_sync.timeouts`, and every await here by `trainer.step_timeout_s`.

Neither keeps the served policy_version: the `WeightPublisher` holds it (in this process, or in
rank 0's) and decides whether a target is new; both ask it, and return its `Published` records.

Both expose the same async methods; LearnerActor picks one at construction. After every train step
each learner process trims its allocator and reports `memory/learner_peak_gb` and
`memory/learner_rss_gb` (`core/memory.py`; a group reports its fullest rank).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from streamrl.core.aio import gather_within
from streamrl.learner.group import LearnerWorker
from streamrl.learner.types import StepResult
from streamrl.weight_sync.types import Published

if TYPE_CHECKING:
    from streamrl.engines.config import EngineConfig
    from streamrl.learner.config import LearnerConfig
    from streamrl.streaming.config import StreamRLConfig
    from streamrl.weight_sync.config import WeightSyncConfig
    from streamrl.weight_sync.publisher import WeightPublisher
    from streamrl.weight_sync.types import AdapterSpec

logger = logging.getLogger(__name__)

_LOW_PRECISION = ("bfloat16", "float16")


def adapter_spec(cfg: LearnerConfig) -> AdapterSpec | None:
    """What a publish tells the engines about its tensors: a LoRA adapter's peft config with
    `learner.lora.sync = "adapter"` (they are its A and B), else None (full or merged weights)."""
    from streamrl.learner.config import LoraSync
    from streamrl.weight_sync.types import AdapterSpec

    lora = cfg.lora
    if lora is None or lora.sync is not LoraSync.ADAPTER:
        return None
    return AdapterSpec(rank=lora.rank, alpha=lora.alpha, target_modules=list(lora.target_modules))


class LocalLearner:
    """One process: the training engine and rank 0 of weight sync."""

    async def node_ids(self) -> list[str]:
        import ray

        return [ray.get_runtime_context().get_node_id()]

    def __init__(self, cfg: StreamRLConfig, init_checkpoint: str | None) -> None:
        from streamrl.learner.engine import TrainingEngine

        self.cfg = cfg
        self.engine = TrainingEngine(cfg.learner)
        if init_checkpoint is not None:
            self.engine.load_checkpoint(init_checkpoint)
        self.publisher: WeightPublisher | None = None

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def set_policy_version(self, version: int) -> None:
        self.engine.policy_version = version

    @property
    def model_path(self) -> str:
        return str(self.engine.model_path)

    async def train_step(self, padded: Any) -> StepResult:
        from streamrl.core.memory import end_of_step

        result = self.engine.step(padded)
        return replace(result, metrics=result.metrics | end_of_step(str(self.engine.device)))

    async def connect(self, engines: list[Any], workers: list[Any], policy_version: int) -> None:
        from streamrl.streaming.actors.engine import engine_clients
        from streamrl.weight_sync.publisher import WeightPublisher

        cfg = self.cfg
        clients = engine_clients(engines, cfg.rollout.engine, policy_version)
        self.publisher = WeightPublisher(cfg.weight_sync, clients, workers)

    async def set_workers(self, workers: list[Any]) -> None:
        assert self.publisher is not None, "connect() first"
        self.publisher.set_workers(workers)

    async def add_engines(self, engines: list[Any], ids: list[str]) -> list[str]:
        from streamrl.streaming.actors.engine import JOINING_VERSION, engine_clients

        assert self.publisher is not None, "connect() first"
        return await self.publisher.add_engines(engine_clients(engines, self.cfg.rollout.engine, JOINING_VERSION, ids))

    async def remove_engines(self, ids: list[str]) -> list[str]:
        assert self.publisher is not None, "connect() first"
        return await self.publisher.remove_engines(ids)

    async def publish(self) -> Published:
        from streamrl.core.memory import trim_allocator

        assert self.publisher is not None, "connect() first"
        tensors, version = self.engine.named_parameters_for_sync(), self.engine.policy_version
        try:
            return await self.publisher.publish(tensors, version, adapter=adapter_spec(self.cfg.learner))
        finally:
            trim_allocator()  # staging buffers of the sync go back to the OS before the next step

    async def unchanged(self) -> Published:
        """What a publish that sends nothing returns (`WeightPublisher.unchanged`)."""
        assert self.publisher is not None, "connect() first"
        return self.publisher.unchanged()

    async def start_checkpoint(self, path: str) -> None:
        self.engine.start_checkpoint(path)

    async def finish_checkpoint(self) -> str | None:
        return await asyncio.to_thread(self.engine.finish_checkpoint)  # the actor answers meanwhile

    async def checkpoint_busy(self) -> bool:
        return self.engine.checkpoint_busy

    async def save_hf(self, path: str) -> None:
        self.engine.save_hf(path)

    async def shutdown(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()


class PublishingLearnerWorker(LearnerWorker):
    """Learner rank 0 that is also rank 0 of weight sync (a Ray actor, like every rank).

    Sync actor with a private event loop for the coordinator, kept across publishes because the
    engine clients and the transport's group are bound to it."""

    def __init__(self, cfg: LearnerConfig, rank: int, world_size: int) -> None:
        super().__init__(cfg, rank, world_size)
        self.publisher: WeightPublisher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync_dtype: str | None = None  # the engines' dtype when lower than the learner's fp32

    def connect(
        self,
        sync_cfg: WeightSyncConfig,
        engine_cfg: EngineConfig,
        engines: list[Any],
        workers: list[Any],
        policy_version: int,
    ) -> None:
        from streamrl.streaming.actors.engine import engine_clients
        from streamrl.weight_sync.publisher import WeightPublisher

        self.close_publisher()
        self._loop = asyncio.new_event_loop()
        self.publisher = WeightPublisher(sync_cfg, engine_clients(engines, engine_cfg, policy_version), workers)
        self._sync_dtype = engine_cfg.dtype if engine_cfg.dtype in _LOW_PRECISION else None

    def set_workers(self, workers: list[Any]) -> None:
        assert self.publisher is not None, "connect() first"
        self.publisher.set_workers(workers)

    def add_engines(self, engine_cfg: EngineConfig, engines: list[Any], ids: list[str]) -> list[str]:
        from streamrl.streaming.actors.engine import JOINING_VERSION, engine_clients

        assert self.publisher is not None and self._loop is not None, "connect() first"
        clients = engine_clients(engines, engine_cfg, JOINING_VERSION, ids)
        return self._loop.run_until_complete(self.publisher.add_engines(clients))

    def remove_engines(self, ids: list[str]) -> list[str]:
        assert self.publisher is not None and self._loop is not None, "connect() first"
        return self._loop.run_until_complete(self.publisher.remove_engines(ids))

    def publish(self, target: int) -> Published:
        """Gather (collective: ranks 1..M-1 run `LearnerWorker.join_sync_gather` now), then sync as `target`."""
        import torch

        assert self.publisher is not None and self._loop is not None, "connect() first"

        started = time.monotonic()
        dtype = getattr(torch, self._sync_dtype) if self._sync_dtype else None
        tensors = [(n, t.to(dtype) if dtype is not None else t) for n, t in self.engine.named_parameters_for_sync()]
        gather_s = time.monotonic() - started
        try:
            published = self._loop.run_until_complete(self.publisher.publish(tensors, target))
        finally:
            del tensors  # the only unsharded copy; free it before training resumes
        return replace(published, metrics={**published.metrics, "sync/gather_s": gather_s})

    def nothing_new(self, target: int) -> Published | None:
        """`WeightPublisher.nothing_new`: asked before a publish, so that every rank gathers or none does."""
        assert self.publisher is not None, "connect() first"
        return self.publisher.nothing_new(target)

    def unchanged(self) -> Published:
        assert self.publisher is not None, "connect() first"
        return self.publisher.unchanged()

    def close_publisher(self) -> None:
        """Release the weight-sync group (engines drop their side too); safe to call twice."""
        publisher, loop, self.publisher, self._loop = self.publisher, self._loop, None, None
        if publisher is not None and loop is not None:
            try:
                loop.run_until_complete(publisher.close())
            finally:
                loop.close()

    def shutdown(self) -> None:
        try:
            self.close_publisher()
        finally:
            super().shutdown()


class GroupLearner:
    """An FSDP2 `LearnerGroup` of `learner.num_workers` Ray actors; see the module docstring."""

    def __init__(self, cfg: StreamRLConfig, init_checkpoint: str | None) -> None:
        from streamrl.learner.group import LearnerGroup

        self.cfg = cfg
        self.timeout_s = cfg.trainer.step_timeout_s
        from streamrl.core.memory import MALLOC_ENV

        self.group = LearnerGroup(
            cfg.learner, timeout_s=self.timeout_s, rank0_cls=PublishingLearnerWorker, env_vars=MALLOC_ENV
        )
        if init_checkpoint is not None:
            self.group.load_checkpoint(init_checkpoint)

    @property
    def policy_version(self) -> int:
        return self.group.policy_version

    async def set_policy_version(self, version: int) -> None:
        self.group.set_policy_version(version)

    @property
    def model_path(self) -> str:
        return str(self.group.model_path)

    async def _wait(self, refs: list[Any]) -> list[Any]:
        return await gather_within(refs, self.timeout_s)

    async def train_step(self, padded: Any) -> StepResult:
        import ray

        result = (await self._wait(self.group.start_train_step(ray.put(padded))))[0]
        self.group.policy_version = result.policy_version
        ranks = await self._wait(self.group.start_end_of_step_memory())
        memory = {key: max(r[key] for r in ranks) for key in ranks[0]}  # the fullest rank
        return replace(result, metrics=result.metrics | memory)

    async def connect(self, engines: list[Any], workers: list[Any], policy_version: int) -> None:
        ref = self.group.rank0.connect.remote(
            self.cfg.weight_sync,
            self.cfg.rollout.engine,
            engines,
            workers,
            policy_version,
        )
        await self._wait([ref])

    async def set_workers(self, workers: list[Any]) -> None:
        await self._wait([self.group.rank0.set_workers.remote(workers)])

    async def add_engines(self, engines: list[Any], ids: list[str]) -> list[str]:
        return (await self._wait([self.group.rank0.add_engines.remote(self.cfg.rollout.engine, engines, ids)]))[0]

    async def remove_engines(self, ids: list[str]) -> list[str]:
        return (await self._wait([self.group.rank0.remove_engines.remote(ids)]))[0]

    async def node_ids(self) -> list[str]:
        return await self._wait(self.group.start_node_ids())

    async def publish(self) -> Published:
        target = self.group.policy_version
        # rank 0's publisher decides before any rank gathers, so that every rank gathers or none does
        (same,) = await self._wait([self.group.rank0.nothing_new.remote(target)])
        if same is not None:
            return same
        refs = [self.group.rank0.publish.remote(target)]
        refs += self.group.start_join_sync_gather()
        published, *_ = await self._wait(refs)
        return published

    async def unchanged(self) -> Published:
        return (await self._wait([self.group.rank0.unchanged.remote()]))[0]

    async def start_checkpoint(self, path: str) -> None:
        await self._wait(self.group.start_snapshot(path))

    async def finish_checkpoint(self) -> str | None:
        return (await self._wait([self.group.rank0.finish_checkpoint.remote()]))[0]

    async def checkpoint_busy(self) -> bool:
        return (await self._wait([self.group.rank0.checkpoint_busy.remote()]))[0]

    async def save_hf(self, path: str) -> None:
        await self._wait(self.group.start_save_hf(path))

    async def shutdown(self) -> None:
        try:
            await self._wait(self.group.start_shutdown())
        finally:
            self.group.kill()
