"""Train verifiers environments unchanged (docs/verifiers.md).

An environment (`load_environment()` returning a SingleTurnEnv, ToolEnv, MultiTurnEnv, StatefulToolEnv,
...) runs in a virtual environment of its own (`venv.py`), as the gateway's `command` program
(`runner.py`): per sample, its own rollout talks to the sample's gateway session, so every trained token
is one the engine sampled, and its own rubric gives the reward. Its dataset, dumped once before training
(`prepare.py`), is the run's prompt stream. `config.py` is the `[rollout.agent.verifiers]` section.
"""
