"""Everything a train step fixes before its first update: lags, the start-of-step no-grad pass
(π_prox, old values, reference log-probs), advantages and — when π_prox is recomputed — the
correction terms of the whole batch (so batch-level statistics such as M2PO's mask see every token).

π_prox is the policy at the start of the step. Until the step's first optimiser update the training
forward *is* that policy, so its detached log-probs are π_prox exactly and cost nothing. The no-grad
pass therefore runs for π_prox only where that is not enough: `prox = recompute` with more than one
update per step (later mini-batches and epochs see moved weights) or with a whole-batch term (M2PO);
PPO's pass for the old values yields π_prox with them. Otherwise `StepInputs.prox_logp` is filled by
the first update's own forwards (`TrainingEngine._proximal`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from streamrl.core.versions import token_lag
from streamrl.learner.advantages import (
    broadcast_sequence_advantages,
    grpo_advantages,
    masked_gae,
    masked_whiten,
    token_level_rewards,
)
from streamrl.learner.config import Algo, ProxMode
from streamrl.learner.correction import CorrectionTerms, staleness_correction
from streamrl.learner.distill import DistillSums, distill_advantages, reverse_kl_tokens
from streamrl.learner.types import TrainBatch

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.model import PolicyModel


class ForwardRunner(Protocol):
    """What the start of a step needs from the learner (`TrainingEngine` is one): its models and
    version, rank facts, and the micro-batch forward machinery the train step also uses (`forward`
    runs a micro-batch's rows with their images, so every pass here sees the pixels). Typed as a
    protocol so this module does not import the engine that imports it."""

    cfg: LearnerConfig
    policy: PolicyModel
    reference: PolicyModel | None
    policy_version: int
    rank: int
    world_size: int

    @property
    def device(self) -> torch.device: ...  # read-only (torch's stub types `device` as a descriptor)
    @property
    def is_distributed(self) -> bool: ...
    def micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]: ...
    def dummy_pass(self, batch: TrainBatch, *, backward: bool) -> None: ...
    def forward(self, model: PolicyModel, mb: TrainBatch) -> Any: ...
    def all_reduce(self, value: float, op: str = "sum") -> float: ...


@dataclass(kw_only=True, slots=True)
class StepInputs:
    batch: TrainBatch  # this rank's rows
    lag: torch.Tensor  # [B, T] learner policy_version − token policy_version (0 off the mask)
    advantages: torch.Tensor  # [B, T]
    returns: torch.Tensor | None  # [B, T] value targets (PPO)
    old_values: torch.Tensor | None  # [B, T] (PPO)
    ref_logp: torch.Tensor | None  # [B, T] (KL)
    terms: CorrectionTerms | None  # whole-batch correction when the start-of-step pass gave π_prox
    prox_logp: torch.Tensor  # [B, T] exact log π_prox of the rows in `prox_known` (filled lazily)
    prox_known: torch.Tensor  # [B] bool: rows whose π_prox is exact in `prox_logp`
    full_width: int  # padded length T of the batch as received
    recompute_s: float  # time of the no-grad pass
    advantage_mean: float
    advantage_std: float
    distill: dict[str, float]  # `distill/*` metrics of the batch; empty without a teacher


def token_lags(batch: TrainBatch, policy_version: int) -> torch.Tensor:
    """Lag of every action token against the learner's version (`core.versions.token_lag`, the
    one definition), 0 off the loss mask; ValueError for tokens newer than the learner."""
    valid = batch.loss_mask != 0
    lag = torch.where(valid, token_lag(policy_version, batch.policy_versions), torch.zeros_like(batch.policy_versions))
    if bool((lag < 0).any()):
        newest = int(batch.policy_versions[valid].max().item())
        raise ValueError(f"batch has tokens of policy_version {newest} > learner policy_version {policy_version}")
    return lag


def sequence_returns(batch: TrainBatch, use_turn_scores: bool) -> torch.Tensor:
    """[B] outcome per sequence: final reward (+ Σ turn scores when enabled)."""
    if not (use_turn_scores and batch.turn_scores):
        return batch.rewards
    extra = torch.tensor([sum(s) for s in batch.turn_scores], dtype=torch.float32, device=batch.rewards.device)
    return batch.rewards + extra


@torch.no_grad()
def _start_of_step_pass(
    engine: ForwardRunner, tb: TrainBatch, *, prox: bool, values: bool, ref: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # prox_logp, old_values, ref_logp
    shape = tb.input_ids.shape
    prox_logp = torch.zeros(shape, device=engine.device) if prox else None
    old_values = torch.zeros(shape, device=engine.device) if values else None
    ref_logp = torch.zeros(shape, device=engine.device) if ref else None
    if not (prox or values or ref):
        return prox_logp, old_values, ref_logp
    for idx in engine.micro_batches(tb, torch.arange(tb.batch_size)):
        if idx.numel() == 0:
            engine.dummy_pass(tb, backward=False)
            continue
        mb = tb.select(idx)
        width = mb.input_ids.shape[1]
        if prox or values:
            out = engine.forward(engine.policy, mb)
            if prox_logp is not None:
                prox_logp[idx, :width] = out.logp.float()
            if old_values is not None:
                old_values[idx, :width] = out.values.float()
        if ref_logp is not None:
            assert engine.reference is not None  # `ref`: there is a reference model
            ref_logp[idx, :width] = engine.forward(engine.reference, mb).logp.float()
    return prox_logp, old_values, ref_logp


def build_step_inputs(engine: ForwardRunner, full: TrainBatch) -> StepInputs:
    cfg = engine.cfg
    full_lag = token_lags(full, engine.policy_version)
    seq_adv = None
    if cfg.algo == Algo.GRPO:  # group statistics need every row, before rows are split over ranks
        seq_adv = grpo_advantages(
            sequence_returns(full, cfg.use_turn_scores), full.group_index, scale_std=cfg.effective_scale_std
        )
    rows = torch.arange(full.batch_size)[engine.rank :: engine.world_size]
    tb = full.select(rows) if engine.is_distributed else full
    lag = full_lag[rows, : tb.input_ids.shape[1]]
    correction = cfg.correction
    recompute = correction.needs_prox and (
        cfg.algo == Algo.PPO  # the pass runs the policy for the old values anyway
        or (correction.prox == ProxMode.RECOMPUTE and (cfg.updates_per_step > 1 or correction.needs_whole_batch))
    )
    start = time.perf_counter()
    engine.policy.eval()
    prox_logp, old_values, ref_logp = _start_of_step_pass(
        engine, tb, prox=recompute, values=cfg.algo == Algo.PPO, ref=engine.reference is not None
    )
    recompute_s = time.perf_counter() - start
    returns = None
    if seq_adv is not None:
        advantages = broadcast_sequence_advantages(seq_adv[rows], tb.loss_mask)
    else:
        token_rewards = token_level_rewards(tb.loss_mask, tb.rewards, tb.turn_scores if cfg.use_turn_scores else None)
        assert old_values is not None  # PPO (not GRPO): the start-of-step pass ran the value head
        advantages, returns = masked_gae(token_rewards, old_values, tb.loss_mask, gamma=cfg.gamma, lam=cfg.lam)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, tb.loss_mask, all_reduce=engine.all_reduce)
    advantages, distill = _with_teacher(engine, tb, advantages)
    terms = None
    prox_known = torch.zeros(tb.batch_size, dtype=torch.bool, device=tb.input_ids.device)
    if recompute:
        assert prox_logp is not None  # the start-of-step pass recomputed it
        terms = staleness_correction(prox_logp, tb.behavior_logprobs, lag, tb.loss_mask, correction)
        prox_known[:] = True
    else:
        prox_logp = torch.zeros(tb.input_ids.shape, dtype=torch.float32, device=tb.input_ids.device)
    valid = tb.loss_mask != 0
    adv_valid = advantages[valid]
    return StepInputs(
        batch=tb,
        lag=lag,
        advantages=advantages,
        returns=returns,
        old_values=old_values,
        ref_logp=ref_logp,
        terms=terms,
        prox_logp=prox_logp,
        prox_known=prox_known,
        full_width=int(full.input_ids.shape[1]),
        recompute_s=recompute_s,
        advantage_mean=float(adv_valid.mean().item()) if adv_valid.numel() else 0.0,
        advantage_std=float(adv_valid.std().item()) if adv_valid.numel() > 1 else 0.0,
        distill=distill,
    )


def _with_teacher(
    engine: ForwardRunner, tb: TrainBatch, advantages: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages with the teacher's per-token term (`learner.distill`) and its metrics over every
    rank's tokens; unchanged (and no metrics) without `learner.distill`."""
    signal = engine.cfg.distill
    if signal is None:
        return advantages, {}
    teacher = tb.teacher_logprobs
    if teacher is None:  # no row of this rank's batch was scored
        teacher = torch.full_like(tb.behavior_logprobs, float("nan"))
    k, scored = reverse_kl_tokens(tb.behavior_logprobs, teacher, tb.loss_mask)
    sums = DistillSums.of(advantages, k, scored, tb.loss_mask, signal)
    for name in sums.__slots__:  # the ratios cover the whole batch, not one rank's share
        setattr(sums, name, engine.all_reduce(getattr(sums, name)))
    return distill_advantages(advantages, k, scored, signal), sums.metrics()
