"""`GatewayAgentLoop` (agent name `gateway`): trains an existing agent program unchanged.

Per sample the loop opens a gateway session for the trajectory, runs the configured user program
against the session's base URL and bearer token, and when the program returns turns the session's
token record into the trajectory (`session.py`). The program is either

- `rollout.agent.gateway.program = "package.module:run"`: `run(base_url, api_key, sample)`, async (run
  on the worker's event loop, cancelled at the timeout) or sync (run in a daemon thread of the
  gateway's own bounded pool, `program_threads`; a sync program past its timeout fails the trajectory
  but its thread runs on), returning the reward or None, or a `ProgramResult` (the reward and named
  numbers of the sample, logged as a command's metrics file is); or
- `rollout.agent.gateway.command = [...]`: a child process (`command.py`) with the URLs, the token
  and the sample without its ground truth (JSON) in a minimal environment; its reward is the number
  it writes to the file named by `STREAMRL_REWARD_FILE`.

The reward is the program's, or when it gives none the configured reward function's on the final
conversation (the session's messages, the final answer included). A program that raises fails the
trajectory, unless a call of it was refused for the context budget: then the trajectory finishes with
finish reason `length` and the reward function scores it.

A weight sync never parks this loop: its state is INTERACTING while the program runs (the worker's
pause only waits for its engine requests, which park in place inside the session), so the program
keeps running and its calls only take longer. On a crash the program dies with the worker; the
trajectory resumes in a new attempt from its last row with the journal's records folded on top (every
answered call, when `durable_journal`; `Session.recover`): the program runs again from the start, and
its calls that repeat journaled ones are answered from the journal (`Session.lookup`) instead of being
sampled again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl.rollout.agent_loop.base import AgentLoopBase, register
from streamrl.rollout.agent_loop.scoring import finite
from streamrl.rollout.gateway.command import ProgramError, checked_metrics, run_command
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.gateway.session import Session
from streamrl.rollout.types import AgentData, AgentState, FinishReason
from streamrl.tools.slots import ToolThreads

logger = logging.getLogger(__name__)

_PROGRAM_THREADS: ToolThreads | None = None  # `program_threads`


@dataclass(frozen=True)
class ProgramResult:
    """What an in-process program may return instead of a bare reward: the reward (None: the run's
    `reward_fn` scores the conversation) and named numbers of its sample, which are advisory and follow
    a command's metrics file's rules (at most 16 names of `[a-z0-9_]`, finite values; anything else is
    ignored with a warning), logged as `rollout/program/<name>/{sum,mean}`."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


async def gateway_server(ctx: Any, cfg: GatewayConfig) -> Any:
    """The worker's gateway server, `ctx.gateway` (made by the first gateway loop, started once on the
    running event loop; the loops that arrive meanwhile wait for the same start)."""
    from streamrl.rollout.gateway.server import GatewayServer

    if ctx.gateway is None:
        ctx.gateway = GatewayServer(cfg)
    await ctx.gateway.ensure_started()
    return ctx.gateway


async def close_gateway(ctx: Any) -> None:
    """Stop the context's gateway server (worker shutdown, tests)."""
    server, ctx.gateway = ctx.gateway, None
    if server is not None:
        await server.stop()


def gateway_metrics(ctx: Any) -> dict[str, float]:
    """The `rollout/gateway/*` counters of the context's server ({} until a gateway loop started it)."""
    return ctx.gateway.metrics() if ctx.gateway is not None and ctx.gateway.port is not None else {}


def program_threads(limit: int) -> ToolThreads:
    """The daemon threads sync programs run in, at most `limit` at once per process. Not asyncio's
    default executor: a sync program past its timeout keeps its thread (threads cannot be cancelled),
    and a few hung ones would stall image decoding and every other `to_thread` caller of the worker.
    Here they only hold slots of this pool; a program that finds none waits, under its own timeout."""
    global _PROGRAM_THREADS
    if _PROGRAM_THREADS is None:
        _PROGRAM_THREADS = ToolThreads(limit, "gateway-program")
    elif _PROGRAM_THREADS.slots.limit != limit:
        _PROGRAM_THREADS.slots.resize(limit)
    return _PROGRAM_THREADS


