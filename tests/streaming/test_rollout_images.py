"""The rollout worker actor's image plumbing without Ray: a VLM config gives the loops a processor and
an image store (a text config gives neither: unchanged), and each row's images become the
`ImageBlob`s its buffer append carries (one per hash, the ref's size and mime, the stored bytes)."""

from __future__ import annotations

import dataclasses

import pytest

from streamrl.models.images import encode_png
from streamrl.rollout.images import ImageStore
from streamrl.rollout.types import Trajectory
from streamrl.streaming.actors.worker import build_agent_context, image_blobs
from streamrl.streaming.config import load_config

pytestmark = pytest.mark.timeout(120)


def _png(rgb, size=(8, 6)) -> bytes:
    from PIL import Image

    return encode_png(Image.new("RGB", size, rgb))


def test_vlm_config_gives_the_loops_a_processor_and_an_image_store():
    from streamrl.models import resolve_model

    path = str(resolve_model("tiny-vlm"))
    vlm = build_agent_context(load_config(None, ["rollout.engine.max_images_per_prompt=2"]), path, server=None)
    assert vlm.images is not None and len(vlm.images) == 0
    assert vlm.max_images == 2  # a response image past the engine's limit is an error observation
    assert vlm.image_token_id == vlm.processor.image_token_id == vlm.tokenizer.convert_tokens_to_ids("<image>")
    text = build_agent_context(load_config(None, []), path, server=None)
    assert text.processor is None and text.images is None and text.image_token_id is None and text.max_images is None


def test_image_blobs_carry_each_referenced_image_once():
    store = ImageStore()
    red, green = store.put(_png((255, 0, 0))), store.put(_png((0, 255, 0), (5, 9)))
    row = Trajectory(
        trajectory_id="t",
        group_id="g",
        sample_index=0,
        agent_name="single_turn_agent",
        prompt_ids=[1],
        response_ids=[],
        response_mask=[],
        behavior_logprobs=[],
        policy_versions=[],
    )
    assert image_blobs(store, row) is None  # a text row: the append call is exactly as before
    row = dataclasses.replace(row, image_refs=[green.sha256, red.sha256, green.sha256], num_image_tokens=[4, 4, 4])
    blobs = image_blobs(store, row)
    assert [b.sha256 for b in blobs] == [green.sha256, red.sha256]
    assert (blobs[0].width, blobs[0].height, blobs[0].mime, blobs[0].data) == (
        5,
        9,
        "image/png",
        store.get(green.sha256),
    )
    with pytest.raises(KeyError):
        image_blobs(ImageStore(), row)  # bytes the worker does not hold are a bug here, never skipped
