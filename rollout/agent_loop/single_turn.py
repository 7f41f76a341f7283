"""SingleTurnAgentLoop: one assistant turn, no tools; interruptible and resumable like the others."""

from __future__ import annotations

from streamrl.rollout.agent_loop.base import AgentLoopBase, register
from streamrl.rollout.types import AgentData, AgentState, FinishReason


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def _run(self, data: AgentData) -> None:
        if data.state is AgentState.PENDING:
            data.prompt_ids = await self.encode_prompt(data, None)
            if len(data.prompt_ids) > self.ctx.cfg.prompt_length:
                raise ValueError(
                    f"prompt of {len(data.prompt_ids)} tokens exceeds agent.prompt_length={self.ctx.cfg.prompt_length}"
                )
            data.state = AgentState.GENERATING
        finish = await self.generate_turn(data)
        data.num_assistant_turns = 1
        data.messages.append({"role": "assistant", "content": self.decode(data.response_ids)})
        self.terminate(data, FinishReason.LENGTH if finish == "length" else FinishReason.STOP)
        data.reward = await self.finalize(data)
