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
    # One GPU: the engine and the learner share it, and NCCL refuses two processes on one GPU.
    assert cfg.weight_sync.backend == ("gloo" if num_gpus == 1 else "nccl") and cfg.trainer.total_steps == 3
    assert cfg.rollout.engine.dtype == "bfloat16" and cfg.weight_sync.wire_dtype == "bfloat16"


def test_wire_dtype_follows_the_engine_unless_set():
    tiny = REPO / "configs/tiny.toml"
    assert load_config(tiny).weight_sync.wire_dtype == "float32"  # the engine's default dtype
    assert load_config(tiny, ["rollout.engine.dtype=auto"]).weight_sync.wire_dtype == "auto"
    assert (
        load_config(tiny, ["rollout.engine.dtype=bfloat16", "weight_sync.wire_dtype=float32"]).weight_sync.wire_dtype
        == "float32"
    )


SHARED = [
    "rollout.engine.device=cuda",
    "rollout.engine.num_gpus=0.5",
    "learner.device=cuda",
    "learner.num_gpus_per_worker=0.5",
]


def test_auto_backend_is_gloo_when_a_gpu_is_shared():
    """ "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device" (NCCL 2.28.9, H100): `auto`
    would pick NCCL for the learner's CUDA tensors at the first sync, so it is resolved here."""
    assert load_config(REPO / "configs/tiny.toml", SHARED).weight_sync.backend == "gloo"
    whole = [
        "rollout.engine.device=cuda",
        "rollout.engine.num_gpus=1",
        "learner.device=cuda",
        "learner.num_gpus_per_worker=1",
    ]
    assert load_config(REPO / "configs/tiny.toml", whole).weight_sync.backend == "auto"


@pytest.mark.parametrize("shared", [SHARED[:2], SHARED[2:]])
def test_nccl_on_a_shared_gpu_is_one_clear_error(shared):
    with pytest.raises(ValueError, match="NCCL refuses two processes of its group on one GPU"):
        load_config(REPO / "configs/tiny.toml", [*shared, "weight_sync.backend=nccl"])
