"""Staleness-aware importance correction. Pure functions on tensors.

Three policies meet in an off-policy step: π_behav sampled the tokens (its logprobs come with the
batch), π_prox is the learner at the start of the step (recomputed by a no-grad forward pass, or
approximated log-linearly from versions), π_θ is the policy being optimised. Per token,
lag = learner policy_version − token policy_version, and

    ρ = π_prox / π_behav        (the staleness ratio; θ has no control over it)
    r = π_θ / π_anchor          (the PPO ratio; anchor = π_prox or π_behav by mode)

A correction is three independent choices plus the clip (`CorrectionConfig.recipe()`):

    anchor     π_behav | π_prox                       r = π_θ / π_anchor
    weight     1 | min(ρ, C) | ρ,  applied at the loss (w) or inside the clip (s)
    rejection  none | bounds [lo ≤ ρ ≤ hi] | M2 (largest (log ρ)² dropped until mean ≤ τ)

and the policy loss is

    L_t = w_t · keep_t · PPOclip(r_t · s_t, A_t)        (no clip: −r_t · s_t · A_t)

The modes are presets of these choices, each exactly the behaviour the mode always had:

    none       anchor π_behav, s = 1,             w = 1,             keep = 1
    tis        anchor π_prox,  s = min(ρ, C),     w = 1,             keep = 1    (C = ∞ ⇒ none)
    decoupled  anchor π_prox,  s = 1,             w = min(ρ, C),     keep = 1    (ρ ≡ 1 ⇒ PPO)
    masked     anchor π_prox,  s = 1,             w = 1,             keep = [lo ≤ ρ ≤ hi]
    m2po       anchor π_behav, s = 1,             w = 1,             keep = M2 mask, no clip

Composed forms, e.g.: AReaL's rejection sampling in mask mode = decoupled + rejection "bounds"
(kept tokens keep w = min(ρ, C)); verl's token TIS + sequence rejection = decoupled + rejection
"bounds" at rejection_level "geometric" (or "sequence").

ρ is taken at `level` (the weight) and `rejection_level` (the rejection; default `level`): token
(ρ_t), sequence (Π_t ρ_t over the sequence's action tokens) or geometric (exp of the mean log ρ_t).
Caps and bounds may depend on lag (`cap_by_lag`, `mask_bounds_by_lag`; a sequence uses its largest
token lag), and tokens with lag > max_token_lag are dropped whatever the recipe. The PPO ratio r
itself is per token, or with `ratio_level = "geometric"` per sequence: exp of the mean of
log π_θ/π_anchor over its action tokens, as in GSPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrl.learner.config import Anchor, CorrectionConfig, CorrectionLevel, RatioLevel, Rejection, Weight, WeightAt

MAX_LOG_RATIO = 20.0  # exp(±20) keeps ratios finite in float32 while far beyond any cap


@dataclass(kw_only=True, slots=True)
class CorrectionTerms:
    anchor_logp: torch.Tensor  # [B, T] log π_anchor (no grad)
    ratio_scale: torch.Tensor  # [B, T] s: multiplies the ratio inside the clip
    is_weight: torch.Tensor  # [B, T] w: multiplies the clipped per-token loss
    keep: torch.Tensor  # [B, T] bool: tokens that carry loss
    behav_ratio: torch.Tensor  # [B, T] token-level ρ = π_prox/π_behav (for metrics)
    clip: bool  # whether the PPO clip applies
    mask: torch.Tensor | None = None  # [B, T] action tokens: set when the PPO ratio is per sequence


def loglinear_prox_logp(
    current_logp: torch.Tensor,  # [B, T] log π_θ from the training forward (detached here)
    behav_logp: torch.Tensor,  # [B, T]
    lag: torch.Tensor,  # [B, T] int
) -> torch.Tensor:  # [B, T]
    """Log-linear interpolation in policy_version between π_behav (version v − lag) and π_θ, which
    is treated as version v + 1 (the weights this step produces):

        log π_prox ≈ log π_behav + α (log π_θ − log π_behav),    α = lag / (lag + 1)

    lag 0 gives π_behav exactly; large lags approach π_θ. Costs no forward pass.
    """
    lag_f = lag.clamp(min=0).to(torch.float32)
    alpha = lag_f / (lag_f + 1.0)
    return behav_logp + alpha * (current_logp.detach() - behav_logp)


def _sequence_reduce(x: torch.Tensor, mask: torch.Tensor, level: CorrectionLevel) -> torch.Tensor:
    """Token log ρ → per-sequence log ρ (sum or mean over action tokens), broadcast back to [B, T]."""
    m = (mask != 0).to(x.dtype)
    if level == CorrectionLevel.TOKEN:
        return x
    total = (x * m).sum(-1, keepdim=True)
    if level == CorrectionLevel.SEQUENCE:
        return total.expand_as(x)
    return (total / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(x)


def _level_lag(lag: torch.Tensor, mask: torch.Tensor, level: CorrectionLevel) -> torch.Tensor:
    if level == CorrectionLevel.TOKEN:
        return lag
    seq_lag = torch.where(mask != 0, lag, torch.zeros_like(lag)).max(-1, keepdim=True).values
    return seq_lag.expand_as(lag)


def lag_table(values: list[float] | None, default: float, lag: torch.Tensor) -> torch.Tensor:
    """values[min(lag, len − 1)] per token, or `default` everywhere when no table is given."""
    if values is None:
        return torch.full(lag.shape, float(default), dtype=torch.float32, device=lag.device)
    table = torch.tensor(values, dtype=torch.float32, device=lag.device)
    return table[lag.clamp(min=0, max=len(values) - 1)]


def m2_keep_mask(log_rho: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO trust region: drop the tokens with the largest (log ρ)² until the mean (log ρ)² of the
    kept tokens is ≤ threshold. Keeps the largest set of smallest-(log ρ)² tokens that satisfies it."""
    valid = mask != 0
    sq = torch.where(valid, log_rho.detach() ** 2, torch.full_like(log_rho, float("inf")))
    flat = sq.flatten()
    num_valid = int(valid.sum().item())
    if num_valid == 0:
        return valid
    order = torch.argsort(flat)
    sorted_sq = flat[order][:num_valid]
    running_mean = torch.cumsum(sorted_sq, 0) / torch.arange(1, num_valid + 1, device=flat.device)
    num_keep = int((running_mean <= threshold).sum().item())  # running mean is non-decreasing
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order[:num_keep]] = True
    return keep.view_as(mask) & valid


