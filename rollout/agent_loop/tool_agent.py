"""ToolAgentLoop: the multi-turn tool/interaction state machine, one handler per state.

    PENDING ─► GENERATING ─► PROCESSING_TOOLS ─► GENERATING ...
                    │ └────► INTERACTING ──────► GENERATING ...
                    └──────► TERMINATED ◄─────── (limits, stop, interaction done)

Every handler reads and writes only `AgentData`, so the loop can park after any handler and resume
from the JSON snapshot. Tool results are recorded in `AgentData.tool_results` together with their
observation tokens in one synchronous step, so a resumed trajectory never runs a tool twice.
Malformed tool calls (bad JSON, unknown tool, wrong argument types, too many calls) become error
observations (mask 0) the model can learn from, and are counted.
"""

from __future__ import annotations

import logging
import time

from rollout.agent_loop.base import AgentLoopBase, register
from rollout.agent_loop.observation import truncate_text
from rollout.types import AgentData, AgentState, FinishReason, ToolCall, ToolResult

logger = logging.getLogger(__name__)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    async def _run(self, data: AgentData) -> None:
        handlers = {
            AgentState.PENDING: self.handle_pending,
            AgentState.GENERATING: self.handle_generating,
            AgentState.PROCESSING_TOOLS: self.handle_processing_tools,
            AgentState.INTERACTING: self.handle_interacting,
        }
        # Tool instances live for one `run` (one segment between parks). Tools are stateless between
        # calls or rebuild state from `tools_kwargs`, so a segment resumed in another process works.
        self.instance_ids: dict[str, str] = {}
        if self.ctx.tools is not None:
            self.instance_ids = await self.ctx.tools.create_instances(data.tools_kwargs)
        await self._reattach_interaction(data)
        try:
            while data.state is not AgentState.TERMINATED:
                await handlers[data.state](data)
            if self.ctx.tools is not None:
                data.tool_rewards.extend((await self.ctx.tools.tool_rewards(self.instance_ids)).values())
            data.reward = await self.finalize(data)
        finally:
            if self.ctx.tools is not None:
                await self.ctx.tools.release_instances(self.instance_ids)

    async def handle_pending(self, data: AgentData) -> None:
        tools = self.ctx.tools.schemas() if self.ctx.tools is not None else None
        data.prompt_ids = self.ctx.encoder.encode_prompt(data.messages, tools)
        if len(data.prompt_ids) > self.ctx.cfg.prompt_length:
            raise ValueError(
                f"prompt of {len(data.prompt_ids)} tokens exceeds agent.prompt_length={self.ctx.cfg.prompt_length}"
            )
        if data.interaction_name is not None:
            interaction = self._interaction(data)
            data.interaction_instance_id = await interaction.start_interaction(
                data.trajectory_id, ground_truth=data.ground_truth
            )
        data.turn_start = 0
        data.state = AgentState.GENERATING

    async def handle_generating(self, data: AgentData) -> None:
        finish = await self.generate_turn(data)
        turn_ids = data.response_ids[data.turn_start :]
        data.num_assistant_turns += 1
        text = self.decode(turn_ids)
        calls: list[ToolCall] = []
        content = text
        if self.ctx.tools is not None and self.ctx.parser is not None:
            parsed = self.ctx.parser.parse(text)
            content, calls = parsed.content, parsed.tool_calls
            calls = self._validate(data, calls)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        data.messages.append(message)

        # A turn cut by the per-turn budget still goes on to its tools / interaction while the
        # trajectory's response budget lasts (the observation then starts with the missing eos).
        if self.out_of_room(data):
            return self.terminate(data, FinishReason.LENGTH)
        if data.num_assistant_turns >= self.ctx.cfg.max_assistant_turns:
            return self.terminate(data, FinishReason.MAX_TURNS)
        if calls:
            if data.num_user_turns >= self.ctx.cfg.max_user_turns:
                return self.terminate(data, FinishReason.MAX_TURNS)
            data.pending_tool_calls = calls
            data.state = AgentState.PROCESSING_TOOLS
        elif data.interaction_name is not None and not data.interaction_done:
            if data.num_user_turns >= self.ctx.cfg.max_user_turns:
                return self.terminate(data, FinishReason.MAX_TURNS)
            data.state = AgentState.INTERACTING
        else:
            self.terminate(data, FinishReason.LENGTH if finish == "length" else FinishReason.STOP)

    def _validate(self, data: AgentData, calls: list[ToolCall]) -> list[ToolCall]:
        """Prefix call ids with the turn (unique per trajectory) and validate against schemas."""
        from rollout.parsers import validate_call

        schemas = self.ctx.tools.schemas()
        out = []
        for i, call in enumerate(calls):
            call = call.model_copy(update={"call_id": f"t{data.num_assistant_turns}_call_{i}"})
            if call.error is None:
                call = validate_call(call, schemas)
            if call.error is not None:
                data.num_parse_errors += 1
                self.ctx.counters.num_parse_errors += 1
            out.append(call)
        return out

    async def handle_processing_tools(self, data: AgentData) -> None:
        cfg = self.ctx.cfg
        done = {r.call_id for r in data.tool_results}
        todo = [c for c in data.pending_tool_calls if c.call_id not in done]
        t0 = time.monotonic()
        results: list[ToolResult] = await self.ctx.tools.execute_calls(
            todo, self.instance_ids, timeout_s=cfg.tool_timeout_s, max_parallel=cfg.max_parallel_calls
        )
        data.tool_s += time.monotonic() - t0
        # From here to the state change there is no await: results and observation land together.
        by_id = {r.call_id: r for r in data.tool_results}
        by_id.update({r.call_id: r for r in results})
        ordered = [by_id[c.call_id] for c in data.pending_tool_calls]
        data.tool_results.extend(results)
        data.num_tool_calls += len(results)
        errors = sum(r.is_error for r in results)
        data.num_tool_errors += errors
        self.ctx.counters.num_tool_calls += len(results)
        self.ctx.counters.num_tool_errors += errors
        data.tool_rewards.extend(r.reward for r in results if r.reward)
        messages = [
            {
                "role": "tool",
                "tool_call_id": r.call_id,
                "name": r.name,
                "content": truncate_text(r.text, cfg.max_tool_response_chars, cfg.tool_response_truncate),
            }
            for r in ordered
        ]
        data.pending_tool_calls = []
        data.num_user_turns += 1
        if not self.append_observation(data, messages):
            return self.terminate(data, FinishReason.LENGTH)
        data.turn_start = len(data.response_ids)
        data.state = AgentState.GENERATING

    async def handle_interacting(self, data: AgentData) -> None:
        interaction = self._interaction(data)
        should_stop, reply, score, _ = await interaction.generate_response(
            data.interaction_instance_id, data.messages, ground_truth=data.ground_truth
        )
        data.turn_scores.append(float(score))
        data.num_user_turns += 1
        if should_stop:
            data.interaction_done = True
            return self.terminate(data, FinishReason.INTERACTION_DONE)
        if not self.append_observation(data, [{"role": "user", "content": reply}]):
            return self.terminate(data, FinishReason.LENGTH)
        data.turn_start = len(data.response_ids)
        data.state = AgentState.GENERATING

    async def _reattach_interaction(self, data: AgentData) -> None:
        """A trajectory resumed in another process restarts its interaction instance under the same id
        (interaction state that must survive a preemption belongs in the messages it sees)."""
        if data.interaction_name is None or data.interaction_instance_id is None or data.interaction_done:
            return
        interaction = self._interaction(data)
        try:
            interaction.instance_state(data.interaction_instance_id)
        except ValueError:
            await interaction.start_interaction(data.interaction_instance_id, ground_truth=data.ground_truth)

    def _interaction(self, data: AgentData):
        name = data.interaction_name
        if name not in self.ctx.interactions:
            raise ValueError(f"unknown interaction {name!r}; configured: {sorted(self.ctx.interactions)}")
        return self.ctx.interactions[name]

    async def finalize(self, data: AgentData) -> float:
        reward = await super().finalize(data)
        if data.interaction_name is not None and data.interaction_instance_id is not None:
            interaction = self._interaction(data)
            reward = max(reward, float(await interaction.calculate_score(data.interaction_instance_id)))
            await interaction.finalize_interaction(data.interaction_instance_id)
        return reward
