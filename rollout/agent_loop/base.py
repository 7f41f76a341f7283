"""Agent loop base: the registry, the shared context, and the interruptible generation step.

An agent loop turns one `AgentData` into one `Trajectory`. `run` either finishes the trajectory or,
when the worker's cancel `asyncio.Event` is set (a weight sync is pausing the engines), *parks* it:
the engine request is aborted, every token already streamed is kept in `AgentData`, and a `partial`
trajectory carrying the JSON snapshot is returned. Resuming is simply `run(AgentData)` again, in this
process or another one: a loop in GENERATING re-prefills prompt + response so far and continues the
same assistant turn with the remaining budget; new tokens carry the engine's new policy_version.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from streamrl.rollout.agent_loop.observation import ObservationEncoder
from streamrl.rollout.config import AgentConfig
from streamrl.rollout.engine.base import SamplingParams
from streamrl.rollout.registry import Registry
from streamrl.rollout.types import AgentData, AgentState, FinishReason, Trajectory, TrajectoryStatus

logger = logging.getLogger(__name__)

LOOPS: Registry[type[AgentLoopBase]] = Registry("agent loop")


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    def wrap(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        LOOPS.register(name)(cls)
        cls.name = name
        return cls

    return wrap


def get_agent_loop_cls(name: str) -> type[AgentLoopBase]:
    return LOOPS.get(name)


@dataclass(kw_only=True)
class LoopCounters:
    """Per-worker counters the loops increment; read by the worker for `rollout/*` metrics."""

    num_interrupts: int = 0
    num_parse_errors: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_tool_calls_interrupted: int = 0  # in doubt after a resume, not idempotent: answered, not re-run
    num_generated_tokens: int = 0
    num_reprefill_tokens: int = 0  # prompt tokens re-sent to an engine after an interrupt


@dataclass(kw_only=True)
class AgentContext:
    """What every agent loop of one worker shares. `cancel` set = park at the next chance.

    `snapshot`, when set, makes a trajectory durable mid-turn: the tool loop awaits it with a copy of
    the AgentData (PROCESSING_TOOLS, the turn's calls journaled as intents) before a turn with a call
    to a non-idempotent tool runs, and it must return only once that state is durable (a partial row
    flushed to the buffer's log); raising fails the trajectory before the tool runs. It is what makes
    "a tool's side effect happens at most once" hold across worker death and job restart; without
    it, that holds within one process only."""

    cfg: AgentConfig
    server: Any  # rollout.server_manager.ServerManager
    tokenizer: Any
    encoder: ObservationEncoder
    tools: Any = None  # rollout.tools.executor.ToolRegistry | None
    parser: Any = None  # rollout.parsers.base.ToolParser | None
    interactions: dict[str, Any] = field(default_factory=dict)
    reward_fn: Callable[[Any], float] | None = None
    snapshot: Callable[[AgentData], Awaitable[None]] | None = None
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    counters: LoopCounters = field(default_factory=LoopCounters)
    num_in_engine: int = 0  # loops with an engine request in flight (pause waits for 0)

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]


class Parked(Exception):
    """Raised inside a loop when it must park; `run` turns it into a partial trajectory."""


class AgentLoopBase(abc.ABC):
    name: str = "base"

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    async def run(self, data: AgentData) -> Trajectory:
        """Drive `data` to TERMINATED, or park it (partial row) when the cancel event is set."""
        if not data.created_at:
            data.created_at = time.time()
        try:
            await self._run(data)
        except Parked:
            data.num_interrupts += 1
            self.ctx.counters.num_interrupts += 1
            return self.to_trajectory(data, TrajectoryStatus.PARTIAL)
        data.check_aligned()
        return self.to_trajectory(data, TrajectoryStatus.FINISHED)

    @abc.abstractmethod
    async def _run(self, data: AgentData) -> None:
        """Advance the state machine until TERMINATED (raise Parked to park)."""

    # ---- shared steps -------------------------------------------------------------------------

    def remaining_budget(self, data: AgentData) -> int:
        """Tokens this turn may still sample: min(per-turn budget left, response budget left)."""
        used_in_turn = len(data.response_ids) - data.turn_start
        turn_left = self.ctx.cfg.max_tokens_per_turn - used_in_turn
        total_left = self.ctx.cfg.response_length - len(data.response_ids)
        return max(min(turn_left, total_left), 0)

    async def generate_turn(self, data: AgentData) -> str:
        """Sample (the rest of) one assistant turn; returns the engine's finish reason.

        Parks before sending if a pause is pending, and mid-generation if one arrives: the engine
        request is aborted and the streamed tokens are appended before parking.
        """
        if self.ctx.cancel.is_set():
            raise Parked()
        max_tokens = self.remaining_budget(data)
        if max_tokens <= 0:
            return "length"
        s = self.ctx.cfg.sampling
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=self.ctx.stop_token_ids,
        )
        data.request_id = f"{data.trajectory_id}-{uuid.uuid4().hex[:8]}"
        prompt = data.prompt_ids + data.response_ids
        if data.num_interrupts and len(data.response_ids) > data.turn_start:
            self.ctx.counters.num_reprefill_tokens += len(prompt)
        t0 = time.monotonic()
        self.ctx.num_in_engine += 1
        gen = asyncio.ensure_future(self.ctx.server.generate(data.trajectory_id, data.request_id, prompt, sampling))
        cancel = asyncio.ensure_future(self.ctx.cancel.wait())
        try:
            done, _ = await asyncio.wait({gen, cancel}, return_when=asyncio.FIRST_COMPLETED)
            if gen not in done:
                await self.ctx.server.abort(data.request_id)
            output, engine_id = await gen
        finally:
            self.ctx.num_in_engine -= 1
            cancel.cancel()
            if not gen.done():
                gen.cancel()
        data.generate_s += time.monotonic() - t0
        data.engine_id = engine_id
        data.append_sampled(output.token_ids, output.logprobs, output.policy_versions)
        self.ctx.counters.num_generated_tokens += len(output.token_ids)
        if output.aborted:
            raise Parked()
        return output.finish_reason

    def out_of_room(self, data: AgentData) -> bool:
        return len(data.response_ids) >= self.ctx.cfg.response_length

    def append_observation(self, data: AgentData, messages: list[dict[str, Any]]) -> bool:
        """Template `messages` after the last assistant turn and append them (mask 0).

        Returns False (and appends nothing) when the observation does not fit the response budget:
        the trajectory then terminates with LENGTH, never a truncated half-template.
        """
        last = data.response_ids[-1] if data.response_ids else None
        ids = self.ctx.encoder.encode_new_messages(messages, after_eos=last == self.ctx.tokenizer.eos_token_id)
        if len(data.response_ids) + len(ids) >= self.ctx.cfg.response_length:
            return False
        data.append_observation(ids)
        data.messages.extend(messages)
        return True

    def decode(self, token_ids: list[int]) -> str:
        return self.ctx.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def finalize(self, data: AgentData) -> float:
        """Score the finished trajectory (reward fn + tool rewards + interaction score)."""
        from streamrl.rollout.rewards import RewardInput

        reward = 0.0
        if self.ctx.reward_fn is not None:
            assistant = [m.get("content") or "" for m in data.messages if m.get("role") == "assistant"]
            reward = float(
                self.ctx.reward_fn(
                    RewardInput(
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
                )
            )
        return reward + sum(data.tool_rewards)

    @staticmethod
    def to_trajectory(data: AgentData, status: TrajectoryStatus) -> Trajectory:
        if data.images:  # the buffer needs each image's placeholder count and bytes (docs/multimodal.md)
            raise NotImplementedError(
                f"trajectory {data.trajectory_id} carries {len(data.images)} images; the agent loop does not "
                "hand images to the buffer yet (docs/multimodal.md, step 1 open items)"
            )
        partial = status is TrajectoryStatus.PARTIAL
        return Trajectory(
            trajectory_id=data.trajectory_id,
            group_id=data.group_id,
            sample_index=data.sample_index,
            agent_name=data.agent_name,
            prompt_ids=list(data.prompt_ids),
            response_ids=list(data.response_ids),
            response_mask=list(data.response_mask),
            behavior_logprobs=list(data.response_logprobs),
            policy_versions=list(data.policy_versions),
            reward=0.0 if partial else data.reward,
            turn_scores=list(data.turn_scores),
            tool_rewards=list(data.tool_rewards),
            num_turns=data.num_assistant_turns + data.num_user_turns,
            num_tool_calls=data.num_tool_calls,
            num_tool_errors=data.num_tool_errors,
            status=status,
            finish_reason=FinishReason.ABORT if partial else (data.finish_reason or FinishReason.STOP),
            num_interrupts=data.num_interrupts,
            generate_s=data.generate_s,
            tool_s=data.tool_s,
            created_at=data.created_at,
            finished_at=time.time(),
            agent_data_json=data.to_json() if partial else None,
        )

    def terminate(self, data: AgentData, reason: FinishReason) -> None:
        data.state = AgentState.TERMINATED
        data.finish_reason = reason
