"""Chat with image parts -> token ids + images, consistent for vLLM (rollout) and HF (learner).

A message's content is a string or a list of parts `{"type": "text", "text": ...}` /
`{"type": "image", "image": PIL.Image}`. `render_image_chat` renders it with the model's chat
template and returns an `ImageChat` holding both token views of the same prompt:

- `engine_prompt_ids`: one image token per image, exactly as the template rendered it. This is what
  the engine gets, with `multi_modal_data={"image": images}`: vLLM (0.32) always runs its own
  placeholder expansion on token prompts, so already-expanded ids would be expanded a second time.
- `input_ids`: every image token replaced by the model's full placeholder run. This equals the
  `prompt_token_ids` vLLM reports back and the `input_ids` the HF processor builds from the same
  text and images, so learner positions, masks and log-probs line up token for token with rollout.

`vision_inputs` are the HF image processor's tensors for the learner forward (`pixel_values`, and
`pixel_attention_mask` for Idefics3; `image_grid_thw` for Qwen2-VL). The Idefics3 rule is tested
against vLLM and the HF processor (tests/rollout/test_tiny_vlm.py); the Qwen2-VL rule is written
but untested here (its processor needs torchvision, which this venv lacks). `expand_image_tokens` and
`collapse_image_tokens` convert between the two id views, so a multi-turn trajectory can keep the
expanded ids (what the model saw) and still hand the engine the collapsed ones.

`count_image_runs` and `image_run_lengths` count the images of expanded ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


def count_image_runs(token_ids: list[int], image_token_id: int) -> int:
    """Images in expanded ids: maximal runs of `image_token_id` (one per image for Idefics3 and
    Qwen2-VL: adjacent images are separated by their wrapper tokens)."""
    return sum(t == image_token_id and (i == 0 or token_ids[i - 1] != image_token_id) for i, t in enumerate(token_ids))


def image_run_lengths(token_ids: list[int], image_token_id: int) -> list[int]:
    """Length of each maximal run of `image_token_id` in expanded ids, in order: one entry per image
    (`Trajectory.num_image_tokens`). `len(image_run_lengths(...)) == count_image_runs(...)`."""
    runs: list[int] = []
    for i, t in enumerate(token_ids):
        if t != image_token_id:
            continue
        if i > 0 and token_ids[i - 1] == image_token_id:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


@dataclass(kw_only=True, slots=True)
class ImageChat:
    """One rendered prompt. Invariant: `collapse_image_tokens(input_ids) == engine_prompt_ids`, and
    `engine_prompt_ids` holds exactly `len(images)` image tokens, in the order of `images`."""

    engine_prompt_ids: list[int]  # [num_engine_prompt_tokens]; one image token per image
    input_ids: list[int]  # [num_prompt_tokens]; placeholders expanded (what the model sees)
    images: list[Image]  # [num_images], in prompt order
    vision_inputs: dict[str, torch.Tensor]  # HF image-processor output for the learner forward
    num_image_tokens: list[int]  # [num_images]; placeholder tokens each image occupies in input_ids

    def vllm_prompt(self) -> dict[str, Any]:
        """The vLLM `TokensPrompt` for this chat."""
        return {"prompt_token_ids": list(self.engine_prompt_ids), "multi_modal_data": {"image": list(self.images)}}


def collect_images(messages: list[dict[str, Any]]) -> list[Image]:
    """The images of a chat in the order the template renders them."""
    images = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image":
                    if part.get("image") is None:
                        raise ValueError("image content part has no 'image' (a PIL.Image)")
                    images.append(part["image"])
    return images


def image_vision_inputs(processor: Any, images: list[Image]) -> dict[str, torch.Tensor]:
    """HF image-processor tensors for `images` (one prompt)."""
    if not images:
        return {}
    kind = _processor_kind(processor)
    batch = [images] if kind == "idefics3" else images  # Idefics3 takes one list of images per prompt
    out = processor.image_processor(images=batch, return_tensors="pt")
    return {k: v for k, v in out.items() if k in ("pixel_values", "pixel_attention_mask", "image_grid_thw")}


def image_replacement_ids(processor: Any, vision_inputs: dict[str, torch.Tensor], index: int) -> list[int]:
    """The token run that replaces image token number `index` (what vLLM and the HF processor insert)."""
    tok = processor.tokenizer
    kind = _processor_kind(processor)
    if kind == "idefics3":
        if getattr(processor.image_processor, "do_image_splitting", False):
            raise ValueError(
                "Idefics3 image splitting is not supported yet; build the processor with do_image_splitting=False"
            )
        fake = tok.convert_tokens_to_ids(processor.fake_image_token)
        glob = tok.convert_tokens_to_ids(processor.global_image_tag)
        return [fake, glob] + [processor.image_token_id] * processor.image_seq_len + [fake]
    # qwen2_vl: <|vision_start|> and <|vision_end|> are in the template; the pad run is grid / merge^2
    grid = vision_inputs["image_grid_thw"][index]
    merge = processor.image_processor.merge_size
    return [processor.image_token_id] * (int(grid.prod()) // merge**2)


def expand_image_tokens(
    processor: Any, ids: list[int], vision_inputs: dict[str, torch.Tensor]
) -> tuple[list[int], list[int]]:
    """Replace each image token of `ids` by its placeholder run; returns (ids, tokens per image)."""
    image_id = processor.image_token_id
    out: list[int] = []
    counts: list[int] = []
    for token in ids:
        if token != image_id:
            out.append(token)
            continue
        run = image_replacement_ids(processor, vision_inputs, len(counts))
        counts.append(sum(t == image_id for t in run))
        out.extend(run)
    return out, counts


def collapse_image_tokens(processor: Any, ids: list[int]) -> list[int]:
    """Inverse of `expand_image_tokens`: each placeholder run back to one image token. For Idefics3
    the wrapper tokens are dropped wherever they occur: they are special tokens only expansion emits."""
    image_id = processor.image_token_id
    if _processor_kind(processor) == "idefics3":
        fake = processor.tokenizer.convert_tokens_to_ids(processor.fake_image_token)
        glob = processor.tokenizer.convert_tokens_to_ids(processor.global_image_tag)
        drop = {fake, glob}
        out: list[int] = []
        for i, token in enumerate(ids):
            if token in drop or (token == image_id and i > 0 and ids[i - 1] == image_id):
                continue
            out.append(token)
        return out
    return [t for i, t in enumerate(ids) if not (t == image_id and i > 0 and ids[i - 1] == image_id)]


def render_image_chat(
    processor: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
) -> ImageChat:
    """Render `messages` (content parts may be images) into an `ImageChat`."""
    images = collect_images(messages)
    engine_ids = processor.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    engine_ids = list(engine_ids)
    num_image_tokens_found = sum(t == processor.image_token_id for t in engine_ids)
    if num_image_tokens_found != len(images):
        raise ValueError(f"chat template rendered {num_image_tokens_found} image tokens for {len(images)} images")
    vision_inputs = image_vision_inputs(processor, images)
    input_ids, counts = expand_image_tokens(processor, engine_ids, vision_inputs)
    return ImageChat(
        engine_prompt_ids=engine_ids,
        input_ids=input_ids,
        images=images,
        vision_inputs=vision_inputs,
        num_image_tokens=counts,
    )


def _processor_kind(processor: Any) -> str:
    name = type(processor).__name__
    if name.startswith("Idefics3"):
        return "idefics3"
    if name.startswith(("Qwen2VL", "Qwen2_5_VL")):
        return "qwen2_vl"
    raise ValueError(f"no image placeholder rule for processor {name}; supported: Idefics3, Qwen2-VL")
