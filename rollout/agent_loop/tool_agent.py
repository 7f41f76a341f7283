"""ToolAgentLoop: the multi-turn tool/interaction state machine, one handler per state.

    PENDING ─► GENERATING ─► PROCESSING_TOOLS ─► GENERATING ...
                    │ └────► INTERACTING ──────► GENERATING ...
                    └──────► TERMINATED ◄─────── (limits, stop, interaction done)

Every handler reads and writes only `AgentData`, so the loop can park after any handler and resume
from the JSON snapshot. Malformed tool calls (bad JSON, unknown tool, wrong argument types, too many
calls) become error observations (mask 0) the model can learn from, and are counted.

A tool call's side effect happens at most once per trajectory. PROCESSING_TOOLS first journals the
calls that will reach a tool (`AgentData.tool_journal`, status INTENT) and, unless they all go to
idempotent tools, awaits the context's `snapshot` hook, which makes that state durable, before
running any of them; results, journal statuses and the observation then land in one synchronous
step. Intents the handler finds already journaled come from such a snapshot, recorded by a process
that died mid-call (a park never happens in this state): calls with a result are not run again,
calls still in INTENT are re-run when their tool is idempotent and otherwise answered with an
"interrupted" error observation.

Tools and interactions may answer with images (`image_observation.py`): a VLM policy sees them in the
observation and `AgentData.images` grows with it; a response whose images cannot be shown becomes an
error observation. A re-run or replayed call never adds an image twice: images enter `AgentData.images`
only with the observation that shows them, in the synchronous step above.

Tool instances and the interaction instance live for the whole trajectory: a park keeps them in this
process, a resume in another process rebuilds them (`BaseTool.restore` from the journal,
`BaseInteraction.restore` from the messages), and they are released when the trajectory ends,
finished or failed.
"""

from __future__ import annotations

import logging
import time

