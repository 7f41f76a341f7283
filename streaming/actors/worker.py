"""RolloutWorkerActor: a Ray actor hosting one `RolloutWorker` and everything its loops need.

Built from the resolved config (JSON) so it can start on any node. Its engines are `EngineActor`s
reached through `RayEngineClient`; its sink appends each trajectory to the `BufferActor` as an Arrow
RecordBatch passed by object ref. The learner's weight-sync coordinator pauses and resumes it. With
`[distill]` it also holds the teacher's engines (`rollout.teacher.TeacherScorer`), which score each
finished trajectory before its row is appended.

Images (a VLM policy, `rollout.engine.max_images_per_prompt > 0`): the worker loads the processor and
keeps an in-memory `ImageStore`; every row it appends carries its images' bytes (`ImageBlob`s, the
buffer keeps one copy per hash, so re-sending is cheap and never depends on what the buffer still
has after a restart), and a parked trajectory resumed here whose images it never saw gets them from
the buffer's image log (`BufferActor.get_images`) before its first generate.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from streamrl.rollout.types import AgentData, RolloutOutcomes
    from streamrl.streaming.config import StreamRLConfig

logger = logging.getLogger(__name__)

# The worker's in-memory images beyond those its trajectories hold (an LRU cache: rollout/images.py).
IMAGE_STORE_MAX_BYTES = 256 * 1024 * 1024


def build_agent_context(cfg: Any, model_path: str, server: Any) -> Any:
    """Tokenizer, observation encoder, tools, parser, interactions and reward for one worker."""
    from transformers import AutoTokenizer

    from streamrl.rollout.agent_loop import AgentContext
    from streamrl.rollout.agent_loop.observation import ObservationEncoder
    from streamrl.rollout.interactions import load_interaction_config
    from streamrl.rollout.parsers import get_parser
    from streamrl.rollout.rewards import get_reward_fn
    from streamrl.tools.config import load_tool_config

    agent = cfg.rollout.agent
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = images = None
    if cfg.rollout.engine.max_images_per_prompt > 0:  # a VLM policy: image prompts are rendered here
        from transformers import AutoProcessor

        from streamrl.rollout.images import ImageStore

        processor, images = AutoProcessor.from_pretrained(model_path), ImageStore()
    tools = load_tool_config(agent.tool_config) if agent.tool_config else None
    interactions = load_interaction_config(agent.interaction_config) if agent.interaction_config else {}
    return AgentContext(
        cfg=agent,
        server=server,
        tokenizer=tokenizer,
        encoder=ObservationEncoder(tokenizer),
        tools=tools,
        parser=get_parser(agent.tool_parser),
        interactions=interactions,
        reward_fn=get_reward_fn(agent.reward_fn),
        processor=processor,
        images=images,
        max_images=cfg.rollout.engine.max_images_per_prompt if processor is not None else None,
    )


def image_blobs(store: Any, traj: Any) -> list | None:
    """The `ImageBlob`s of a row's `image_refs` (None for a text row: the append call is unchanged)."""
    if not traj.image_refs:
        return None
    from streamrl.buffer.types import ImageBlob

    return [ImageBlob.from_ref(store.ref(sha), store.get(sha)) for sha in dict.fromkeys(traj.image_refs)]


def teacher_scorer(cfg: Any, teachers: dict[str, Any]) -> Any:
    """The worker's `TeacherScorer` over the teacher's engine actors (id -> handle); None without
    `[distill]`. Its own `ServerManager`: routing and health apart from the rollout engines'."""
    if cfg.distill is None:
        return None
    if not teachers:
        raise ValueError("[distill] is set but the worker was given no teacher engine")
    from streamrl.rollout.server_manager import ServerManager
    from streamrl.rollout.teacher import TeacherScorer
    from streamrl.streaming.actors.engine import engine_clients

    clients = engine_clients(list(teachers.values()), cfg.distill.engine, ids=list(teachers))
    return TeacherScorer(ServerManager(clients))


