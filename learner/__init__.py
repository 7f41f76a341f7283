"""Learner: buffer batches → PPO/GRPO policy updates with staleness-aware importance correction.

Pure policy math: `advantages` (GRPO, masked multi-turn GAE), `losses` (clipped surrogate, value,
KL, aggregation), `correction` (none / tis / decoupled / masked / m2po). Around it: `engine`
(`TrainingEngine`: HF model, AdamW, micro-batching, checkpoints, weights for sync) and `group`
(`LearnerGroup`: FSDP2 ranks as Ray actors). Heavy modules import torch; this package init does not.
"""
