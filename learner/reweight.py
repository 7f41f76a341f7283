"""Offline re-weighting: what each staleness correction would have done to the same logged data.

`streamrl staleness reweight RUN_DIR --checkpoint STEP` (`streaming/reweight_cli.py`) recomputes
log π_prox for the run's logged batches under one saved checkpoint θ_S and hands them here with the
behaviour log-probs, the logged token lags and GRPO advantages. Everything below is pure tensor math.

No update happens offline, so the policy being optimised is the proximal one: π_θ = π_prox = π_S.
"What the correction would have done" is then exactly the start of a train step whose weights are
θ_S (the first forward of the first mini-batch), per action token t, with ρ_t = π_S/π_behav:

    weight       w·s                  the correction's importance weight, truncation applied
                                      (1 for none / masked / m2po, min(ρ, C) for tis / decoupled)
    truncated    w·s < ρ at the weight's level (the cap bit)
    masked       keep_t = 0            (rejection bounds, M2, max_token_lag)
    clipped      the surrogate PPOclip(r·s, A) sits on a clipped branch (incl. dual clip), with
                 r = π_θ/π_anchor at θ = θ_S: r = 1 for a proximal anchor, r = ρ for a behaviour
                 anchor. So a proximal anchor clips only when s ≠ 1 (tis: the weight sits inside
                 the clip), a behaviour anchor (none) clips wherever ρ leaves [1 − ε_low, 1 + ε_high]
                 in the direction of A, and m2po never clips.
    grad_weight  g_t = w·keep·r·s·[not clipped] = −(∂L_t/∂log π_θ(t)) / A_t: the factor the token's
                 score-function gradient A_t ∇log π_θ(t) gets in the first update

and per correction, pooled over every action token n of the selected batches (each batch corrected
on its own, as the learner does, so M2's batch-level mask sees exactly one step's tokens):

    ess          (Σ w·s·keep)² / (n · Σ (w·s·keep)²), dropped tokens counting as weight 0; 1 when
                 every token keeps weight 1 (none), the kept fraction for 0/1 weights (masked)
    loss_share   Σ_{t in lag bucket k} |g_t A_t| / Σ_t |g_t A_t|: the share of the first update's
                 policy-gradient magnitude carried by tokens of each logged lag (token-mean
                 aggregation: a common normaliser, so shares do not depend on it)

Lags are the logged ones (learner version at consume − token version), so lag-dependent caps and
bounds act as they did in the run. The counterfactual is exact for the step that consumed its batch
right after θ_S was trained (its real π_prox is θ_S); for the other steps it asks "had π_prox been
θ_S". ρ by version gap (checkpoint label − token version) separates the two: at gap 0 the
checkpoint is the policy that sampled the token and ρ ≠ 1 is engine/learner numerics only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamrl.learner.config import CorrectionConfig, CorrectionMode, Weight
from streamrl.learner.correction import policy_ratio, staleness_correction
from streamrl.learner.is_metrics import effective_sample_size, lag_bucket_names
from streamrl.learner.losses import ppo_policy_loss


@dataclass(kw_only=True, slots=True)
class ClipSettings:
    """The run's PPO clip (`LearnerConfig.clip_low`, `clip_high`, `dual_clip_c`)."""

    clip_low: float
    clip_high: float
    dual_clip_c: float | None


@dataclass(kw_only=True, slots=True)
class TokenEffect:
    """One correction applied to one or more logged batches, flattened over their N action tokens."""

    rho: torch.Tensor  # [N] token ρ = π_prox/π_behav
    weight: torch.Tensor  # [N] w·s, the correction's importance weight
    truncated: torch.Tensor  # [N] bool
    keep: torch.Tensor  # [N] bool
    clipped: torch.Tensor  # [N] bool (clip or dual clip)
    grad_weight: torch.Tensor  # [N] g = w·keep·r·s·[not clipped]
    advantage: torch.Tensor  # [N]
    lag: torch.Tensor  # [N] int64, logged token lag
    seq: torch.Tensor  # [N] int64, sequence index (unique over the concatenated batches)

    @classmethod
    def concat(cls, parts: list[TokenEffect]) -> TokenEffect:
        """Pool batches; sequence indices are shifted so that they stay distinct."""
        offset, seqs = 0, []
        for p in parts:
            seqs.append(p.seq + offset)
            offset += int(p.seq.max().item()) + 1 if p.seq.numel() else 0
        fields = [n for n in cls.__slots__ if n != "seq"]  # type: ignore[attr-defined]
        return cls(**{n: torch.cat([getattr(p, n) for p in parts]) for n in fields}, seq=torch.cat(seqs))


