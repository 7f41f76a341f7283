"""The driver: the loops of fully asynchronous RL, and the synchronous baseline, on a built `Pipeline`.

    admission ──► rollout workers ──► buffer ──► learner ──► weight sync ──┐
        ▲                                                                │
        └────────────── capacity (max_staleness, learner version) ◄──────┘

Async mode runs three named loops concurrently; the first one to fail cancels the others and the
error surfaces in `run_async` (no fire-and-forget). Sync mode (`trainer.mode="sync"`) uses the same
components one phase at a time: admit one batch, wait for it, train, publish.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamrl.core import faults, trace
from streamrl.streaming.elastic import scale_loop
from streamrl.streaming.failures import check_failures
from streamrl.streaming.pipeline import Pipeline

logger = logging.getLogger(__name__)

# The longest a loop waits for an event before it re-checks on its own (a safety net: loops wake on
# the buffer's change counter and on publishes, `Pipeline.wait_for_change`, not on this timer).
WAIT_S = 1.0


async def admission_loop(pipeline: Pipeline) -> None:
    """Start new trajectory groups while the staleness bound allows.

    Consumes: prompts from the stream (cursor). Waits for: rollout capacity, which grows when the
    learner publishes a new policy version (learner_loop) and shrinks as groups are admitted.
    Every admitted group is first appended to the buffer as PENDING partial rows (durable), so a
    crash never loses or duplicates a prompt. Between rounds it sleeps until the buffer changes (a
    row arrived, a batch was sampled) or a publish changed the served version.
    """
    changes = -1
    while not pipeline.done:
        version = pipeline.state.policy_version  # read before capacity: a publish after it wakes the wait
        num_groups = await pipeline.admission_capacity_groups()
        for _ in range(num_groups):
            if not await pipeline.admit_next_group():
                break
        changes = (await pipeline.wait_for_change(changes, version, timeout_s=WAIT_S)).changes


async def learner_loop(pipeline: Pipeline) -> None:
    """Train on complete batches as they become ready and publish weights every `sync_every` steps.

    Consumes: batches from the buffer (whole GRPO groups within the staleness bound). Waits for:
    the buffer (rollout workers unblock it by appending finished trajectories). Unblocks: admission
    (a new policy version raises capacity). Ends the run after `total_steps`.
    """
    cfg = pipeline.cfg.trainer
    while pipeline.state.learner_step < cfg.total_steps:
        t_wait = time.monotonic()
        batch_ref = await wait_for_batch(pipeline)
        pipeline.learner_idle_s += time.monotonic() - t_wait
        if batch_ref is None:
            break
        metrics = await pipeline.train_step(batch_ref)
        faults.hit("learner.after_step")
        if pipeline.state.learner_step % cfg.sync_every == 0 or pipeline.state.learner_step == cfg.total_steps:
            metrics.update(await publish(pipeline))
            faults.hit("publish.after")
        if pipeline.state.learner_step % cfg.checkpoint_every == 0 or pipeline.state.learner_step == cfg.total_steps:
            await pipeline.checkpoint()
        await pipeline.settle_checkpoint(wait=False)  # record a checkpoint written meanwhile
        await pipeline.log_step(metrics)
    await pipeline.settle_checkpoint()
    pipeline.done = True


async def publish(pipeline: Pipeline) -> dict[str, float]:
    """Publish the learner's weights. A running held-out evaluation pins the served version, so the
    sync first waits for it (bounded); the new weights are then evaluated if they are due."""
    if pipeline.evaluator is None:
        return await pipeline.publish_weights()
    held_s = await pipeline.evaluator.hold()
    metrics = await pipeline.publish_weights()
    if pipeline.state.learner_step < pipeline.cfg.trainer.total_steps:  # the last weights: after the workers park
        pipeline.evaluator.maybe_start(pipeline)
    return metrics | {"eval/sync_held_s": held_s}


class Stalled(RuntimeError):
    """The learner waited `trainer.stall_timeout_s` for a batch while no trajectory row arrived."""


async def wait_for_batch(pipeline: Pipeline, *, check_workers: bool = False, refill: int = 0):
    """The next batch, or None when the prompts are used up and nothing is left in flight (the run
    ends cleanly with fewer steps). Raises `Stalled` when nothing arrives for `stall_timeout_s`.

    `refill` (the sync loop, which admits one generation round at a time): when nothing is in flight
    and the buffer still holds no batch, groups were dropped by the DAPO filter (all rewards equal),
    so another round of `refill` groups is admitted, as often as needed. A round finishes whole
    before its batch is taken (as verl's blocking generate does): no generation overlaps a step."""
    stall_s = pipeline.cfg.trainer.stall_timeout_s
    last_rows, last_change, changes = -1, time.monotonic(), -1
    drain = refill > 0
    while drain or (batch_ref := await pipeline.sample_batch()) is None:
        # Sleeps until a row arrives after the last look (returns at once the first time, and when
        # one arrived between that look and the sample above: no wake-up is lost).
        progress = await pipeline.buffer.wait_progress(changes, WAIT_S)
        in_flight, rows, changes = progress.in_flight, progress.rows_appended, progress.changes
        if in_flight == 0:  # nothing more can arrive: what the buffer holds now decides
            if (batch_ref := await pipeline.sample_batch()) is not None:
                return batch_ref
            if pipeline.prompts_exhausted:
                await check_failures(pipeline, final=True)  # ran out because (nearly) everything failed?
                logger.warning(
                    "the prompt stream is exhausted (%d prompts admitted) and nothing is in flight: "
                    "ending the run at learner step %d of %d",
                    pipeline.state.cursor,
                    pipeline.state.learner_step,
                    pipeline.cfg.trainer.total_steps,
                )
                pipeline.exhausted = True
                return None
            if refill:
                logger.info("no batch and nothing in flight (groups were filtered): admitting %d more", refill)
                for _ in range(refill):
                    await pipeline.admit_next_group()
                continue
        if rows != last_rows:
            last_rows, last_change = rows, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise Stalled(
                f"no trajectory row arrived for {stall_s:.0f}s while the learner waited for a batch "
                f"({in_flight} trajectories in flight, policy version {pipeline.state.policy_version}); "
                "see RUN_DIR/logs for engine and worker errors (trainer.stall_timeout_s sets this limit)"
            )
        if check_workers:
            await pipeline.check_workers()
    return batch_ref


async def health_loop(pipeline: Pipeline) -> None:
    """Replace preempted rollout workers and resubmit their trajectories from the buffer.

    Consumes: worker liveness (a cheap call per worker). Waits for: a poll interval. Unblocks:
    admission and the learner (resumed trajectories finish and fill batches).
    """
    while not pipeline.done:
        await pipeline.check_workers()
        await asyncio.sleep(1.0)


def start_trace(pipeline: Pipeline) -> None:
    """This process's lifecycle trace (the actors find theirs from the run's config on their own)."""
    cfg = pipeline.cfg.trace
    trace.configure(
        pipeline.run_dir if cfg.enabled else None, max_shard_mb=cfg.max_shard_mb, max_total_mb=cfg.max_total_mb
    )


async def run_async(pipeline: Pipeline) -> None:
    start_trace(pipeline)
    tasks = [
        asyncio.create_task(admission_loop(pipeline), name="admission"),
        asyncio.create_task(learner_loop(pipeline), name="learner"),
        asyncio.create_task(health_loop(pipeline), name="health"),
        asyncio.create_task(scale_loop(pipeline), name="scale"),  # `streamrl scale` (streaming.elastic)
    ]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise RuntimeError(f"{task.get_name()} loop failed") from task.exception()
        await tasks[1]  # the learner loop ends the run
    finally:
        pipeline.done = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_sync(pipeline: Pipeline) -> None:
    """On-policy baseline: admit one generation round (one batch's groups, or
    `trainer.sync_generation_groups`), wait for a full batch (more rounds while the DAPO filter drops
    groups), train, publish, repeat."""
    start_trace(pipeline)
    cfg = pipeline.cfg.trainer
    round_groups = max(cfg.sync_generation_groups, pipeline.groups_per_step)
    while pipeline.state.learner_step < cfg.total_steps:
        for _ in range(round_groups):
            await pipeline.admit_next_group()
        t_wait = time.monotonic()
        batch_ref = await wait_for_batch(pipeline, check_workers=True, refill=round_groups)
        pipeline.learner_idle_s += time.monotonic() - t_wait
        if batch_ref is None:
            break
        metrics = await pipeline.train_step(batch_ref)
        metrics.update(await publish(pipeline))
        if pipeline.state.learner_step % cfg.checkpoint_every == 0 or pipeline.state.learner_step == cfg.total_steps:
            await pipeline.checkpoint()
        await pipeline.settle_checkpoint(wait=False)  # record a checkpoint written meanwhile
        await pipeline.log_step(metrics)
    await pipeline.settle_checkpoint()
    pipeline.done = True
