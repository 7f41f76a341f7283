"""Token log-probs and entropies of a bias-free LM head, chunk by chunk, with one weight gradient.

`chunked_head_logprobs(src, weight, targets, ...)` is what `learner.model.chunked_token_logprobs_and_entropy`
computes with one checkpointed `head(h)` per chunk, as a single autograd function: forward runs every
chunk under no_grad and keeps nothing vocabulary-sized; backward recomputes each chunk's logits and
writes the hidden-state gradient into its slice and the weight gradient into **one** [V, H] tensor
(`addmm_`). The checkpointed chunks instead return a [V, H] gradient per chunk that autograd then
sums into the weight's buffer: two vocabulary × hidden tensors alive at once on top of `weight.grad`
(113 MB each for SmolLM2), which set the learner's step peak (bench/results/learner_peak.json).

Gradients, with z = h·Wᵀ / τ, p = softmax(z), ℓ = log p, H = −Σ p·ℓ, g = upstream gradients:
    ∂ℓ_target/∂z = onehot(target) − p,    ∂H/∂z = −p ⊙ (ℓ + H)
    dz = g_logp · (onehot − p) − g_H · p ⊙ (ℓ + H);    dh = (dz/τ)·W,    dW = (dz/τ)ᵀ·h

Used only where it is exact and plain: a bias-free Linear head whose weight is an ordinary tensor,
no autocast (the checkpointed path keeps autocast's rounding), and a policy FSDP does not manage
(`PolicyModel.fused_head`: FSDP2 gathers the weight and reduces its gradient in hooks of the head
module's own calls, which this function bypasses); everything else takes the checkpointed chunks.
Measured on the longest default batch (SmolLM2, fp32): step peak 2.86 → 2.73 GiB.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch


def fused_head_applies(head: torch.nn.Module, src: torch.Tensor) -> TypeGuard[torch.nn.Linear]:
    """Whether `chunked_head_logprobs` computes exactly what `head` would: a bias-free Linear with a
    plain (unsharded) weight, outside autocast."""
    weight = getattr(head, "weight", None)
    return (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and type(weight) is torch.nn.Parameter
        and not torch.is_autocast_enabled(src.device.type)
    )


def _score_dtype(t: torch.Tensor) -> torch.dtype:
    """Log-softmax in fp32 at least (fp64 stays fp64, for gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logp_all(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (h @ weight.t()).to(_score_dtype(h))  # [n, V]
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        src: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        targets: torch.Tensor,  # [N]
        chunk: int,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = src.shape[0]
        logp = src.new_empty(n, dtype=_score_dtype(src))
        entropy = src.new_empty(n if with_entropy else 0, dtype=_score_dtype(src))
        for start in range(0, n, chunk):
            logp_all = _chunk_logp_all(src[start : start + chunk], weight, temperature)
            logp[start : start + chunk] = logp_all.gather(-1, targets[start : start + chunk, None]).squeeze(-1)
            if with_entropy:
                entropy[start : start + chunk] = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(src, weight, targets, entropy)
        ctx.chunk, ctx.temperature, ctx.entropy_grad = chunk, temperature, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple:  # type: ignore[override]
        src, weight, targets, entropy = ctx.saved_tensors
        need_src, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_src = torch.zeros_like(src) if need_src else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        if not ctx.entropy_grad:
            grad_entropy = None  # the entropy was returned without a graph
        if grad_logp is None and grad_entropy is None:
            return grad_src, grad_weight, None, None, None, None, None
        for start in range(0, src.shape[0], ctx.chunk):
            end = start + ctx.chunk
            h = src[start:end]
            logp_all = _chunk_logp_all(h, weight, ctx.temperature)
            probs = logp_all.exp()
            dz = torch.zeros_like(logp_all)
            if grad_logp is not None:
                g = grad_logp[start:end, None]
                dz.sub_(probs * g).scatter_add_(-1, targets[start:end, None], g)
            if grad_entropy is not None:
                dz.sub_(probs * (logp_all + entropy[start:end, None]) * grad_entropy[start:end, None])
            del logp_all, probs
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            dz = dz.to(weight.dtype)
            if grad_src is not None:
                grad_src[start:end] = dz @ weight
            if grad_weight is not None:
                grad_weight.addmm_(dz.t(), h)
        return grad_src, grad_weight, None, None, None, None, None


def chunked_head_logprobs(
    src: torch.Tensor,  # [N, H] hidden states of the scoring positions
    weight: torch.Tensor,  # [V, H] LM head weight
    targets: torch.Tensor,  # [N] token each position scores
    *,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [N] each; entropy None without `with_entropy`
    logp, entropy = _ChunkedHead.apply(
        src, weight, targets, chunk_tokens, temperature, with_entropy, entropy_requires_grad
    )
    return logp, entropy if with_entropy else None
