"""Agents built with real agent frameworks, trained unchanged through the gateway (docs/gateway.md).

Each module exposes `run(base_url, api_key, sample) -> reward | None`, the function the `gateway` agent
loop calls per sample (`rollout.agent.gateway.program = "streamrl.workloads.agents.<module>:run"`).
The framework is pointed at the base URL as it would be at any OpenAI-compatible server; of streamrl
they use at most a tool's implementation (the calculator's evaluator).
"""
