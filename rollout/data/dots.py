"""A generated image task, "count the dots": image prompts for a VLM run without a dataset download.

`data.source = "dots"` (streaming/prompts.py) draws each prompt here: a small PNG with 1 to
`MAX_DOTS` black dots on white, sent as an image content part (a base64 `data:` URL, the form prompt
rows carry images in, see `rollout/agent_loop/image_prompt.py`) followed by the question. The answer
format is the one `math_answer` grades (`\\boxed{N}`, else the last number), so the text-only reward
scores it and the ground truth is the count.

The image is `IMAGE_SIZE` square, the tiny VLM's tile size (`models/tiny_vlm.py`): the
processor neither resizes nor splits it, so every image costs the same placeholder run. Dots are
placed on a grid of cells, one dot per cell, so they never overlap and the count is what is drawn.
Deterministic in (num_prompts, seed): the same seed gives the same bytes, so the same image hashes.
"""

from __future__ import annotations

import base64
import random

from streamrl.rollout.types import PromptRecord

IMAGE_SIZE = 56  # pixels, square: one tile of the tiny VLM (no resize, no splitting)
MAX_DOTS = 9
GRID = 3  # GRID x GRID cells, one dot at most per cell: MAX_DOTS == GRID**2
DOT_RADIUS = 5
DOTS_QUESTION = "How many dots are in the image? Answer with \\boxed{N}."


def draw_dots(count: int, rng: random.Random) -> bytes:
    """PNG bytes of `count` non-overlapping black dots on white, jittered inside random grid cells."""
    from PIL import Image, ImageDraw

    from streamrl.models.images import encode_png

    if not 1 <= count <= MAX_DOTS:
        raise ValueError(f"count must be in 1..{MAX_DOTS}, got {count}")
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    draw = ImageDraw.Draw(image)
    cell = IMAGE_SIZE // GRID
    slack = cell - 2 * DOT_RADIUS - 2
    for index in rng.sample(range(GRID * GRID), count):
        row, col = divmod(index, GRID)
        x = col * cell + 1 + DOT_RADIUS + rng.randint(0, slack)
        y = row * cell + 1 + DOT_RADIUS + rng.randint(0, slack)
        draw.ellipse((x - DOT_RADIUS, y - DOT_RADIUS, x + DOT_RADIUS, y + DOT_RADIUS), fill="black")
    return encode_png(image)


def dots_messages(png: bytes) -> list[dict]:
    """The user turn: the image part first, then the question (one image token, then the text)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return [{"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": DOTS_QUESTION}]}]


def make_dots_dataset(num_prompts: int, seed: int) -> list[PromptRecord]:
    """`num_prompts` count-the-dots prompts; group ids `dots-<seed>-<i>`, ground truth the count."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be non-negative, got {num_prompts}")
    rng = random.Random(seed)
    records = []
    for i in range(num_prompts):
        count = rng.randint(1, MAX_DOTS)
        records.append(
            PromptRecord(
                group_id=f"dots-{seed}-{i}",
                messages=dots_messages(draw_dots(count, rng)),
                ground_truth=str(count),
                data_index=i,
            )
        )
    return records
