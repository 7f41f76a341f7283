"""`Slots`: a counting semaphore for coroutines of any event loop and thread, and `ToolThreads`, the
bounded daemon threads sync tool functions run in.

asyncio's `Semaphore` belongs to one event loop; the caps it serves here are per process (the
sandboxes one worker runs at once, the threads a tool function may hold), and a process may run
several loops (the worker's, an MCP toolset's, a test's). A slot is released from any thread: a tool
thread gives its slot back when its function returns, however long after its caller gave up.

Sync tool functions do not use the loop's default executor (`asyncio.to_thread`): a function that
hangs keeps its thread forever (threads cannot be cancelled), and a handful of hung calls would
exhaust the pool that image decoding and every other `to_thread` caller of the worker share. Each
`ToolThreads` runs at most `max_threads` calls at once in daemon threads of its own (a hung one
never blocks interpreter exit); a call beyond that waits for a slot, under its caller's timeout.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Slots:
    """At most `limit` holders at once, first come first served; `limit` may change while in use."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a slot limit must be positive, got {limit}")
        self.limit = limit
        self.num_held = 0
        self.peak = 0  # most holders at once since the last `reset_peak`
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.num_held < self.limit and not self._waiters:
                self._take()
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            with self._lock:
                try:
                    self._waiters.remove((loop, waiter))
                    handed_over = False
                except ValueError:  # `release` already passed its slot to this waiter
                    handed_over = True
            if handed_over:
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back (from any thread): to the oldest waiter, or to the pool."""
        while True:
            with self._lock:
                if not self._waiters or self.num_held > self.limit:  # over the limit after a resize
                    self.num_held -= 1
                    return
                loop, waiter = self._waiters.popleft()  # the slot passes on: num_held is unchanged
            try:
                loop.call_soon_threadsafe(_wake, waiter)
                return
            except RuntimeError:  # that waiter's loop is closed: it will never take the slot
                continue

    def resize(self, limit: int) -> None:
        """A new limit; waiters that now fit are woken, holders over it keep their slots."""
        if limit <= 0:
            raise ValueError(f"a slot limit must be positive, got {limit}")
        with self._lock:
            self.limit = limit
            fits = max(0, min(limit - self.num_held, len(self._waiters)))
            for _ in range(fits):
                self._take()
        for _ in range(fits):  # each slot just taken passes to the oldest waiter
            self.release()

    def _take(self) -> None:
        self.num_held += 1
        self.peak = max(self.peak, self.num_held)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.num_held


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
    # a cancelled waiter finds itself gone from the queue and releases the slot (see `acquire`)


class ToolThreads:
    """Runs sync functions in daemon threads, at most `max_threads` at once (see the module docstring).

    `num_abandoned` counts threads still running a call whose caller stopped waiting (timed out or
    cancelled): they hold their slot until the function returns."""

    def __init__(self, max_threads: int, name: str) -> None:
        self.slots = Slots(max_threads)
        self.name = name
        self.num_abandoned = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a thread of this pool, with the caller's context variables."""
        await self.slots.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        thread = threading.Thread(target=self._work, args=(call, loop, done), name=f"{self.name}-tool", daemon=True)
        try:
            thread.start()
        except BaseException:
            self.slots.release()
            raise
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            if not done.done():
                with self._lock:
                    self.num_abandoned += 1
                done.add_done_callback(self._returned)
            raise

    def _work(self, call: Callable[[], T], loop: asyncio.AbstractEventLoop, done: asyncio.Future[T]) -> None:
        try:
            outcome: tuple[str, Any] = ("result", call())
        except BaseException as exc:  # handed to the caller, who decides what it means
            outcome = ("exception", exc)
        finally:
            self.slots.release()
        try:
            loop.call_soon_threadsafe(_settle, done, *outcome)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this call any more
            pass

    def _returned(self, _: asyncio.Future[Any]) -> None:
        with self._lock:
            self.num_abandoned -= 1


def _settle(done: asyncio.Future[Any], kind: str, value: Any) -> None:
    if done.done():
        return
    if kind == "result":
        done.set_result(value)
    else:
        done.set_exception(value)
