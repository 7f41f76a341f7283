"""`TrainBatch`: the learner's view of a buffer batch, as torch tensors on the learner device.

Built from `buffer.types.PaddedBatch` (numpy, right-padded) with `TrainBatch.from_padded`; any object
with the same attributes works, so the learner never imports the buffer package.

Conventions (shared with the buffer):
- sequences are prompt + response tokens, right-padded to T;
- `routed_experts[b, t]` (MoE engines only) are the [num_moe_layers, top_k] experts token t was routed
  through when the engine generated it, -1 where unknown; the policy's forward replays them
  (`learner.moe_replay`);
- `loss_mask[b, t] == 1` iff token t was sampled by the policy; `behavior_logprobs[b, t]` is the
  logprob of token t under the behavior policy and `policy_versions[b, t]` its weights' version
  (-1 where the mask is 0); `teacher_logprobs[b, t]` (distillation only) the teacher's logprob of the
  same token, NaN where the teacher scored nothing;
- the logprob of token t comes from the logits at position t-1, so position 0 never carries loss;
- a VLM row's `input_ids` hold its image placeholders already expanded (what the model saw), and
  `images[b]` holds that row's pixels in placeholder order (`learner.vision`); text-only batches have
  `images is None`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from streamrl.learner.vision import RowImages


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainState:
    """What a checkpoint saves and restores (`learner.checkpoint` takes this, not the engine): the
    models, optimiser, schedule and shuffle generator, the counters it records, and the rank facts
    that decide who writes. `load_checkpoint` returns the counters it read; the engine sets them."""

    cfg: Any  # learner.config.LearnerConfig
    policy: Any  # learner.model.PolicyModel (sharded under FSDP)
    optimizer: Any
    scheduler: Any
    generator: Any  # torch.Generator
    tokenizer: Any
    rank: int
    is_distributed: bool
    policy_version: int
    num_optimizer_steps: int
    lora: Any = None  # learner.lora.LoraAdapter of `policy` (None: full fine-tuning)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """A learner rank's train step, across the actor boundary: the version its weights now carry
    (control), the step's metrics (observability only, never read for control), and whether every
    optimiser step of it was skipped for a non-finite loss or gradient norm (weights unchanged)."""

    policy_version: int
    metrics: dict[str, float]
    skipped_nonfinite: bool = False


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64 (1 = real token)
    loss_mask: torch.Tensor  # [B, T] float32 (1 = sampled by the policy)
    behavior_logprobs: torch.Tensor  # [B, T] float32
    policy_versions: torch.Tensor  # [B, T] int64, -1 where loss_mask == 0
    seq_lens: torch.Tensor  # [B] int64
    rewards: torch.Tensor  # [B] float32 (final score)
    group_index: torch.Tensor  # [B] int64 (sequences of one GRPO group share it)
    # [B] int64: tokens of the row's first prompt (None when the source batch does not say); a GRPO
    # group's rows share these tokens, which `learner.shared_prefix` forwards once per group
    prompt_lens: torch.Tensor | None = None
    turn_scores: list[list[float]] = field(default_factory=list)  # [B][num_scored_turns]
    # [B]; row b's image inputs (None: no image in row b). None for a text-only batch.
    images: list[RowImages | None] | None = None
    # [B, T, num_moe_layers, top_k] int64 recorded expert ids, -1 = route live; None: no routes (dense)
    routed_experts: torch.Tensor | None = None
    # [B, T] float32 the distillation teacher's log-prob of each response token, NaN where unscored;
    # None: no teacher (`learner.distill`)
    teacher_logprobs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @classmethod
    def from_padded(cls, padded: Any, device: str | torch.device = "cpu", *, processor: Any = None) -> TrainBatch:
        """Convert a `PaddedBatch`-like object (numpy arrays) and validate the data contract.

        When `padded.images` (`[B][num_images]`, encoded bytes or PIL images in placeholder order)
        holds any image, the pixels are built here with `processor` (the learner model's)."""
        import numpy as np
        import torch

        def t(name: str, dtype: torch.dtype) -> torch.Tensor:
            value = getattr(padded, name)
            arr = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))  # own copy
            return arr.to(device=device, dtype=dtype)

        batch = cls(
            input_ids=t("input_ids", torch.int64),
            attention_mask=t("attention_mask", torch.int64),
            loss_mask=t("loss_mask", torch.float32),
            behavior_logprobs=t("behavior_logprobs", torch.float32),
            policy_versions=t("policy_versions", torch.int64),
            seq_lens=t("seq_lens", torch.int64),
            rewards=t("rewards", torch.float32),
            group_index=t("group_index", torch.int64),
            prompt_lens=t("prompt_lens", torch.int64) if getattr(padded, "prompt_lens", None) is not None else None,
            turn_scores=[list(map(float, s)) for s in getattr(padded, "turn_scores", None) or []],
            routed_experts=t("routed_experts", torch.int64)
            if getattr(padded, "routed_experts", None) is not None
            else None,
            teacher_logprobs=t("teacher_logprobs", torch.float32)
            if getattr(padded, "teacher_logprobs", None) is not None
            else None,
        )
        raw_images = getattr(padded, "images", None) or [[] for _ in range(batch.batch_size)]
        has_images = any(len(row) for row in raw_images)
        if has_images and processor is None:
            raise ValueError("batch has images but the learner model has no image processor (not a VLM)")
        # a VLM batch is checked even without images: placeholder tokens with no pixels are a data bug
        if processor is not None and (has_images or bool((batch.input_ids == processor.image_token_id).any())):
            from streamrl.learner.vision import batch_vision_inputs

            rows = batch_vision_inputs(processor, raw_images, batch.input_ids.cpu())
            batch.images = [None if r is None else r.to(device) for r in rows]
        batch.validate()
        return batch

    def validate(self) -> None:
        """Raise ValueError when the arrays break the data contract."""
        import torch

        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for name in ("attention_mask", "loss_mask", "behavior_logprobs", "policy_versions", "teacher_logprobs"):
            if getattr(self, name) is not None and getattr(self, name).shape != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}")
        for name in ("seq_lens", "rewards", "group_index", "prompt_lens"):
            value = getattr(self, name)
            if value is not None and value.shape != shape[:1]:
                raise ValueError(f"{name} must be [B={shape[0]}], got {tuple(value.shape)}")
        if self.turn_scores and len(self.turn_scores) != shape[0]:
            raise ValueError(f"turn_scores has {len(self.turn_scores)} rows for batch size {shape[0]}")
        routes = self.routed_experts
        if routes is not None and (routes.dim() != 4 or routes.shape[:2] != shape):
            raise ValueError(
                f"routed_experts must be [B, T, layers, top_k] with [B, T]={tuple(shape)}, got {tuple(routes.shape)}"
            )
        if self.images is not None and len(self.images) != shape[0]:
            raise ValueError(f"images has {len(self.images)} rows for batch size {shape[0]}")
        if bool((self.loss_mask[:, 0] != 0).any()):
            raise ValueError("loss_mask at position 0 must be 0 (no logits predict the first token)")
        if bool(((self.loss_mask != 0) & (self.attention_mask == 0)).any()):
            raise ValueError("loss_mask is 1 on a padding position")
        sampled = self.loss_mask != 0
        if bool((self.policy_versions[sampled] < 0).any()):
            raise ValueError("policy_versions must be >= 0 where loss_mask is 1")
        if not bool(torch.isfinite(self.behavior_logprobs[sampled]).all()):
            raise ValueError("behavior_logprobs must be finite where loss_mask is 1")

    def select(self, index: torch.Tensor) -> TrainBatch:
        """Rows `index` (a 1-D index tensor), trimmed to their longest sequence; each row keeps its
        images (a row's placeholders never exceed its `seq_lens`, so trimming cuts no image)."""
        width = max(int(self.seq_lens[index].max().item()), 1) if index.numel() else 1
        rows = index.tolist()
        return TrainBatch(
            input_ids=self.input_ids[index, :width],
            attention_mask=self.attention_mask[index, :width],
            loss_mask=self.loss_mask[index, :width],
            behavior_logprobs=self.behavior_logprobs[index, :width],
            policy_versions=self.policy_versions[index, :width],
            seq_lens=self.seq_lens[index],
            rewards=self.rewards[index],
            group_index=self.group_index[index],
            prompt_lens=None if self.prompt_lens is None else self.prompt_lens[index],
            turn_scores=[self.turn_scores[i] for i in rows] if self.turn_scores else [],
            images=[self.images[i] for i in rows] if self.images is not None else None,
            routed_experts=None if self.routed_experts is None else self.routed_experts[index, :width],
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[index, :width],
        )
