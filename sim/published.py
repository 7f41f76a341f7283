"""Component costs of large clusters, from published measurements (each number cites its source), and
the cluster layouts the projections and `streamrl plan` simulate.

Sources (H100 80 GB SXM throughout):
- [H100] NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB.
  https://www.nvidia.com/en-us/data-center/h100/
- [vLLM-8B] ~12,500 output tokens/s for Llama 3.1 8B BF16 on one H100 with vLLM (third-party
  benchmarks collected in https://www.morphllm.com/vllm-benchmarks; the vLLM v0.6 release reports the
  same model class at 2.7x its earlier throughput: https://blog.vllm.ai/2024/09/05/perf-update.html).
- [vLLM-32B] Qwen3-32B on one H100, vLLM, ShareGPT: 2,353 tokens/s total (baseline), 4,285 tuned.
  https://docs.gpustack.ai/2.0/performance-lab/qwen3-32b/h100
- [vLLM-235B] Qwen3-235B-A22B on 8 H100, vLLM, ShareGPT: 8,425 tokens/s total (baseline), 15,574 tuned
  (FP8, two TP4 replicas). https://docs.gpustack.ai/latest/performance-lab/qwen3-235b-a22b/h100
- [Megatron] Megatron-Core reaches up to 47 % MFU on H100 (https://github.com/NVIDIA/Megatron-LM);
  RL learners run below pretraining MFU (recompute of log-probs, variable-length micro-batches), so
  the projections assume 35 % for dense models and 25 % for the MoE (an assumption, not a citation;
  MoE pretraining recipes for Qwen3-235B-A22B on 256 H100: https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html).
- [NCCL] weight broadcast 8-30 GB/s between the learner and the engines across nodes (bus bandwidth of
  NCCL broadcast over 200-400 Gb/s InfiniBand: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md);
  20 GB/s by default.
- [AReaL] asynchronous RL 2.77x faster than synchronous at equal GPUs (AReaL, arXiv:2505.24298,
  https://arxiv.org/abs/2505.24298); [verl-async] 2.35-2.67x for Qwen2.5-7B on 128 GPUs (verl's fully
  async recipe, https://verl.readthedocs.io/en/latest/advance/fully_async.html).
- Model shapes: the models' config.json on the Hugging Face Hub (Qwen2.5-7B-Instruct, Qwen3-32B,
  Qwen3-235B-A22B): layers, KV heads, head size give the KV cache bytes per token.

How the engine numbers become an `EngineCost`: a decode step reads the weights once (`base_s` =
weight bytes / (HBM bandwidth * 0.7 efficiency) over the engine's GPUs) and each sequence's KV cache
(`per_seq_ctx_s` = KV bytes per token / the same bandwidth); `per_seq_s` is set so that the engine
reaches the published throughput at the batch that fills its KV memory at the benchmark's ~1k-token
context. The batch is capped by the KV memory left after the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from streamrl.sim.costs import Costs, EngineCost, LearnerCost, SyncCost, ToolLatency, TrajectoryShape

H100_FLOPS = 989e12  # [H100] dense BF16
H100_HBM_BPS = 3.35e12  # [H100]
H100_MEM_B = 80e9  # [H100]
HBM_EFFICIENCY = 0.7  # share of peak bandwidth a decode step achieves (assumption)
BENCH_CTX = 1024  # context of the published serving benchmarks (ShareGPT-like, ~1k tokens)
NCCL_BPS = 20e9  # [NCCL] middle of 8-30 GB/s


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float  # total parameters (weights to store and sync)
    active: float  # parameters per token (MoE: the active experts)
    kv_bytes_per_token: float  # 2 (K, V) * layers * KV heads * head size * 2 bytes
    engine_gpus: int  # GPUs per engine (tensor / expert parallel)
    engine_tokens_per_s: float  # published saturated throughput of one engine
    mfu: float  # learner model-FLOP utilization (see [Megatron])
    source: str


MODELS = {
    "7B": ModelSpec("7B", 7.6e9, 7.6e9, 2 * 28 * 4 * 128 * 2, 1, 12_500.0, 0.35, "[vLLM-8B], Qwen2.5-7B shape"),
    # TP2 (assumed: one H100 leaves 32B only ~6 GB of KV cache), at the published per-GPU rate
    "32B": ModelSpec("32B", 32.8e9, 32.8e9, 2 * 64 * 8 * 128 * 2, 2, 2 * 2_353.0, 0.35, "[vLLM-32B], Qwen3-32B shape"),
    "235B": ModelSpec(
        "235B", 235e9, 22e9, 2 * 94 * 4 * 128 * 2, 8, 8_425.0, 0.25, "[vLLM-235B], Qwen3-235B-A22B shape"
    ),
}


def engine_cost(model: ModelSpec, mean_ctx: float) -> EngineCost:
    """A published engine as an `EngineCost` (see the module docstring); `mean_ctx` sizes the batch cap."""
    bw = model.engine_gpus * H100_HBM_BPS * HBM_EFFICIENCY
    base_s = 2 * model.params / bw
    per_seq_ctx_s = model.kv_bytes_per_token / bw
    kv_free = model.engine_gpus * H100_MEM_B * 0.9 - 2 * model.params
    bench_batch = max(int(kv_free / (model.kv_bytes_per_token * BENCH_CTX)), 1)
    bench_batch = min(bench_batch, 256)
    per_seq_s = max(bench_batch / model.engine_tokens_per_s - base_s, 0.0) / bench_batch - per_seq_ctx_s * BENCH_CTX
    max_batch = max(min(int(kv_free / (model.kv_bytes_per_token * max(mean_ctx, 1.0))), 512), 1)
    return EngineCost(base_s, max(per_seq_s, 0.0), per_seq_ctx_s, request_s=0.02, max_batch=max_batch)


def learner_cost(model: ModelSpec, gpus: float) -> LearnerCost:
    """Tokens per second of `gpus` learner GPUs: MFU * peak / (8 * active params) per GPU (forward and
    backward, 6N, plus the log-prob recompute, 2N); a fixed 2 s per step (optimizer, gathers)."""
    tokens_per_s = gpus * model.mfu * H100_FLOPS / (8 * model.active)
    return LearnerCost(base_s=2.0, per_token_s=1.0 / tokens_per_s, step_overhead_s=0.5)


def sync_cost(model: ModelSpec, *, bandwidth_Bps: float = NCCL_BPS, overlap: bool = True) -> SyncCost:
    """BF16 weights broadcast at `bandwidth_Bps`. With `overlap` (streamrl's default) the engines keep
    serving while the weights stream into a staged copy and pause only for the in-GPU commit (weights
    / HBM bandwidth); without it they pause for the whole transfer (`pause_share` 1)."""
    nbytes = 2 * model.params
    commit_s = nbytes / (model.engine_gpus * H100_HBM_BPS * HBM_EFFICIENCY) if overlap else 0.0
    return SyncCost(
        base_s=1.0, bytes=nbytes, bandwidth_Bps=bandwidth_Bps, pause_base_s=commit_s, pause_share=0 if overlap else 1
    )


def agent_shape() -> TrajectoryShape:
    """The projected workload: tool-using agents with 1-8 assistant turns of 100-2,000 tokens (median
    400), a 1,024-token prompt and 256-token tool observations (an assumption: a typical SWE / search
    agent turn; the simulator takes any other shape)."""
    q = [100 * math.exp(math.log(20) * (i / 20) ** 1.5) for i in range(21)]  # 100 .. 2,000, median ~400
    return TrajectoryShape.uniform_turns(1, 8, turn_tokens=tuple(q), prompt_tokens=1024.0, observation_tokens=256.0)


def cluster_costs(
    model: ModelSpec,
    *,
    learner_gpus: float,
    tool: ToolLatency,
    shape: TrajectoryShape | None = None,
    overlap: bool = True,
) -> Costs:
    shape = shape or agent_shape()
    mean_ctx = shape.prompt_tokens + shape.mean_turns * (shape.mean_turn_tokens + shape.observation_tokens) / 2
    return Costs(
        engine=engine_cost(model, mean_ctx),
        tool=tool,
        shape=shape,
        learner=learner_cost(model, learner_gpus),
        sync=sync_cost(model, overlap=overlap),
        source={"model": model.name, "engine": model.source, "learner": "[Megatron] MFU", "sync": "[NCCL]"},
    )
