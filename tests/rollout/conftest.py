"""Fixtures of the tiny VLM tests (test_tiny_vlm.py, test_multimodal_engine.py): the locally built
random-weight Idefics3 folder, its processor and the HF model, once per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def vlm_path():
    from streamrl.rollout.models import resolve_model

    return resolve_model("tiny-vlm")


@pytest.fixture(scope="module")
def processor(vlm_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_path)


@pytest.fixture(scope="module")
def hf_vlm(vlm_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_path, dtype="float32").eval()
