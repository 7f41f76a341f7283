"""The statistics of held-out evaluation: pass@k, pass^k and paired tests of two evaluations.

Pure functions on plain numbers (no I/O), so the numbers the trainer prints, the report plots and
`streamrl eval` compares are the ones tested here against hand-computed values.

- **pass@k** (Chen et al. 2021, the unbiased estimator): with `n` samples of a prompt of which `c` are
  correct, the chance that at least one of `k` samples drawn without replacement is correct,
  `1 - C(n-c, k) / C(n, k)`, averaged over prompts. pass@1 is the mean correctness.
- **pass^k** (tau-bench): the chance that all `k` drawn samples are correct, `C(c, k) / C(n, k)`: how
  reliably the policy solves a prompt, not whether it ever does.
- **avg@k**: the mean reward over every sample (rewards need not be 0/1).

Two evaluations of the same prompts compare *paired*, prompt by prompt (and seed by seed): a prompt
that was solved before and after says nothing about training. For 0/1 outcomes the exact McNemar test
uses only the prompts that flipped; for other rewards, a sign-flip permutation test on the per-prompt
differences gives the p-value and a paired bootstrap the confidence interval. A percentile bootstrap
alone is too optimistic on a few dozen 0/1 pairs, so it never gives the p-value here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c correct, k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k of one prompt: the chance that k samples drawn without replacement all pass."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return math.prod((c - i) / (n - i) for i in range(k)) if c >= k else 0.0


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalSummary:
    """One evaluation: `num_prompts` prompts with `num_samples` samples each."""

    num_prompts: int
    num_samples: int  # per prompt (the smallest count, if a prompt lost samples)
    k: int
    avg_reward: float  # avg@k: mean reward over every sample
    pass_at_1: float
    pass_at_k: float
    pass_hat_k: float

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        return {
            f"{prefix}reward_mean": self.avg_reward,
            f"{prefix}pass_at_1": self.pass_at_1,
            f"{prefix}pass_at_k": self.pass_at_k,
            f"{prefix}pass_hat_k": self.pass_hat_k,
            f"{prefix}k": float(self.k),
            f"{prefix}num_prompts": float(self.num_prompts),
        }


def summarize(rewards: Mapping[str, Sequence[float]], *, k: int, threshold: float) -> EvalSummary:
    """`rewards[prompt_id]` = the rewards of its samples; a sample passes when reward >= threshold.
    pass@k and pass^k use each prompt's own sample count (>= k)."""
    if not rewards:
        raise ValueError("no prompts to summarize")
    short = {p: len(r) for p, r in rewards.items() if len(r) < k}
    if short:
        raise ValueError(f"pass@{k} needs >= {k} samples per prompt; short prompts: {dict(list(short.items())[:5])}")
    per_pass = [(len(r), sum(x >= threshold for x in r)) for r in rewards.values()]
    return EvalSummary(
        num_prompts=len(rewards),
        num_samples=min(len(r) for r in rewards.values()),
        k=k,
        avg_reward=sum(sum(r) for r in rewards.values()) / sum(len(r) for r in rewards.values()),
        pass_at_1=_mean(c / n for n, c in per_pass),
        pass_at_k=_mean(pass_at_k(n, c, k) for n, c in per_pass),
        pass_hat_k=_mean(pass_hat_k(n, c, k) for n, c in per_pass),
    )


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def mcnemar_exact(num_up: int, num_down: int) -> float:
    """Two-sided exact McNemar p-value: `num_up` pairs flipped 0 -> 1 and `num_down` 1 -> 0."""
    n = num_up + num_down
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(num_up, num_down) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


@dataclass(kw_only=True, slots=True, frozen=True)
class PairedComparison:
    """After minus before on the same prompts (and seeds)."""

    num_pairs: int
    before: float
    after: float
    ci_low: float  # 95 % paired bootstrap interval of the mean difference
    ci_high: float
    p_value: float  # two-sided
    test: str  # "mcnemar-exact" or "sign-flip permutation"
    num_up: int  # pairs that rose
    num_down: int  # pairs that fell

    @property
    def diff(self) -> float:
        return self.after - self.before

    def record(self) -> dict[str, float | int | str | list[float]]:
        """The comparison as a benchmark's JSON fields."""
        return {
            "before": self.before,
            "after": self.after,
            "rise": self.diff,
            "ci95": [self.ci_low, self.ci_high],
            "p_value": self.p_value,
            "test": self.test,
            "num_pairs": self.num_pairs,
            "num_up": self.num_up,
            "num_down": self.num_down,
        }

    def line(self) -> str:
        return (
            f"{self.before:.3f} -> {self.after:.3f} ({self.diff:+.3f}, "
            f"95% CI [{self.ci_low:+.3f}, {self.ci_high:+.3f}], "
            f"{self.test} p={self.p_value:.2g}, {self.num_pairs} pairs: {self.num_up} up, {self.num_down} down)"
        )


def compare(
    before: Mapping[str, float], after: Mapping[str, float], *, seed: int = 0, num_resamples: int = 10_000
) -> PairedComparison:
    """Paired test of two evaluations keyed by pair id (prompt, or seed/prompt), values a per-pair score
    (the prompt's mean reward). Exact McNemar when every score is 0 or 1, otherwise a sign-flip
    permutation test (exact up to 16 non-zero pairs, else `num_resamples` random flips)."""
    keys = sorted(set(before) & set(after))
    if len(keys) != len(before) or len(keys) != len(after):
        raise ValueError(
            f"paired evaluations must hold the same pairs: {len(before)} before, {len(after)} after, {len(keys)} shared"
        )
    if not keys:
        raise ValueError("no pairs to compare")
    diffs = [after[k] - before[k] for k in keys]
    rng = random.Random(seed)
    binary = all(before[k] in (0.0, 1.0) and after[k] in (0.0, 1.0) for k in keys)
    up, down = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    if binary:
        p, test = mcnemar_exact(up, down), "mcnemar-exact"
    else:
        p, test = sign_flip_p(diffs, rng, num_resamples), "sign-flip permutation"
    low, high = bootstrap_ci(diffs, rng, num_resamples)
    return PairedComparison(
        num_pairs=len(keys),
        before=_mean(before[k] for k in keys),
        after=_mean(after[k] for k in keys),
        ci_low=low,
        ci_high=high,
        p_value=p,
        test=test,
        num_up=up,
        num_down=down,
    )


def sign_flip_p(diffs: Sequence[float], rng: random.Random, num_resamples: int) -> float:
    """Two-sided p of the mean paired difference under the null that each sign is a coin flip."""
    nonzero = [d for d in diffs if d != 0.0]
    if not nonzero:
        return 1.0
    observed = abs(sum(nonzero)) - 1e-12
    if len(nonzero) <= 16:  # every one of the 2^n sign patterns
        hits = sum(
            abs(sum(d if (mask >> i) & 1 else -d for i, d in enumerate(nonzero))) >= observed
            for mask in range(2 ** len(nonzero))
        )
        return hits / 2 ** len(nonzero)
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in nonzero)) >= observed for _ in range(num_resamples))
    return (hits + 1) / (num_resamples + 1)


def bootstrap_ci(
    diffs: Sequence[float], rng: random.Random, num_resamples: int, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `diffs` (pairs resampled whole)."""
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(num_resamples))
    tail = (1.0 - level) / 2
    return means[int(tail * (num_resamples - 1))], means[int((1.0 - tail) * (num_resamples - 1))]
