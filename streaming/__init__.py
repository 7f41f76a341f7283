"""The driver: config, CLI, the training loops and the Ray actors that host every part.

`config` (the one config tree), `cli`, `train` (builds the pipeline), `pipeline` (driver state and one
typed client per actor), `driver` (the async and sync loops), `actors/` (the Ray hosts and their
clients), `heldout` (version-pinned evaluation), `resume`, `checkpoints`, `invariants`, `sft`,
`preflight` (the memory estimate), `replay`.
"""