@dataclass(kw_only=True, slots=True)
class CorrectionSummary:
    """One row of the reweight table (definitions in the module docstring)."""

    correction: str
    num_tokens: int
    num_seqs: int
    weight_mean: float
    weight_min: float
    weight_max: float
    truncated_frac: float  # of action tokens
    masked_frac: float  # of action tokens
    seq_masked_frac: float  # of sequences with ≥ 1 dropped action token
    seq_rejected_frac: float  # of sequences with every action token dropped
    clip_frac: float  # of action tokens
    ess: float
    grad_weight_mean: float
    loss_share: dict[str, float] = field(default_factory=dict)  # lag bucket -> share of Σ|g·A|


def correction_effect(
    prox_logp: torch.Tensor,  # [B, T] log π_prox under the checkpoint
    behav_logp: torch.Tensor,  # [B, T] log π_behav as logged
    lag: torch.Tensor,  # [B, T] int, logged token lag, 0 off the mask
    mask: torch.Tensor,  # [B, T] loss mask
    advantages: torch.Tensor,  # [B, T]
    cfg: CorrectionConfig,
    clip: ClipSettings,
) -> TokenEffect:
    """Apply `cfg` to one batch at θ = θ_prox (no update): the start of a train step on it."""
    terms = staleness_correction(prox_logp, behav_logp, lag, mask, cfg)
    valid = mask != 0
    weight = terms.is_weight * terms.ratio_scale
    truncated = torch.zeros_like(valid)
    if cfg.recipe().weight is Weight.TRUNCATED:
        full = staleness_correction(prox_logp, behav_logp, lag, mask, cfg.model_copy(update={"weight": Weight.FULL}))
        truncated = weight < full.is_weight * full.ratio_scale
    ratio = policy_ratio(prox_logp.detach().to(torch.float32), terms)  # r·s with π_θ = π_prox
    _, was_clipped, dual = ppo_policy_loss(
        ratio,
        advantages,
        clip_low=clip.clip_low,
        clip_high=clip.clip_high,
        dual_clip_c=clip.dual_clip_c,
        clip=terms.clip,
    )
    clipped = was_clipped | dual
    grad_weight = terms.is_weight * terms.keep * ratio * ~clipped
    seq = torch.arange(mask.shape[0]).unsqueeze(1).expand_as(mask)
    return TokenEffect(
        rho=terms.behav_ratio[valid],
        weight=weight[valid],
        truncated=truncated[valid],
        keep=terms.keep[valid],
        clipped=clipped[valid],
        grad_weight=grad_weight[valid],
        advantage=advantages.to(torch.float32)[valid],
        lag=lag[valid].to(torch.int64),
        seq=seq[valid],
    )


