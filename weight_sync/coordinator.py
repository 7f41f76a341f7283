"""`WeightSyncCoordinator`: publish learner weights as a new policy_version, transactionally.

One sync = pause -> transfer (stage in every engine) -> verify checksums -> load (commit in every
engine) -> set policy_version on every engine -> resume. Every phase runs under its own timeout.
The version advances only after every engine acknowledged; on any failure the staged weights are
discarded, the transport's group is torn down (the next sync rebuilds it) and the engines keep serving
the previous version. Resume always runs, in `finally`.

Pause modes (`WeightSyncConfig.pause_mode`):
- abort (default): rollout workers are paused first (their loops abort in-flight requests, keep the
  streamed tokens and park; they re-prefill after resume), then engines pause with ABORT.
- keep: only the engines pause, freezing in-flight requests with their KV; those continue after the
  swap (on KV computed by the old weights). Rollout workers are not touched.

The KV prefix cache is safe across versions because engines salt requests with the policy_version;
`reset_prefix_cache` is called as well where the engine offers it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rollout.engine.base import PauseMode
from weight_sync.config import WeightSyncConfig
from weight_sync.transport import SyncEngine, TransferOutcome, WeightTransport, make_transport, rpc_all
from weight_sync.types import SyncResult, WeightSyncError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@runtime_checkable
class PausableWorkers(Protocol):
    """The rollout side (implemented by the rollout workers / agent-loop driver)."""

    async def pause(self) -> None:
        """Abort in-flight generations keeping their tokens, park loops, stop admitting; returns when parked."""

    async def resume(self) -> None:
        """Let parked loops re-prefill and continue; admit new trajectories again."""


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
        self.engines = list(engines)
        self.workers = workers
        self.transport = transport if transport is not None else make_transport(config)
        self.policy_version = max(e.policy_version for e in engines)
        self.num_syncs = 0
        self.num_failed = 0
        self.last_result: SyncResult | None = None
        self._lock = asyncio.Lock()

    async def sync(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int | None = None
    ) -> SyncResult:
        """Publish `named_tensors` as `policy_version` (default: current + 1). Never raises for a failed
        sync (see `SyncResult.ok/error`); raises ValueError for bad input."""
        target = self.policy_version + 1 if policy_version is None else policy_version
        if target <= self.policy_version:
            raise ValueError(f"policy_version must increase: serving {self.policy_version}, asked for {target}")
        tensors = list(named_tensors)
        if not tensors:
            raise ValueError("no tensors to sync")
        async with self._lock:
            result = await self._sync(tensors, target)
        self.num_syncs += 1
        self.num_failed += 0 if result.ok else 1
        self.last_result = result
        return result

    async def _sync(self, tensors: list[tuple[str, torch.Tensor]], target: int) -> SyncResult:
        timeouts = self.config.timeouts
        result = SyncResult(ok=False, policy_version=self.policy_version, engine_ids=[e.engine_id for e in self.engines])
        started = time.monotonic()
        outcome: TransferOutcome | None = None
        try:
            result.pause_s = await _timed(self._pause(), timeouts.pause, "pause")
            t0 = time.monotonic()
            outcome = await self.transport.send(self.engines, tensors, target)
            result.transfer_s = time.monotonic() - t0
            result.num_bytes = outcome.manifest.num_bytes
            t0 = time.monotonic()
            if self.config.verify_checksum:
                _verify(outcome, [e.engine_id for e in self.engines])
            result.verify_s = time.monotonic() - t0
            t0 = time.monotonic()
            await self._commit(target)
            result.load_s = time.monotonic() - t0
            result.ok, result.policy_version = True, target
            self.policy_version = target
        except WeightSyncError as exc:
            result.error, result.failed_phase = str(exc), exc.phase
            logger.error("%s; engines keep serving policy_version %d", exc, self.policy_version)
            await self._rollback()
        except BaseException:
            await self._rollback()
            raise
        finally:
            t0 = time.monotonic()
            await self._resume()
            result.resume_s = time.monotonic() - t0
            result.total_s = time.monotonic() - started
        if result.ok:
            logger.info(
                "synced policy_version %d: %d bytes, pause %.3fs transfer %.3fs load %.3fs resume %.3fs",
                target, result.num_bytes, result.pause_s, result.transfer_s, result.load_s, result.resume_s,
            )
        return result

    async def _pause(self) -> None:
        mode = self.config.pause_mode
        if mode is PauseMode.ABORT and self.workers is not None:
            await self.workers.pause()
        # Let every engine's pause settle before failing: resuming an engine whose pause is still in
        # flight would leave it paused forever.
        outcomes = await asyncio.gather(*(e.pause(mode) for e in self.engines), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _commit(self, target: int) -> None:
        """Load staged weights everywhere, then advance the version of each engine that loaded."""
        timeout_s = self.config.timeouts.load

        async def one(engine: SyncEngine) -> None:
            await engine.collective_rpc("commit_weights", timeout=timeout_s)
            await engine.set_policy_version(target)
            reset = getattr(engine, "reset_prefix_cache", None)
            if reset is not None:  # salting already isolates versions; this frees the stale blocks
                await reset()

        tasks = {e.engine_id: asyncio.ensure_future(one(e)) for e in self.engines}
        done, pending = await asyncio.wait(tasks.values(), timeout=timeout_s)
        for task in pending:
            task.cancel()
        failed = {eid: task for eid, task in tasks.items() if task not in done or task.exception() is not None}
        if failed:
            loaded = [eid for eid in tasks if eid not in failed]
            reasons = "; ".join(
                f"{eid}: {'timed out' if t not in done else repr(t.exception())}" for eid, t in failed.items()
            )
            raise WeightSyncError(
                "load", f"commit failed on {sorted(failed)} ({reasons}); engines {loaded} already serve v{target}"
            )

    async def _rollback(self) -> None:
        """Drop staged weights and the (possibly broken) group; best effort, bounded."""
        try:
            await rpc_all(self.engines, "discard_weights", timeout_s=self.config.timeouts.verify, phase="rollback")
        except WeightSyncError as exc:
            logger.warning("could not discard staged weights everywhere: %s", exc)
        await self.transport.reset(self.engines)

    async def _resume(self) -> None:
        """Engines first (so parked loops find them serving), then workers; each bounded, all attempted."""
        timeout_s = self.config.timeouts.resume
        outcomes = await asyncio.gather(
            *(asyncio.wait_for(e.resume(), timeout_s) for e in self.engines), return_exceptions=True
        )
        for engine, outcome in zip(self.engines, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.error("engine %s did not resume: %r", engine.engine_id, outcome)
        if self.config.pause_mode is PauseMode.ABORT and self.workers is not None:
            try:
                await asyncio.wait_for(self.workers.resume(), timeout_s)
            except Exception:
                logger.exception("rollout workers did not resume")
                raise

    def metrics(self) -> dict[str, float]:
        """`sync/*` of the last sync plus run counters."""
        out = self.last_result.metrics() if self.last_result is not None else {}
        out["sync/num_syncs"] = float(self.num_syncs)
        out["sync/num_failed"] = float(self.num_failed)
        return out

    async def close(self) -> None:
        await self.transport.close(self.engines)


async def _timed(coro, timeout_s: float, phase: str) -> float:
    started = time.monotonic()
    try:
        await asyncio.wait_for(coro, timeout_s)
    except TimeoutError as exc:
        raise WeightSyncError(phase, f"did not finish within {timeout_s:.1f}s") from exc
    except WeightSyncError:
        raise
    except Exception as exc:
        raise WeightSyncError(phase, repr(exc)) from exc
    return time.monotonic() - started


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
