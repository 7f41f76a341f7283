"""The offline re-weighting math (`learner/reweight.py`) against hand-computed values.

One batch, two sequences, five action tokens, behaviour log-prob 0 everywhere, so ρ = π_prox:

    row 0 (A = +1):  ρ = e^0.5, 1, e^-0.5     lags 0, 1, 2
    row 1 (A = −1):  ρ = 3.5, e^-0.1, (pad)    lags 1, 0
"""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.config import CorrectionConfig, Rejection
from streamrl.learner.reweight import (
    ClipSettings,
    TokenEffect,
    correction_effect,
    effective_sample_size,
    loss_share_by_lag,
    parse_correction,
    summarize,
)

E5, EM5, EM1 = math.exp(0.5), math.exp(-0.5), math.exp(-0.1)
CLIP = ClipSettings(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
BASE = CorrectionConfig(cap=2.0, mask_low=0.5, mask_high=2.0, m2_threshold=0.04)


def _batch():
    prox = torch.tensor([[0.5, 0.0, -0.5], [math.log(3.5), -0.1, 0.0]])
    behav = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    lag = torch.tensor([[0, 1, 2], [1, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    return prox, behav, lag, mask, adv


def _row(spec: str, **overrides) -> tuple[TokenEffect, object]:
    cfg = parse_correction(spec, CorrectionConfig.model_validate({**BASE.model_dump(), **overrides}))
    effect = correction_effect(*_batch(), cfg, CLIP)
    return effect, summarize(spec, effect, num_lag_buckets=4)


def test_none_keeps_weight_one_but_its_behaviour_anchor_clips_at_rho():
    effect, s = _row("none")
    assert effect.weight.tolist() == [1.0] * 5 and s.ess == 1.0 and s.truncated_frac == 0 and s.masked_frac == 0
    # r = ρ: e^0.5 > 1.28 with A > 0 is clipped; 3.5 > c = 3 with A < 0 is dual-clipped
    assert effect.clipped.tolist() == [True, False, False, True, False] and s.clip_frac == pytest.approx(0.4)
    assert effect.grad_weight.tolist() == pytest.approx([0.0, 1.0, EM5, 0.0, EM1])
    total = 1.0 + EM5 + EM1  # |g·A| of the unclipped tokens, at lags 1, 2, 0
    assert s.loss_share == pytest.approx({"lag_0": EM1 / total, "lag_1": 1.0 / total, "lag_2": EM5 / total})
    assert (s.num_tokens, s.num_seqs, s.seq_masked_frac, s.seq_rejected_frac) == (5, 2, 0.0, 0.0)


def test_decoupled_truncates_at_the_loss_and_never_clips_at_ratio_one():
    effect, s = _row("decoupled")
    w = [E5, 1.0, EM5, 2.0, EM1]  # min(ρ, 2)
    assert effect.weight.tolist() == pytest.approx(w) and effect.grad_weight.tolist() == pytest.approx(w)
    assert effect.truncated.tolist() == [False, False, False, True, False] and s.truncated_frac == pytest.approx(0.2)
    assert s.clip_frac == 0.0 and s.weight_max == pytest.approx(2.0) and s.weight_min == pytest.approx(EM5)
    assert s.ess == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    assert s.weight_mean == pytest.approx(sum(w) / 5)


def test_tis_puts_the_capped_weight_inside_the_clip():
    effect, s = _row("tis")
    assert effect.weight.tolist() == pytest.approx([E5, 1.0, EM5, 2.0, EM1])
    # ratio = s: e^0.5 > 1.28 with A > 0 clips; 2 with A < 0 is below the dual clip c = 3
    assert effect.clipped.tolist() == [True, False, False, False, False]
    assert effect.grad_weight.tolist() == pytest.approx([0.0, 1.0, EM5, 2.0, EM1])


def test_masked_drops_tokens_outside_the_bounds():
    effect, s = _row("masked")
    assert effect.keep.tolist() == [True, True, True, False, True]
    assert (s.masked_frac, s.seq_masked_frac, s.seq_rejected_frac) == pytest.approx((0.2, 0.5, 0.0))
    assert s.ess == pytest.approx(0.8)  # 0/1 weights: the kept fraction
    assert effect.weight.tolist() == [1.0] * 5 and s.clip_frac == 0.0


def test_sequence_level_rejection_drops_whole_sequences():
    _, s = _row("masked", rejection_level="sequence")  # row 1: Πρ = 3.5 e^-0.1 > 2; row 0: Πρ = 1
    assert (s.masked_frac, s.seq_masked_frac, s.seq_rejected_frac) == pytest.approx((0.4, 0.5, 0.5))


def test_m2po_keeps_the_smallest_squared_log_ratios_and_never_clips():
    effect, s = _row("m2po")  # (log ρ)² = .25, 0, .25, 1.57, .01: running means 0, .005, .087 → keep 2
    assert effect.keep.tolist() == [False, True, False, False, True]
    assert s.masked_frac == pytest.approx(0.6) and s.seq_masked_frac == 1.0 and s.seq_rejected_frac == 0.0
    assert s.clip_frac == 0.0 and effect.grad_weight.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0, EM1])


def test_lag_dependent_cap_uses_the_logged_lag():
    effect, _ = _row("decoupled", cap_by_lag=[1.0, 3.0])  # lag 0 capped at 1, lag ≥ 1 at 3
    assert effect.weight.tolist() == pytest.approx([1.0, 1.0, EM5, 3.0, EM1])
    assert effect.truncated.tolist() == [True, False, False, True, False]


def test_effective_sample_size_and_shares():
    assert effective_sample_size(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(0.5)
    assert effective_sample_size(torch.tensor([2.0, 2.0])) == pytest.approx(1.0)
    assert effective_sample_size(torch.zeros(3)) == 0.0
    shares = loss_share_by_lag(torch.tensor([1.0, 1.0, 2.0, 4.0]), torch.tensor([0, 5, 1, 9]), 2)
    assert shares == pytest.approx({"lag_0": 0.125, "lag_1": 0.25, "lag_2plus": 0.625})
    assert loss_share_by_lag(torch.zeros(2), torch.tensor([0, 1]), 2) == {"lag_0": 0.0, "lag_1": 0.0}


def test_concat_keeps_sequences_distinct():
    a = correction_effect(*_batch(), BASE, CLIP)
    both = TokenEffect.concat([a, a])
    assert both.seq.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert summarize("x", both, 4).num_seqs == 4


def test_parse_correction():
    base = CorrectionConfig.model_validate({**BASE.model_dump(), "mode": "masked", "rejection": "m2", "cap": 5.0})
    composed = parse_correction("decoupled:rejection=bounds,rejection_level=geometric", base)
    assert composed.recipe().rejection is Rejection.BOUNDS and composed.cap == 5.0
    assert parse_correction("masked", base).recipe().rejection is Rejection.BOUNDS  # the preset, not the run's choice
    assert parse_correction("run", base).recipe().rejection is Rejection.M2
    with pytest.raises(ValueError, match="unknown correction"):
        parse_correction("ppo", base)
    with pytest.raises(ValueError, match="unknown key"):
        parse_correction("tis:kap=3", base)
