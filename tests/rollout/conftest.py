"""Fixtures of the tiny VLM tests (test_tiny_vlm.py, test_multimodal_engine.py, test_multimodal_loop.py): the
locally built random-weight Idefics3 folder, its processor, the HF model and the project's `VLLMEngine` on it,
once per test module."""

from __future__ import annotations

import pytest
import pytest_asyncio


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


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vlm_engine(vlm_path, request):
    """The project's `VLLMEngine` on the tiny VLM (in process, up to 2 images per prompt)."""
    from tests.fixtures.vllm import _vllm_import_error

    reason = _vllm_import_error()
    if reason is not None:
        pytest.skip(reason)
    from streamrl.rollout.engine.config import EngineConfig
    from streamrl.rollout.engine.vllm_engine import VLLMEngine

    cfg = EngineConfig(
        model="tiny-vlm", device="cpu", max_model_len=512, max_num_seqs=4, kv_cache_space_gb=1,
        max_images_per_prompt=2, in_process=True,
    )
    engine = VLLMEngine(cfg, f"vlm-{request.module.__name__.rsplit('.', 1)[-1]}")
    yield engine
    await engine.shutdown()
