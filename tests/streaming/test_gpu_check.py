"""`make gpu-check`'s run settings are a valid config for one GPU and for several (the run itself
needs CUDA: bench/gpu_check.py, results in bench/results/gpu.json where a GPU machine ran it)."""

from __future__ import annotations

import pytest

from bench.gpu_check import gpu_overrides
from streamrl.streaming.config import load_config
from tests.conftest import REPO


@pytest.mark.parametrize(("num_gpus", "ranks", "engine_gpus"), [(1, 1, 0.5), (2, 1, 1.0), (8, 7, 1.0)])
def test_gpu_check_settings_resolve(tmp_path, num_gpus, ranks, engine_gpus):
    cfg = load_config(REPO / "configs/tiny.toml", gpu_overrides(tmp_path, steps=3, num_gpus=num_gpus))
    assert cfg.rollout.engine.device == "cuda" and cfg.rollout.engine.num_gpus == engine_gpus
    assert cfg.learner.device == "cuda" and cfg.learner.num_workers == ranks
    assert cfg.weight_sync.backend == "nccl" and cfg.trainer.total_steps == 3