from streamrl.core import faults, trace
from streamrl.rollout.agent_loop.base import AgentLoopBase, Parked, register
from streamrl.rollout.agent_loop.image_observation import cap_tool_images, reply_content, tool_message
from streamrl.rollout.agent_loop.scoring import finite
from streamrl.rollout.types import AgentData, AgentState, FinishReason
from streamrl.tools.types import ToolCall, ToolCallStatus, ToolJournalEntry, ToolResult

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
        self.instance_ids: dict[str, str] = {}
        try:
            await self._attach(data)
            while data.state is not AgentState.TERMINATED:
                await handlers[data.state](data)
            data.reward = await self.finalize(data)
        except Parked:
            raise  # the instances stay here for the resume
        except BaseException:
            try:
                await self._close(data)
            except Exception as exc:  # the trajectory's own error is the one to surface
                logger.warning("cleanup of failed trajectory %s raised %r", data.trajectory_id, exc)
            raise
        await self._close(data)

    async def _attach(self, data: AgentData) -> None:
        """Get this trajectory's tool and interaction instances: live ones if it parked in this
        process, otherwise rebuilt from what the trajectory carries."""
        if self.ctx.tools is not None:
            self.instance_ids = await self.ctx.tools.open_session(
                data.trajectory_id, data.tools_kwargs, data.tool_journal
            )
        await self._reattach_interaction(data)

    async def _close(self, data: AgentData) -> None:
        """The trajectory ended (finished, failed or cancelled): finalize its interaction and release
        its tool instances."""
        try:
            if data.interaction_name is not None and data.interaction_instance_id is not None:
                await self._interaction(data).finalize_interaction(data.interaction_instance_id)
        finally:
            if self.ctx.tools is not None:
                await self.ctx.tools.close_session(data.trajectory_id)

    async def handle_pending(self, data: AgentData) -> None:
        tools = self.ctx.tools.schemas() if self.ctx.tools is not None else None
        data.prompt_ids = await self.encode_prompt(data, tools)
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
        from streamrl.tools.schema import validate_call

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
        cfg, tools = self.ctx.cfg, self.ctx.tools
        calls = data.pending_tool_calls
        turn = {c.call_id for c in calls}
        seen = {e.call_id for e in data.tool_journal} | {r.call_id for r in data.tool_results}
        # Intents journaled by this call run now; intents found in the snapshot we resumed from are
        # in doubt (the process that recorded them died while they ran).
        fresh = set() if turn & seen else await self._journal_intents(data)
        to_run: list[ToolJournalEntry] = []
        lost: list[ToolJournalEntry] = []  # in doubt and not idempotent: never run twice
        for entry in data.tool_journal:
            if entry.call_id in turn and entry.status is ToolCallStatus.INTENT:
                (to_run if entry.call_id in fresh or tools.is_idempotent(entry.name) else lost).append(entry)
        t0 = time.monotonic()
        with trace.span("tool", "trajectory", data.trajectory_id, attempt=data.attempt, calls=len(to_run)):
            results = await tools.run_calls(
                [e.call() for e in to_run],
                self.instance_ids,
                timeout_s=cfg.tool_timeout_s,
                images=self.ctx.response_images,
            )
        data.tool_s += time.monotonic() - t0
        # From here to the state change there is no await: results, journal, observation and its
        # images land together (only `to_run` results carry images, in call order).
        results = cap_tool_images(results, len(data.images), self.ctx.max_images)
        new: dict[str, ToolResult] = {}  # call id -> result, for the calls run and the calls lost
        for entry, result in zip(to_run, results):
            entry.status, entry.result = ToolCallStatus.DONE, result
            new[entry.call_id] = result
        for entry in lost:
            result = tools.interrupted(entry.call())
            entry.status, entry.result = ToolCallStatus.INTERRUPTED, result
            new[entry.call_id] = result
            self.ctx.counters.num_tool_calls_interrupted += 1
        data.tool_results.extend(new[c.call_id] for c in calls if c.call_id in new)
        by_id = {r.call_id: r for r in data.tool_results}
        ordered = [by_id[c.call_id] for c in calls]
        data.num_tool_calls += len(ordered)
        errors = sum(r.is_error for r in ordered)
        data.num_tool_errors += errors
        self.ctx.counters.num_tool_calls += len(ordered)
        self.ctx.counters.num_tool_errors += errors
        data.tool_rewards.extend(r.reward for r in ordered if r.reward)
        messages = [tool_message(r, cfg) for r in ordered]
        data.pending_tool_calls = []
        data.num_user_turns += 1
        if not self.append_observation(data, messages):
            return self.terminate(data, FinishReason.LENGTH)
        data.turn_start = len(data.response_ids)
        data.state = AgentState.GENERATING

    async def _journal_intents(self, data: AgentData) -> set[str]:
        """Answer the turn's calls that cannot reach a tool, journal the others as intents, and make
        that state durable (the context's snapshot hook) before any of them runs; returns their ids.

        A turn whose calls all go to idempotent tools skips the snapshot: redoing it from the last
        durable row re-runs them, which is harmless, and calculator turns stay free of a log flush."""
        tools = self.ctx.tools
        plan = tools.check_calls(data.pending_tool_calls, max_parallel=self.ctx.cfg.max_parallel_calls)
        intents = [c for c in plan if isinstance(c, ToolCall)]
        data.tool_results.extend(r for r in plan if isinstance(r, ToolResult))
        data.tool_journal.extend(
            ToolJournalEntry(call_id=c.call_id, name=c.name, arguments=c.arguments) for c in intents
        )
        if self.ctx.snapshot is not None and any(not tools.is_idempotent(c.name) for c in intents):
            await self.make_durable(data)
            faults.hit("tool.before_run")  # the intents are durable, no tool has run
        return {c.call_id for c in intents}

    async def handle_interacting(self, data: AgentData) -> None:
        interaction = self._interaction(data)
        with trace.span("interaction", "trajectory", data.trajectory_id, attempt=data.attempt):
            should_stop, reply, score, _ = await interaction.generate_response(
                data.interaction_instance_id, data.messages, ground_truth=data.ground_truth
            )
        data.turn_scores.append(finite(f"the turn score of interaction {data.interaction_name}", score))
        data.num_user_turns += 1
        if should_stop:
            data.interaction_done = True
            return self.terminate(data, FinishReason.INTERACTION_DONE)
        content = await reply_content(reply, self.ctx.response_images, len(data.images), self.ctx.max_images)
        if not self.append_observation(data, [{"role": "user", "content": content}]):
            return self.terminate(data, FinishReason.LENGTH)
        data.turn_start = len(data.response_ids)
        data.state = AgentState.GENERATING

    async def _reattach_interaction(self, data: AgentData) -> None:
        """A trajectory resumed in another process restores its interaction instance under the same id
        (interaction state that must survive a preemption is rebuilt from the messages it sees)."""
        if data.interaction_name is None or data.interaction_instance_id is None or data.interaction_done:
            return
        interaction = self._interaction(data)
        try:
            interaction.instance_state(data.interaction_instance_id)
        except ValueError:
            await interaction.restore(data.interaction_instance_id, data.messages, ground_truth=data.ground_truth)

    def _interaction(self, data: AgentData):
        name = data.interaction_name
        if name not in self.ctx.interactions:
            raise ValueError(f"unknown interaction {name!r}; configured: {sorted(self.ctx.interactions)}")
        return self.ctx.interactions[name]

    async def finalize(self, data: AgentData) -> float:
        if self.ctx.tools is not None:
            data.tool_rewards.extend((await self.ctx.tools.tool_rewards(self.instance_ids)).values())
        reward = await super().finalize(data)
        if data.interaction_name is not None and data.interaction_instance_id is not None:
            score = await self._interaction(data).calculate_score(data.interaction_instance_id)
            reward = max(reward, finite(f"the score of interaction {data.interaction_name}", score))
        return reward