def lag_buckets(lag: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket index per token: the lag itself, the last bucket for lag ≥ num_buckets."""
    return lag.clamp(min=0, max=num_buckets)


def loss_share_by_lag(contribution: torch.Tensor, lag: torch.Tensor, num_buckets: int) -> dict[str, float]:
    """Share of Σ contribution per lag bucket (`is_metrics.lag_bucket_names`); empty buckets are
    omitted, all shares 0 when the total is 0 (e.g. every advantage 0)."""
    buckets = lag_buckets(lag, num_buckets)
    total = float(contribution.double().sum().item())
    out = {}
    for k, name in enumerate(lag_bucket_names(num_buckets)):
        sel = buckets == k
        if bool(sel.any()):
            out[name] = float(contribution[sel].double().sum().item()) / total if total > 0 else 0.0
    return out


def _frac(x: torch.Tensor) -> float:
    return float(x.double().mean().item()) if x.numel() else 0.0


def summarize(name: str, e: TokenEffect, num_lag_buckets: int) -> CorrectionSummary:
    """Pool a correction's token effects into one table row."""
    n = int(e.weight.numel())
    seqs = torch.unique(e.seq)
    dropped = (~e.keep).to(torch.int64)
    per_seq_dropped = torch.zeros(int(e.seq.max().item()) + 1 if n else 0, dtype=torch.int64).index_add_(
        0, e.seq, dropped
    )
    per_seq_tokens = torch.zeros_like(per_seq_dropped).index_add_(0, e.seq, torch.ones_like(dropped))
    per_seq_dropped, per_seq_tokens = per_seq_dropped[seqs], per_seq_tokens[seqs]
    kept_weight = e.weight * e.keep
    return CorrectionSummary(
        correction=name,
        num_tokens=n,
        num_seqs=int(seqs.numel()),
        weight_mean=float(e.weight.double().mean().item()) if n else 0.0,
        weight_min=float(e.weight.min().item()) if n else 0.0,
        weight_max=float(e.weight.max().item()) if n else 0.0,
        truncated_frac=_frac(e.truncated),
        masked_frac=_frac(~e.keep),
        seq_masked_frac=_frac(per_seq_dropped > 0),
        seq_rejected_frac=_frac(per_seq_dropped == per_seq_tokens),
        clip_frac=_frac(e.clipped),
        ess=effective_sample_size(kept_weight),
        grad_weight_mean=float(e.grad_weight.double().mean().item()) if n else 0.0,
        loss_share=loss_share_by_lag((e.grad_weight * e.advantage).abs(), e.lag, num_lag_buckets),
    )


def parse_correction(spec: str, base: CorrectionConfig) -> CorrectionConfig:
    """`NAME` or `NAME:key=value,key=value` → the run's correction settings (caps, bounds, levels,
    thresholds) with preset NAME and only the listed choices overriding it; NAME `run` is the run's
    own correction as configured. ValueError for an unknown preset or key."""
    name, _, rest = spec.partition(":")
    overrides: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"correction {spec!r}: expected key=value, got {item!r}")
        overrides[key.strip()] = value.strip()
    data = base.model_dump(mode="json")
    if name != "run":
        names = [m.value for m in CorrectionMode]
        if name not in names:
            raise ValueError(f"unknown correction {name!r}; presets: {', '.join(names)} (or 'run')")
        data.update(mode=name, anchor=None, weight=None, weight_at=None, rejection=None, clip=None)
    for key, value in overrides.items():
        if key not in data:
            raise ValueError(f"correction {spec!r}: unknown key {key!r}")
        data[key] = value
    return CorrectionConfig.model_validate(data)


@dataclass(kw_only=True, slots=True)
class RhoStats:
    """ρ = π_prox/π_behav over a set of action tokens (independent of the correction)."""

    num_tokens: int
    mean: float
    min: float
    max: float
    mismatch_kl: float  # k3 estimate of KL(π_behav ‖ π_prox) = E[ρ − 1 − log ρ]
    max_abs_log: float  # max |log ρ|


def rho_stats(rho: torch.Tensor) -> RhoStats:
    r = rho.double()
    if not r.numel():
        return RhoStats(num_tokens=0, mean=0.0, min=0.0, max=0.0, mismatch_kl=0.0, max_abs_log=0.0)
    log_r = torch.log(r.clamp(min=1e-30))
    return RhoStats(
        num_tokens=int(r.numel()),
        mean=float(r.mean()),
        min=float(r.min()),
        max=float(r.max()),
        mismatch_kl=float((r - 1.0 - log_r).mean()),
        max_abs_log=float(log_r.abs().max()),
    )


def rho_by(rho: torch.Tensor, key: torch.Tensor) -> dict[int, RhoStats]:
    """ρ statistics per distinct integer key (a lag, a version gap)."""
    return {int(k): rho_stats(rho[key == k]) for k in torch.unique(key).tolist()}
