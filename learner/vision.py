"""Image inputs of the learner forward (docs/multimodal.md, "How an image travels").

A VLM row is its token ids (placeholders already expanded, what the model saw at rollout) plus the
pixels of its images. The learner owns the model's processor and builds the pixels itself from the
image bytes (`image_vision_inputs`); no pixel tensor travels through the buffer.

Pixels are held per row (`RowImages`, one record per `TrainBatch` row) so that `TrainBatch.select`,
which packs rows into micro-batches, keeps a row's pixels with its placeholder tokens by indexing a
list. Each forward collates the rows of its micro-batch into the keyword arguments of the HF
multimodal base model (`collate_images`), in the model's own layout:

- Idefics3 / SmolVLM: `pixel_values [B, max_images, 3, H, W]`, `pixel_attention_mask
  [B, max_images, H, W]`; a row with fewer images is padded with all-zero images, which the model
  drops before its vision tower (HF's batching convention), so padding costs no vision compute.
- Qwen2-VL: `pixel_values [num_patches, C*T*P*P]` and `image_grid_thw [num_images, 3]` concatenated
  over the rows in row order, which is the order their image tokens appear in the flattened
  `input_ids` (written, untested here: its processor needs torchvision, which this venv lacks).

A text-only batch carries no `RowImages` at all (`TrainBatch.images is None`) and pays nothing.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

# model_type -> how per-row image tensors are batched for the forward (see the module docstring)
PADDED_IMAGE_MODELS = frozenset({"idefics3", "smolvlm"})
FLAT_IMAGE_MODELS = frozenset({"qwen2_vl", "qwen2_5_vl"})


@dataclass(frozen=True, kw_only=True, slots=True)
class RowImages:
    """The image-processor output for one row's images, in the order of their placeholder runs in
    the row's `input_ids` (prompt images, then images of tool / interaction responses)."""

    num_images: int
    pixel_values: torch.Tensor  # Idefics3 [num_images, 3, H, W]; Qwen2-VL [num_patches, C*T*P*P]
    pixel_attention_mask: torch.Tensor | None = None  # Idefics3 [num_images, H, W] bool (1 = real pixel)
    # other image inputs of the model, leading dim per image: Qwen2-VL image_grid_thw [num_images, 3]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: str | torch.device) -> RowImages:
        return RowImages(
            num_images=self.num_images,
            pixel_values=self.pixel_values.to(device),
            pixel_attention_mask=None if self.pixel_attention_mask is None else self.pixel_attention_mask.to(device),
            extra={k: v.to(device) for k, v in self.extra.items()},
        )


def is_vision_config(config: Any) -> bool:
    """Whether a HF config is an image-text-to-text model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def decode_image(image: bytes | Image | Any) -> Image:
    """Encoded image bytes (PNG, JPEG, ...), or a record holding them as `.data` (the engine's
    `ImageInput`) → RGB PIL image; a PIL image passes through."""
    from PIL import Image as PILImage

    image = getattr(image, "data", image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        with PILImage.open(io.BytesIO(bytes(image))) as img:
            return img.convert("RGB")
    return image


def image_vision_inputs(processor: Any, images: Sequence[bytes | Image]) -> RowImages | None:
    """One row's images (bytes or PIL, prompt order) → its `RowImages` (None for no image).

    The processor call is `models.multimodal.image_vision_inputs`, the same rule the rollout
    side renders prompts with, so the learner's pixels equal the ones vLLM was given."""
    from streamrl.models.multimodal import image_vision_inputs as processor_tensors

    if not images:
        return None
    return _row_images(processor_tensors(processor, [decode_image(x) for x in images]), len(images))


def batch_vision_inputs(
    processor: Any,
    images: Sequence[Sequence[bytes | Image]],
    input_ids: torch.Tensor,  # [B][num_images], [B, T]
) -> list[RowImages | None]:
    """`image_vision_inputs` for every row, checking each row's placeholder count: a row whose
    `input_ids` hold a different number of image tokens than its images expand to is a data bug
    (the model would scatter image features into the wrong positions), so it raises ValueError."""
    from streamrl.models.multimodal import image_replacement_ids
    from streamrl.models.multimodal import image_vision_inputs as processor_tensors

    if len(images) != input_ids.shape[0]:
        raise ValueError(f"images for {len(images)} rows, batch has {input_ids.shape[0]}")
    image_id = processor.image_token_id
    rows: list[RowImages | None] = []
    for b, row in enumerate(images):
        found = int((input_ids[b] == image_id).sum().item())
        raw = processor_tensors(processor, [decode_image(x) for x in row]) if row else {}
        expected = sum(sum(t == image_id for t in image_replacement_ids(processor, raw, i)) for i in range(len(row)))
        if found != expected:
            raise ValueError(f"row {b}: {found} image tokens in input_ids, its {len(row)} images expand to {expected}")
        rows.append(_row_images(raw, len(row)) if row else None)
    return rows


def _row_images(tensors: dict[str, torch.Tensor], num_images: int) -> RowImages:
    tensors = dict(tensors)
    pixel_values = tensors.pop("pixel_values")
    mask = tensors.pop("pixel_attention_mask", None)
    if pixel_values.dim() == 5:  # Idefics3: [1 prompt, num_images, 3, H, W]
        pixel_values = pixel_values[0]
        mask = None if mask is None else mask[0]
        if pixel_values.shape[0] != num_images:
            raise ValueError(f"processor made {pixel_values.shape[0]} tiles for {num_images} images (no splitting yet)")
    return RowImages(num_images=num_images, pixel_values=pixel_values, pixel_attention_mask=mask, extra=tensors)


def collate_images(rows: Sequence[RowImages | None], model_type: str) -> dict[str, torch.Tensor]:
    """The multimodal base model's image keyword arguments for a micro-batch's rows; {} when no row
    has an image (the forward is then text-only)."""
    import torch

    present = [r for r in rows if r is not None and r.num_images > 0]
    if not present:
        return {}
    if model_type in FLAT_IMAGE_MODELS:
        out = {"pixel_values": torch.cat([r.pixel_values for r in present])}
        for key in present[0].extra:
            out[key] = torch.cat([r.extra[key] for r in present])
        return out
    if model_type not in PADDED_IMAGE_MODELS:
        supported = sorted(PADDED_IMAGE_MODELS | FLAT_IMAGE_MODELS)
        raise ValueError(f"no image batching rule for model_type {model_type!r}; supported: {supported}")
    if any(r.extra for r in present):
        raise ValueError(f"{model_type} takes pixel_values and pixel_attention_mask, not {sorted(present[0].extra)}")
    first = present[0].pixel_values
    max_images = max(r.num_images for r in present)
    height = max(r.pixel_values.shape[-2] for r in present)
    width = max(r.pixel_values.shape[-1] for r in present)
    pixels = first.new_zeros((len(rows), max_images, first.shape[1], height, width))
    mask = torch.zeros((len(rows), max_images, height, width), dtype=torch.bool, device=first.device)
    for b, r in enumerate(rows):
        if r is None or r.num_images == 0:
            continue  # all-zero images: dropped by the model
        n, h, w = r.num_images, r.pixel_values.shape[-2], r.pixel_values.shape[-1]
        pixels[b, :n, :, :h, :w] = r.pixel_values
        mask[b, :n, :h, :w] = True if r.pixel_attention_mask is None else r.pixel_attention_mask.bool()
    return {"pixel_values": pixels, "pixel_attention_mask": mask}
