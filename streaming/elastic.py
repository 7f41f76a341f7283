"""Elastic and preemptible inference engines during a run (`streamrl scale`, docs/multi-node.md).

The engine set changes without a restart, in three ways:

- **Scale up** (`streamrl scale RUN_DIR --engines N`): new engine actors `engine-{k}` are launched
  (k never reused) from the run's engine config. A new engine loads the model it was started from, not
  the current policy, so it announces `JOINING_VERSION` (-1) and is *joining*: it enters every rollout
  worker's routing table out of routing and joins the weight-sync set; the next sync stages the full
  weights in it and commits them at that sync's version. Once its own stats report the version the
  driver serves, it leaves `joining` and the workers' routing takes it in (I6: no token is sampled from
  weights other than a published version).
- **Drain** (a preemption notice, `--preempt engine-k`, or scaling down): the engine leaves every
  worker's routing first; its in-flight requests are then aborted, each returning the tokens streamed so
  far, so their trajectories park (a partial row, the per-token versions as sampled) and go on at once on
  another engine from prompt + tokens so far; then it leaves the sync set and is stopped.
- **Killed without notice**: its in-flight requests fail over in the workers (`ServerManager` retries
  from the worker's in-memory state: prompt + tokens received so far), and the health loop, finding
  the actor dead, takes it out of routing and the sync set for good.

Requests are files (`RUN_DIR/scale_request.json`, written atomically by the command) that the driver
polls; a request present when the driver starts (an earlier segment's) is not applied again: a resumed
run starts with `rollout.num_engines` engines.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.core.run_dir import RunDir, read_json, write_json

if TYPE_CHECKING:
    from streamrl.engines.config import EngineConfig
    from streamrl.streaming.actors.engine import RayEngineClient
    from streamrl.streaming.pipeline import Pipeline

logger = logging.getLogger(__name__)

POLL_S = 1.0
DRAIN_TIMEOUT_S = 60.0  # a drained engine's aborted requests return within this


@dataclass(frozen=True, kw_only=True)
class ScaleRequest:
    """RUN_DIR/scale_request.json: the engine count wanted and engines to drain (a preemption notice)."""

    request_id: str
    engines: int | None = None
    preempt: tuple[str, ...] = ()


def write_scale_request(
    run_dir: str | Path, *, engines: int | None = None, preempt: list[str] | None = None
) -> ScaleRequest:
    """Record a scale request for the running driver of `run_dir` (atomic: it never reads half a file)."""
    run = RunDir.open(run_dir)
    if engines is None and not preempt:
        raise ValueError("nothing to do: give --engines N and/or --preempt ENGINE_ID")
    if engines is not None and engines < 1:
        raise ValueError(f"--engines must be at least 1, got {engines}")
    request = ScaleRequest(request_id=uuid.uuid4().hex, engines=engines, preempt=tuple(preempt or ()))
    write_json(run.scale_request, asdict(request))
    return request


def read_scale_request(run_dir: str | Path) -> ScaleRequest | None:
    """The request in `run_dir`, or None (none, or a file `write_scale_request` did not write)."""
    path = RunDir(run_dir).scale_request
    try:
        data = read_json(path)
        engines = None if data.get("engines") is None else int(data["engines"])
        return ScaleRequest(request_id=str(data["request_id"]), engines=engines, preempt=tuple(data.get("preempt", ())))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.error("%s is not a scale request (%r); ignored", path, exc)
        return None


@dataclass(kw_only=True)
class EngineFleet:
    """The driver's view of the engine set beyond `Pipeline.engines`."""

    engine_cfg: EngineConfig | None = None  # what new engines start from (None: this run cannot scale up)
    next_index: int = 0  # engine-{k}: k is never reused
    joining: set[str] = field(default_factory=set)  # launched, kept out of routing until they serve the policy
    joined: dict[str, dict[str, int]] = field(default_factory=dict)  # engine -> its stats when let in
    retired: dict[str, str] = field(default_factory=dict)  # engine -> why it left (drained, preempted, dead)
    num_drained_requests: int = 0  # generations aborted by drains (their trajectories went on elsewhere)
    starting: set[asyncio.Task] = field(default_factory=set)  # scale-ups waiting for their engines to load
    num_starting: int = 0  # engines launched and not yet up (counted by a request for N engines)


async def scale_loop(pipeline: Pipeline) -> None:
    """Apply each new scale request as it appears; one that fails is logged, the run goes on."""
    stale = read_scale_request(pipeline.run_dir)
    last = stale.request_id if stale is not None else None
    while not pipeline.done:
        request = read_scale_request(pipeline.run_dir)
        if request is not None and request.request_id != last:
            last = request.request_id
            try:
                await apply_request(pipeline, request)
            except (ValueError, TimeoutError) as exc:
                logger.error("scale request %s not applied: %s", request, exc)
        await asyncio.sleep(POLL_S)


