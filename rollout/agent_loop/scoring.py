"""Scoring a finished trajectory: the reward function off the event loop, under a deadline, and every
reward part checked finite.

A rollout worker runs all its agent loops on one event loop; a reward function is plain sync code of
unknown cost (a verl scorer, a regex over a 30k-character answer), so it runs in `reward_pool()`, a
few threads of its own (not asyncio's default executor, which tokenization and file I/O share), and
the loop waits at most `rollout.agent.reward_timeout_s` for it. A call past the deadline fails the
trajectory; its thread cannot be stopped and keeps one of the pool's threads until it returns, so a
reward function that hangs for good ends up failing every trajectory after a few: loud, not silent.

A NaN or infinite reward, tool reward or interaction score would make the group's advantages NaN and
the learner's weights NaN one step later, so `finite` turns it into a `RewardError`: the trajectory
becomes a FAILED row whose error names the culprit, and nothing non-finite reaches the buffer. Finite
is judged where the reward is used, not in float64: the learner's batch carries rewards as float32
and takes each group's mean and squared deviations in it, so a reward past `MAX_ABS_REWARD` (1e39 is
already inf in float32) is refused as well; so is a total of finite parts that exceeds it.
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.rollout.rewards import RewardFn, RewardInput
    from streamrl.rollout.types import AgentData

NUM_REWARD_THREADS = 4  # reward calls of one worker process that run at once; more wait their turn
# Keeps a group's float32 sum and squared deviations finite: (2 * 1e15)**2 * group size < 3.4e38 (float32
# max) for groups of up to ~8e7 trajectories. Real rewards are many orders of magnitude smaller.
MAX_ABS_REWARD = 1e15

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class RewardError(ValueError):
    """A trajectory cannot be scored: a non-finite reward, or a reward function that failed to return in time."""


def reward_pool() -> ThreadPoolExecutor:
    """This process's reward threads (created on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(NUM_REWARD_THREADS, thread_name_prefix="reward")
        return _pool


def finite(what: str, value: Any) -> float:
    """`value` as a float; a `RewardError` naming `what` when it is no number or not finite."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"{what} is {value!r:.60}, not a number") from None
    if not math.isfinite(number):
        raise RewardError(f"{what} is {number}: a non-finite reward would turn the group's advantages into NaN")
    if abs(number) > MAX_ABS_REWARD:
        raise RewardError(
            f"{what} is {number}: not finite in the learner's float32 group statistics (|reward| must be "
            f"<= {MAX_ABS_REWARD:g}); the group's advantages would be inf or NaN"
        )
    return number


async def call_reward_fn(fn: RewardFn, inp: RewardInput, timeout_s: float) -> float:
    """`fn(inp)` in the reward pool, at most `timeout_s` seconds; the finite reward or a `RewardError`."""
    name = getattr(fn, "__name__", type(fn).__name__)
    future = asyncio.get_running_loop().run_in_executor(reward_pool(), fn, inp)
    try:
        value = await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        raise RewardError(
            f"reward function {name} did not return within {timeout_s:g} s (rollout.agent.reward_timeout_s)"
        ) from None
    return finite(f"the reward of reward function {name}", value)


def reward_input(data: AgentData) -> RewardInput:
    """What the reward function sees of a finished trajectory."""
    from streamrl.rollout.rewards import RewardInput

    assistant = [m.get("content") or "" for m in data.messages if m.get("role") == "assistant"]
    return RewardInput(
        response_text="\n".join(assistant),
        final_answer_text=assistant[-1] if assistant else "",
        ground_truth=data.ground_truth,
        num_turns=data.num_assistant_turns + data.num_user_turns,
        num_tool_calls=data.num_tool_calls,
        num_tool_errors=data.num_tool_errors,
        messages=data.messages,
        data_source=data.data_source,
        raw_ground_truth=data.raw_ground_truth,
        extra_info=data.extra_info,
    )
