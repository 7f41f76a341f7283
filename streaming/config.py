"""The root run configuration: one pydantic model composed of each component's own config.

Run files are sparse TOML (`configs/*.toml`); `key.sub=value` overrides come from the CLI; the
resolved config is written as JSON beside every run (`RUN_DIR/run_info.json`). Bad config raises one
`ValueError` that names the offending field.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamrl.buffer.config import BufferConfig
from streamrl.engines.config import VLLM_LORA_RANKS, EngineConfig, LoraServing
from streamrl.learner.config import DistillMode, DistillSignal, LearnerConfig, LoraSync
from streamrl.observability.metrics import WandbConfig
from streamrl.observability.tracing import TraceConfig
from streamrl.rollout.config import RolloutConfig
from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.mini_swe.config import SOURCE as MINI_SWE_SOURCE
from streamrl.rollout.mini_swe.config import MiniSweConfig
from streamrl.rollout.mini_swe.config import check_sources as check_mini_swe
from streamrl.rollout.verifiers.config import SOURCE as VERIFIERS_SOURCE
from streamrl.rollout.verifiers.config import PreparedVerifiers, VerifiersConfig, check_sources
from streamrl.streaming.placement import PlacementConfig
from streamrl.streaming.prompt_filter import PromptFilterConfig
from streamrl.weight_sync.config import BackendKind, WeightSyncConfig

GENERATED_SOURCES = ("arithmetic", "dots")  # data.source values drawn by a generator, not read from a file


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "arithmetic" = generated arithmetic word problems (the embedded default); "dots" = generated
    # count-the-dots image prompts for a VLM (rollout/data/dots.py; needs
    # rollout.engine.max_images_per_prompt >= 1); else a parquet/jsonl path.
    source: str = "arithmetic"
    num_prompts: int = Field(256, gt=0)  # for generated sources (arithmetic, dots)
    difficulty: Literal["easy", "medium", "hard"] = "medium"  # generated arithmetic only
    seed: int = 0
    shuffle: bool = True
    num_epochs: int = Field(100, gt=0)  # the data iterator cycles; total_steps ends the run
    # Online difficulty filtering: skip the appearances of prompts every sample solves (or none does).
    prompt_filter: PromptFilterConfig = Field(default_factory=PromptFilterConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_eval_keys(cls, data: Any) -> Any:
        moved = sorted(k for k in data if k in MOVED_EVAL_KEYS) if isinstance(data, dict) else []
        if moved:
            raise ValueError(
                "the held-out evaluation keys moved to the [eval] section: "
                + ", ".join(f"data.{k} -> eval.{MOVED_EVAL_KEYS[k]}" for k in moved)
            )
        return data


MOVED_EVAL_KEYS = {"eval_num_prompts": "num_prompts", "eval_source": "source", "eval_temperature": "temperature"}


class EvalConfig(BaseModel):
    """Held-out evaluation during training (streaming/heldout.py): prompts the run never trains on,
    each sampled `k` times by one pinned policy version, before the first step, every `every_steps`
    learner steps and after the last. Its rows go to RUN_DIR/eval/, never to the training buffer."""

    model_config = ConfigDict(extra="forbid")

    num_prompts: int = Field(0, ge=0)  # 0 = no evaluation
    # A parquet/jsonl path; None: for a generated data.source, a draw with another seed, minus any
    # prompt the training stream also holds.
    source: str | None = None
    k: int = Field(1, gt=0)  # samples per prompt: avg@k, pass@k, pass^k
    temperature: float = Field(0.0, ge=0.0)  # 0 = greedy (then k > 1 repeats one answer)
    every_steps: int = Field(0, ge=0)  # 0 = before the first and after the last step only
    pass_threshold: float = 1.0  # a sample "passes" (pass@k) when its reward >= this
    # A weight sync waits for a running evaluation (its trajectories keep one policy version) at most
    # this long; past it the evaluation is abandoned (counted, nothing written) and the sync goes on.
    max_hold_s: float = Field(600.0, gt=0)

    @property
    def enabled(self) -> bool:
        return self.num_prompts > 0


class SFTConfig(BaseModel):
    """Short supervised warm-up on generated tool-use transcripts for a model new to our format."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    difficulty: Literal["easy", "medium", "hard"] = "medium"  # of the generated transcripts
    num_examples: int = Field(256, gt=0)
    num_steps: int = Field(60, ge=0)
    batch_size: int = Field(8, gt=0)
    lr: float = Field(5e-5, gt=0)
    # Share of the transcripts that call the tool; the others answer at once (the same gold answer).
    # Below 1 the model learns both formats and RL learns when the tool pays (rollout.data).
    tool_fraction: float = Field(1.0, ge=0.0, le=1.0)
    skip_if_cached: bool = True  # reuse the warmed-up folder cached under $STREAMRL_CACHE


