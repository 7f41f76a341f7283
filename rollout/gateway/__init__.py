"""The agent gateway: OpenAI- and Anthropic-compatible endpoints that let an unmodified agent program
generate through the rollout worker's engines while the trainer records exactly what the policy sampled
(docs/gateway.md).

`config` (pure data) and `protocol` (wire formats) import nothing heavy; `session` holds the token
record and the journal, `server` the FastAPI/uvicorn app (imported only when a gateway loop starts),
`loop` the `gateway` agent loop that runs the user program per sample, `command` a `command` program
(its minimal environment, its capped output) under `supervisor` (a standalone script: the subreaper
that kills all the program started). No Ray here: the gateway runs in the rollout worker's process,
on its event loop.
"""

from streamrl.rollout.gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
