"""Train a real coding-agent harness, mini-swe-agent, unchanged (docs/harness.md).

mini-swe-agent runs in a virtual environment of its own (it brings litellm and litellm's pins), as the
gateway's `command` program: per sample, the episode program (`episode.py`) makes a copy of the task's
repository (`tasks.py`), starts mini's own `DefaultAgent` and litellm model class against the sample's
gateway session (`runner.py`), runs each shell command the agent sends in streamrl's sandbox on that copy
(`shell.py`), and scores the final repository with the task's hidden tests. The tasks' prompts, written
once before training (`prepare.py`), are the run's prompt stream. `config.py` is the
`[rollout.agent.mini_swe]` section.
"""
