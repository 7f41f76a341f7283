"""The replay buffer: trajectories as Arrow record batches in memory and in a durable log.

`store.ReplayBuffer` holds rows, appends them to the log (`log`, `durable`, `manifest`, `images`),
recovers it after a crash, completes GRPO groups (`groups`), admits by staleness (`admission`),
samples whole groups exactly once (`sampling`) and pads batches for the learner (`padding`).
`schema` is the Arrow mirror of `rollout.types.Trajectory`. No Ray here: the actor that hosts the
buffer is `streaming.actors.buffer`.
"""
