"""Composable corrections: the mode presets reproduce the modes as they were (against a frozen copy
of the old function), and composed recipes against hand-computed values (AReaL mask-mode rejection
sampling, verl token TIS + sequence/geometric rejection, full weights, GSPO sequence ratios)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from streamrl.learner.config import CorrectionConfig, CorrectionLevel, CorrectionMode
from streamrl.learner.correction import (
    MAX_LOG_RATIO,
    CorrectionTerms,
    _level_lag,
    _sequence_reduce,
    lag_table,
    m2_keep_mask,
    policy_ratio,
    staleness_correction,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def _legacy_correction(prox_logp, behav_logp, lag, mask, cfg: CorrectionConfig) -> CorrectionTerms:
    """`staleness_correction` as it was before corrections composed, kept as the oracle; same
    arguments ([B, T] tensors and the config)."""
    prox_logp = prox_logp.detach().to(torch.float32)
    behav_logp = behav_logp.to(torch.float32)
    valid = mask != 0
    token_log_rho = torch.where(valid, prox_logp - behav_logp, torch.zeros_like(prox_logp))
    log_rho = _sequence_reduce(token_log_rho, mask, cfg.level).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    rho = torch.exp(log_rho)
    level_lag = _level_lag(lag, mask, cfg.level)
    ones = torch.ones_like(prox_logp)
    keep = valid.clone()
    if cfg.max_token_lag is not None:
        keep &= _level_lag(lag, mask, cfg.level) <= cfg.max_token_lag
    anchor, scale, weight, clip = prox_logp, ones, ones, True
    if cfg.mode == CorrectionMode.NONE:
        anchor = behav_logp
    elif cfg.mode == CorrectionMode.TIS:
        scale = torch.minimum(rho, lag_table(cfg.cap_by_lag, cfg.cap, level_lag))
    elif cfg.mode == CorrectionMode.DECOUPLED:
        weight = torch.minimum(rho, lag_table(cfg.cap_by_lag, cfg.cap, level_lag))
    elif cfg.mode == CorrectionMode.MASKED:
        bounds = cfg.mask_bounds_by_lag
        low = lag_table([b[0] for b in bounds] if bounds else None, cfg.mask_low, level_lag)
        high = lag_table([b[1] for b in bounds] if bounds else None, cfg.mask_high, level_lag)
        keep &= (rho >= low) & (rho <= high)
    elif cfg.mode == CorrectionMode.M2PO:
        anchor, clip = behav_logp, False
        keep &= m2_keep_mask(log_rho, keep, cfg.m2_threshold)
    else:
        raise ValueError(f"unknown correction mode {cfg.mode!r}")
    return CorrectionTerms(
        anchor_logp=anchor,
        ratio_scale=scale * valid,
        is_weight=weight * valid,
        keep=keep,
        behav_ratio=torch.exp(token_log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) * valid,
        clip=clip,
    )


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(4, 7, generator=g) * 3
    prox = behav + torch.randn(4, 7, generator=g) * 0.6
    mask = (torch.rand(4, 7, generator=g) > 0.3).long()
    mask[:, 0] = 0
    lag = torch.randint(0, 4, (4, 7), generator=g) * mask
    return prox, behav, lag, mask


PRESET_VARIANTS = [
    {},
    {"cap": 1.2},
    {"cap_by_lag": [2.0, 1.3, 1.05]},
    {"mask_low": 0.8, "mask_high": 1.3},
    {"mask_bounds_by_lag": [(0.5, 2.0), (0.8, 1.25)]},
    {"m2_threshold": 0.02},
    {"max_token_lag": 1},
]


@pytest.mark.parametrize(("mode", "level"), list(itertools.product(list(CorrectionMode), list(CorrectionLevel))))
def test_every_preset_reproduces_its_old_mode_exactly(mode, level):
    for seed, extra in itertools.product(range(3), PRESET_VARIANTS):
        cfg = CorrectionConfig(mode=mode, level=level, **extra)
        args = _case(seed)
        new, old = staleness_correction(*args, cfg), _legacy_correction(*args, cfg)
        for name in ("anchor_logp", "ratio_scale", "is_weight", "keep", "behav_ratio"):
            assert torch.equal(getattr(new, name), getattr(old, name)), (mode, level, extra, name)
        assert new.clip == old.clip and new.mask is None
        logp = args[0] + 0.1
        assert torch.equal(policy_ratio(logp, new), policy_ratio(logp, old))


def test_a_preset_spelled_out_is_the_preset():
    args = _case(7)
    spelled = {
        "none": dict(anchor="behavior", weight="none", rejection="none", clip=True),
        "tis": dict(anchor="proximal", weight="truncated", weight_at="ratio", rejection="none"),
        "decoupled": dict(anchor="proximal", weight="truncated", weight_at="loss", rejection="none"),
        "masked": dict(anchor="proximal", weight="none", rejection="bounds"),
        "m2po": dict(anchor="behavior", weight="none", rejection="m2", clip=False),
    }
    for mode, choices in spelled.items():
        other = "masked" if mode != "masked" else "tis"  # start from a different preset
        preset = staleness_correction(*args, CorrectionConfig(mode=mode))
        composed = staleness_correction(*args, CorrectionConfig(mode=other, **choices))
        for name in ("anchor_logp", "ratio_scale", "is_weight", "keep"):
            assert torch.equal(getattr(preset, name), getattr(composed, name)), (mode, name)


def _one_row(log_rho: list[float], lags: list[int] | None = None):
    n = len(log_rho)
    behav = torch.full((1, n), -1.0)
    return behav + torch.tensor([log_rho]), behav, torch.tensor([lags or [0] * n]), torch.ones(1, n, dtype=torch.long)


def test_areal_mask_mode_rejection_keeps_the_weight_on_kept_tokens():
    prox, behav, lag, mask = _one_row([math.log(0.4), LN2, math.log(1.5), LN3])
    cfg = CorrectionConfig(mode="decoupled", rejection="bounds", cap=1.8, mask_low=0.5, mask_high=2.5)
    terms = staleness_correction(prox, behav, lag, mask, cfg)
    assert terms.keep.tolist() == [[False, True, True, False]]  # ρ = 0.4 and 3 leave [0.5, 2.5]
    assert torch.allclose(terms.is_weight, torch.tensor([[0.4, 1.8, 1.5, 1.8]]))  # min(ρ, 1.8), kept or not
    assert torch.allclose(terms.anchor_logp, prox) and terms.clip
    # today's `masked` preset on the same data keeps the same tokens with weight 1
    masked = staleness_correction(prox, behav, lag, mask, CorrectionConfig(mode="masked", mask_low=0.5, mask_high=2.5))
    assert torch.equal(masked.keep, terms.keep) and torch.equal(masked.is_weight, torch.ones(1, 4))


def test_verl_token_tis_with_geometric_sequence_rejection():
    # two sequences: ρ tokens (2, 2, 1) → geometric 2^(2/3) = 1.587; (0.5, 1, 1) → 0.794
    behav = torch.full((2, 3), -1.0)
    prox = behav + torch.tensor([[LN2, LN2, 0.0], [-LN2, 0.0, 0.0]])
    lag, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    cfg = CorrectionConfig(
        mode="decoupled", cap=1.5, rejection="bounds", rejection_level="geometric", mask_low=0.75, mask_high=1.5
    )
    terms = staleness_correction(prox, behav, lag, mask, cfg)
    assert terms.keep.tolist() == [[False] * 3, [True] * 3]  # 1.587 > 1.5 drops the whole first sequence
    assert torch.allclose(terms.is_weight, torch.tensor([[1.5, 1.5, 1.0], [0.5, 1.0, 1.0]]))  # token-level TIS
    seq = staleness_correction(
        prox, behav, lag, mask, cfg.model_copy(update={"rejection_level": "sequence", "mask_high": 5.0})
    )
    assert seq.keep.tolist() == [[True] * 3, [False] * 3]  # ρ_seq = 4 inside, 0.5 below 0.75


def test_full_weight_is_untruncated_and_weight_at_ratio_moves_it_inside_the_clip():
    prox, behav, lag, mask = _one_row([LN3, -LN2])
    full = staleness_correction(prox, behav, lag, mask, CorrectionConfig(weight="full", cap=1.0))
    assert torch.allclose(full.is_weight, torch.tensor([[3.0, 0.5]])) and torch.equal(
        full.ratio_scale, torch.ones(1, 2)
    )
    inside = staleness_correction(prox, behav, lag, mask, CorrectionConfig(weight="full", weight_at="ratio"))
    assert torch.allclose(inside.ratio_scale, torch.tensor([[3.0, 0.5]])) and torch.equal(
        inside.is_weight, torch.ones(1, 2)
    )


def test_gspo_sequence_ratio_is_the_geometric_mean_and_moves_every_token():
    behav = torch.full((2, 4), -2.0)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    delta = torch.tensor([[5.0, LN2, LN2, -LN2], [0.0, LN3, 0.0, 7.0]])  # non-action tokens must not count
    logp = (behav + delta).requires_grad_(True)
    terms = staleness_correction(
        behav,
        behav,
        torch.zeros(2, 4, dtype=torch.long),
        mask,
        CorrectionConfig(mode="decoupled", ratio_level="geometric"),
    )
    ratio = policy_ratio(logp, terms)
    expected = torch.tensor([[2 ** (1 / 3)] * 4, [3**0.5] * 4]) * mask  # 0 off action tokens, as per token
    assert torch.allclose(ratio, expected, rtol=1e-6)
    (ratio * mask).sum().backward()
    assert torch.all(logp.grad[mask == 0] == 0) and torch.all(logp.grad[mask == 1] > 0)
    # d/dlogp_t of Σ_tokens r_seq = n_tokens · r_seq / n_tokens = r_seq for every action token
    assert torch.allclose(logp.grad[mask == 1], torch.tensor([2 ** (1 / 3)] * 3 + [3**0.5] * 2), rtol=1e-6)


def test_needs_prox_follows_the_recipe():
    assert not CorrectionConfig(mode="none").needs_prox
    assert CorrectionConfig(mode="none", rejection="bounds").needs_prox
    assert CorrectionConfig(mode="m2po").needs_prox and CorrectionConfig(mode="decoupled").needs_prox
    with pytest.raises(ValueError):
        CorrectionConfig(weight="halfway")
