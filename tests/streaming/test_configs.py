"""Every run file in configs/ validates, and the learner's placement follows its config.

Fast: no Ray, no model, no engine (placement is resolved for explicit devices only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.learner.config import LearnerConfig
from streamrl.learner.group import placement
from streamrl.streaming.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def test_the_documented_run_files_exist():
    names = {p.name for p in CONFIGS}
    assert {"default.toml", "tiny.toml", "gpu_qwen2.5_1.5b_gsm8k.toml", "gpu_qwen2.5_7b_gsm8k.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_run_file_validates(path):
    cfg = load_config(path)
    assert cfg.rollout.engine.max_model_len >= cfg.rollout.max_model_len
    assert cfg.learner.model == cfg.rollout.engine.model == cfg.model
    if cfg.rollout.agent.tool_config is not None:
        assert (REPO / cfg.rollout.agent.tool_config).is_file()


@pytest.mark.parametrize(
    ("name", "engine_gpus", "learner_gpus"),
    [("gpu_qwen2.5_1.5b_gsm8k.toml", 2, 2), ("gpu_qwen2.5_7b_gsm8k.toml", 4, 4)],
)
def test_gpu_run_files_give_engines_and_learner_disjoint_gpus(name, engine_gpus, learner_gpus):
    cfg = load_config(REPO / "configs" / name)
    engine = cfg.rollout.engine
    assert engine.device == "cuda" and engine.dtype == "bfloat16"
    assert engine.num_gpus == engine.tensor_parallel_size
    assert cfg.rollout.num_engines * engine.num_gpus == engine_gpus
    where = placement(cfg.learner)
    assert where.device == "cuda" and where.num_gpus_per_worker == 1
    assert where.num_workers * where.num_gpus_per_worker == learner_gpus
    assert cfg.learner.dtype == "bfloat16" and cfg.weight_sync.backend == "auto"
    assert cfg.model.startswith("/models/Qwen2.5-")  # a local-folder placeholder the user sets


def test_learner_placement_defaults_and_auto_device():
    assert placement(LearnerConfig(device="cpu")).actor_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert placement(LearnerConfig(device="cuda", num_workers=4)).actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0}
    auto = LearnerConfig(device="auto", num_workers=2, num_cpus_per_worker=2)
    assert placement(auto, cluster_gpus=2).device == "cuda"
    assert placement(auto, cluster_gpus=1).device == "cpu"  # not a GPU for every rank
    assert placement(auto, cluster_gpus=0).actor_options() == {"num_cpus": 2.0, "num_gpus": 0.0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["learner.device=cpu", "learner.num_gpus_per_worker=1"], "num_gpus_per_worker"),
        (["learner.device=cuda", "learner.num_gpus_per_worker=0"], "num_gpus_per_worker"),
        (["learner.device=cuda", "learner.num_workers=2", "learner.num_gpus_per_worker=0.5"], "num_gpus_per_worker"),
        (["learner.num_workers=0"], "learner.num_workers"),
    ],
)
def test_bad_learner_placement_is_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_learner_actor_options_follow_num_workers():
    from streamrl.streaming.actors.learner import learner_actor_options

    single = load_config(None, ["learner.device=cpu", "learner.num_cpus_per_worker=2"])
    assert learner_actor_options(single) == {"num_cpus": 2.0, "num_gpus": 0.0}
    group = load_config(None, ["learner.device=cuda", "learner.num_workers=4"])
    assert learner_actor_options(group) == {"num_cpus": 0, "num_gpus": 0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sft.enabled=true"], "sft.enabled = true with a VLM"),
        (["sft.enabled=true", "model=tiny", "data.source=arithmetic", "rollout.engine.max_images_per_prompt=0"], None),
        (["rollout.engine.max_images_per_prompt=0"], 'data.source = "dots" \\(image prompts\\) needs'),
    ],
)
def test_vlm_run_file_refuses_what_would_fail_deep_in_the_run(overrides, message):
    """The SFT warm-up loads a causal LM (an Idefics3 folder crashed its child process with a
    transformers traceback), and image prompts on text-only engines fail every trajectory."""
    if message is None:
        assert load_config(REPO / "configs/vlm_tiny.toml", overrides).sft.enabled
        return
    with pytest.raises(ValueError, match=message):
        load_config(REPO / "configs/vlm_tiny.toml", overrides)
