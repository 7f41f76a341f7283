"""pass@k, pass^k and the paired tests of two evaluations (streaming/eval_stats.py), against values
worked out by hand or by brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from streamrl.streaming.eval_stats import (
    bootstrap_ci,
    compare,
    mcnemar_exact,
    pass_at_k,
    pass_hat_k,
    sign_flip_p,
    summarize,
)


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (8, 3, 4), (6, 6, 2), (3, 1, 3)])
def test_pass_at_k_and_pass_hat_k_equal_the_brute_force_over_every_draw(n, c, k):
    samples = [1] * c + [0] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(samples[i] for i in d) for d in draws) / len(draws))
    assert pass_hat_k(n, c, k) == pytest.approx(sum(all(samples[i] for i in d) for d in draws) / len(draws))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_hat_k(4, 2, 5)


def test_summarize_uses_the_threshold_and_every_sample():
    summary = summarize({"a": [1.0, 0.0, 0.6, 0.2], "b": [0.0, 0.0, 0.0, 0.0]}, k=2, threshold=0.5)
    assert summary.avg_reward == pytest.approx(1.8 / 8)
    assert summary.pass_at_1 == pytest.approx((2 / 4 + 0) / 2)
    assert summary.pass_at_k == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)
    assert summary.pass_hat_k == pytest.approx((1 / math.comb(4, 2)) / 2)
    with pytest.raises(ValueError, match="needs >= 3 samples"):
        summarize({"a": [1.0, 0.0]}, k=3, threshold=1.0)


def test_mcnemar_exact_matches_the_binomial_tail():
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)  # 5 prompts flipped up, none down: p = 0.0625
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 1024)


def test_compare_uses_mcnemar_on_binary_pairs_and_ignores_concordant_ones():
    before = {f"p{i}": 0.0 for i in range(10)} | {f"q{i}": 1.0 for i in range(30)}
    after = dict(before) | {f"p{i}": 1.0 for i in range(8)} | {"q0": 0.0}
    result = compare(before, after)
    assert (result.test, result.num_up, result.num_down) == ("mcnemar-exact", 8, 1)
    assert result.p_value == pytest.approx(mcnemar_exact(8, 1))
    assert result.diff == pytest.approx(7 / 40)
    assert result.ci_low < result.diff < result.ci_high


def test_compare_refuses_unpaired_evaluations():
    with pytest.raises(ValueError, match="same pairs"):
        compare({"a": 0.0, "b": 1.0}, {"a": 1.0})


def test_the_sign_flip_test_is_exact_for_few_pairs_and_calibrated_under_the_null():
    # 4 equal positive differences: only the all-plus and all-minus patterns are as extreme: 2/16
    assert sign_flip_p([0.5, 0.5, 0.5, 0.5], random.Random(0), 1000) == pytest.approx(2 / 16)
    assert sign_flip_p([0.0, 0.0], random.Random(0), 1000) == 1.0
    # null: symmetric differences, the p-value is below 0.05 in about 5 % of repeats
    rng = random.Random(1)
    rejections = sum(sign_flip_p([rng.gauss(0, 1) for _ in range(30)], rng, 400) < 0.05 for _ in range(200))
    assert 2 <= rejections <= 20


def test_compare_on_graded_rewards_uses_the_permutation_test():
    rng = random.Random(3)
    before = {f"p{i}": rng.random() * 0.5 for i in range(40)}
    after = {k: v + 0.2 + rng.gauss(0, 0.05) for k, v in before.items()}
    result = compare(before, after)
    assert result.test == "sign-flip permutation" and result.p_value < 1e-3
    assert result.ci_low > 0.15 and result.ci_high < 0.25


def test_the_bootstrap_interval_covers_the_mean_at_about_its_level():
    rng = random.Random(4)
    covered = 0
    for _ in range(100):
        diffs = [rng.gauss(0.1, 1.0) for _ in range(60)]
        low, high = bootstrap_ci(diffs, rng, 500)
        covered += low <= 0.1 <= high
    assert 85 <= covered <= 100
