"""Advantage estimators: GRPO group-normalised outcome advantages and masked multi-turn GAE.

Pure functions on tensors. Shapes: B sequences, T padded positions; `mask` is the loss mask
(1 = action token sampled by the policy, 0 = prompt / observation / padding). A trajectory's final
reward sits on its last action token; optional per-turn scores sit on the last action token of their
turn (the end of each contiguous run of mask-1 tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assistant_turn_spans(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous runs of mask-1 positions in one row as half-open (start, end) pairs."""
    m = (mask_row != 0).to(torch.int8)
    padded = torch.cat([m.new_zeros(1), m, m.new_zeros(1)])
    diff = padded[1:] - padded[:-1]
    starts = torch.nonzero(diff == 1).flatten().tolist()
    ends = torch.nonzero(diff == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))


def token_level_rewards(
    mask: torch.Tensor,  # [B, T]
    rewards: torch.Tensor,  # [B]
    turn_scores: Sequence[Sequence[float]] | None = None,  # [B][num_scored_turns]
) -> torch.Tensor:  # [B, T]
    """Scatter scalar rewards onto action tokens.

        r[b, last_action(b)] += rewards[b]
        r[b, end(turn_k(b)) - 1] += turn_scores[b][k]      for k < len(turn_scores[b])

    A row with no action token gets no reward (nothing to credit). More turn scores than assistant
    turns is a data bug and raises ValueError.
    """
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    for b in range(mask.shape[0]):
        turns = assistant_turn_spans(mask[b])
        if not turns:
            continue
        out[b, turns[-1][1] - 1] += rewards[b].to(torch.float32)
        scores = list(turn_scores[b]) if turn_scores else []
        if len(scores) > len(turns):
            raise ValueError(f"row {b}: {len(scores)} turn scores but only {len(turns)} assistant turns")
        for (_, end), score in zip(turns, scores):
            out[b, end - 1] += float(score)
    return out


def grpo_advantages(
    rewards: torch.Tensor,  # [B] scalar return per sequence
    group_index: torch.Tensor,  # [B] group id per sequence
    *,
    scale_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # [B]
    """GRPO outcome advantage, per sequence.

        A_i = (R_i − mean_{j∈g(i)} R_j) / (std_{j∈g(i)} R_j + eps)     if scale_std
        A_i =  R_i − mean_{j∈g(i)} R_j                                  otherwise (Dr.GRPO)

    std is the unbiased sample std; a group of one has advantage 0.
    """
    rewards = rewards.to(torch.float32)
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float32, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, rewards)
    mean = total / count
    centered = rewards - mean[inverse]
    if not scale_std:
        return centered
    sq = torch.zeros_like(count).index_add_(0, inverse, centered**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std[inverse] + eps)


def broadcast_sequence_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence advantages → [B, T] on action tokens (0 elsewhere)."""
    return adv[:, None].to(torch.float32) * (mask != 0).to(torch.float32)


def masked_gae(
    token_rewards: torch.Tensor,  # [B, T]
    values: torch.Tensor,  # [B, T] V(s_t) for the state in which action token t is sampled
    mask: torch.Tensor,  # [B, T]
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # advantages [B, T], returns [B, T]
    """GAE over action tokens only; observation tokens (mask 0) are skipped, not stepped through.

    For action tokens t_1 < t_2 < … < t_n of a row (everything between them — tool responses,
    user turns — is part of the environment transition):

        δ_k = r_{t_k} + γ · V_{t_{k+1}} − V_{t_k}          (V_{t_{n+1}} = 0: terminal)
        A_k = δ_k + γλ · A_{k+1}                            (A_{n+1} = 0)
        R_k = A_k + V_{t_k}                                 (value target)

    so the value of the last action token of a turn bootstraps from the first action token of the
    next turn, across the tool response. Non-action positions get advantage and return 0; rewards
    on non-action positions are ignored (place them with `token_level_rewards`).
    """
    m = (mask != 0).to(torch.float32)
    values = values.detach().to(torch.float32) * m
    rewards = token_rewards.to(torch.float32) * m
    batch, length = mask.shape
    next_value = torch.zeros(batch, dtype=torch.float32, device=mask.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros((batch, length), dtype=torch.float32, device=mask.device)
    for t in reversed(range(length)):
        is_action = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = a_t * is_action
        # Carry only through action tokens: observation positions leave the carry untouched.
        next_value = torch.where(is_action > 0, values[:, t], next_value)
        next_adv = torch.where(is_action > 0, a_t, next_adv)
    returns = (adv + values) * m
    return adv, returns


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    *,
    all_reduce: Callable[[float], float] | None = None,
) -> torch.Tensor:
    """(x − mean) / std over mask-1 entries (population std); 0 elsewhere.

    `all_reduce` (a sum over learner ranks) makes mean and std global across a sharded batch.
    """
    total = all_reduce or (lambda v: v)
    m = (mask != 0).to(x.dtype)
    n = max(total(float(m.sum().item())), 1.0)
    mean = total(float((x * m).sum().item())) / n
    var = total(float((((x - mean) * m) ** 2).sum().item())) / n
    return (x - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=x.dtype)) * m
