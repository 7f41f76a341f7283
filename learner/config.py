"""Learner configuration: optimisation, PPO/GRPO loss knobs, the staleness correction and LoRA.

`LearnerConfig` is the `[learner]` table of a run file; `CorrectionConfig` its `[learner.correction]`
sub-table, `LoraConfig` its `[learner.lora]` sub-table (absent: full fine-tuning), `DistillSignal` what
the run's `[distill]` table tells the learner (absent: no distillation). Every knob the
pure functions in `advantages.py`, `losses.py` and `correction.py` read is declared here with its
constraint, so a bad run file fails at load time with a pydantic error instead of halfway through a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


class Algo(StrEnum):
    GRPO = "grpo"  # group-normalised outcome advantage, no critic
    PPO = "ppo"  # value head + GAE over action tokens


class CorrectionMode(StrEnum):
    NONE = "none"  # PPO ratio against behavior logprobs (naive off-policy baseline)
    TIS = "tis"  # truncated IS: ratio (π_θ/π_prox)·min(π_prox/π_behav, C), clipped as PPO
    DECOUPLED = "decoupled"  # AReaL: clip π_θ/π_prox, weight by min(π_prox/π_behav, C)
    MASKED = "masked"  # IcePop/MIS: drop tokens/sequences whose π_prox/π_behav leaves [lo, hi]
    M2PO = "m2po"  # second-moment trust region: mask largest (log π_prox/π_behav)² tokens


class CorrectionLevel(StrEnum):
    TOKEN = "token"  # per-token ratio
    SEQUENCE = "sequence"  # product of token ratios over the sequence
    GEOMETRIC = "geometric"  # geometric mean of token ratios over the sequence


class Anchor(StrEnum):
    """What the PPO ratio π_θ/π_anchor is taken against."""

    BEHAVIOR = "behavior"
    PROXIMAL = "proximal"


class Weight(StrEnum):
    """The importance weight built from ρ = π_prox/π_behav."""

    NONE = "none"  # 1
    TRUNCATED = "truncated"  # min(ρ, C)
    FULL = "full"  # ρ


class WeightAt(StrEnum):
    LOSS = "loss"  # multiplies the clipped per-token loss (AReaL decoupled, verl rollout_is)
    RATIO = "ratio"  # multiplies the ratio inside the clip (TIS as in Yao et al.)


class Rejection(StrEnum):
    """Which tokens (or sequences) carry no loss, decided from ρ."""

    NONE = "none"
    BOUNDS = "bounds"  # keep mask_low ≤ ρ ≤ mask_high (IcePop/MIS, AReaL mask mode, verl rollout_rs)
    M2 = "m2"  # M2PO: drop the largest (log ρ)² until their mean ≤ m2_threshold


class RatioLevel(StrEnum):
    """The PPO ratio per token, or per sequence as the geometric mean of its token ratios (GSPO)."""

    TOKEN = "token"
    GEOMETRIC = "geometric"


@dataclass(frozen=True, kw_only=True, slots=True)
class CorrectionRecipe:
    """A correction as independent choices (`CorrectionConfig.recipe()`; formulas in correction.py)."""

    anchor: Anchor
    weight: Weight
    weight_at: WeightAt
    rejection: Rejection
    clip: bool


# Each mode is a preset: exactly the behaviour the mode had before corrections composed.
PRESETS: dict[CorrectionMode, CorrectionRecipe] = {
    CorrectionMode.NONE: CorrectionRecipe(
        anchor=Anchor.BEHAVIOR, weight=Weight.NONE, weight_at=WeightAt.LOSS, rejection=Rejection.NONE, clip=True
    ),
    CorrectionMode.TIS: CorrectionRecipe(
        anchor=Anchor.PROXIMAL, weight=Weight.TRUNCATED, weight_at=WeightAt.RATIO, rejection=Rejection.NONE, clip=True
    ),
    CorrectionMode.DECOUPLED: CorrectionRecipe(
        anchor=Anchor.PROXIMAL, weight=Weight.TRUNCATED, weight_at=WeightAt.LOSS, rejection=Rejection.NONE, clip=True
    ),
    CorrectionMode.MASKED: CorrectionRecipe(
        anchor=Anchor.PROXIMAL, weight=Weight.NONE, weight_at=WeightAt.LOSS, rejection=Rejection.BOUNDS, clip=True
    ),
    CorrectionMode.M2PO: CorrectionRecipe(
        anchor=Anchor.BEHAVIOR, weight=Weight.NONE, weight_at=WeightAt.LOSS, rejection=Rejection.M2, clip=False
    ),
}


class ProxMode(StrEnum):
    # Both are exact wherever the weights are still the step's starting ones (see `TrainingEngine`):
    # they differ only for mini-batches trained after the step's first optimiser update.
    RECOMPUTE = "recompute"  # extra no-grad pass at the start of the step when a later update needs it
    LOGLINEAR = "loglinear"  # after the first update, interpolate behav→current logprobs by version


class LossAggMode(StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    CONSTANT = "constant"  # Dr.GRPO: token sum / (num_seqs · constant)


class KLEstimator(StrEnum):
    K1 = "k1"  # log π_θ − log π_ref
    K2 = "k2"  # ½ (log π_θ − log π_ref)²
    K3 = "k3"  # exp(log π_ref − log π_θ) − 1 − (log π_ref − log π_θ)


class LRSchedule(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class CorrectionConfig(BaseModel):
    """Staleness-aware importance correction (see `learner/correction.py` for the formulas)."""

    model_config = ConfigDict(extra="forbid")

    # `mode` is a preset (`PRESETS`); each of `anchor`, `weight`, `weight_at`, `rejection`, `clip`
    # set here replaces the preset's choice, e.g. mode = "decoupled" + rejection = "bounds" is AReaL's
    # rejection sampling in mask mode (kept tokens keep their weight min(ρ, C)).
    mode: CorrectionMode = CorrectionMode.DECOUPLED
    anchor: Anchor | None = None
    weight: Weight | None = None
    weight_at: WeightAt | None = None
    rejection: Rejection | None = None
    clip: bool | None = None
    # ρ of the weight per token, sequence or geometric mean; the rejection's level defaults to it.
    level: CorrectionLevel = CorrectionLevel.TOKEN
    rejection_level: CorrectionLevel | None = None
    ratio_level: RatioLevel = RatioLevel.TOKEN
    prox: ProxMode = ProxMode.RECOMPUTE
    # Truncation cap C of π_prox/π_behav for tis/decoupled; `cap_by_lag[i]` overrides it for tokens of
    # lag i (the last entry for all larger lags).
    cap: float = Field(default=2.0, gt=0)
    cap_by_lag: list[float] | None = None
    # Keep interval [mask_low, mask_high] of π_prox/π_behav for `masked`; `mask_bounds_by_lag` per lag.
    mask_low: float = Field(default=0.5, ge=0)
    mask_high: float = Field(default=2.0, gt=0)
    mask_bounds_by_lag: list[tuple[float, float]] | None = None
    # M2PO: largest (log π_prox/π_behav)² tokens are masked until their mean is ≤ m2_threshold.
    m2_threshold: float = Field(default=0.04, gt=0)
    # Tokens whose lag exceeds this are masked out of every mode (None: no limit).
    max_token_lag: int | None = Field(default=None, ge=0)
    # Metrics break down by lag 0..num_lag_buckets-1 and `lag_{num_lag_buckets}plus`.
    num_lag_buckets: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CorrectionConfig:
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low {self.mask_low} must be < mask_high {self.mask_high}")
        if self.cap_by_lag is not None and (not self.cap_by_lag or min(self.cap_by_lag) <= 0):
            raise ValueError("cap_by_lag must be a non-empty list of positive caps")
        if self.mask_bounds_by_lag is not None:
            if not self.mask_bounds_by_lag or any(lo >= hi or lo < 0 for lo, hi in self.mask_bounds_by_lag):
                raise ValueError("mask_bounds_by_lag must be a non-empty list of (lo, hi) with 0 <= lo < hi")
        return self

    def recipe(self) -> CorrectionRecipe:
        """The preset of `mode` with every choice set in this config put in its place."""
        preset = PRESETS[self.mode]
        return CorrectionRecipe(
            anchor=self.anchor or preset.anchor,
            weight=self.weight or preset.weight,
            weight_at=self.weight_at or preset.weight_at,
            rejection=self.rejection or preset.rejection,
            clip=preset.clip if self.clip is None else self.clip,
        )

    @property
    def needs_prox(self) -> bool:
        """Whether anything reads π_prox: a proximal anchor, a weight or a rejection (all use ρ)."""
        r = self.recipe()
        return r.anchor is Anchor.PROXIMAL or r.weight is not Weight.NONE or r.rejection is not Rejection.NONE

    @property
    def needs_whole_batch(self) -> bool:
        """Whether a term is a statistic over the whole batch (M2PO's mask), so π_prox must be known for
        every row before the first micro-batch's loss."""
        return self.recipe().rejection is Rejection.M2


class LoraSync(StrEnum):
    """What a publish sends the engines when the learner trains a LoRA adapter."""

    MERGED = "merged"  # the merged weights W + B·A·α/r under the base model's names, as a full fine-tune sends
    # the adapter alone (A and B of each target), loaded into each engine as a new LoRA adapter per
    # policy_version; needs engines that serve LoRA (rollout.engine.backend = "vllm", checked by the run config)
    ADAPTER = "adapter"


# The attention and MLP projections of Llama-style decoders (Llama, Qwen2, Mistral, SmolLM2).
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """LoRA on the policy LM (`learner/lora.py`, docs/lora.md): each target Linear W gains a trainable
    low-rank update B·A scaled by alpha / rank; W itself stays frozen."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=16, gt=0)  # r: A is [r, in], B is [out, r]
    alpha: int = Field(default=32, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(default=0.0, ge=0, lt=1)  # on the adapter's input, training pass only
    # Module names (the last component, as peft matches them) whose nn.Linear layers get an adapter.
    target_modules: list[str] = Field(default_factory=lambda: list(LLAMA_PROJECTIONS), min_length=1)
    sync: LoraSync = LoraSync.MERGED

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"learner.lora.target_modules has duplicates: {self.target_modules}")
        return self


class DistillMode(StrEnum):
    """How the teacher's per-token signal enters the advantage (`learner.distill`)."""

    KL = "kl"  # A_t = −coef · k_t: on-policy distillation alone
    MIXED = "mixed"  # A_t = A_task_t − coef · k_t: the task advantage plus the teacher's


class DistillSignal(BaseModel):
    """What the learner does with the teacher's log-probs. The run's `[distill]` table sets it
    (`streaming.config.DistillConfig`); None: no distillation."""

    model_config = ConfigDict(extra="forbid")

    mode: DistillMode = DistillMode.KL
    coef: float = Field(default=1.0, gt=0)  # weight of the per-token reverse-KL advantage


class LearnerConfig(BaseModel):
    """The training engine: model, optimiser, schedule, micro-batching and the PPO/GRPO loss."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"  # HF folder, or a built-in name resolved by models.resolve_model
    algo: Algo = Algo.GRPO
    device: str = Field(default="auto", pattern="^(auto|cpu|cuda)$")
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16)$")  # autocast compute dtype
    seed: int = 0
    # Activation checkpointing of the decoder layers (HF `gradient_checkpointing_enable`, non-reentrant):
    # backward recomputes each layer's forward instead of keeping its activations, trading about one
    # more forward pass for activation memory that no longer grows with the number of layers
    # (SmolLM2-135M, 4096-token micro-batches: step peak 7.8 → 3.1 GiB; bench/memory_learner.py).
    gradient_checkpointing: bool = False
    # The LM head, log-softmax and entropy run on chunks of this many token positions, each
    # checkpointed, so no [B, T, vocab] float32 logits tensor is ever held (the largest tensors of a
    # step: 0.8 GB per copy for 4096 tokens of a 49k vocabulary; a 512-token chunk holds 0.1 GB per
    # copy and costs one extra LM-head matmul in backward). 0: the whole micro-batch at once.
    logits_chunk_tokens: int = Field(default=512, ge=0)
    temperature: float = Field(default=1.0, gt=0)  # sampling temperature the engines use

    # Placement. num_workers = 1: one process (the LearnerActor itself). num_workers > 1: an FSDP2
    # group of that many rank actors (`learner/group.py`; NCCL on CUDA, gloo on CPU), each asking
    # Ray for the resources below, so engines and learner ranks land on disjoint GPUs.
    num_workers: int = Field(default=1, ge=1)  # FSDP ranks
    num_gpus_per_worker: float | None = Field(default=None, ge=0)  # None: 1 on CUDA, 0 on CPU
    num_cpus_per_worker: float = Field(default=1.0, ge=0)  # a Ray scheduling count, not cores
    # Ray custom resources of each learner process, e.g. {learner_node = 1} to pin it to nodes
    resources_per_worker: dict[str, float] = Field(default_factory=dict)

    # Optimiser and schedule (one scheduler step per optimiser step).
    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    # An optimiser step whose loss or gradient norm is NaN/inf is skipped (no weight change); this
    # many learner steps in a row with nothing but skipped updates stop the run.
    max_nonfinite_steps: int = Field(default=3, ge=1)
    warmup_steps: int = Field(default=0, ge=0)
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    # optimiser steps the schedule spans; needed by linear/cosine ("total_steps", its earlier name, is read too)
    lr_schedule_steps: int | None = Field(
        default=None, gt=0, validation_alias=AliasChoices("lr_schedule_steps", "total_steps")
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)

    # Batching: a train batch splits into num_minibatches optimiser steps per epoch; each mini-batch
    # is packed into micro-batches of at most micro_batch_tokens padded tokens (grad accumulation).
    ppo_epochs: int = Field(default=1, ge=1)
    num_minibatches: int = Field(default=1, ge=1)
    micro_batch_tokens: int = Field(default=4096, gt=0)
    shuffle_minibatches: bool = True
    # The training pass forwards each GRPO group's shared prompt once (forward and backward) and
    # every row's continuation against it, packed with a 4-D attention mask (`learner/shared_prefix.py`):
    # same losses and gradients, fewer tokens. A packed group counts prompt + continuations against
    # micro_batch_tokens; a larger group is cut into chunks that each repeat the prompt. Groups whose
    # rows differ in their prompt, vision-language models and the no-grad passes stay dense.
    shared_prefix: bool = True

    @property
    def updates_per_step(self) -> int:
        """Optimiser updates in one learner step: ppo_epochs × num_minibatches."""
        return self.ppo_epochs * self.num_minibatches

    # Policy loss.
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    clip_high: float = Field(default=0.28, ge=0)
    dual_clip_c: float | None = Field(default=3.0, gt=1)
    loss_agg_mode: LossAggMode = LossAggMode.TOKEN_MEAN
    loss_norm_constant: float | None = Field(default=None, gt=0)  # CONSTANT mode; None: padded length
    entropy_coef: float = Field(default=0.0, ge=0)
    kl_coef: float = Field(default=0.0, ge=0)
    kl_estimator: KLEstimator = KLEstimator.K3
    use_reference: bool = False  # keep a frozen copy of the initial model for the KL term

    # Critic (PPO only): value head on the policy trunk.
    vf_coef: float = Field(default=0.5, ge=0)
    value_clip: float | None = Field(default=0.2, gt=0)
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=0.95, ge=0, le=1)
    whiten_advantages: bool = True  # PPO: normalise GAE advantages over the batch's action tokens

    # GRPO advantage.
    grpo_scale_std: bool = True
    dr_grpo: bool = False  # Dr.GRPO: no std scaling and the constant loss normaliser
    use_turn_scores: bool = True  # per-turn scores join the return (PPO: at their turn's last token)

    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    # LoRA adapter training, synced merged or as the adapter alone (docs/lora.md); None: every weight trains.
    lora: LoraConfig | None = None
    # On-policy distillation from a teacher's per-token log-probs (docs/distillation.md); set from the
    # run's [distill] table. None: the task advantage alone.
    distill: DistillSignal | None = None

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.lr_schedule != LRSchedule.CONSTANT and self.lr_schedule_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule.value!r} needs lr_schedule_steps (optimiser steps)")
        if self.kl_coef > 0 and not self.use_reference:
            raise ValueError("kl_coef > 0 needs use_reference = true (the KL is to a frozen reference)")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1): {self.betas}")
        gpus = self.num_gpus_per_worker
        if self.device == "cpu" and gpus:
            raise ValueError(f"device='cpu' with num_gpus_per_worker={gpus} would reserve GPUs the learner never uses")
        if self.device == "cuda" and gpus is not None and gpus == 0:
            raise ValueError("device='cuda' needs num_gpus_per_worker > 0 (or unset: 1)")
        if self.device == "cuda" and self.num_workers > 1 and gpus not in (None, 1):
            raise ValueError(f"an FSDP rank uses exactly one GPU: num_gpus_per_worker must be 1, got {gpus}")
        if self.lora is not None and self.num_workers > 1:
            raise ValueError(
                f"learner.lora with num_workers={self.num_workers} is not built: the merged-weight sync, the "
                "adapter checkpoint and its resume run in one learner process (FSDP2 would shard frozen base "
                "weights and adapters in one unit, and each merged weight would need its base and adapter "
                "gathered together); none of that is written or tested. Use num_workers = 1: one process "
                "holds the frozen weights once and gradients and AdamW moments for the adapter only"
            )
        return self

    def resolved_num_gpus_per_worker(self, device: str) -> float:
        """Ray GPUs per learner process once `device` is resolved: the set value, else 1 on CUDA, 0 on CPU."""
        if self.num_gpus_per_worker is not None:
            return self.num_gpus_per_worker
        return 1.0 if device == "cuda" else 0.0

    @property
    def effective_loss_agg_mode(self) -> LossAggMode:
        """Dr.GRPO forces the constant normaliser."""
        return LossAggMode.CONSTANT if self.dr_grpo else self.loss_agg_mode

    @property
    def effective_scale_std(self) -> bool:
        return self.grpo_scale_std and not self.dr_grpo