def sample_of(data: AgentData, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the program is given about its sample (JSON-able). An in-process `program` is the worker's
    own code and may score itself with the ground truth; a `command` gets only `COMMAND_SAMPLE_FIELDS`."""
    return {
        "trajectory_id": data.trajectory_id,
        "group_id": data.group_id,
        "sample_index": data.sample_index,
        "attempt": data.attempt,
        "messages": messages,
        "ground_truth": data.ground_truth,
        "data_source": data.data_source,
        "raw_ground_truth": data.raw_ground_truth,
        "extra_info": data.extra_info,
        "tools_kwargs": data.tools_kwargs,
    }


async def run_program(
    cfg: GatewayConfig,
    base_url: str,
    api_key: str,
    sample: dict[str, Any],
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> float | None:
    """Run the configured program once; returns its reward (None: none given). A command's named
    numbers (`command.read_metrics`) and a `ProgramResult`'s go to `on_metrics`."""
    if cfg.command is not None:
        return await run_command(cfg, base_url, api_key, sample, on_metrics)
    if cfg.program is None:
        raise ValueError("rollout.agent.gateway needs a `program` or a `command` for the gateway agent loop")
    from streamrl.core.registry import import_object

    fn = import_object(cfg.program)
    if inspect.iscoroutinefunction(fn):
        coro = fn(base_url, api_key, sample)
    else:
        coro = program_threads(cfg.max_sync_programs).run(fn, base_url, api_key, sample)
    try:
        result = await asyncio.wait_for(coro, cfg.timeout_s)
    except TimeoutError:
        if not inspect.iscoroutinefunction(fn):
            logger.warning("sync program %s passed its timeout; its thread runs on until it returns", cfg.program)
        raise ProgramError(f"program {cfg.program} did not return within {cfg.timeout_s:g} s") from None
    if isinstance(result, ProgramResult):
        if on_metrics is not None:
            on_metrics(checked_metrics(cfg.program, result.metrics))
        result = result.reward
    return None if result is None else finite(f"the reward of program {cfg.program}", result)


@register("gateway")
class GatewayAgentLoop(AgentLoopBase):
    async def _run(self, data: AgentData) -> None:
        cfg = self.ctx.cfg.gateway
        if cfg is None:
            raise ValueError("the gateway agent loop needs rollout.agent.gateway (a program or a command)")
        server = await gateway_server(self.ctx, cfg)
        session = Session(self.ctx, data, cfg, honor_sampling=cfg.honor_request_sampling)
        state = session.state
        if data.state is AgentState.PENDING:
            state.sample_messages = list(data.messages)  # before the journal's records change them
        # A resume in another attempt: the program starts over and the journal answers its repeats.
        if await session.recover() or data.state is not AgentState.PENDING:
            state.num_restarts += 1
        data.state = AgentState.INTERACTING
        server.add(session)
        finish = FinishReason.STOP
        try:
            reward = await run_program(
                cfg,
                server.base_url(session),
                session.token,
                sample_of(data, state.sample_messages),
                on_metrics=server.account_program,
            )
        except Exception as exc:
            session.save()  # the failed row shows the session as it ended
            if session.failed is not None:
                raise session.failed from exc
            if not state.length_exceeded:
                raise
            logger.info("trajectory %s: program ended after a refused over-long call: %r", data.trajectory_id, exc)
            reward, finish = None, FinishReason.LENGTH
        finally:
            server.remove(session)
        if session.failed is not None:
            session.save()
            raise session.failed
        async with session.lock:
            session.finish()
        if not data.prompt_ids:
            raise ProgramError(f"program of trajectory {data.trajectory_id} made no model call")
        if finish is FinishReason.STOP and data.response_ids and data.response_mask[-1] == 1:
            last = data.response_ids[-1]
            finish = FinishReason.STOP if last == self.ctx.tokenizer.eos_token_id else FinishReason.LENGTH
        self.terminate(data, finish)
        data.reward = reward if reward is not None else await self.finalize(data)
