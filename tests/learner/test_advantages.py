"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.advantages import (
    assistant_turn_spans,
    grpo_advantages,
    masked_gae,
    masked_whiten,
    token_level_rewards,
)


def test_grpo_group_normalised_with_std():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 4.0]), torch.tensor([0, 0, 7, 7]), scale_std=True)
    s = 1 / math.sqrt(2)  # centred ±0.5 / std 0.7071 and ∓1 / std 1.4142
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s]), atol=1e-5)


def test_grpo_mean_centering_only_and_singleton_group():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 5.0]), torch.tensor([0, 0, 0, 1]), scale_std=False)
    assert torch.allclose(adv, torch.tensor([-1 / 3, -4 / 3, 5 / 3, 0.0]), atol=1e-6)
    adv_std = grpo_advantages(torch.tensor([2.0, 1.0, 1.0]), torch.tensor([3, 4, 4]))
    assert torch.equal(adv_std, torch.zeros(3))  # singleton and constant groups carry no signal


def test_assistant_turn_spans_and_token_rewards_at_turn_ends():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])
    assert assistant_turn_spans(mask[0]) == [(1, 3), (5, 7)]
    r = token_level_rewards(mask, torch.tensor([1.0]), [[0.5, 0.25]])
    assert torch.allclose(r, torch.tensor([[0, 0, 0.5, 0, 0, 0, 1.25, 0]]))
    # no scores: only the final reward on the last action token; a row without actions gets nothing
    r2 = token_level_rewards(torch.tensor([[0, 1, 0], [0, 0, 0]]), torch.tensor([2.0, 3.0]))
    assert torch.equal(r2, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))


def test_token_rewards_reject_more_scores_than_turns():
    with pytest.raises(ValueError, match="turn scores"):
        token_level_rewards(torch.tensor([[0, 1, 1]]), torch.tensor([1.0]), [[0.1, 0.2]])


def test_multi_turn_gae_skips_observation_tokens():
    # positions: 0 prompt, 1-2 turn 1, 3-4 tool response, 5 turn 2, 6 padding
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0]])
    # values at observation/padding positions are garbage and must be ignored
    values = torch.tensor([[9.0, 0.5, 1.0, 9.0, 9.0, 2.0, 9.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.1, 7.0, 7.0, 1.0, 7.0]])  # off-mask rewards ignored
    adv, ret = masked_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # pos 5 (last): δ = 1 − 2 = −1, A = −1
    # pos 2: δ = 0.1 + 0.9·V5 − V2 = 0.9, A = 0.9 + 0.72·(−1) = 0.18   (bootstraps across the tool response)
    # pos 1: δ = 0 + 0.9·V2 − V1 = 0.4, A = 0.4 + 0.72·0.18 = 0.5296
    expected_adv = torch.tensor([[0, 0.5296, 0.18, 0, 0, -1.0, 0]])
    assert torch.allclose(adv, expected_adv, atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0, 1.0296, 1.18, 0, 0, 1.0, 0]]), atol=1e-6)


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.5, 1.0], [0.0, 0.0, 2.0, 0.0]])
    values = torch.tensor([[0.2, 0.0, 0.3, 0.4], [0.0, 1.0, 1.5, 0.0]])
    adv, ret = masked_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, torch.tensor([[1.5, 0, 1.5, 1.0], [0, 2.0, 2.0, 0]]))
    assert torch.allclose(adv, ret - values * mask)


def test_masked_whiten():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1, 1, 0]]))
    assert torch.allclose(out, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-4)
