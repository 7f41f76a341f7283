"""Fixtures of the tiny VLM tests (test_tiny_vlm.py, test_multimodal_engine.py, test_multimodal_loop.py,
test_response_images.py): the locally built random-weight Idefics3 folder, its processor, the HF model and the
project's `VLLMEngine` on it, once for this package (torn down after its last test, before tests/streaming).

Package scope, not module scope: an engine start and shutdown is ~10 s of the suite, paid once instead of once
per module. Sharing is safe because the tests were already written for a shared engine: each reads its
starting `policy_version` from the engine and counts from it, and a test that changes the weights restores them
before it ends (the HF model is only read)."""

from __future__ import annotations

import pytest
import pytest_asyncio


@pytest.fixture(scope="package")
def vlm_path():
    from streamrl.models import resolve_model

    return resolve_model("tiny-vlm")


@pytest.fixture(scope="package")
def processor(vlm_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_path)


@pytest.fixture(scope="package")
def hf_vlm(vlm_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_path, dtype="float32").eval()


@pytest_asyncio.fixture(scope="package", loop_scope="session")
async def vlm_engine(vlm_path):
    """The project's `VLLMEngine` on the tiny VLM (in process, up to 2 images per prompt)."""
    from streamrl.engines.vllm_engine import VLLMEngine
    from tests.fixtures.vllm import cpu_engine_config, skip_without_vllm

    skip_without_vllm()
    cfg = cpu_engine_config("tiny-vlm", max_model_len=512, max_num_seqs=4, max_images_per_prompt=2)
    engine = VLLMEngine(cfg, "vlm-rollout")
    yield engine
    await engine.shutdown()
