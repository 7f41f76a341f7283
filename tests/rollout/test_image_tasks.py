"""The generated count-the-dots image task (`data.source = "dots"`): deterministic bytes, the drawn
dot count equals the ground truth, the prompt carries one image part the agent loop admits, and the
built-in text reward grades the requested answer format. No model."""

from __future__ import annotations

import io
import random

import pytest

from streamrl.models.images import load_image_source
from streamrl.rollout.data.dots import IMAGE_SIZE, MAX_DOTS, draw_dots, make_dots_dataset
from streamrl.rollout.rewards import RewardInput, math_answer


def _count_dots(png: bytes) -> int:
    """Connected dark regions (4-neighbourhood) of the decoded image."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("L")
    assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
    dark = {(x, y) for x in range(IMAGE_SIZE) for y in range(IMAGE_SIZE) if image.getpixel((x, y)) < 128}
    count = 0
    while dark:
        count += 1
        stack = [dark.pop()]
        while stack:
            x, y = stack.pop()
            for nb in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if nb in dark:
                    dark.remove(nb)
                    stack.append(nb)
    return count


def test_every_count_is_drawn_as_that_many_separate_dots():
    rng = random.Random(0)
    for count in range(1, MAX_DOTS + 1):
        for _ in range(3):
            assert _count_dots(draw_dots(count, rng)) == count
    with pytest.raises(ValueError, match="count must be in 1..9"):
        draw_dots(0, rng)


def test_dataset_is_deterministic_and_its_ground_truth_is_the_drawn_count():
    records = make_dots_dataset(12, seed=3)
    again = make_dots_dataset(12, seed=3)
    assert [r.messages for r in records] == [r.messages for r in again]
    assert [r.group_id for r in records] == [f"dots-3-{i}" for i in range(12)]
    assert [r.data_index for r in records] == list(range(12))
    assert make_dots_dataset(12, seed=4)[0].messages != records[0].messages
    for record in records:
        (message,) = record.messages
        image, text = message["content"]
        assert message["role"] == "user" and image["type"] == "image" and text["type"] == "text"
        assert image["image"].startswith("data:image/png;base64,")
        assert _count_dots(load_image_source(image["image"])) == int(record.ground_truth)
        assert "\\boxed{N}" in text["text"]


def test_the_text_reward_grades_the_requested_answer():
    record = make_dots_dataset(1, seed=0)[0]
    right, wrong = f"\\boxed{{{record.ground_truth}}}", f"\\boxed{{{int(record.ground_truth) % 9 + 1}}}"
    assert (
        math_answer(RewardInput(response_text=right, final_answer_text=right, ground_truth=record.ground_truth)) == 1.0
    )
    assert (
        math_answer(RewardInput(response_text=wrong, final_answer_text=wrong, ground_truth=record.ground_truth)) == 0.0
    )


def test_the_data_source_name_loads_it():
    from streamrl.rollout.data import load_records

    assert [r.messages for r in load_records("dots", 4, 7)] == [r.messages for r in make_dots_dataset(4, 7)]