@ray.remote
class RolloutWorkerActor:
    def __init__(
        self,
        worker_id: str,
        cfg: StreamRLConfig,
        model_path: str,
        engines: list,
        buffer: Any,
        engine_ids: list[str] | None = None,
        keep_out: list[str] | None = None,
        teachers: dict[str, Any] | None = None,
    ) -> None:
        from streamrl.engines.base import PauseMode
        from streamrl.rollout.server_manager import ServerManager
        from streamrl.rollout.worker import RolloutWorker
        from streamrl.streaming.actors.clients import BufferClient
        from streamrl.streaming.actors.engine import engine_clients

        logging.basicConfig(level=logging.INFO)
        self.append_timeout_s = 120.0
        self.buffer = BufferClient(buffer, timeout_s=60.0)  # + the wait of each append for room
        clients = engine_clients(engines, cfg.rollout.engine, ids=engine_ids)
        server = ServerManager(clients, max_sticky_keys=cfg.rollout.sticky_lru_size)
        for engine_id in keep_out or []:  # not yet serving the current version (or leaving): never routed to
            server.mark_unhealthy(engine_id, reason="kept out by the driver")
        self.engine_cfg = cfg.rollout.engine
        ctx = build_agent_context(cfg, model_path, server)
        ctx.snapshot = self._snapshot  # I5: tool intents are durable first
        ctx.append_journal = self._append_journal  # and the gateway's answers
        ctx.read_journal = self.buffer.journal
        ctx.fetch_images = self._fetch_images
        if ctx.tools is not None:
            from streamrl.core.faults import hit

            ctx.tools.on_executed = lambda call: hit("tool.after_run")
        self.server = server
        self.teacher = teacher_scorer(cfg, teachers or {})
        self.worker = RolloutWorker(
            ctx,
            self._sink,
            max_concurrent=cfg.rollout.max_concurrent_per_worker,
            pause_mode=PauseMode(cfg.weight_sync.pause_mode),
            worker_id=worker_id,
            teacher=self.teacher,
        )
        if ctx.images is not None:  # a cache from here on: what it evicts comes back from the buffer's image log
            ctx.images.max_bytes, ctx.images.pinned = IMAGE_STORE_MAX_BYTES, self.worker.image_shas

    async def _sink(self, traj: Any) -> bool:
        """Append one row; False when the buffer stayed full for `append_timeout_s` (the worker
        retries). A finished row waits for room; partial rows are always accepted at once."""
        from streamrl.core.faults import hit

        hit("worker.sink")
        images = image_blobs(self.worker.ctx.images, traj)
        accepted = await self.buffer.append_rows([traj], wait_s=self.append_timeout_s, images=images)
        hit("worker.after_sink")
        return accepted

    async def _snapshot(self, data: Any) -> None:
        """Make a trajectory's state durable (a partial row flushed to the buffer's log): its journaled
        tool intents before the tools run. Raising fails the trajectory; the tool never runs."""
        from streamrl.rollout.types import TrajectoryStatus

        ctx = self.worker.ctx
        row = data.to_trajectory(TrajectoryStatus.PARTIAL, image_token_id=ctx.image_token_id)
        images = image_blobs(ctx.images, row)
        ok = await self.buffer.append_rows([row], wait_s=self.append_timeout_s, durable=True, images=images)
        if not ok:
            raise RuntimeError(f"snapshot of {data.trajectory_id} was not made durable")

    async def _append_journal(self, record: Any) -> None:
        """Make one journal record durable (the gateway's answered call, before it is sent). Raising
        fails the trajectory; the answer is never sent."""
        await self.buffer.append_journal([record])

    async def _fetch_images(self, sha256s: list[str]) -> list[bytes]:
        """Bytes of images this worker lacks (a parked trajectory resumed here), from the buffer."""
        return await self.buffer.get_images(sha256s)

    async def submit(self, items: list[AgentData]) -> int:
        """Start (or resume) these trajectories; returns how many this worker runs now."""
        for data in items:
            self.worker.submit(data)
        return self.worker.num_running

    async def pause(self, epoch: int | None = None) -> None:
        await self.worker.pause(epoch=epoch)

    async def resume(self, epoch: int | None = None) -> None:
        await self.worker.resume(epoch=epoch)

    async def metrics(self) -> dict[str, float]:
        self.worker.check()
        return self.worker.metrics()

    async def node_id(self) -> str:
        """The Ray node this actor runs on (the driver records placement in RUN_DIR/placement.json)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def memory(self) -> dict[str, float]:
        """`memory/rollout_worker_peak_gb`: this part's peak since it started (`core.memory.part_memory`)."""
        from streamrl.core.memory import part_memory

        return part_memory("rollout_worker")

    async def route(self, keep_out: list[str]) -> list[str]:
        """Keep routing in line with weight sync (I6): engines in `keep_out` (dropped from the sync
        set, so they may serve stale or half-loaded weights) leave routing; every other unhealthy
        engine is pinged and rejoins once it answers at the newest policy_version. The teacher's
        engines (distillation) are probed alike. Returns the engines restored."""
        restored = await self.server.align(keep_out)
        if self.teacher is not None:
            restored += await self.teacher.server.probe_unhealthy()
        return restored

    async def add_engines(self, engines: list, engine_ids: list[str]) -> None:
        """Engines launched during the run: known from now on, routed to once `route` lets them in."""
        from streamrl.streaming.actors.engine import JOINING_VERSION, engine_clients

        for client in engine_clients(engines, self.engine_cfg, JOINING_VERSION, engine_ids):
            self.server.add_engine(client)

    async def retire_engines(self, engine_ids: list[str], timeout_s: float) -> int:
        """Drain engines for good (`ServerManager.retire`): their trajectories park with the tokens
        streamed so far and, the worker not being paused, go on at once on the other engines."""
        aborted = 0
        for engine_id in engine_ids:
            aborted += await self.server.retire(engine_id, timeout_s)
        return aborted

    async def running_ids(self) -> list[str]:
        return self.worker.running_ids()

    async def num_outstanding(self) -> int:
        return self.worker.num_running + self.worker.num_held

    async def wait_idle(self, timeout_s: float) -> None:
        await self.worker.wait_idle(timeout_s)

    async def errors(self) -> list[str]:
        return list(self.worker.errors)

    async def outcomes(self) -> RolloutOutcomes:
        return self.worker.outcomes()

    async def shutdown(self) -> None:
        from streamrl.rollout.gateway.loop import close_gateway

        await self.worker.shutdown()
        await close_gateway(self.worker.ctx)  # the gateway server its `gateway` loops started, if any
        if self.worker.ctx.tools is not None:
            self.worker.ctx.tools.close()  # MCP servers this worker started
