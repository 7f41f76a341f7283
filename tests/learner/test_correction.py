"""Staleness correction modes against hand-computed tensors, and their reductions to each other."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.config import CorrectionConfig, LossAggMode
from streamrl.learner.correction import (
    loglinear_prox_logp,
    m2_keep_mask,
    policy_ratio,
    staleness_correction,
)
from streamrl.learner.is_metrics import TokenStats, correction_metrics
from streamrl.learner.losses import aggregate, ppo_policy_loss

LN2, LN3 = math.log(2.0), math.log(3.0)


def _loss(logp, prox, behav, lag, mask, adv, cfg: CorrectionConfig) -> torch.Tensor:
    """The engine's policy-loss pipeline on plain tensors."""
    terms = staleness_correction(prox, behav, lag, mask, cfg)
    ratio = policy_ratio(logp, terms)
    pg, _, _ = ppo_policy_loss(ratio, adv, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, clip=terms.clip)
    return aggregate(pg * terms.is_weight * terms.keep, mask, LossAggMode.TOKEN_MEAN)


def _random_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(3, 6, generator=g) * 3
    prox = behav + torch.randn(3, 6, generator=g) * 0.3
    logp = (prox + torch.randn(3, 6, generator=g) * 0.3).requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 0, 1]])
    lag = torch.randint(0, 3, (3, 6), generator=g) * mask
    adv = torch.randn(3, 6, generator=g)
    return logp, prox, behav, lag, mask, adv


def _value_and_grad(logp, *args):
    logp.grad = None
    loss = _loss(logp, *args)
    loss.backward()
    return loss.detach(), logp.grad.clone()


def test_none_equals_tis_with_infinite_cap():
    logp, prox, behav, lag, mask, adv = _random_case()
    none_l, none_g = _value_and_grad(logp, prox, behav, lag, mask, adv, CorrectionConfig(mode="none"))
    tis_l, tis_g = _value_and_grad(logp, prox, behav, lag, mask, adv, CorrectionConfig(mode="tis", cap=math.inf))
    assert torch.allclose(none_l, tis_l, atol=1e-6) and torch.allclose(none_g, tis_g, atol=1e-6)
    capped_l, _ = _value_and_grad(logp, prox, behav, lag, mask, adv, CorrectionConfig(mode="tis", cap=1.0))
    assert not torch.allclose(none_l, capped_l)  # the cap matters on this data