async def apply_request(pipeline: Pipeline, request: ScaleRequest) -> None:
    """Drain the engines named in `preempt`, then launch or drain engines to reach `engines`. A
    launch goes on in the background (an engine takes a minute or more to load): a preemption notice
    that arrives meanwhile is served at once."""
    logger.warning("scale request: %s", request)
    for engine_id in request.preempt:
        await drain(pipeline, engine_id, why="preempted")
    if request.engines is None:
        return
    count = len(pipeline.engines) + pipeline.fleet.num_starting
    if request.engines > count:
        task = asyncio.create_task(scale_up(pipeline, request.engines - count), name="scale-up")
        pipeline.fleet.starting.add(task)
        task.add_done_callback(_scale_up_done(pipeline.fleet))
    for engine_id in _drain_order(pipeline)[: max(count - request.engines, 0)]:
        await drain(pipeline, engine_id, why="scaled down")


def _scale_up_done(fleet: EngineFleet):
    def done(task: asyncio.Task) -> None:
        fleet.starting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("scale-up failed: %r", task.exception())

    return done


def _drain_order(pipeline: Pipeline) -> list[str]:
    """Joining engines first (they serve nothing yet), then the newest."""
    ids = [e.engine_id for e in pipeline.engines]
    return sorted(ids, key=lambda e: (e not in pipeline.fleet.joining, -int(e.rsplit("-", 1)[-1])))


async def scale_up(pipeline: Pipeline, count: int) -> list[str]:
    """Launch `count` engines; once up, they join the sync set and every worker's table (out of
    routing: `admit_joined` lets them in when they serve the current version). Returns their ids."""
    fleet = pipeline.fleet
    if fleet.engine_cfg is None or fleet.engine_cfg.backend != "vllm":
        raise ValueError("only vllm engines the run launches itself can be added")
    fleet.num_starting += count
    try:
        up = await _start(pipeline, fleet.engine_cfg, count)
    finally:
        fleet.num_starting -= count
    if not up:
        return []
    async with pipeline._health_lock:  # no worker is replaced meanwhile: each one learns the new engines
        fleet.joining.update(e.engine_id for e in up)
        pipeline.engines.extend(up)
        for worker in pipeline.workers:
            await _ignore_dead(worker.add_engines(up))
        await pipeline.learner.add_engines(up)
    ids = [e.engine_id for e in up]
    logger.warning("engines %s started; they serve once a sync brought them to the current version", ids)
    return ids


