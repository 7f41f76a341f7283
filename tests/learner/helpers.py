"""Builders for learner tests: a `PaddedBatch`-like namespace of numpy arrays."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def padded_batch(
    sequences: list[tuple[list[int], list[int], list[int]]],
    *,
    rewards: list[float],
    group_index: list[int],
    behavior_logprobs: list[list[float]] | None = None,
    policy_versions: list[int] | list[list[int]] | None = None,
    turn_scores: list[list[float]] | None = None,
) -> SimpleNamespace:
    """sequences[b] = (prompt_ids, response_ids, response_mask); right-padded with id 0.

    behavior_logprobs[b] is per response token; policy_versions[b] an int (whole row) or per token.
    """
    batch = len(sequences)
    width = max(len(p) + len(r) for p, r, _ in sequences)
    ids = np.zeros((batch, width), np.int64)
    attn = np.zeros((batch, width), np.int8)
    loss = np.zeros((batch, width), np.int8)
    behav = np.zeros((batch, width), np.float32)
    versions = np.full((batch, width), -1, np.int32)
    for b, (prompt, resp, mask) in enumerate(sequences):
        n, p = len(prompt) + len(resp), len(prompt)
        ids[b, :n] = prompt + resp
        attn[b, :n] = 1
        loss[b, p:n] = mask
        if behavior_logprobs is not None:
            behav[b, p:n] = np.asarray(behavior_logprobs[b]) * np.asarray(mask)
        pv = 0 if policy_versions is None else policy_versions[b]
        row_versions = np.asarray(pv if isinstance(pv, list) else [pv] * len(resp))
        versions[b, p:n] = np.where(np.asarray(mask) == 1, row_versions, -1)
    return SimpleNamespace(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss,
        behavior_logprobs=behav,
        policy_versions=versions,
        prompt_lens=np.asarray([len(p) for p, _, _ in sequences], np.int32),
        seq_lens=attn.sum(1).astype(np.int32),
        rewards=np.asarray(rewards, np.float32),
        group_index=np.asarray(group_index, np.int64),
        trajectory_ids=[f"t{b}" for b in range(batch)],
        group_ids=[f"g{g}" for g in group_index],
        turn_scores=turn_scores or [[] for _ in range(batch)],
    )
