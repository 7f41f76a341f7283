"""`WeightSyncCoordinator`: publish learner weights as a new policy_version, transactionally.

One sync = transfer (stage in every engine) -> verify checksums -> pause -> commit (every engine loads
its staged copy and flips its version label in the same step) -> resume. With `overlap` (default) the
engines keep generating while the weights are transferred and verified: they pause only for the
commit, the in-place load. `overlap = false` pauses first (pause -> transfer -> verify -> commit ->
resume), for engines that must not receive while they serve. Every phase runs under its own
timeout and every engine call carries the sync's epoch, a fencing token: a call that timed out here
still runs on its engine actor, and the engine's `SyncFence` makes such late calls harmless (a pause
that lands after its resume is undone, a resume always wins over an older pause).

All or nothing for everything downstream (I7): after a failure before the commit the engines keep
serving the old version (after the resume, staged weights are discarded and the transport's group is
torn down; the next sync rebuilds it).
Once the commit started, an engine whose commit failed or timed out gets one re-commit from its staged
copy (kept until a load succeeds; a load still in flight is joined, not repeated) before generation
resumes; an engine that still fails is dropped from the sync set, and it refuses to sample if its
weights may be half loaded. The reported policy_version is the one every engine left in the set serves.

Dead engines (I6): an engine that cannot be resumed (error or timeout), or, when an overlapped
staging failed before anything was paused, does not answer a ping, is dead or wedged and leaves
the sync set; a sync that dropped engines is retried at once on the survivors, so the run goes on
without them. A dropped engine that answers a ping before a later sync rejoins it (that sync brings
it to the current weights). With no engine left, `sync` raises `NoHealthyEngineError`. Dropping here
does not touch routing: `dropped` names the engines the driver should take out of its ServerManagers.

Membership changes without a restart: `add_engines` puts new engines into the sync set (the next sync
stages the full weights in them and commits them at its version, which is how a new engine reaches the
current policy before it serves); `remove_engines` takes drained or dead ones out for good. Both wait
for a sync in progress; the transport's group is rebuilt at the next sync because its members changed.

Pause modes (`WeightSyncConfig.pause_mode`):
- abort (default): rollout workers are paused first (their loops abort in-flight requests, keep the
  streamed tokens and park; they re-prefill after resume), then engines pause with ABORT.
- keep: only the engines pause, freezing in-flight requests with their KV; those continue after the
  swap (on KV computed by the old weights). Rollout workers are not touched.

The KV prefix cache is safe across versions because engines salt requests with the policy_version.

LoRA adapter sync (`adapter` given): the tensors are the adapter's A and B only and the same phases run
(transfer, checksums, pause, commit, resume); the commit loads them as a new adapter named after the
version instead of reloading weights in place, and each engine keeps an older adapter until no
request that names it is left (`engines.adapters`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from streamrl.core import trace
from streamrl.engines.base import NoHealthyEngineError, PauseMode
from streamrl.weight_sync.config import WeightSyncConfig
from streamrl.weight_sync.transport import SyncEngine, TransferOutcome, WeightTransport, make_transport, rpc_all
from streamrl.weight_sync.types import AdapterSpec, SyncResult, WeightSyncError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@runtime_checkable
class PausableWorkers(Protocol):
    """The rollout side (implemented by the rollout workers / agent-loop driver)."""

    async def pause(self, epoch: int | None = None) -> None:
        """Abort in-flight generations keeping their tokens, park loops, stop admitting; returns when
        parked. `epoch` fences it as for engines: stale or overtaken pauses must not stick."""

    async def resume(self, epoch: int | None = None) -> None:
        """Let parked loops re-prefill and continue; admit new trajectories again (unless `epoch` is
        older than the pause in force)."""


class WeightSyncCoordinator:
    def __init__(
        self,
        config: WeightSyncConfig,
        engines: Sequence[SyncEngine],
        *,
        workers: PausableWorkers | None = None,
        transport: WeightTransport | None = None,
    ) -> None:
        if not engines:
            raise ValueError("WeightSyncCoordinator needs at least one engine")
        ids = [e.engine_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        self.config = config
        self.all_engines = list(engines)
        self.dropped: dict[str, str] = {}  # engine_id -> why it left the sync set (and should leave routing)
        self.workers = workers
        self.transport = transport if transport is not None else make_transport(config)
        self._served_version = max(e.policy_version for e in engines)
        self.num_syncs = 0
        self.num_failed = 0
        self.num_versions_skipped = 0  # versions the engines never served: they went straight to a newer one
        self.last_result: SyncResult | None = None
        self._epoch = 0
        self._lock = asyncio.Lock()

    @property
    def served_version(self) -> int:
        """The policy_version every engine in the sync set serves. Only a committed sync moves it: this
        is its one mutable holder in the learner's process, everyone else reads it (through the publisher)."""
        return self._served_version

    def is_new(self, target: int) -> bool:
        """Whether `target` is anything to send: labels only go up (a sync never relabels or rolls the
        engines back), so a target at or below the served label is nothing new. The one place that decides."""
        return target > self._served_version

    @property
    def engines(self) -> list[SyncEngine]:
        """The sync set: engines not dropped, in construction order."""
        return [e for e in self.all_engines if e.engine_id not in self.dropped]

    async def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        policy_version: int | None = None,
        *,
        adapter: AdapterSpec | None = None,
    ) -> SyncResult:
        """Publish `named_tensors` as `policy_version` (default: current + 1); with `adapter` they are a
        LoRA adapter's A and B, which every engine serves as a new adapter of that version on its base
        weights. A failed sync does not raise (see `SyncResult.ok/error`); raises ValueError for bad
        input and NoHealthyEngineError when no engine is left to sync."""
        target = self._served_version + 1 if policy_version is None else policy_version
        if not self.is_new(target):
            raise ValueError(f"policy_version must increase: serving {self._served_version}, asked for {target}")
        tensors = list(named_tensors)
        if not tensors:
            raise ValueError("no tensors to sync")
        async with self._lock:
            await self._readmit()
            self._check_engines_left()
            served_before = self._served_version
            result = await self._sync(tensors, target, adapter)
            self._count(result, served_before)
            if not result.ok and result.dropped_engine_ids and self.engines:
                logger.warning("retrying policy_version %d on the %d engines left", target, len(self.engines))
                dropped = result.dropped_engine_ids
                result = await self._sync(tensors, target, adapter)
                result.dropped_engine_ids = dropped + result.dropped_engine_ids
                self._count(result, served_before)
            self._check_engines_left()
        return result

    def _count(self, result: SyncResult, served_before: int) -> None:
        """Coalescing is counted here: a sync always carries the newest weights it is given, so the
        versions between the one served before and a committed target (`sync_every` > 1, a failed
        sync retried with newer weights, publish lag) are skipped, never queued."""
        self.num_syncs += 1
        self.num_failed += 0 if result.ok else 1
        if result.ok:
            self.num_versions_skipped += max(result.policy_version - served_before - 1, 0)
        self.last_result = result

    async def add_engines(self, engines: Sequence[SyncEngine]) -> list[str]:
        """Put new engines into the sync set (after any sync in progress); returns the ids added
        (an id already in the set is ignored). The next sync brings them to its version."""
        async with self._lock:
            known = {e.engine_id for e in self.all_engines}
            added = [e for e in engines if e.engine_id not in known]
            self.all_engines.extend(added)
        return [e.engine_id for e in added]

    async def remove_engines(self, engine_ids: Iterable[str]) -> list[str]:
        """Take engines out of the sync set for good (drained or dead; after any sync in progress);
        returns the ids removed. Raises ValueError rather than remove the last one."""
        gone = set(engine_ids)
        async with self._lock:
            removed = [e.engine_id for e in self.all_engines if e.engine_id in gone]
            if removed and len(removed) == len(self.all_engines):
                raise ValueError(f"removing {removed} would leave no engine to sync")
            self.all_engines = [e for e in self.all_engines if e.engine_id not in gone]
            for engine_id in removed:
                self.dropped.pop(engine_id, None)
        return removed

    def _check_engines_left(self) -> None:
        if not self.engines:
            reasons = "; ".join(f"{eid}: {why}" for eid, why in self.dropped.items())
            raise NoHealthyEngineError(f"no healthy inference engine left: {reasons}")

    async def _sync(
        self, tensors: list[tuple[str, torch.Tensor]], target: int, adapter: AdapterSpec | None
    ) -> SyncResult:
        timeouts = self.config.timeouts
        engines = self.engines
        self._epoch = epoch = max(self._epoch + 1, time.time_ns())  # fresh and increasing across coordinators
        result = SyncResult(ok=False, policy_version=self._served_version, engine_ids=[e.engine_id for e in engines])
        drops: dict[str, str] = {}
        started, wall = time.monotonic(), {"sync": time.time()}  # wall: the lifecycle trace's clock
        paused_at: float | None = None  # set once the pause was sent: from then on, resume in `finally`
        try:
            if self.config.overlap:  # stage while serving: generation goes on until the commit
                await self._stage(engines, tensors, target, adapter, result)
            paused_at, wall["paused"] = time.monotonic(), time.time()
            result.pause_s = await _timed(self._pause(engines, epoch), timeouts.pause, "pause")
            if not self.config.overlap:
                await self._stage(engines, tensors, target, adapter, result)
            t0 = time.monotonic()
            drops |= await self._commit(engines, target, epoch)
            result.load_s = time.monotonic() - t0
            if len(drops) == len(engines):
                raise WeightSyncError("load", f"commit failed on every engine: {drops}")
            result.ok, result.policy_version = True, target
            self._served_version = target
        except WeightSyncError as exc:
            result.error, result.failed_phase = str(exc), exc.phase
            logger.error("%s; engines keep serving policy_version %d", exc, self._served_version)
        finally:
            t0, wall["resume"] = time.monotonic(), time.time()
            try:
                if paused_at is not None:
                    drops |= await self._resume_engines(engines, epoch)
                    await self._resume_workers(epoch)
                else:  # an overlapped staging failed, nothing was paused: is an engine dead?
                    drops |= await self._probe(engines, f"after a failed {result.failed_phase or 'staging'}")
            finally:
                result.resume_s = time.monotonic() - t0
                result.paused_s = 0.0 if paused_at is None else time.monotonic() - paused_at
                for engine_id, why in drops.items():
                    self._drop(engine_id, why)
                result.dropped_engine_ids = sorted(drops)
                if not result.ok:  # staged copies never serve, so this waits until generation runs again
                    await self._rollback([e for e in engines if e.engine_id not in drops])
                result.total_s = time.monotonic() - started
                _trace_sync(wall, result, target)
        if result.ok:
            logger.info(
                "synced policy_version %d: %d bytes, transfer %.3fs load %.3fs, engines paused %.3fs (overlap %s)",
                target,
                result.num_bytes,
                result.transfer_s,
                result.load_s,
                result.paused_s,
                self.config.overlap,
            )
        return result

    async def _stage(
        self,
        engines: Sequence[SyncEngine],
        tensors: list[tuple[str, torch.Tensor]],
        target: int,
        adapter: AdapterSpec | None,
        result: SyncResult,
    ) -> None:
        """Transfer into every engine's staging copy, then check every checksum (raises WeightSyncError)."""
        with trace.span("stage", "sync", "sync", policy_version=target) as span:
            t0 = time.monotonic()
            outcome = await self.transport.send(engines, tensors, target, adapter=adapter)
            result.transfer_s = time.monotonic() - t0
            result.num_bytes = outcome.manifest.num_bytes
            span.set(bytes=result.num_bytes)
            t0 = time.monotonic()
            if self.config.verify_checksum:
                _verify(outcome, [e.engine_id for e in engines])
            result.verify_s = time.monotonic() - t0

    async def _pause(self, engines: Sequence[SyncEngine], epoch: int) -> None:
        mode = self.config.pause_mode
        with trace.span("pause", "sync", "sync", mode=str(mode.value), engines=len(engines)):
            if mode is PauseMode.ABORT and self.workers is not None:
                await self.workers.pause(epoch=epoch)
            outcomes = await asyncio.gather(*(e.pause(mode, epoch=epoch) for e in engines), return_exceptions=True)
        for engine, outcome in zip(engines, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                raise WeightSyncError("pause", f"engine {engine.engine_id}: {outcome!r}") from outcome

    async def _commit(self, engines: Sequence[SyncEngine], target: int, epoch: int) -> dict[str, str]:
        """Commit everywhere, re-commit once where that failed; returns {engine_id: why} of engines that
        still do not serve `target` (they get dropped)."""
        with trace.span("commit", "sync", "sync", policy_version=target, engines=len(engines)):
            failed = await self._commit_round(engines, target, epoch)
        if not failed:
            return {}
        logger.warning("commit of policy_version %d failed on %s; re-committing there", target, failed)
        again = await self._commit_round([e for e in engines if e.engine_id in failed], target, epoch)
        repaired = sorted(set(failed) - set(again))
        if repaired:
            logger.info("re-commit repaired %s: they serve policy_version %d", repaired, target)
        return {
            eid: f"commit of policy_version {target} failed ({failed[eid]}), re-commit too ({why})"
            for eid, why in again.items()
        }

    async def _commit_round(self, engines: Sequence[SyncEngine], target: int, epoch: int) -> dict[str, str]:
        timeout_s = self.config.timeouts.load
        return await _failures(engines, lambda e: e.commit_weights(target, epoch=epoch, timeout_s=timeout_s), timeout_s)

    async def _rollback(self, engines: Sequence[SyncEngine]) -> None:
        """Drop staged weights and the (possibly broken) group; best effort, bounded."""
        try:
            await rpc_all(engines, "discard_weights", timeout_s=self.config.timeouts.verify, phase="rollback")
        except WeightSyncError as exc:
            logger.warning("could not discard staged weights everywhere: %s", exc)
        await self.transport.reset(engines)

    async def _resume_engines(self, engines: Sequence[SyncEngine], epoch: int) -> dict[str, str]:
        """Resume every engine of this sync (bounded, all attempted); returns {engine_id: why} of those
        that did not answer: dead or wedged."""
        return await _failures(
            engines, lambda e: e.resume(epoch=epoch), self.config.timeouts.resume, prefix="resume failed: "
        )

    async def _resume_workers(self, epoch: int) -> None:
        """After the engines, so that parked loops find them serving."""
        if self.config.pause_mode is PauseMode.ABORT and self.workers is not None:
            try:
                await asyncio.wait_for(self.workers.resume(epoch=epoch), self.config.timeouts.resume)
            except Exception:
                logger.exception("rollout workers did not resume")
                raise

    async def _probe(self, engines: Sequence[SyncEngine], when: str) -> dict[str, str]:
        """One bounded ping per engine; returns {engine_id: why} of those that did not answer."""
        return await _failures(
            engines, lambda e: e.ping(), self.config.timeouts.probe, prefix=f"no answer to a ping {when}: "
        )

    def _drop(self, engine_id: str, why: str) -> None:
        self.dropped[engine_id] = why
        logger.error(
            "engine %s leaves the weight-sync set (take it out of routing): %s. "
            "It rejoins if it answers a ping before a later sync.",
            engine_id,
            why,
        )

    async def _readmit(self) -> None:
        """One bounded ping per dropped engine; those that answer rejoin the sync set."""
        dropped = [e for e in self.all_engines if e.engine_id in self.dropped]
        if not dropped:
            return
        timeout_s = self.config.timeouts.probe
        outcomes = await asyncio.gather(
            *(asyncio.wait_for(e.ping(), timeout_s) for e in dropped), return_exceptions=True
        )
        for engine, outcome in zip(dropped, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                logger.warning(
                    "engine %s answers again (serving policy_version %s); it rejoins the weight-sync set",
                    engine.engine_id,
                    outcome,
                )
                del self.dropped[engine.engine_id]

    def metrics(self) -> dict[str, float]:
        """`sync/*` of the last sync plus run counters."""
        out = self.last_result.metrics() if self.last_result is not None else {}
        out["sync/num_syncs"] = float(self.num_syncs)
        out["sync/num_failed"] = float(self.num_failed)
        out["sync/num_versions_skipped"] = float(self.num_versions_skipped)
        out["sync/num_engines"] = float(len(self.engines))
        return out

    async def close(self) -> None:
        await self.transport.close(self.engines)


def _trace_sync(wall: dict[str, float], result: SyncResult, target: int) -> None:
    """The lifecycle trace of one sync attempt: the resume, the engines' paused span (pause sent to
    resume done: the generation time the sync cost) and the whole sync."""
    if "paused" in wall:
        trace.complete("resume", "sync", "sync", wall["resume"], policy_version=target)
        trace.complete("paused", "sync", "sync", wall["paused"], policy_version=target)
    trace.complete("sync", "sync", "sync", wall["sync"], policy_version=target, ok=result.ok, bytes=result.num_bytes)


async def _timed(coro, timeout_s: float, phase: str) -> float:
    started = time.monotonic()
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            await coro
    except TimeoutError as exc:
        if deadline.expired():
            raise WeightSyncError(phase, f"did not finish within {timeout_s:.1f}s") from exc
        raise WeightSyncError(phase, repr(exc)) from exc  # a timeout of the phase's own, not the deadline
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(phase, repr(exc)) from exc
    return time.monotonic() - started


def _describe(exc: BaseException, timeout_s: float) -> str:
    return f"no answer within {timeout_s:.1f}s" if isinstance(exc, TimeoutError) else repr(exc)


async def _failures(
    engines: Sequence[SyncEngine],
    call: Callable[[SyncEngine], Awaitable[object]],
    timeout_s: float,
    *,
    prefix: str = "",
) -> dict[str, str]:
    """`call` on every engine at once, each bounded by `timeout_s` (all attempted, none cancels the
    others); returns {engine_id: prefix + why} of those that raised or did not answer."""
    outcomes = await asyncio.gather(*(asyncio.wait_for(call(e), timeout_s) for e in engines), return_exceptions=True)
    return {
        e.engine_id: prefix + _describe(o, timeout_s)
        for e, o in zip(engines, outcomes, strict=True)
        if isinstance(o, BaseException)
    }


def _verify(outcome: TransferOutcome, engine_ids: Sequence[str]) -> None:
    expected = outcome.manifest.checksums
    bad = []
    for engine_id, reports in zip(engine_ids, outcome.reports, strict=True):
        for report in reports:
            if report.policy_version != outcome.manifest.policy_version or report.checksums != expected:
                wrong = [i for i, (a, b) in enumerate(zip(report.checksums, expected, strict=True)) if a != b]
                bad.append(f"{engine_id}/rank{report.rank}: buckets {wrong}")
    if bad:
        raise WeightSyncError("verify", f"checksum mismatch, weights corrupted in flight: {', '.join(bad)}")