async def _start(pipeline: Pipeline, engine_cfg: EngineConfig, count: int) -> list[RayEngineClient]:
    """Launch `count` engine actors at `JOINING_VERSION` and wait for them; those that do not come
    up within `startup_timeout_s` are killed and left out."""
    from streamrl.streaming.actors.engine import JOINING_VERSION, RayEngineClient

    fleet, timeouts, new = pipeline.fleet, pipeline.cfg.trainer.actor_timeouts, []
    for _ in range(count):
        index = fleet.next_index
        engine_id, fleet.next_index = f"engine-{index}", index + 1
        placed = pipeline.cfg.placement.engine_config(engine_cfg, index, pipeline.cfg.rollout.num_engines)
        new.append(RayEngineClient.launch(placed, engine_id, policy_version=JOINING_VERSION, timeouts=timeouts))
    outcomes = await asyncio.gather(*(e.wait_ready() for e in new), return_exceptions=True)
    up = []
    for engine, outcome in zip(new, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            logger.error("engine %s did not start (%r); it is not added", engine.engine_id, outcome)
            engine.kill()
        else:
            up.append(engine)
    return up


async def admit_joined(pipeline: Pipeline) -> list[str]:
    """Joining engines whose own stats report the version the driver serves leave `joining` (the
    next `align_routing` takes them into routing). Returns them."""
    fleet, admitted = pipeline.fleet, []
    if not fleet.joining:
        return admitted
    for engine in [e for e in pipeline.engines if e.engine_id in fleet.joining]:
        try:
            stats = await engine.actor_stats()
        except Exception as exc:  # fault boundary: a dead one is retired by the health check
            logger.info("joining engine %s did not answer: %r", engine.engine_id, exc)
            continue
        if stats.policy_version >= max(pipeline.state.policy_version, 0):
            fleet.joining.discard(engine.engine_id)
            fleet.joined[engine.engine_id] = {
                "policy_version": stats.policy_version,
                "driver_policy_version": pipeline.state.policy_version,
                "num_generated_tokens": stats.num_generated_tokens,
                "num_prompt_tokens": stats.num_prompt_tokens,
            }
            admitted.append(engine.engine_id)
            logger.warning("engine %s serves policy_version %d: into routing", engine.engine_id, stats.policy_version)
    return admitted


async def drain(pipeline: Pipeline, engine_id: str, *, why: str) -> int:
    """Out of routing, in-flight generations aborted and continued elsewhere, out of the sync set,
    stopped. Returns how many generations were handed back. Refuses to drain the last serving engine."""
    engine = next((e for e in pipeline.engines if e.engine_id == engine_id), None)
    if engine is None:
        raise ValueError(f"no engine {engine_id!r} in this run (engines: {[e.engine_id for e in pipeline.engines]})")
    async with pipeline._health_lock:
        serving = [e for e in pipeline.engines if e.engine_id not in pipeline.fleet.joining]
        if engine in serving and len(serving) == 1:
            raise ValueError(f"{engine_id} is the last engine serving the policy: it is not drained")
        aborted = await _leave(pipeline, engine, why=why, timeout_s=DRAIN_TIMEOUT_S)
    await engine.shutdown()
    pipeline.fleet.num_drained_requests += aborted
    logger.warning("engine %s %s: %d generations went on elsewhere; stopped", engine_id, why, aborted)
    return aborted


async def _leave(pipeline: Pipeline, engine: RayEngineClient, *, why: str, timeout_s: float) -> int:
    """Take `engine` out of the run: pipeline, every worker's routing (aborting what runs there), the
    sync set. Holds the health lock (the caller's)."""
    pipeline.engines.remove(engine)
    pipeline.fleet.joining.discard(engine.engine_id)
    pipeline.fleet.retired[engine.engine_id] = why
    aborted = 0
    for worker in pipeline.workers:
        aborted += await _ignore_dead(worker.retire_engines([engine.engine_id], timeout_s)) or 0
    await pipeline.learner.remove_engines([engine.engine_id])
    pipeline.dropped_engines.pop(engine.engine_id, None)
    return aborted


async def check_engines(engines: list[Any]) -> list[Any]:
    """The engines whose actor is gone; raises `NoHealthyEngineError` when that is all of them.

    Without this, a run whose only engine died before its first weight sync would admit prompt after
    prompt, each failing at once ("all engines are unhealthy"): rows keep arriving, so the learner's
    stall check never fires, and the run cycles through the dataset instead of stopping. An engine
    that is merely slow to answer is not dead; one dead among live ones is retired (`retire_dead`)."""
    import ray

    from streamrl.engines.base import NoHealthyEngineError

    dead, why = [], []
    for i, engine in enumerate(engines):
        try:
            await engine.actor_stats()
        except ray.exceptions.RayActorError as exc:
            dead.append(engine)
            why.append(f"{getattr(engine, 'engine_id', f'engine-{i}')}: {type(exc).__name__}")
        except TimeoutError:
            continue  # busy, not dead
    if dead and len(dead) == len(engines):
        raise NoHealthyEngineError(f"no inference engine is alive: {'; '.join(why)}")
    return dead


async def retire_dead(pipeline: Pipeline, dead: list[RayEngineClient]) -> None:
    """Engines whose actor is gone (killed without notice) leave routing and the sync set for good:
    their in-flight requests already failed over to the others (`ServerManager.generate`)."""
    for engine in dead:
        if engine in pipeline.engines:
            logger.error("engine %s is dead: out of routing and of the weight-sync set", engine.engine_id)
            await _leave(pipeline, engine, why="dead", timeout_s=5.0)


async def _ignore_dead(call: Any) -> Any:
    """A worker call; a dead or unresponsive worker is left to the health loop (it is replaced, and
    its replacement is built over `Pipeline.engines` as they are then)."""
    import ray

    try:
        return await call
    except (TimeoutError, ray.exceptions.RayActorError) as exc:
        logger.warning("a rollout worker did not take the engine change (%r): the health loop replaces it", exc)
        return None


def register(sub: Any) -> None:
    """`streamrl scale RUN_DIR --engines N | --preempt ENGINE_ID` (a subparser of the CLI)."""
    scale = sub.add_parser("scale", help="add, drain or preempt inference engines of a running `streamrl train`")
    scale.add_argument("run_dir")
    scale.add_argument("--engines", type=int, help="the number of engines wanted (new ones join at the next sync)")
    scale.add_argument("--preempt", action="append", default=[], metavar="ENGINE_ID", help="drain this engine now")
    scale.set_defaults(func=_scale_main)


def _scale_main(args: Any) -> int:
    request = write_scale_request(args.run_dir, engines=args.engines, preempt=args.preempt)
    print(f"scale request {request.request_id} written; the run's driver applies it within a second or two")
    return 0


__all__ = ["EngineFleet", "ScaleRequest", "read_scale_request", "scale_loop", "write_scale_request"]
