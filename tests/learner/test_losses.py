"""Policy / value / KL losses and aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.config import KLEstimator, LossAggMode
from streamrl.learner.losses import aggregate, kl_penalty, ppo_policy_loss, token_logprobs_and_entropy, value_loss


def test_ppo_clip_asymmetric_and_dual_clip():
    ratio = torch.tensor([0.5, 1.0, 1.5, 1.5, 0.5, 5.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    loss, clipped, dual = ppo_policy_loss(ratio, adv, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    assert torch.allclose(loss, torch.tensor([-0.5, -1.0, -1.28, 1.5, 0.8, 3.0]))
    assert clipped.tolist() == [False, False, True, False, True, False]
    assert dual.tolist() == [False, False, False, False, False, True]
    loss.sum().backward()
    # clipped and dual-clipped tokens carry no gradient; the others −A
    assert torch.allclose(ratio.grad, torch.tensor([-1.0, -1.0, 0.0, 1.0, 0.0, 0.0]))


def test_ppo_without_dual_clip_and_without_clip():
    ratio = torch.tensor([5.0, 0.1])
    adv = torch.tensor([-1.0, 1.0])
    loss, _, dual = ppo_policy_loss(ratio, adv, clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    assert torch.allclose(loss, torch.tensor([5.0, -0.1])) and not dual.any()
    loss, clipped, _ = ppo_policy_loss(ratio, adv, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0, clip=False)
    assert torch.allclose(loss, torch.tensor([5.0, -0.1])) and not clipped.any()


def test_value_loss_clipping():
    values = torch.tensor([1.0, 2.0, 0.6])
    old = torch.tensor([0.5, 0.5, 0.5])
    returns = torch.tensor([1.5, 0.0, 0.6])
    loss, clipped = value_loss(values, old, returns, clip=0.2)
    # t0: max((1−1.5)², (0.7−1.5)²) = 0.64; t1: max(4, 0.49) = 4; t2: inside the clip range: 0
    assert torch.allclose(loss, torch.tensor([0.32, 2.0, 0.0]))
    assert clipped.tolist() == [True, False, False]
    unclipped, _ = value_loss(values, old, returns, clip=None)
    assert torch.allclose(unclipped, torch.tensor([0.125, 2.0, 0.0]))


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [(KLEstimator.K1, 1.0), (KLEstimator.K2, 0.5), (KLEstimator.K3, math.exp(-1.0))],
)
def test_kl_estimators(estimator, expected):
    out = kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), estimator)  # d = log π_ref − log π_θ = −1
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_aggregation_modes():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, m, LossAggMode.TOKEN_MEAN).item() == pytest.approx(7 / 3)
    assert aggregate(x, m, LossAggMode.SEQ_MEAN_TOKEN_SUM).item() == pytest.approx(3.5)
    assert aggregate(x, m, LossAggMode.SEQ_MEAN_TOKEN_MEAN).item() == pytest.approx(2.75)
    assert aggregate(x, m, LossAggMode.CONSTANT, constant=4).item() == pytest.approx(7 / 8)
    assert aggregate(x, m, LossAggMode.CONSTANT).item() == pytest.approx(7 / 6)  # default constant: T


@pytest.mark.parametrize("mode", list(LossAggMode))
def test_aggregation_over_micro_batches_sums_to_full_batch(mode):
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    m = (torch.rand(5, 6) > 0.4).int()
    full = aggregate(x, m, mode, constant=6)
    norms = dict(num_tokens=float(m.sum()), num_seqs=5.0, constant=6)
    # micro-batches are row subsets trimmed to their own width (here: rows 2.. padded only to 4)
    m_trim = m.clone()
    m_trim[2:, 4:] = 0
    x_trim = x * m_trim
    full_trim = aggregate(x_trim, m_trim, mode, constant=6)
    trim_norms = dict(norms, num_tokens=float(m_trim.sum()))
    parts = aggregate(x_trim[:2], m_trim[:2], mode, **trim_norms) + aggregate(
        x_trim[2:, :4], m_trim[2:, :4], mode, **trim_norms
    )
    assert parts.item() == pytest.approx(full_trim.item(), rel=1e-6)
    rows = aggregate(x[:3], m[:3], mode, **norms) + aggregate(x[3:], m[3:], mode, **norms)
    assert rows.item() == pytest.approx(full.item(), rel=1e-6)


def test_token_logprobs_are_shifted_and_temperature_scaled():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(4.0), 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])
    logp, ent = token_logprobs_and_entropy(logits, ids)
    assert logp[0, 0] == 0.0
    assert logp[0, 1].item() == pytest.approx(math.log(0.75))  # from logits at position 0
    assert logp[0, 2].item() == pytest.approx(math.log(0.8))  # from logits at position 1
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert ent[0, 1].item() == pytest.approx(h, rel=1e-6)
    hot, _ = token_logprobs_and_entropy(logits, ids, temperature=2.0, with_entropy=False)
    assert hot[0, 1].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), rel=1e-6)
