"""asyncio helpers the packages share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any


def observe_outcome(future: asyncio.Future) -> None:
    """Mark a future's exception as seen once it is done. For a future whose outcome is read some other
    way, or not at all: a gather cancelled with its caller finishes with a CancelledError that nobody
    reads, and asyncio logs "exception was never retrieved" when it is collected."""
    future.add_done_callback(lambda done: done.cancelled() or done.exception())


async def gather_within(
    aws: Sequence[Awaitable[Any]], timeout_s: float, *, return_exceptions: bool = False
) -> list[Any]:
    """`asyncio.gather(*aws)` with a deadline: TimeoutError after `timeout_s`, the awaitables cancelled.
    A caller cancelled while it waits cancels them too, and leaves no unread exception behind."""
    gathered = asyncio.gather(*aws, return_exceptions=return_exceptions)
    observe_outcome(gathered)
    return await asyncio.wait_for(gathered, timeout_s)
