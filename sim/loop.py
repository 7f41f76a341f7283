"""A minimal discrete-event loop: callbacks ordered by (time, insertion order), so a run is
deterministic for a given seed (simpy is not a dependency of the project; this is all it needs)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        if delay_s < 0:
            raise ValueError(f"cannot schedule {delay_s} s in the past")
        heapq.heappush(self._heap, (self.now + delay_s, next(self._seq), fn, args))

    def run(self, stop: Callable[[], bool], max_events: int = 50_000_000) -> None:
        """Run events in time order until `stop()` or no event is left."""
        while self._heap and not stop():
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)
            self.num_events += 1
            if self.num_events > max_events:
                raise RuntimeError(f"simulation ran past {max_events} events (a configuration that never ends?)")
