"""Agent loops: `run(AgentData) -> Trajectory`, registered by name (`tool_agent`, `single_turn_agent`)."""

from streamrl.rollout.agent_loop.base import AgentContext, AgentLoopBase, LoopCounters, get_agent_loop_cls, register
from streamrl.rollout.agent_loop.single_turn import SingleTurnAgentLoop
from streamrl.rollout.agent_loop.tool_agent import ToolAgentLoop
from streamrl.rollout.gateway.loop import GatewayAgentLoop  # registers `gateway`

__all__ = [
    "AgentContext",
    "AgentLoopBase",
    "GatewayAgentLoop",
    "LoopCounters",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "get_agent_loop_cls",
    "register",
]
