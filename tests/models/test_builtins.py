"""Model folders: SmolLM2 converted from the shipped GGUF, and the tiny model, both with our template."""

from __future__ import annotations

import json

import pytest

from streamrl.models import resolve_model
from streamrl.models.template import CHAT_TEMPLATE

# First call converts the GGUF (~30 s on 2 cores); later runs hit the cache ($STREAMRL_CACHE).
pytestmark = pytest.mark.timeout(300)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_model("smollm2")


def test_smollm2_folder_has_weights_config_and_chat_eos(smollm2_path):
    from transformers import AutoTokenizer, GenerationConfig

    assert (smollm2_path / "model.safetensors").is_file()
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert config["eos_token_id"] == im_end
    assert GenerationConfig.from_pretrained(smollm2_path).eos_token_id == im_end
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(im_end) == 2  # no extra BOS
    assert tok.decode(ids) == text


def test_smollm2_weights_are_a_working_instruct_model(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    assert model.dtype == torch.float32 and model.config.vocab_size == len(tok)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    completion = out[0, len(ids) :].tolist()
    assert "Paris" in tok.decode(completion)
    assert completion[-1] == tok.eos_token_id  # the turn ends with <|im_end|>


def test_tiny_model_uses_the_same_template(tiny_model_path, tiny_tokenizer):
    assert tiny_tokenizer.chat_template == CHAT_TEMPLATE
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert resolve_model(str(tiny_model_path)) == tiny_model_path


def test_resolve_model_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in"):
        resolve_model(str(tmp_path / "missing"))
