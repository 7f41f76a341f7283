"""What produces trajectories: agent loops on inference engines, with tools and rewards.

`types` holds the records (`AgentData`, `Trajectory`); `agent_loop/` the loops (tool calling,
single turn, image prompts); `engine/` the engine interface, vLLM and a fake; `server_manager`
routing over engines; `parsers/` tool-call parsers; `tools/` and `interactions/` what the agent
talks to; `rewards`; `worker.RolloutWorker`, the pause/resume point; datasets (`data`). No Ray
here: the actors that host engines and workers are in `streaming.actors`.
"""
