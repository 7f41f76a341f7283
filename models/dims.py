"""A model's dimensions from its HF config alone, without loading (or building) its weights: what
memory depends on (`streaming.preflight` estimates every part of a run from them), parameter counts
of dense, MoE and vision-language decoders, and of LoRA adapters on them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def target_shapes(dims: ModelDims, targets: list[str]) -> list[tuple[int, int]]:
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
    return dims.num_layers * sum(rank * (i + o) for i, o in target_shapes(dims, targets))


def lora_target_params(dims: ModelDims, targets: list[str]) -> int:
    """Parameters of the target weights themselves: what a merged copy of them holds."""
    return dims.num_layers * sum(i * o for i, o in target_shapes(dims, targets))
