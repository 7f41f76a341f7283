"""Per-token PPO losses and their aggregation. Pure functions on tensors.

Every loss returns a per-token tensor [B, T]; `aggregate` reduces it with the configured mode and
explicit normalisers so that summing `aggregate` over the micro-batches of a mini-batch (each with
the mini-batch's `num_tokens` / `num_seqs`) gives exactly the mini-batch loss.
"""

from __future__ import annotations

import torch

from streamrl.learner.config import KLEstimator, LossAggMode


def token_logprobs_and_entropy(
    logits: torch.Tensor,  # [B, T, V] logits at every position
    input_ids: torch.Tensor,  # [B, T]
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, T] each
    """logprob[b, t] = log softmax(logits[b, t-1] / τ)[input_ids[b, t]]  (0 at t = 0);
    entropy[b, t] = H(softmax(logits[b, t-1] / τ))  (0 at t = 0)."""
    shifted = logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(shifted, dim=-1)
    logp = torch.gather(logp_all, -1, input_ids[:, 1:, None]).squeeze(-1)
    logp = torch.nn.functional.pad(logp, (1, 0))
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_requires_grad):  # metric-only: no graph
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.nn.functional.pad(entropy, (1, 0))


def ppo_policy_loss(
    ratio: torch.Tensor,  # [B, T] importance ratio the clip acts on (carries the gradient)
    advantages: torch.Tensor,  # [B, T]
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None,
    clip: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # loss, clipped flag, dual-clipped flag [B, T]
    """Clipped surrogate with asymmetric clip and dual clip.

        L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))
        L = min(L, −A·c)        where A < 0  (dual clip, c > 1)

    With `clip=False` L = −A·r (used by M2PO, whose trust region is its mask).
    """
    unclipped = -advantages * ratio
    if not clip:
        zeros = torch.zeros_like(ratio, dtype=torch.bool)
        return unclipped, zeros, zeros
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual = torch.zeros_like(was_clipped)
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, was_clipped, dual


def value_loss(
    values: torch.Tensor,  # [B, T] current value predictions (carry the gradient)
    old_values: torch.Tensor,  # [B, T] values at the start of the step
    returns: torch.Tensor,  # [B, T] value targets
    *,
    clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # loss, clipped flag [B, T]
    """L_V = ½ max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²)   (½ (V − R)² without clip)."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def kl_penalty(
    logp: torch.Tensor,  # [B, T] log π_θ (carries the gradient)
    ref_logp: torch.Tensor,  # [B, T] log π_ref
    estimator: KLEstimator,
) -> torch.Tensor:  # [B, T]
    """Per-token estimators of KL(π_θ ‖ π_ref) on samples (Schulman's k1/k2/k3), with d = log π_ref − log π_θ:

    k1 = −d,   k2 = ½ d²,   k3 = exp(d) − 1 − d   (unbiased, always ≥ 0)
    """
    d = ref_logp - logp
    if estimator == KLEstimator.K1:
        return -d
    if estimator == KLEstimator.K2:
        return 0.5 * d**2
    if estimator == KLEstimator.K3:
        d = d.clamp(-20.0, 20.0)
        return torch.exp(d) - 1.0 - d
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(
    values: torch.Tensor,  # [B, T] per-token loss
    mask: torch.Tensor,  # [B, T] 1 where the token counts
    mode: LossAggMode,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    constant: float | None = None,
) -> torch.Tensor:  # scalar
    """Reduce a per-token loss. N = num_tokens (default Σ mask), S = num_seqs (default B), n_b = Σ_t mask[b]:

    token-mean           Σ_{b,t} m·x / N
    seq-mean-token-sum   Σ_b (Σ_t m·x) / S
    seq-mean-token-mean  Σ_b (Σ_t m·x / n_b) / S      (rows with n_b = 0 contribute 0)
    constant (Dr.GRPO)   Σ_{b,t} m·x / (S · constant)  (constant defaults to T)
    """
    m = (mask != 0).to(values.dtype)
    masked = values * m
    seqs = float(values.shape[0]) if num_seqs is None else float(num_seqs)
    if mode == LossAggMode.TOKEN_MEAN:
        tokens = float(m.sum().item()) if num_tokens is None else float(num_tokens)
        return masked.sum() / max(tokens, 1.0)
    if mode == LossAggMode.SEQ_MEAN_TOKEN_SUM:
        return masked.sum() / max(seqs, 1.0)
    if mode == LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        per_seq = masked.sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(seqs, 1.0)
    if mode == LossAggMode.CONSTANT:
        norm = float(values.shape[1]) if constant is None else float(constant)
        return masked.sum() / (max(seqs, 1.0) * norm)
    raise ValueError(f"unknown loss aggregation mode {mode!r}")
