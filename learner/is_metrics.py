"""Importance-correction and staleness metrics, overall and per lag bucket.

The engine collects one `TokenStats` per micro-batch forward (flattened over action tokens) and
reduces them once per step with `correction_metrics`. Names: `is/<stat>` and `is/<stat>/lag_<k>`
(k < num_lag_buckets) or `is/<stat>/lag_<K>plus`; `is/token_frac/lag_<k>` is the share of the step's
action tokens at each token lag (lag itself is reported by the buffer: core/catalogue.py).

    is/ratio_*       ρ = π_prox/π_behav  (mean, max, min, p50, p90, p99)
    is/policy_ratio_mean  r·s, the ratio the PPO clip saw
    is/weight_mean   w, the IS weight outside the clip
    is/clip_frac     fraction of action tokens whose surrogate was clipped (incl. dual clip)
    is/mask_frac     fraction of action tokens dropped (masked / M2 / max_token_lag)
    is/mismatch_kl   k3 estimate of KL(π_behav ‖ π_prox) = E_behav[ρ − 1 − log ρ]
    is/ess           effective sample size of the loss's token weights w·keep: (Σ)² / (n Σ²) ∈ [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class TokenStats:
    behav_ratio: torch.Tensor  # [N] ρ per action token
    policy_ratio: torch.Tensor  # [N]
    is_weight: torch.Tensor  # [N]
    clipped: torch.Tensor  # [N] bool
    masked: torch.Tensor  # [N] bool
    lag: torch.Tensor  # [N] int

    @classmethod
    def concat(cls, parts: list[TokenStats]) -> TokenStats:
        return cls(
            **{name: torch.cat([getattr(p, name) for p in parts]) for name in cls.__slots__}  # type: ignore[attr-defined]
        )


def effective_sample_size(weights: torch.Tensor) -> float:
    """(Σw)² / (n Σw²) ∈ [0, 1]; 0 for no tokens or all-zero weights."""
    w = weights.double()
    sq = float((w**2).sum().item())
    return float(w.sum().item()) ** 2 / (w.numel() * sq) if w.numel() and sq > 0 else 0.0


def _stats(s: TokenStats, sel: torch.Tensor) -> dict[str, float]:
    rho = s.behav_ratio[sel].double()
    log_rho = torch.log(rho.clamp(min=1e-30))
    q = torch.quantile(rho, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {
        "ratio_mean": rho.mean().item(),
        "ratio_max": rho.max().item(),
        "ratio_min": rho.min().item(),
        "ratio_p50": q[0].item(),
        "ratio_p90": q[1].item(),
        "ratio_p99": q[2].item(),
        "policy_ratio_mean": s.policy_ratio[sel].double().mean().item(),
        "weight_mean": s.is_weight[sel].double().mean().item(),
        "clip_frac": s.clipped[sel].double().mean().item(),
        "mask_frac": s.masked[sel].double().mean().item(),
        "mismatch_kl": (rho - 1.0 - log_rho).mean().item(),
        "ess": effective_sample_size(s.is_weight[sel] * ~s.masked[sel]),
        "num_tokens": float(sel.sum().item()),
    }


def lag_bucket_names(num_buckets: int) -> list[str]:
    return [f"lag_{k}" for k in range(num_buckets)] + [f"lag_{num_buckets}plus"]


def correction_metrics(stats: TokenStats, num_lag_buckets: int) -> dict[str, float]:
    """`is/*` overall and per lag bucket (buckets without tokens are omitted) + `is/token_frac/*`."""
    out: dict[str, float] = {}
    n = int(stats.lag.numel())
    if n == 0:
        return out
    everything = torch.ones(n, dtype=torch.bool)
    for key, value in _stats(stats, everything).items():
        out[f"is/{key}"] = value
    lag = stats.lag
    for k, name in enumerate(lag_bucket_names(num_lag_buckets)):
        sel = lag >= k if k == num_lag_buckets else lag == k
        out[f"is/token_frac/{name}"] = sel.double().mean().item()
        if bool(sel.any()):
            for key, value in _stats(stats, sel).items():
                out[f"is/{key}/{name}"] = value
    return out
