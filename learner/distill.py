"""On-policy distillation: the teacher's per-token log-probs turned into a per-token advantage.

Pure functions on tensors. The student sampled token t with log-prob `behavior_logprobs[b, t]`
(the engine's, stored with the token); the teacher scored the same token in the same context
(`teacher_logprobs[b, t]`, `rollout.teacher`). Their difference is a one-sample estimate of the
per-token reverse KL between the two policies at that position,

    k_t = log π_student(x_t | x_<t) − log π_teacher(x_t | x_<t),    E_{x_t ~ π_student}[k_t] = KL(π_student ‖ π_teacher)

and −k_t is the per-token reward for moving toward the teacher on the tokens the student itself
produces (on-policy distillation as in Agarwal et al. 2024, Thinking Machines' Tinker recipe, TRL's
GKD with λ = 1 and NeMo-RL). The advantage is used as is, without a baseline or group normalisation,
in the same clipped policy-gradient loss as the task advantage:

    mode "kl":     A_t = −coef · k_t
    mode "mixed":  A_t = A_task_t − coef · k_t

Only action tokens (loss mask 1) with a finite teacher log-prob carry the term; a row the teacher
did not score (written before distillation was on) gets none, and `distill/coverage` says how many
tokens had one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrl.learner.config import DistillMode, DistillSignal


def reverse_kl_tokens(
    behavior_logprobs: torch.Tensor,  # [B, T] log π_student of the sampled tokens
    teacher_logprobs: torch.Tensor,  # [B, T] log π_teacher of the same tokens, NaN where unscored
    mask: torch.Tensor,  # [B, T] loss mask
) -> tuple[torch.Tensor, torch.Tensor]:  # k [B, T] (0 where unscored), scored [B, T] bool
    """k_t = behavior − teacher at the action tokens the teacher scored, and which those are."""
    scored = (mask != 0) & torch.isfinite(teacher_logprobs)
    k = torch.where(scored, behavior_logprobs.float() - teacher_logprobs.float(), torch.zeros_like(behavior_logprobs))
    return k, scored


def distill_advantages(
    task_advantages: torch.Tensor,  # [B, T] the task's advantages (0 off the mask)
    k: torch.Tensor,  # [B, T] reverse-KL estimate (`reverse_kl_tokens`)
    scored: torch.Tensor,  # [B, T] bool
    signal: DistillSignal,
) -> torch.Tensor:  # [B, T]
    """The advantage of `signal.mode` (module docstring): the teacher's term −coef·k alone, or added
    to the task advantage. Unscored tokens keep the task advantage ("mixed") or get 0 ("kl")."""
    teacher = torch.where(scored, -signal.coef * k, torch.zeros_like(k))
    if signal.mode is DistillMode.KL:
        return teacher
    return task_advantages + teacher


@dataclass(kw_only=True, slots=True)
class DistillSums:
    """Sums over one rank's action tokens, added over ranks before the ratios are taken."""

    kl_sum: float  # Σ k over scored tokens
    teacher_abs_sum: float  # Σ |coef·k| over scored tokens
    task_abs_sum: float  # Σ |A_task| over action tokens that the advantage kept (0 in mode "kl")
    num_scored: float
    num_action: float

    @classmethod
    def of(
        cls,
        task_advantages: torch.Tensor,
        k: torch.Tensor,
        scored: torch.Tensor,
        mask: torch.Tensor,
        signal: DistillSignal,
    ) -> DistillSums:
        action = mask != 0
        task = 0.0 if signal.mode is DistillMode.KL else float(task_advantages[action].abs().sum().item())
        return cls(
            kl_sum=float(k[scored].sum().item()),
            teacher_abs_sum=float((signal.coef * k[scored]).abs().sum().item()),
            task_abs_sum=task,
            num_scored=float(scored.sum().item()),
            num_action=float(action.sum().item()),
        )

    def metrics(self) -> dict[str, float]:
        """`distill/kl_mean` (nats per scored token), `distill/teacher_share` (the teacher's share of
        the advantage's magnitude: 1 in mode "kl", 0 when no token has any advantage) and
        `distill/coverage` (scored share of action tokens)."""
        magnitude = self.teacher_abs_sum + self.task_abs_sum
        return {
            "distill/kl_mean": self.kl_sum / max(self.num_scored, 1.0),
            "distill/teacher_share": self.teacher_abs_sum / magnitude if magnitude > 0 else 0.0,
            "distill/coverage": self.num_scored / max(self.num_action, 1.0),
        }
