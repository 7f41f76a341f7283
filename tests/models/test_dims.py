"""A model's dimensions from its config alone (`models.dims`): parameter counts equal to the stored
weights for the built-in models, dense and MoE, and to published counts of large MoE models."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from streamrl.models.dims import SMOLLM2_CONFIG, ModelDims, model_dims


def test_param_count_from_config_dims_matches_the_weights(tiny_model_path):
    import safetensors

    with safetensors.safe_open(str(next(Path(tiny_model_path).glob("*.safetensors"))), "np") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert model_dims(str(tiny_model_path)).num_params == stored  # Qwen2: q/k/v biases, tied head
    assert model_dims("smollm2").num_params == 134_515_008  # SmolLM2-135M-Instruct as converted
    untied = ModelDims.from_hf_config({**SMOLLM2_CONFIG, "tie_word_embeddings": False})
    assert untied.num_params == 134_515_008 + 49152 * 576


def test_param_count_of_moe_models():
    """Every layer sparse: the router and each expert's SwiGLU (Qwen3 adds its q/k norms)."""
    import safetensors

    from streamrl.models import resolve_model

    moe = resolve_model("tiny-moe")
    with safetensors.safe_open(str(next(Path(moe).glob("*.safetensors"))), "np") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert model_dims("tiny-moe").num_params == model_dims(str(moe)).num_params == stored
    qwen3_30b_a3b = dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
    )
    assert ModelDims.from_hf_config(qwen3_30b_a3b).num_params == 30_532_122_624  # its model card's 30.5B
    mixtral_8x7b = dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    assert ModelDims.from_hf_config(mixtral_8x7b).num_params == 46_702_792_704  # 46.7B


def test_model_dims_rejects_what_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in"):
        model_dims(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "clip", "hidden_size": 512}')
    with pytest.raises(ValueError, match="has no 'num_attention_heads'"):
        model_dims(str(tmp_path))
