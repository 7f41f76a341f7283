"""The tiny VLM: offline build, chat -> ids + images, and the real vLLM engine against transformers.

vLLM here is a plain in-process `vllm.LLM` on the tiny VLM (the project's `VLLMEngine` with images is
tests/rollout/test_multimodal_engine.py); it costs ~16 s to start and ~1.8 GiB RSS.
"""

from __future__ import annotations

import gc

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# Observed max |vLLM - HF| per-token logprob on fp32 CPU: 4.8e-7 (32 sampled tokens x 4 images);
# the bar leaves room for other CPU kernels and thread counts.
LOGPROB_ATOL = 1e-4


def _image(rgb: tuple[int, int, int]):
    from PIL import Image

    img = Image.new("RGB", (56, 56), rgb)
    img.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (0, 0, 28, 28))  # not a flat image
    return img


def _chat(img) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "what is this?"}]}]


@pytest.fixture(scope="module")
def vlm_llm(vlm_path):
    from tests.fixtures.vllm import skip_without_vllm, tiny_vlm_llm

    skip_without_vllm()
    llm = tiny_vlm_llm(vlm_path, max_images=2)
    yield llm
    del llm
    gc.collect()


def hf_logprobs(model, chat, response_ids: list[int]) -> list[float]:
    """log p(response_ids[i] | prefix, image) by one forward pass (what the learner will compute)."""
    import torch

    ids = torch.tensor([chat.input_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, **chat.vision_inputs).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    n = len(chat.input_ids)
    return lps[torch.arange(n - 1, n + len(response_ids) - 1), torch.tensor(response_ids)].tolist()


def test_build_is_cached_and_loads_offline(vlm_path, monkeypatch):
    from transformers import AutoConfig, AutoProcessor

    from streamrl.models.tiny_vlm import IMAGE_SEQ_LEN, IMAGE_TOKEN, resolve_tiny_vlm

    mtime = (vlm_path / "model.safetensors").stat().st_mtime_ns
    assert resolve_tiny_vlm() == vlm_path
    assert (vlm_path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    processor = AutoProcessor.from_pretrained(vlm_path)
    config = AutoConfig.from_pretrained(vlm_path)
    assert config.text_config.head_dim >= 32  # vLLM CPU attention
    assert config.image_token_id == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert processor.image_seq_len == IMAGE_SEQ_LEN
    assert config.text_config.vocab_size == len(processor.tokenizer)


def test_render_matches_hf_processor(processor):
    import torch

    from streamrl.models.multimodal import collapse_image_tokens, render_image_chat
    from streamrl.models.tiny_vlm import IMAGE_SEQ_LEN

    imgs = [_image((200, 30, 30)), _image((30, 30, 200))]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": imgs[0]},
                {"type": "text", "text": "and"},
                {"type": "image", "image": imgs[1]},
            ],
        },
        {"role": "assistant", "content": "two"},
        {"role": "tool", "content": "plain text response"},
    ]
    chat = render_image_chat(processor, messages)
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = processor(text=text, images=[imgs], return_tensors="pt")
    assert chat.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(chat.vision_inputs["pixel_values"], ref["pixel_values"])
    assert chat.num_image_tokens == [IMAGE_SEQ_LEN, IMAGE_SEQ_LEN]
    assert sum(t == processor.image_token_id for t in chat.input_ids) == 2 * IMAGE_SEQ_LEN
    assert sum(t == processor.image_token_id for t in chat.engine_prompt_ids) == 2
    assert collapse_image_tokens(processor, chat.input_ids) == chat.engine_prompt_ids


def test_vllm_generates_from_image_and_matches_hf(processor, hf_vlm, vlm_llm):
    from vllm import SamplingParams

    from streamrl.models.multimodal import render_image_chat

    chat = render_image_chat(processor, _chat(_image((220, 40, 40))))
    params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=0, ignore_eos=True)
    (out,) = vlm_llm.generate(chat.vllm_prompt(), params, use_tqdm=False)
    assert list(out.prompt_token_ids) == chat.input_ids  # vLLM expanded the placeholders like HF
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    vllm_lps = [lp[t].logprob for lp, t in zip(completion.logprobs, tokens, strict=True)]
    assert len(tokens) == 8

    hf_lps = hf_logprobs(hf_vlm, chat, tokens)
    diff = max(abs(a - b) for a, b in zip(vllm_lps, hf_lps, strict=True))
    assert diff < LOGPROB_ATOL, (vllm_lps, hf_lps)

    # The pixels are really consumed: under another image the same tokens' log-probs move far more
    # than vLLM and HF differ, so vLLM matched HF's forward on *this* image.
    other = render_image_chat(processor, _chat(_image((10, 200, 90))))
    moved = max(abs(a - b) for a, b in zip(hf_logprobs(hf_vlm, other, tokens), hf_lps, strict=True))
    assert moved > 10 * max(diff, 1e-6), (moved, diff)
