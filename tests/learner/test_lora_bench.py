"""bench/lora.py's sync bytes on the tiny model: what one weight sync sends per mode, read from
`named_parameters_for_sync()` as the transports lay it out."""

from __future__ import annotations

import pytest
from torch import nn

from bench.lora import setting_overrides, sync_bytes
from streamrl.learner.config import LearnerConfig, LoraSync
from streamrl.learner.engine import TrainingEngine
from streamrl.weight_sync.config import WeightSyncConfig

RANK = 4


def test_adapter_sync_sends_a_and_b_only_and_merged_sync_sends_what_full_fine_tuning_sends():
    full = TrainingEngine(LearnerConfig(model="tiny", device="cpu"))
    lora = TrainingEngine(LearnerConfig(model="tiny", device="cpu", lora={"rank": RANK, "sync": "adapter"}))
    ws = WeightSyncConfig()
    full_bytes, lora_bytes = sync_bytes(full, ws), sync_bytes(lora, ws)
    assert set(full_bytes) == {"full"} and set(lora_bytes) == {"merged", "adapter"}
    assert lora_bytes["adapter"]["bytes"] < lora_bytes["merged"]["bytes"] == full_bytes["full"]["bytes"]
    assert lora_bytes["merged"]["num_tensors"] == full_bytes["full"]["num_tensors"]
    # A [r, in] and B [out, r] of every target Linear, in fp32
    targets = [
        m
        for name, m in full.policy.lm.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] in lora.cfg.lora.target_modules
    ]
    assert lora_bytes["adapter"]["bytes"] == 4 * RANK * sum(m.in_features + m.out_features for m in targets)
    assert lora.cfg.lora.sync is LoraSync.ADAPTER  # the engine's own mode is restored
    half = sync_bytes(full, WeightSyncConfig(wire_dtype="bfloat16"))
    assert half["full"]["bytes"] * 2 == full_bytes["full"]["bytes"]


def test_setting_names():
    assert setting_overrides("full", "tiny") == ["model=tiny"]
    assert setting_overrides("lora32-adapter", "tiny")[1:] == ["learner.lora.rank=32", "learner.lora.sync=adapter"]
    with pytest.raises(ValueError, match="unknown setting"):
        setting_overrides("lora", "tiny")