def test_decoupled_with_prox_equal_behav_is_standard_ppo():
    logp, _, behav, lag, mask, adv = _random_case(1)
    cfg = CorrectionConfig(mode="decoupled", cap=2.0)
    dec_l, dec_g = _value_and_grad(logp, behav, behav, lag, mask, adv, cfg)
    # standard PPO: clip(π_θ/π_old) with π_old = π_behav and no weights
    logp.grad = None
    pg, _, _ = ppo_policy_loss(torch.exp(logp - behav), adv, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    ppo = aggregate(pg, mask, LossAggMode.TOKEN_MEAN)
    ppo.backward()
    assert torch.allclose(dec_l, ppo.detach(), atol=1e-6) and torch.allclose(dec_g, logp.grad, atol=1e-6)


@pytest.mark.parametrize("mode", ["none", "tis", "decoupled", "masked", "m2po"])
def test_gradient_only_through_action_tokens(mode):
    logp, prox, behav, lag, mask, adv = _random_case(2)
    _, grad = _value_and_grad(logp, prox, behav, lag, mask, adv, CorrectionConfig(mode=mode))
    assert torch.all(grad[mask == 0] == 0)
    assert grad[mask == 1].abs().sum() > 0


def _one_row(log_rho: list[float], lags: list[int] | None = None):
    n = len(log_rho)
    behav = torch.full((1, n), -1.0)
    prox = behav + torch.tensor([log_rho])
    lag = torch.tensor([lags or [0] * n])
    return prox, behav, lag, torch.ones(1, n, dtype=torch.long)


def test_tis_truncates_the_ratio_scale():
    prox, behav, lag, mask = _one_row([LN3, -LN2, 0.0])
    terms = staleness_correction(prox, behav, lag, mask, CorrectionConfig(mode="tis", cap=2.0))
    assert torch.allclose(terms.ratio_scale, torch.tensor([[2.0, 0.5, 1.0]]))
    assert torch.equal(terms.is_weight, torch.ones(1, 3)) and terms.keep.all() and terms.clip
    assert torch.allclose(terms.anchor_logp, prox)
    assert torch.allclose(terms.behav_ratio, torch.tensor([[3.0, 0.5, 1.0]]))
    # with π_θ = π_prox the ratio the clip sees is the truncated ρ
    assert torch.allclose(policy_ratio(prox, terms), torch.tensor([[2.0, 0.5, 1.0]]))


def test_decoupled_weight_with_lag_dependent_caps():
    prox, behav, lag, mask = _one_row([LN3, LN3, LN3, -LN2], lags=[0, 1, 5, 5])
    cfg = CorrectionConfig(mode="decoupled", cap_by_lag=[2.5, 1.5, 1.0])
    terms = staleness_correction(prox, behav, lag, mask, cfg)
    assert torch.allclose(terms.is_weight, torch.tensor([[2.5, 1.5, 1.0, 0.5]]))
    assert torch.equal(terms.ratio_scale, torch.ones(1, 4)) and torch.allclose(terms.anchor_logp, prox)


@pytest.mark.parametrize(
    ("level", "expected"), [("token", [2.0, 2.0, 1.0]), ("sequence", [4.0] * 3), ("geometric", [2 ** (2 / 3)] * 3)]
)
def test_sequence_and_geometric_levels(level, expected):
    prox, behav, lag, mask = _one_row([LN2, LN2, 0.0])
    terms = staleness_correction(prox, behav, lag, mask, CorrectionConfig(mode="decoupled", level=level, cap=10.0))
    assert torch.allclose(terms.is_weight, torch.tensor([expected]), rtol=1e-5)


def test_masked_token_and_sequence_and_lag_bounds():
    prox, behav, lag, mask = _one_row([math.log(0.4), 0.0, LN3])
    tok = staleness_correction(prox, behav, lag, mask, CorrectionConfig(mode="masked", mask_low=0.5, mask_high=2.0))
    assert tok.keep.tolist() == [[False, True, False]]
    seq = staleness_correction(
        prox, behav, lag, mask, CorrectionConfig(mode="masked", level="sequence", mask_low=0.5, mask_high=2.0)
    )
    assert seq.keep.tolist() == [[True, True, True]]  # ρ_seq = 0.4·1·3 = 1.2 is inside
    geo = staleness_correction(
        prox, behav, lag, mask, CorrectionConfig(mode="masked", level="geometric", mask_low=0.5, mask_high=1.05)
    )
    assert geo.keep.tolist() == [[False, False, False]]  # 1.2^(1/3) = 1.063 > 1.05
    prox, behav, lag, mask = _one_row([LN2, LN2], lags=[0, 1])
    by_lag = CorrectionConfig(mode="masked", mask_bounds_by_lag=[(0.5, 3.0), (0.9, 1.5)])
    assert staleness_correction(prox, behav, lag, mask, by_lag).keep.tolist() == [[True, False]]


def test_m2po_second_moment_mask():
    prox, behav, lag, mask = _one_row([0.1, -0.2, 0.5])  # squares .01 .04 .25; running means .01 .025 .1
    terms = staleness_correction(prox, behav, lag, mask, CorrectionConfig(mode="m2po", m2_threshold=0.04))
    assert terms.keep.tolist() == [[True, True, False]]
    assert not terms.clip and torch.allclose(terms.anchor_logp, behav)
    assert m2_keep_mask(torch.tensor([[0.1, 0.1]]), torch.tensor([[1, 0]]), 0.04).tolist() == [[True, False]]


def test_max_token_lag_masks_in_every_mode():
    prox, behav, lag, mask = _one_row([0.0, 0.0, 0.0], lags=[0, 2, 3])
    for mode in ["none", "tis", "decoupled", "masked", "m2po"]:
        terms = staleness_correction(prox, behav, lag, mask, CorrectionConfig(mode=mode, max_token_lag=2))
        assert terms.keep.tolist() == [[True, True, False]], mode


def test_loglinear_prox_interpolates_by_lag():
    cur = torch.tensor([[-1.0, -1.0, -1.0]])
    behav = torch.tensor([[-3.0, -3.0, -3.0]])
    prox = loglinear_prox_logp(cur, behav, torch.tensor([[0, 1, 3]]))
    assert torch.allclose(prox, torch.tensor([[-3.0, -2.0, -1.5]]))


def test_correction_config_rejects_bad_bounds():
    with pytest.raises(ValueError):
        CorrectionConfig(mask_low=2.0, mask_high=1.0)
    with pytest.raises(ValueError):
        CorrectionConfig(mask_bounds_by_lag=[(1.0, 0.5)])


def test_metrics_overall_and_by_lag_bucket():
    stats = TokenStats(
        behav_ratio=torch.tensor([1.0, 2.0, 0.5, 4.0]),
        policy_ratio=torch.tensor([1.0, 1.0, 1.0, 1.0]),
        is_weight=torch.tensor([1.0, 2.0, 0.5, 2.0]),
        clipped=torch.tensor([False, True, False, False]),
        masked=torch.tensor([False, False, True, True]),
        lag=torch.tensor([0, 0, 1, 7]),
    )
    m = correction_metrics(stats, num_lag_buckets=2)
    assert m["is/ratio_mean"] == pytest.approx(1.875)
    assert m["is/ratio_max"] == 4.0 and m["is/ratio_min"] == 0.5
    assert m["is/clip_frac"] == 0.25 and m["is/mask_frac"] == 0.5
    assert m["is/ratio_mean/lag_0"] == pytest.approx(1.5)
    assert m["is/mask_frac/lag_1"] == 1.0 and m["is/ratio_mean/lag_2plus"] == 4.0
    assert m["is/mismatch_kl/lag_0"] == pytest.approx((2.0 - 1.0 - LN2) / 2)
    assert m["is/token_frac/lag_0"] == 0.5 and "staleness/lag_max" not in m  # lag stats: the buffer's
    assert "is/ratio_p90" in m and "is/weight_mean/lag_0" in m
    # ESS of the loss weights w·keep: (1 + 2 + 0 + 0)² / (4 · (1 + 4)) overall; lag 0 keeps 1 and 2
    assert m["is/ess"] == pytest.approx(9 / 20)
    assert m["is/ess/lag_0"] == pytest.approx(9 / 10) and m["is/ess/lag_1"] == 0.0