class ActorTimeouts(BaseModel):
    """How long the driver waits for each kind of call to an actor (`streaming.actors.clients`). A
    call past its deadline raises `TimeoutError`; the health checks tell that from a dead actor."""

    model_config = ConfigDict(extra="forbid")

    probe_s: float = Field(30.0, gt=0)  # cheap state: memory, outstanding count, outcomes
    query_s: float = Field(60.0, gt=0)  # node id, running ids, routing, metrics and stats
    stop_s: float = Field(120.0, gt=0)  # pause, close, shutdown
    recovery_s: float = Field(600.0, gt=0)  # reading the recovered log's highest version label
    # any other call (a learner step, a publish, an append) waits trainer.step_timeout_s


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["async", "sync"] = "async"
    total_steps: int = Field(
        20, gt=0
    )  # learner steps: one buffer batch each (num_minibatches x ppo_epochs optimiser steps)
    sync_every: int = Field(1, gt=0)  # publish weights every K learner steps
    checkpoint_every: int = Field(5, gt=0)
    # The learner copies a checkpoint's state (weights, optimizer, RNG) in host memory and writes it on
    # a background thread while it trains on; the run records it once sealed (streaming/checkpoints.py).
    # Costs one extra copy of the weights and optimizer state until the write ends. False: write inline.
    async_checkpoint: bool = True
    # Complete checkpoints kept in RUN_DIR/checkpoints (the oldest go once a new one is complete); 0 = all.
    # Two leave a resume an older one to fall back to when the newest is torn (streaming/checkpoints.py).
    keep_checkpoints: int = Field(2, ge=0)
    run_root: str = "runs"
    run_name: str | None = None  # default: <config stem>-<timestamp>
    step_timeout_s: float = Field(1800.0, gt=0)  # a learner step or a sync longer than this fails the run
    actor_timeouts: ActorTimeouts = Field(default_factory=ActorTimeouts)
    # The learner waiting this long for a batch while no trajectory row arrives fails the run with
    # an error naming the counts (no silent hang on dead engines or stuck workers).
    stall_timeout_s: float = Field(900.0, gt=0)
    # More than this share of failed trajectories among the newest `failed_window` finished or failed
    # ones stops the run with the most common failure reason (streaming/failures.py); 1 = never.
    max_failed_fraction: float = Field(0.9, gt=0, le=1)
    failed_window: int = Field(64, gt=0)
    log_samples_every: int = Field(1, gt=0)
    seed: int = 0
    # Sync mode: groups admitted together per generation round (verl's gen_batch_size with DAPO
    # dynamic sampling); rounds repeat until the DAPO filter leaves a full batch. 0 = one batch's
    # groups. More than one batch's groups needs buffer.max_staleness = 0 and buffer.over_age =
    # "evict": the groups left over when the step trains are evicted as stale, never trained later.
    sync_generation_groups: int = Field(0, ge=0)


class DistillConfig(BaseModel):
    """On-policy distillation (docs/distillation.md): a teacher model on engines of its own scores every
    sampled token of every finished trajectory, and the learner turns the scores into a per-token
    reverse-KL advantage, alone (`mode = "kl"`) or added to the task advantage (`"mixed"`). The teacher
    never takes part in weight sync."""

    model_config = ConfigDict(extra="forbid")

    teacher: str = Field(description="'tiny', 'smollm2' or a HF folder; it must share the student's tokenizer")
    mode: DistillMode = DistillMode.KL
    coef: float = Field(1.0, gt=0, description="weight of the per-token reverse-KL advantage")
    num_engines: int = Field(1, ge=1, description="teacher engines (each a Ray actor, routed like the rollout's)")
    # The teacher engines' settings, as `rollout.engine` (its own dtype, KV cache, max_model_len, placement:
    # num_cpus, cpu_cores, num_gpus, resources). `model` is set from `teacher`.
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @property
    def signal(self) -> DistillSignal:
        """What the learner needs of it."""
        return DistillSignal(mode=self.mode, coef=self.coef)


class StreamRLConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"  # 'tiny', 'smollm2' or a HF folder: the engines and the learner both use it
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    trace: TraceConfig = Field(default_factory=TraceConfig)  # lifecycle trace (docs/trace.md)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)  # cores per part (streaming/placement.py)
    distill: DistillConfig | None = None  # on-policy distillation from a teacher engine; None: off

    def with_model(self, model_path: str) -> StreamRLConfig:
        """This config with `model` set to the run's resolved folder (`streaming.sft.prepare_model`, the
        one place a run resolves its model), validated again so the components get it too."""
        return StreamRLConfig.model_validate(self.model_dump() | {"model": model_path})

    def with_verifiers(self, prepared: PreparedVerifiers, gateway: GatewayConfig) -> StreamRLConfig:
        """This config training on its prepared verifiers environment (`rollout/verifiers/prepare.py`):
        the dumped splits as `data.source` (and `eval.source` where it says "verifiers"), the gateway
        running the environment's runner, and `prepared` recorded; validated again."""
        section = self.rollout.agent.verifiers
        assert section is not None
        section = section.model_copy(update={"prepared": prepared})
        return self._with_gateway_data("verifiers", section, VERIFIERS_SOURCE, gateway)

    def with_mini_swe(self, prepared: MiniSweConfig, gateway: GatewayConfig) -> StreamRLConfig:
        """This config training the coding harness on its prepared tasks (`rollout/mini_swe/prepare.py`):
        the written prompts as `data.source` (and `eval.source` where it says "mini_swe"), the gateway
        running the episode program, and the prepared section recorded; validated again."""
        return self._with_gateway_data("mini_swe", prepared, MINI_SWE_SOURCE, gateway)

    def _with_gateway_data(
        self, name: str, section: VerifiersConfig | MiniSweConfig, source: str, gateway: GatewayConfig
    ) -> StreamRLConfig:
        """The config with `rollout.agent.<name>` = `section` (prepared: its prompt files) as the prompt
        stream and `gateway` (its command) as the gateway loop's program."""
        prepared = section.prepared
        assert prepared is not None
        raw = self.model_dump(mode="json")
        raw["data"]["source"] = prepared.train_file
        if self.eval.source == source:
            if prepared.eval_file is None:
                raise ValueError(f'eval.source = "{source}" but [rollout.agent.{name}] has no eval dataset')
            raw["eval"]["source"] = prepared.eval_file
        agent = raw["rollout"]["agent"]
        agent["gateway"] = gateway.model_dump(mode="json")
        agent[name] = section.model_dump(mode="json")
        return StreamRLConfig.model_validate(raw)

    @model_validator(mode="after")
    def _propagate(self) -> StreamRLConfig:
        # the one place the root `model` reaches the components that load it
        self.rollout.engine.model = self.model
        self.learner.model = self.model
        if self.weight_sync.wire_dtype == "auto" and self.rollout.engine.dtype != "auto":
            self.weight_sync.wire_dtype = self.rollout.engine.dtype  # what the engines cast to on load
        lag = self.weight_sync.publish_lag
        if lag and (self.trainer.mode != "sync" or self.trainer.sync_every != 1):
            raise ValueError(
                f'weight_sync.publish_lag={lag} (a fixed lag) needs trainer.mode = "sync" and trainer.sync_every = 1 '
                f"(got mode {self.trainer.mode!r}, sync_every {self.trainer.sync_every}): in async mode the lag also "
                "depends on scheduling"
            )
        self._check_images()
        self._check_lora_sync()
        self._check_server_backend()
        self._check_nccl_gpus()
        self._check_sync_rounds()
        self._check_placement()
        self._check_distill()
        agent = self.rollout.agent
        if agent.verifiers is not None and agent.mini_swe is not None:
            raise ValueError("[rollout.agent.verifiers] and [rollout.agent.mini_swe] both run as the gateway's command")
        check_sources(agent.verifiers, agent.gateway, self.data.source, self.eval.source)  # docs/verifiers.md
        check_mini_swe(agent.mini_swe, agent.gateway, self.data.source, self.eval.source)  # docs/harness.md
        if self.eval.enabled and self.eval.source is None and self.data.source not in GENERATED_SOURCES:
            raise ValueError(
                f"eval.num_prompts={self.eval.num_prompts} with data.source a dataset ({self.data.source!r}): "
                "set eval.source to a held-out parquet/jsonl file (only generated sources draw their own)"
            )
        if self.rollout.engine.max_model_len < self.rollout.max_model_len:
            raise ValueError(
                f"rollout.engine.max_model_len={self.rollout.engine.max_model_len} < prompt_length + "
                f"response_length = {self.rollout.max_model_len}"
            )
        return self

    def _check_distill(self) -> None:
        """The teacher's engines score prompt + response in one request (one position more than the
        rollout's longest sequence), text only, with vLLM in process or behind its server (SGLang's
        scoring is not built); the learner gets the signal."""
        distill = self.distill
        self.learner.distill = None if distill is None else distill.signal  # the one place the learner gets it
        if distill is None:
            return
        distill.engine.model = distill.teacher
        if distill.engine.backend == "sglang_server":
            raise ValueError(
                'distill.engine.backend = "sglang_server": teacher scoring is built for "vllm" (in-process) and '
                '"vllm_server" only'
            )
        if distill.engine.backend != "vllm" and len(distill.engine.server_urls) != distill.num_engines:
            raise ValueError(
                f"distill.engine.server_urls lists {len(distill.engine.server_urls)} servers for "
                f"distill.num_engines={distill.num_engines}: one per teacher engine"
            )
        if self.rollout.engine.max_images_per_prompt > 0:
            raise ValueError("distill with a VLM policy is not built: the teacher scores text-only sequences")
        if distill.engine.max_model_len <= self.rollout.max_model_len:
            raise ValueError(
                f"distill.engine.max_model_len={distill.engine.max_model_len} must exceed the rollout's prompt_length "
                f"+ response_length = {self.rollout.max_model_len} (the teacher scores whole sequences)"
            )
        if distill.mode == "kl" and self.buffer.filter_uniform_reward_groups:
            raise ValueError(
                'distill.mode = "kl" trains on the teacher\'s signal alone, but buffer.filter_uniform_reward_groups '
                "drops every group whose task rewards are all equal, most of them with a teacher to learn from: "
                'set it to false (or distill.mode = "mixed")'
            )

    def _check_placement(self) -> None:
        self.placement.engine_slice(0, self.rollout.num_engines)  # equal slices, or ValueError
        if self.placement.learner_cores is not None and self.learner.num_workers > 1:
            raise ValueError(
                "placement.learner_cores pins one learner process; with learner.num_workers > 1 leave it unset "
                "(each rank of a CPU group takes cpu_count / num_workers threads)"
            )

    def _check_sync_rounds(self) -> None:
        rounds = self.trainer.sync_generation_groups
        if rounds > self.buffer.groups_per_batch and (
            self.buffer.max_staleness != 0 or self.buffer.over_age == "train"
        ):
            raise ValueError(
                f"trainer.sync_generation_groups={rounds} > the {self.buffer.groups_per_batch} group(s) of a batch "
                f"with buffer.max_staleness={self.buffer.max_staleness} and buffer.over_age={self.buffer.over_age!r}: "
                "the groups left over would be trained at the next step, off-policy; set buffer.max_staleness = 0 "
                'and buffer.over_age = "evict"'
            )

    def _check_images(self) -> None:
        """A VLM run is one with `rollout.engine.max_images_per_prompt > 0` (the built-in 'tiny-vlm'
        is a VLM whatever it says): refuse, before anything starts, what would otherwise fail deep in
        the run — the SFT warm-up (text-only tool transcripts on a causal LM: no VLM loads there) and
        image prompts sent to engines and workers that serve text only (every trajectory would fail)."""
        images = self.rollout.engine.max_images_per_prompt
        if self.sft.enabled and (images > 0 or self.model == "tiny-vlm"):
            raise ValueError(
                f"sft.enabled = true with a VLM (model {self.model!r}, rollout.engine.max_images_per_prompt={images}): "
                "the SFT warm-up trains text-only tool transcripts on a causal LM; set sft.enabled = false"
            )
        if self.data.source == "dots" and images == 0:
            raise ValueError(
                'data.source = "dots" (image prompts) needs a VLM served with images: set '
                'rollout.engine.max_images_per_prompt >= 1 (and model = "tiny-vlm" or a VLM folder)'
            )

    def _check_lora_sync(self) -> None:
        """`learner.lora.sync = "adapter"` needs engines that serve LoRA adapters: in-process vLLM with
        the worker extension (which loads each synced adapter). It sets `rollout.engine.lora` (vLLM's
        `max_lora_rank` the smallest one that fits the adapter's rank). Refused: a server backend, a VLM
        (vLLM applies LoRA to the language model only, so the vision tower's adapters would be dropped
        silently) and `weight_sync.publish_lag` (a resume serves the checkpoint's adapter at once,
        which a refilling lag window would hold back)."""
        lora, engine = self.learner.lora, self.rollout.engine
        adapter_sync = lora is not None and lora.sync is LoraSync.ADAPTER
        if not adapter_sync:
            if engine.lora is not None:
                raise ValueError(
                    'rollout.engine.lora serves LoRA adapters, which only learner.lora.sync = "adapter" sends; '
                    "remove it (the merged sync and full fine-tuning reload the engines' weights instead)"
                )
            return
        assert lora is not None
        if engine.backend != "vllm" or not engine.worker_extension_cls:
            raise ValueError(
                f'learner.lora.sync = "adapter" needs engines that serve LoRA adapters: rollout.engine.backend = '
                f'"vllm" with its worker extension (got backend {engine.backend!r}, worker_extension_cls '
                f"{engine.worker_extension_cls!r}). An inference-server backend takes weights from disk only: use "
                'learner.lora.sync = "merged"'
            )
        images = self.rollout.engine.max_images_per_prompt
        if images > 0 or self.model == "tiny-vlm":
            raise ValueError(
                f'learner.lora.sync = "adapter" with a VLM (model {self.model!r}, max_images_per_prompt={images}): '
                "vLLM serves LoRA on the language model only and would drop the vision tower's adapters; use "
                'learner.lora.sync = "merged"'
            )
        if self.weight_sync.publish_lag:
            raise ValueError(
                f'learner.lora.sync = "adapter" with weight_sync.publish_lag={self.weight_sync.publish_lag} is not '
                "built: a resume must serve the checkpoint's adapter before the lag window refills; use "
                'learner.lora.sync = "merged"'
            )
        fits = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
        if not fits:
            raise ValueError(
                f"learner.lora.rank={lora.rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}"
            )
        if engine.lora is None:
            engine.lora = LoraServing(max_lora_rank=fits[0])
        elif engine.lora.max_lora_rank < lora.rank:
            raise ValueError(
                f"rollout.engine.lora.max_lora_rank={engine.lora.max_lora_rank} < learner.lora.rank={lora.rank}"
            )

    def _check_server_backend(self) -> None:
        """An inference server takes new weights from disk only (docs/inference-server.md)."""
        backend = self.rollout.engine.backend
        if backend == "vllm":
            return
        if self.weight_sync.transport != "filesystem":
            raise ValueError(
                f'rollout.engine.backend = "{backend}" loads weights from disk: set weight_sync.transport = '
                f'"filesystem" (got {str(self.weight_sync.transport)!r}), with weight_sync.fs_dir on a filesystem '
                "the server reads"
            )
        if backend == "sglang_server" and self.weight_sync.verify_checksum:
            raise ValueError(
                'rollout.engine.backend = "sglang_server" reads the weight folder itself, so nothing is staged to '
                "checksum: set weight_sync.verify_checksum = false"
            )

    def _check_nccl_gpus(self) -> None:
        """NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected", seen on an H100).
        A fractional GPU for the engine or a learner rank shares a GPU, so `auto` becomes gloo there
        (it would otherwise pick NCCL for CUDA tensors at the first sync) and an explicit nccl is refused."""
        if self.weight_sync.backend == "gloo" or self.weight_sync.transport != "distributed":
            return
        engine, learner = self.rollout.engine, self.learner
        shared = []
        if engine.device != "cpu" and 0 < engine.num_gpus < 1:
            shared.append(f"rollout.engine.num_gpus={engine.num_gpus}")
        if learner.device != "cpu" and learner.num_gpus_per_worker is not None and 0 < learner.num_gpus_per_worker < 1:
            shared.append(f"learner.num_gpus_per_worker={learner.num_gpus_per_worker}")
        if not shared:
            return
        if self.weight_sync.backend == "auto":
            self.weight_sync.backend = BackendKind.GLOO
            return
        raise ValueError(
            f'weight_sync.backend = "nccl" with {" and ".join(shared)}: a fractional GPU shares one GPU with another '
            'process, and NCCL refuses two processes of its group on one GPU ("Duplicate GPU detected"); set '
            'weight_sync.backend = "gloo" (or "auto") or give each process a whole GPU'
        )

    @property
    def group_size(self) -> int:
        """Trajectories per prompt (GRPO n)."""
        return self.buffer.group_size


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (TOML values; bare words are strings) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a table")
        node[parts[-1]] = _parse_value(raw.strip())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> StreamRLConfig:
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        with open(path, "rb") as f:
            data = tomllib.load(f)
    apply_overrides(data, overrides or [])
    try:
        return StreamRLConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        raise ValueError(f"invalid config at {where}: {err['msg']} (got {err.get('input')!r})") from None


def dump_config(cfg: StreamRLConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2)
