"""`ServerManager`: routes agent-loop requests across N inference engines.

Routing rule: a trajectory's first request goes to the healthy engine with the fewest outstanding
requests (ties: the one that was given fewer requests so far); later turns of the same trajectory
stick to that engine so its prefix cache (prompt + earlier turns) is reused. The sticky map is an
LRU bounded by `max_sticky_keys`; an evicted trajectory is simply routed afresh.

Health: an engine whose `generate` raises anything but `ValueError` or `TypeError` (bad input: the
request fails alone, since retrying it would fail it on every engine and take each out of service)
is marked unhealthy and removed from routing; its sticky trajectories re-route, and the failed
request is retried once on another engine (the output is a fresh sample of the same prompt, so
nothing is lost). `AgentData` records the engine a trajectory used; `pin` restores that affinity
after a resume in another worker. `probe_unhealthy` (called by the driver's health loop) pings the
engines and puts an unhealthy one back into routing once it answers again and serves the newest
policy_version seen; one that comes back with stale weights waits until weight sync has caught it up.

Elastic engines: `add_engine` takes a new engine in out of routing (the driver lets it in once it
serves the current version); `retire` drains one for good: it leaves routing, its in-flight requests
are aborted (each returns the tokens streamed so far, so the trajectory parks and continues on another
engine from prompt + tokens so far) and, once none is left, it is forgotten.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

from streamrl.engines.base import (
    EngineStats,
    GenerationOutput,
    ImageInput,
    InferenceEngine,
    NoHealthyEngineError,
    PauseMode,
    SamplingParams,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["NoHealthyEngineError", "ServerManager", "ServerManagerStats"]


@dataclass(kw_only=True, slots=True)
class ServerManagerStats:
    num_engines: int
    num_healthy: int
    num_sticky_keys: int
    num_in_flight: int
    num_sticky_evictions: int
    num_engine_failures: int
    num_retries: int
    num_restored: int
    outstanding: dict[str, int]  # engine_id -> requests in flight through this manager
    engines: list[EngineStats]  # healthy engines only

    def metrics(self) -> dict[str, float]:
        """This manager's share of the `rollout/*` metrics (the driver sums them over workers; engine
        busy fractions come from the engines themselves)."""
        return {
            "rollout/num_in_flight": float(self.num_in_flight),
            "rollout/num_sticky_keys": float(self.num_sticky_keys),
            "rollout/num_engine_failures": float(self.num_engine_failures),
            "rollout/num_engines_restored": float(self.num_restored),
        }


class ServerManager:
    """Least-outstanding-requests choice on a trajectory's first call, sticky afterwards."""

    def __init__(
        self, engines: Sequence[InferenceEngine], *, max_sticky_keys: int = 100_000, max_retries: int = 1
    ) -> None:
        if not engines:
            raise ValueError("ServerManager needs at least one engine")
        ids = [e.engine_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        if max_sticky_keys < 1:
            raise ValueError(f"max_sticky_keys must be >= 1, got {max_sticky_keys}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._engines: dict[str, InferenceEngine] = {e.engine_id: e for e in engines}
        self._healthy: set[str] = set(ids)
        self._outstanding: dict[str, int] = dict.fromkeys(ids, 0)
        self._num_routed: dict[str, int] = dict.fromkeys(ids, 0)
        self._sticky: OrderedDict[str, str] = OrderedDict()  # trajectory_key -> engine_id, LRU order
        self._in_flight: dict[str, str] = {}  # request_id -> engine_id
        self.max_sticky_keys = max_sticky_keys
        self.max_retries = max_retries
        self._num_sticky_evictions = 0
        self._num_engine_failures = 0
        self._num_retries = 0
        self._num_restored = 0
        self._newest_version = -1  # newest policy_version seen in an output or a ping
        self._retired: set[str] = set()  # drained for good: never probed nor restored again

    # -- routing ----------------------------------------------------------------------------------

    @property
    def engine_ids(self) -> list[str]:
        return list(self._engines)

    @property
    def healthy_engine_ids(self) -> list[str]:
        return [e for e in self._engines if e in self._healthy]

    def engine(self, engine_id: str) -> InferenceEngine:
        return self._engines[engine_id]

    def sticky_engine(self, trajectory_key: str) -> str | None:
        """The engine a trajectory is pinned to, if any (does not refresh its LRU position)."""
        return self._sticky.get(trajectory_key)

    def _remember(self, trajectory_key: str, engine_id: str) -> None:
        self._sticky[trajectory_key] = engine_id
        self._sticky.move_to_end(trajectory_key)
        while len(self._sticky) > self.max_sticky_keys:
            self._sticky.popitem(last=False)
            self._num_sticky_evictions += 1

    def choose(self, trajectory_key: str) -> str:
        """Engine for the next request of `trajectory_key` (and remember it)."""
        engine_id = self._sticky.get(trajectory_key)
        if engine_id is None or engine_id not in self._healthy:
            if not self._healthy:
                raise NoHealthyEngineError(f"all {len(self._engines)} engines are unhealthy")
            engine_id = min(self.healthy_engine_ids, key=lambda e: (self._outstanding[e], self._num_routed[e]))
        self._remember(trajectory_key, engine_id)
        return engine_id

    def pin(self, trajectory_key: str, engine_id: str) -> bool:
        """Restore affinity (e.g. from AgentData after a resume); False if that engine can't take it."""
        if engine_id not in self._healthy:
            return False
        self._remember(trajectory_key, engine_id)
        return True

    def release(self, trajectory_key: str) -> None:
        """Forget a finished trajectory's affinity."""
        self._sticky.pop(trajectory_key, None)

    # -- requests ---------------------------------------------------------------------------------

    async def generate(
        self,
        trajectory_key: str,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        images: list[ImageInput] | None = None,
    ) -> tuple[GenerationOutput, str]:
        """Generate on the trajectory's engine; returns the output and the engine id that produced it.
        `images` go with the ids unchanged (`InferenceEngine.generate`)."""
        output, engine_id = await self._routed(
            trajectory_key, request_id, lambda e: e.generate(request_id, prompt_ids, sampling, images=images)
        )
        if output.policy_versions:
            self._newest_version = max(self._newest_version, output.policy_versions[-1])
        return output, engine_id

    async def score(self, trajectory_key: str, request_id: str, token_ids: list[int], start: int) -> list[float]:
        """Score given tokens (`InferenceEngine.score`) on an engine chosen, health-checked and retried
        as for `generate` (the distillation teacher's engines)."""
        scores, _ = await self._routed(trajectory_key, request_id, lambda e: e.score(request_id, token_ids, start))
        return scores

    async def _routed(
        self, trajectory_key: str, request_id: str, call: Callable[[InferenceEngine], Awaitable[T]]
    ) -> tuple[T, str]:
        """`call` on the trajectory's engine; an engine that fails (anything but ValueError or
        TypeError: those are the request's fault) leaves routing and the call is retried elsewhere."""
        if request_id in self._in_flight:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        attempt = 0
        while True:
            engine_id = self.choose(trajectory_key)
            self._outstanding[engine_id] += 1
            self._num_routed[engine_id] += 1
            self._in_flight[request_id] = engine_id
            try:
                return await call(self._engines[engine_id]), engine_id
            except (ValueError, TypeError):  # bad request: the caller's bug, the engine is fine
                raise
            except Exception as exc:  # fault boundary: the engine, not the request, is broken
                self._num_engine_failures += 1
                self.mark_unhealthy(engine_id, reason=f"{type(exc).__name__}: {exc}")
                if attempt >= self.max_retries or not self._healthy:
                    raise
                attempt += 1
                self._num_retries += 1
            finally:
                self._outstanding[engine_id] -= 1
                del self._in_flight[request_id]

    async def abort(self, request_id: str) -> None:
        """Abort a request on the engine holding it; unknown/finished ids are ignored."""
        engine_id = self._in_flight.get(request_id)
        if engine_id is not None:
            await self._engines[engine_id].abort(request_id)

    def mark_unhealthy(self, engine_id: str, reason: str = "") -> None:
        """Stop routing to an engine; its sticky trajectories will be re-routed on their next turn."""
        if engine_id not in self._engines:
            raise ValueError(f"unknown engine {engine_id!r}")
        if engine_id in self._healthy:
            self._healthy.discard(engine_id)
            logger.warning("engine %s marked unhealthy: %s", engine_id, reason or "by caller")
        for key in [k for k, e in self._sticky.items() if e == engine_id]:
            del self._sticky[key]

    def mark_healthy(self, engine_id: str) -> None:
        if engine_id not in self._engines:
            raise ValueError(f"unknown engine {engine_id!r}")
        if engine_id in self._retired:
            raise ValueError(f"engine {engine_id!r} was retired")
        self._healthy.add(engine_id)

    def add_engine(self, engine: InferenceEngine) -> bool:
        """Take in a new engine, out of routing: `probe_unhealthy` / `align` let it in once it answers
        at the newest policy_version and the caller no longer keeps it out. False if already known."""
        engine_id = engine.engine_id
        if engine_id in self._engines or engine_id in self._retired:
            return False
        self._engines[engine_id] = engine
        self._outstanding[engine_id] = 0
        self._num_routed[engine_id] = 0
        return True

    async def retire(self, engine_id: str, timeout_s: float = 30.0) -> int:
        """Drain `engine_id` for good: out of routing, its in-flight requests aborted (their loops get
        the tokens streamed so far and continue elsewhere), then forgotten once none is left (within
        `timeout_s`; a request still pending then keeps it known, but it is never routed to again).
        Returns how many requests were aborted. Unknown engines are ignored (0)."""
        if engine_id not in self._engines:
            return 0
        self._retired.add(engine_id)
        self.mark_unhealthy(engine_id, reason="retired (drained)")
        engine = self._engines[engine_id]
        requests = [r for r, e in self._in_flight.items() if e == engine_id]
        await asyncio.gather(*(asyncio.wait_for(engine.abort(r), timeout_s) for r in requests), return_exceptions=True)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._outstanding[engine_id] > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self._outstanding[engine_id] == 0:
            for table in (self._engines, self._outstanding, self._num_routed):
                del table[engine_id]
        else:
            logger.warning("engine %s retired with %d requests still pending", engine_id, self._outstanding[engine_id])
        return len(requests)

    async def probe_unhealthy(self, timeout_s: float = 10.0, *, keep_out: Collection[str] = ()) -> list[str]:
        """Ping every engine once (concurrently, each bounded by `timeout_s`) and restore each unhealthy
        engine that answers with the newest policy_version seen (in these pings or in routed outputs),
        except those in `keep_out` (e.g. engines weight sync dropped and has not taken back yet).
        Returns the restored engine ids; a no-op while every engine is healthy."""
        unhealthy = [
            e for e in self._engines if e not in self._healthy and e not in keep_out and e not in self._retired
        ]
        if not unhealthy:
            return []
        ids = [e for e in self._engines if e not in self._retired]
        outcomes = await asyncio.gather(
            *(asyncio.wait_for(self._engines[e].ping(), timeout_s) for e in ids), return_exceptions=True
        )
        served = {e: v for e, v in zip(ids, outcomes, strict=True) if not isinstance(v, BaseException)}
        self._newest_version = max([self._newest_version, *served.values()])
        restored = [e for e in unhealthy if e in served and served[e] >= self._newest_version]
        for engine_id in restored:
            self.mark_healthy(engine_id)
            self._num_restored += 1
            logger.warning(
                "engine %s answers again at policy_version %d: back in routing", engine_id, served[engine_id]
            )
        for engine_id in unhealthy:
            if engine_id in served and engine_id not in restored:
                logger.info(
                    "engine %s answers but serves policy_version %d < %d: stays out of routing",
                    engine_id,
                    served[engine_id],
                    self._newest_version,
                )
        return restored

    async def align(self, keep_out: Collection[str], timeout_s: float = 10.0) -> list[str]:
        """Take the engines in `keep_out` out of routing (weight sync dropped them: they may serve
        stale or half-loaded weights) and `probe_unhealthy` the others. Returns the engines restored."""
        for engine_id in keep_out:
            if engine_id in self._healthy:
                self.mark_unhealthy(engine_id, reason="dropped from the weight-sync set")
        return await self.probe_unhealthy(timeout_s, keep_out=keep_out)

    # -- fleet-wide control -----------------------------------------------------------------------

    async def _each(self, method: str, *args: object) -> None:
        await asyncio.gather(*(getattr(self._engines[e], method)(*args) for e in self.healthy_engine_ids))

    async def pause_all(self, mode: PauseMode = PauseMode.ABORT) -> None:
        await self._each("pause", PauseMode(mode))

    async def resume_all(self) -> None:
        await self._each("resume")

    async def set_policy_version(self, policy_version: int) -> None:
        await self._each("set_policy_version", policy_version)

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self._engines.values()), return_exceptions=True)

    def stats(self) -> ServerManagerStats:
        return ServerManagerStats(
            num_engines=len(self._engines),
            num_healthy=len(self._healthy),
            num_sticky_keys=len(self._sticky),
            num_in_flight=len(self._in_flight),
            num_sticky_evictions=self._num_sticky_evictions,
            num_engine_failures=self._num_engine_failures,
            num_retries=self._num_retries,
            num_restored=self._num_restored,
            outstanding=dict(self._outstanding),
            engines=[self._engines[e].stats() for e in self.healthy_engine_ids],
        )