def staleness_correction(
    prox_logp: torch.Tensor,  # [B, T] log π_prox (no grad)
    behav_logp: torch.Tensor,  # [B, T] log π_behav
    lag: torch.Tensor,  # [B, T] int, 0 where mask is 0
    mask: torch.Tensor,  # [B, T] loss mask
    cfg: CorrectionConfig,
) -> CorrectionTerms:
    """Build the correction terms of `cfg.recipe()` (formulas in the module docstring)."""
    recipe = cfg.recipe()
    prox_logp = prox_logp.detach().to(torch.float32)
    behav_logp = behav_logp.to(torch.float32)
    valid = mask != 0
    token_log_rho = torch.where(valid, prox_logp - behav_logp, torch.zeros_like(prox_logp))

    def log_rho_at(level: CorrectionLevel) -> torch.Tensor:
        return _sequence_reduce(token_log_rho, mask, level).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)

    ones = torch.ones_like(prox_logp)
    keep = valid.clone()
    if cfg.max_token_lag is not None:
        keep &= _level_lag(lag, mask, cfg.level) <= cfg.max_token_lag
    weight = ones
    if recipe.weight is not Weight.NONE:
        weight = torch.exp(log_rho_at(cfg.level))
        if recipe.weight is Weight.TRUNCATED:
            weight = torch.minimum(weight, lag_table(cfg.cap_by_lag, cfg.cap, _level_lag(lag, mask, cfg.level)))
    scale, is_weight = (weight, ones) if recipe.weight_at is WeightAt.RATIO else (ones, weight)
    rejection_level = cfg.rejection_level or cfg.level
    if recipe.rejection is Rejection.BOUNDS:
        rho = torch.exp(log_rho_at(rejection_level))
        level_lag = _level_lag(lag, mask, rejection_level)
        bounds = cfg.mask_bounds_by_lag
        low = lag_table([b[0] for b in bounds] if bounds else None, cfg.mask_low, level_lag)
        high = lag_table([b[1] for b in bounds] if bounds else None, cfg.mask_high, level_lag)
        keep &= (rho >= low) & (rho <= high)
    elif recipe.rejection is Rejection.M2:
        keep &= m2_keep_mask(log_rho_at(rejection_level), keep, cfg.m2_threshold)
    return CorrectionTerms(
        anchor_logp=prox_logp if recipe.anchor is Anchor.PROXIMAL else behav_logp,
        ratio_scale=scale * valid,
        is_weight=is_weight * valid,
        keep=keep,
        behav_ratio=torch.exp(token_log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) * valid,
        clip=recipe.clip,
        mask=mask if cfg.ratio_level is RatioLevel.GEOMETRIC else None,
    )


def policy_ratio(logp: torch.Tensor, terms: CorrectionTerms) -> torch.Tensor:
    """r · s = exp(log π_θ − log π_anchor) · s  (carries the gradient through `logp`); per sequence
    (the geometric mean of its token ratios, broadcast to its tokens) when `terms.mask` is set."""
    log_r = logp - terms.anchor_logp
    if terms.mask is not None:
        log_r = _sequence_reduce(
            torch.where(terms.mask != 0, log_r, torch.zeros_like(log_r)), terms.mask, CorrectionLevel.GEOMETRIC
        )
    return torch.exp(log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) * terms.ratio_scale
