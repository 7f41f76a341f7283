"""`TrainingEngine`: one PPO/GRPO train step per buffer batch, on CPU or one rank of a GPU group.

A step: (1) a no-grad pass over the batch for whatever the loss needs from the start-of-step policy —
π_prox where the training forward cannot give it (`step_inputs`), old values (PPO) and reference
log-probs (KL); (2) advantages
(GRPO group-normalised or masked GAE); (3) `ppo_epochs × num_minibatches` optimiser steps, each
accumulating gradients over micro-batches packed by token budget, each GRPO group's shared prompt
forwarded once per micro-batch with `shared_prefix` (`learner.shared_prefix`); (4) `policy_version += 1`.

An optimiser step whose loss or gradient norm is NaN/inf (a NaN reward that slipped through, an
overflow) is skipped: its gradients are dropped and the weights, optimiser state and LR schedule stay
as they were. `learner/num_nonfinite_steps` counts them; a learner step all of whose optimiser steps
were skipped returns `StepResult.skipped_nonfinite` (its policy_version still advances, labelling the
unchanged weights, so versions keep counting learner steps) and the driver publishes nothing new.

policy_version convention: the engine starts at 0 (the initial weights); after `train_step` number k
it holds policy_version k, which is the version weight_sync publishes. Token lag inside step k + 1 is
k − (token policy_version).

Under torch.distributed (the `LearnerGroup`, FSDP2) every rank receives the whole batch, computes
the GRPO advantages on all of it, and trains on rows `rank::world_size`; normalisers are global and
every rank runs the same number of micro-batch passes (collectives must match).

A vision-language model (`learner.model.is_vision_model`) also loads its processor: batches with
images get their pixels built from the image bytes (`TrainBatch.from_padded(..., processor=)`), and
every forward — training pass, no-grad recompute, reference — receives each row's pixels.

With `learner.lora` the policy LM carries a LoRA adapter (`learner.lora`): the optimiser holds the
adapter's parameters (and PPO's value head) only, the base weights stay frozen, and the weights that
leave the engine (`named_parameters_for_sync`, `save_hf`, checkpoints' `hf/`) are the merged ones.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamrl.learner import checkpoint as ckpt
from streamrl.learner.config import Algo, LearnerConfig, LoraSync, LossAggMode, LRSchedule
from streamrl.learner.correction import CorrectionTerms, loglinear_prox_logp, policy_ratio, staleness_correction
from streamrl.learner.is_metrics import TokenStats, correction_metrics
from streamrl.learner.lora import LoraAdapter
from streamrl.learner.losses import aggregate, kl_penalty, ppo_policy_loss, value_loss
from streamrl.learner.model import (
    PolicyModel,
    is_vision_model,
    load_lm,
    pack_by_tokens,
    resolve_autocast_dtype,
    resolve_device,
    split_minibatches,
)
from streamrl.learner.sharded import clip_grad_norm, full_tensor
from streamrl.learner.shared_prefix import MicroBatchPlan, check_packable, packed_forward, plan_micro_batches
from streamrl.learner.step_inputs import StepInputs, build_step_inputs
from streamrl.learner.types import StepResult, TrainBatch, TrainState

logger = logging.getLogger(__name__)


def _lr_lambda(cfg: LearnerConfig) -> Callable[[int], float]:
    """Linear warmup to 1, then constant / linear / cosine decay to min_lr_ratio at lr_schedule_steps."""
    import math

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == LRSchedule.CONSTANT or cfg.lr_schedule_steps is None:
            return 1.0
        span = max(cfg.lr_schedule_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        if cfg.lr_schedule == LRSchedule.LINEAR:
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return factor


class TrainingEngine:
    """HF policy (+ value head), AdamW, schedule and the PPO/GRPO step. See the module docstring."""

    def __init__(self, cfg: LearnerConfig, *, shard: Callable[[torch.nn.Module], None] | None = None) -> None:
        from transformers import AutoTokenizer

        from streamrl.models import resolve_model

        self.cfg = cfg
        self.checkpoint_writer = ckpt.CheckpointWriter()
        dist = torch.distributed
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and self.world_size > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.autocast_dtype = resolve_autocast_dtype(cfg.dtype, self.device)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model_path = resolve_model(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.processor: Any = None  # image processor + tokenizer of a vision-language model
        if is_vision_model(self.model_path):
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.model_path)
        lm = load_lm(self.model_path, self.device, gradient_checkpointing=cfg.gradient_checkpointing)
        # the adapter goes into `lm` in place, before anything wraps it; it freezes every base weight
        self.lora = LoraAdapter(lm, cfg.lora) if cfg.lora is not None else None
        chunk = cfg.logits_chunk_tokens
        self.policy = PolicyModel(lm, with_value_head=cfg.algo == Algo.PPO, logits_chunk_tokens=chunk).to(self.device)
        # the training pass forwards each group's shared prompt once (learner.shared_prefix); a VLM's
        # rows carry pixels the packed forward does not take, so it trains dense
        self.shared_prefix = cfg.shared_prefix and not self.policy.is_vision
        if self.shared_prefix:
            check_packable(self.policy)
        elif cfg.shared_prefix:
            logger.info("learner.shared_prefix is not applied to a vision-language model: its rows train dense")
        self.reference: PolicyModel | None = None
        if cfg.use_reference:
            ref_lm = load_lm(self.model_path, self.device)
            self.reference = PolicyModel(ref_lm, with_value_head=False, logits_chunk_tokens=chunk)
            self.reference.requires_grad_(False).eval()
        if shard is not None:
            self.policy.fused_head = False  # FSDP hooks the head module's calls (learner.lm_head)
            shard(self.policy)
            if self.reference is not None:
                shard(self.reference)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]  # all of them without LoRA
        self.optimizer = torch.optim.AdamW(
            trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.policy_version = 0
        self.num_optimizer_steps = 0
        self._optimizer_steps_at_start = 0  # num_optimizer_steps when the current step began

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # ---- forward helpers -------------------------------------------------------------------------

    def _autocast(self) -> Any:
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        )

    def all_reduce(self, value: float, op: str = "sum") -> float:
        if not self.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        reduce_op = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(t, op=reduce_op)
        return float(t.item())

    def micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """Token-budget packing of `rows`, padded with empty entries to the group-wide count."""
        lens = batch.seq_lens[rows].tolist()
        groups = [rows[torch.tensor(g, dtype=torch.long)] for g in pack_by_tokens(lens, self.cfg.micro_batch_tokens)]
        target = int(self.all_reduce(float(len(groups)), "max"))
        return groups + [rows[:0]] * (target - len(groups))

    def train_micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[MicroBatchPlan]:
        """The training pass's micro-batches of `rows`: `micro_batches`, or with `shared_prefix` each
        group sharing a prompt packed as one segment (`learner.shared_prefix.plan_micro_batches`)."""
        if not self.shared_prefix:
            return [MicroBatchPlan(rows=idx, segments=()) for idx in self.micro_batches(batch, rows)]
        plans = plan_micro_batches(batch, rows, self.cfg.micro_batch_tokens)
        target = int(self.all_reduce(float(len(plans)), "max"))
        return plans + [MicroBatchPlan(rows=rows[:0], segments=())] * (target - len(plans))

    def to_train_batch(self, batch: Any) -> TrainBatch:
        """A buffer batch (or a `TrainBatch`, passed through) on this engine's device, with pixels."""
        if isinstance(batch, TrainBatch):
            return batch
        return TrainBatch.from_padded(batch, self.device, processor=self.processor)

    def forward(self, model: PolicyModel, mb: TrainBatch, *, with_entropy: bool = False) -> Any:
        """`model` on a micro-batch; the policy replays the engine's routes, the reference routes live."""
        with self._autocast():
            return model(
                mb.input_ids,
                mb.attention_mask,
                images=mb.images,
                temperature=self.cfg.temperature,
                with_entropy=with_entropy,
                entropy_requires_grad=self.cfg.entropy_coef > 0,
                routes=mb.routed_experts if model is self.policy else None,
            )

    def train_forward(self, mb: TrainBatch, plan: MicroBatchPlan) -> Any:
        """The training pass of one micro-batch, with grad: dense, or packed when a group in it shares
        its prompt (same log-probs, entropies and values on every position that carries loss)."""
        if not plan.is_shared:
            return self.forward(self.policy, mb, with_entropy=True)
        with self._autocast():
            return packed_forward(
                self.policy,
                mb,
                plan.segments,
                temperature=self.cfg.temperature,
                with_entropy=True,
                entropy_requires_grad=self.cfg.entropy_coef > 0,
            )

    def dummy_pass(self, batch: TrainBatch, *, backward: bool) -> None:
        """A zero-weight pass so this rank joins the collectives of a micro-batch it does not have."""
        mb = batch.select(torch.tensor([0]))
        out = self.forward(self.policy, mb)
        if backward:
            zero = out.logp.sum() * 0.0 + (out.values.sum() * 0.0 if out.values is not None else 0.0)
            zero.backward()

    @torch.no_grad()
    def compute_logprobs(self, batch: Any, *, reference: bool = False) -> torch.Tensor:
        """log π(token t) for every position of the batch under the current (or reference) weights,
        [B, T] float32 on CPU, 0 at t = 0 and on padding. Uses the training micro-batching."""
        tb = self.to_train_batch(batch)
        model = self.reference if reference else self.policy
        if model is None:
            raise ValueError("compute_logprobs(reference=True) needs use_reference = true")
        out = torch.zeros(tb.input_ids.shape, dtype=torch.float32)
        for idx in self.micro_batches(tb, torch.arange(tb.batch_size)):
            if idx.numel() == 0:
                self.dummy_pass(tb, backward=False)
                continue
            mb = tb.select(idx)
            logp = self.forward(model, mb).logp.float() * mb.attention_mask
            out[idx, : mb.input_ids.shape[1]] = logp.cpu()
        return out

    # ---- the step ----------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> dict[str, float]:
        """`step`'s metrics only (benches and tests that read nothing else)."""
        return self.step(batch).metrics

    def step(self, batch: Any) -> StepResult:
        """One PPO/GRPO step on a buffer batch: the new policy_version, `learner/*` and `is/*` metrics
        (core/catalogue.py) and whether every optimiser step was skipped as non-finite."""
        start = time.perf_counter()
        cfg = self.cfg
        full = self.to_train_batch(batch)
        if full.batch_size < self.world_size:
            raise ValueError(f"batch of {full.batch_size} sequences for {self.world_size} learner ranks")
        self.policy.eval()  # no dropout anywhere: the no-grad pass and the training pass see one policy
        inputs = build_step_inputs(self, full)
        recompute_s = inputs.recompute_s
        tb = inputs.batch
        stats: list[TokenStats] = []
        sums: dict[str, float] = {}
        self.policy.train()
        num_updates = num_skipped = 0
        self._optimizer_steps_at_start = self.num_optimizer_steps
        for _ in range(cfg.ppo_epochs):
            gen = self.generator if cfg.shuffle_minibatches else None
            for rows in split_minibatches(tb.batch_size, cfg.num_minibatches, gen):
                parts, stepped = self._minibatch_update(tb, inputs, rows, stats)
                for key, value in parts.items():
                    sums[key] = sums.get(key, 0.0) + value
                num_updates += 1
                num_skipped += not stepped
        self.policy_version += 1
        elapsed = time.perf_counter() - start
        metrics = {f"learner/{k}": v / num_updates for k, v in sums.items()}
        num_tokens = self.all_reduce(float(tb.num_action_tokens))
        total_tokens = self.all_reduce(float(tb.attention_mask.sum().item()))
        metrics.update(
            {
                "learner/policy_version": float(self.policy_version),
                "learner/num_optimizer_steps": float(self.num_optimizer_steps),
                "learner/num_nonfinite_steps": float(num_skipped),
                "learner/lr": float(self.scheduler.get_last_lr()[0]),
                "learner/num_seqs": float(full.batch_size),
                "learner/num_action_tokens": num_tokens,
                "learner/tokens_per_s": total_tokens * cfg.ppo_epochs / max(elapsed, 1e-9),
                "learner/update_s": elapsed,
                "learner/recompute_time_s": recompute_s,
                "learner/reward_mean": float(full.rewards.mean().item()),
                "learner/advantage_mean": inputs.advantage_mean,
                "learner/advantage_std": inputs.advantage_std,
                **inputs.distill,
            }
        )
        if stats:
            local = TokenStats.concat(stats)
            if self.is_distributed:  # IS statistics cover every rank's tokens
                gathered: list[Any] = [None] * self.world_size
                torch.distributed.all_gather_object(gathered, local)
                local = TokenStats.concat(gathered)
            metrics.update(correction_metrics(local, cfg.correction.num_lag_buckets))
        return StepResult(
            policy_version=self.policy_version, metrics=metrics, skipped_nonfinite=num_skipped == num_updates
        )

    def _minibatch_update(
        self, tb: TrainBatch, inputs: StepInputs, rows: torch.Tensor, stats: list[TokenStats]
    ) -> tuple[dict[str, float], bool]:
        """Accumulate gradients over the micro-batches of `rows`, clip, step; returns the loss parts
        and whether the optimiser stepped (False: skipped as non-finite, see `_clip_and_step`)."""
        cfg = self.cfg
        mode = cfg.effective_loss_agg_mode
        num_tokens = self.all_reduce(float(tb.loss_mask[rows].sum().item()))
        num_seqs = self.all_reduce(float(rows.numel()))
        constant = cfg.loss_norm_constant or self.all_reduce(float(inputs.full_width), "max")
        norms = dict(num_tokens=num_tokens, num_seqs=num_seqs, constant=constant)
        self.optimizer.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        for plan in self.train_micro_batches(tb, rows):
            idx = plan.rows
            if idx.numel() == 0:
                self.dummy_pass(tb, backward=True)
                continue
            mb = tb.select(idx)
            width = mb.input_ids.shape[1]
            sl = _row_slicer(idx, width)  # slices a [B, T] step tensor like `mb`
            out = self.train_forward(mb, plan)
            mask = mb.loss_mask
            lag = sl(inputs.lag)
            if inputs.terms is not None:
                terms = _slice_terms(inputs.terms, sl)
            else:
                prox = self._proximal(out.logp, mb, idx, lag, inputs)
                terms = staleness_correction(prox, mb.behavior_logprobs, lag, mask, cfg.correction)
            ratio = policy_ratio(out.logp, terms)
            pg, clipped, dual = ppo_policy_loss(
                ratio,
                sl(inputs.advantages),
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip_c=cfg.dual_clip_c,
                clip=terms.clip,
            )
            pg_loss = aggregate(pg * terms.is_weight * terms.keep, mask, mode, **norms)
            entropy = aggregate(out.entropy, mask, mode, **norms)
            loss = pg_loss - cfg.entropy_coef * entropy
            contrib = {"pg_loss": pg_loss.item(), "entropy": entropy.item()}
            if inputs.ref_logp is not None:
                kl = aggregate(kl_penalty(out.logp, sl(inputs.ref_logp), cfg.kl_estimator), mask, mode, **norms)
                loss = loss + cfg.kl_coef * kl
                contrib["kl"] = kl.item()
            if out.values is not None:
                assert inputs.old_values is not None and inputs.returns is not None  # PPO: both come with the values
                vl, v_clipped = value_loss(out.values, sl(inputs.old_values), sl(inputs.returns), clip=cfg.value_clip)
                vf = aggregate(vl, mask, LossAggMode.TOKEN_MEAN, num_tokens=num_tokens)
                loss = loss + cfg.vf_coef * vf
                contrib["value_loss"] = vf.item()
                contrib["value_clip_frac"] = float((v_clipped & (mask != 0)).sum().item()) / max(num_tokens, 1.0)
            # FSDP averages gradients over ranks; the normalisers are already global, so undo it.
            (loss * self.world_size).backward()
            contrib["loss"] = loss.item()
            for key, value in contrib.items():
                parts[key] = parts.get(key, 0.0) + value
            valid = mask != 0
            stats.append(
                TokenStats(
                    behav_ratio=terms.behav_ratio[valid].detach().float().cpu(),
                    policy_ratio=ratio[valid].detach().float().cpu(),
                    is_weight=terms.is_weight[valid].detach().float().cpu(),
                    clipped=(clipped | dual)[valid].cpu(),
                    masked=(~terms.keep)[valid].cpu(),
                    lag=lag[valid].cpu(),
                )
            )
        if self.is_distributed:
            parts = {k: self.all_reduce(v) for k, v in parts.items()}
        parts["grad_norm"], stepped = self._clip_and_step(parts.get("loss", 0.0))
        return parts, stepped

    def _proximal(
        self, logp: torch.Tensor, mb: TrainBatch, idx: torch.Tensor, lag: torch.Tensor, inputs: StepInputs
    ) -> torch.Tensor:  # [b, width]
        """log π_prox of a micro-batch: the start-of-step policy's log-probs.

        Before the step's first optimiser update the weights are the start-of-step ones, so the
        training forward's own log-probs are π_prox exactly; they are kept for the rows' later epochs.
        A row first reached after an update (a later mini-batch) gets the log-linear interpolation in
        version between π_behav and π_θ, taken as one version ahead (`loglinear_prox_logp`). Treating
        π_θ as one version ahead where it is not (the old rule, on every update) shifts the PPO ratio's
        anchor back towards π_behav by 1/(lag + 1) of the way, so a stale token whose probability has
        already risen under a positive advantage is clipped out of the gradient.
        """
        width = logp.shape[1]
        exact = logp.detach().float()
        if self.num_optimizer_steps == self._optimizer_steps_at_start:  # no update yet (or all skipped)
            inputs.prox_logp[idx, :width] = exact
            inputs.prox_known[idx] = True
            return exact
        known = inputs.prox_known[idx].unsqueeze(-1)
        approx = loglinear_prox_logp(logp, mb.behavior_logprobs, lag)
        return torch.where(known, inputs.prox_logp[idx, :width], approx)

    def _clip_and_step(self, loss: float) -> tuple[float, bool]:
        """Clip and take one optimiser and schedule step; returns (grad norm, stepped).

        A non-finite `loss` or grad norm skips the step: the gradients are dropped and the weights,
        the optimiser state and the schedule stay as they were. Every rank decides alike: `loss` is
        summed over ranks and the norm is global."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        norm = clip_grad_norm(params, max_norm)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            logger.warning(
                "optimizer step skipped: loss %s, grad norm %s (policy_version %d)", loss, norm, self.policy_version
            )
            return norm, False
        self.optimizer.step()
        self.scheduler.step()
        self.num_optimizer_steps += 1
        return norm, True

    # ---- weights out -------------------------------------------------------------------------------

    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every LM parameter, in the names vLLM's loader expects.

        Single process: the live parameter tensors (detached views, no copy). FSDP: each parameter
        is all-gathered on its own (`learner.sharded.full_tensor`), so at most one unsharded parameter is alive
        beyond the shards; every rank must iterate (the gather is collective), rank 0 sends.
        Tied weights appear once (under the input-embedding name), as in the HF checkpoint.
        With LoRA: the merged weights under the base model's names (`LoraAdapter.merged_parameters`),
        each target's W + B·A·α/r a new tensor, every other parameter the live one; with
        `lora.sync = "adapter"` the adapter's A and B alone, under peft's names (`LoraAdapter.adapter_tensors`).
        """
        if self.lora is not None:
            adapter_only = self.cfg.lora is not None and self.cfg.lora.sync is LoraSync.ADAPTER
            yield from self.lora.adapter_tensors() if adapter_only else self.lora.merged_parameters()
            return
        for name, param in self.policy.lm.named_parameters():
            yield name, full_tensor(param).detach()

    def train_state(self) -> TrainState:
        # a VLM's processor saves its tokenizer *and* image processor: vLLM needs both to load the folder
        tokenizer = self.processor if self.processor is not None else self.tokenizer
        return TrainState(
            cfg=self.cfg,
            policy=self.policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            generator=self.generator,
            tokenizer=tokenizer,
            rank=self.rank,
            is_distributed=self.is_distributed,
            policy_version=self.policy_version,
            num_optimizer_steps=self.num_optimizer_steps,
            lora=self.lora,
        )

    def save_hf(self, directory: str | Path) -> Path:
        """HF `save_pretrained` folder (weights + config + tokenizer) that vLLM loads; atomic."""
        return ckpt.save_hf(self.train_state(), Path(directory))

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Weights, optimiser, scheduler, RNG, step and policy_version; write-then-rename."""
        self.checkpoint_writer.wait()  # one writer per folder: a write in flight lands first
        return ckpt.save_checkpoint(self.train_state(), Path(directory))

    def start_checkpoint(self, directory: str | Path) -> None:
        """Snapshot the checkpoint now and write it on a background thread while training goes on
        (`checkpoint.CheckpointWriter`); `finish_checkpoint` collects it."""
        self.checkpoint_writer.start(self.train_state(), Path(directory))

    def finish_checkpoint(self) -> str | None:
        """The folder of the checkpoint in flight once sealed (None if none, or not rank 0); raises
        `CheckpointWriteError` when its write failed."""
        path = self.checkpoint_writer.wait()
        return None if path is None else str(path)

    @property
    def checkpoint_busy(self) -> bool:
        """A checkpoint write is still running (`finish_checkpoint` would wait)."""
        return self.checkpoint_writer.busy

    def load_checkpoint(self, directory: str | Path) -> None:
        self.policy_version, self.num_optimizer_steps = ckpt.load_checkpoint(self.train_state(), Path(directory))


def _row_slicer(idx: torch.Tensor, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows `idx`, the first `width` columns: a [B, T] step tensor cut like one micro-batch."""
    return lambda x: x[idx, :width]


def _slice_terms(terms: CorrectionTerms, sl: Callable[[torch.Tensor], torch.Tensor]) -> CorrectionTerms:
    return CorrectionTerms(
        anchor_logp=sl(terms.anchor_logp),
        ratio_scale=sl(terms.ratio_scale),
        is_weight=sl(terms.is_weight),
        keep=sl(terms.keep),
        behav_ratio=sl(terms.behav_ratio),
        clip=terms.clip,
        mask=None if terms.mask is None else sl(terms.mask),
    )
