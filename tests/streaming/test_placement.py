"""Placement: each part's threads on its own cores, read back from /proc (streaming/placement.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading

import pytest

from streamrl.core.cpu_affinity import parse_cpu_list, pin_process, thread_affinities
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.placement import PlacementConfig

pytestmark = pytest.mark.timeout(300)
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to place two parts")


def test_parse_cpu_list_reads_the_kernel_format():
    assert parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}
    assert parse_cpu_list("3") == {3}


@pytest.mark.parametrize(
    ("placement", "match"),
    [
        ({"engine_cores": [0, 1], "learner_cores": [1]}, "share cores"),
        ({"engine_cores": [0, 0]}, "distinct"),
        ({"learner_cores": [-1]}, "distinct"),
        ({"engine_cores": []}, "at least 1"),
    ],
)
def test_bad_placements_are_refused_naming_the_field(placement, match):
    with pytest.raises(ValueError, match=match):
        StreamRLConfig(placement=placement)


def test_engine_cores_split_into_equal_slices_one_per_engine():
    cfg = StreamRLConfig(placement={"engine_cores": [0, 1, 2, 3]}, rollout={"num_engines": 2})
    assert [cfg.placement.engine_slice(i, 2) for i in range(3)] == [[0, 1], [2, 3], [0, 1]]  # a third shares
    with pytest.raises(ValueError, match="same number of cores"):
        StreamRLConfig(placement={"engine_cores": [0, 1, 2]}, rollout={"num_engines": 2})
    assert PlacementConfig().engine_slice(0, 1) is None  # floating engines keep their config


def test_a_pinned_learner_group_is_refused():
    with pytest.raises(ValueError, match="num_workers"):
        StreamRLConfig(placement={"learner_cores": [1]}, learner={"num_workers": 2})


def test_cores_this_machine_lacks_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="not on this machine"):
        PlacementConfig(learner_cores=[os.cpu_count() or 1]).check_machine()


def _pin_with_threads(cores, started, release) -> None:
    # threads that exist before the pin and one started after it, all alive until released
    before = [threading.Thread(target=release.wait) for _ in range(3)]
    for t in before:
        t.start()
    pin_process(cores)
    after = threading.Thread(target=release.wait)
    after.start()
    started.set()
    release.wait(60)


@TWO_CORES
def test_pin_process_pins_threads_that_existed_and_those_started_later():
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_pin_with_threads, args=([1], started, release))
    proc.start()
    try:
        assert started.wait(60)
        masks = thread_affinities(proc.pid)
        assert len(masks) >= 5  # the main thread, three before, one after
        assert all(mask == {1} for mask in masks.values()), masks
    finally:
        release.set()
        proc.join(30)


@TWO_CORES
@pytest.mark.ray
@pytest.mark.vllm
def test_engine_and_learner_threads_run_on_disjoint_cores(ray_cluster, tiny_model_path):
    """The real parts: a vLLM engine actor pinned to core 0 generates, a learner actor pinned to core
    1 loads its model; every thread of each process may run on its own core only."""
    from tests.fixtures.vllm import skip_without_vllm

    skip_without_vllm()
    from streamrl.core.memory import learner_runtime_env
    from streamrl.engines.base import SamplingParams
    from streamrl.streaming.actors.engine import RayEngineClient
    from streamrl.streaming.actors.learner import LearnerActor, learner_actor_options

    cfg = StreamRLConfig(
        model=str(tiny_model_path),
        placement={"engine_cores": [0], "learner_cores": [1]},
        rollout={"engine": {"device": "cpu", "max_model_len": 1024, "kv_cache_space_gb": 1}},
        learner={"device": "cpu"},
    )
    engine = RayEngineClient.launch(cfg.placement.engine_config(cfg.rollout.engine, 0, 1), "engine-placed")
    learner = LearnerActor.options(  # pyrefly: ignore[missing-attribute]
        **learner_actor_options(cfg), runtime_env={"env_vars": learner_runtime_env(1)}
    ).remote(cfg)
    try:

        async def exercise() -> int:
            await asyncio.wait_for(engine.wait_ready(), 240)
            params = SamplingParams(max_tokens=4, temperature=0.0)
            await asyncio.wait_for(engine.generate("placed-0", [1, 2, 3], params), 120)
            return await asyncio.wait_for(engine._call("pid"), 60)

        engine_pid = asyncio.run(exercise())
        ray = ray_cluster
        assert ray.get(learner.policy_version.remote(), timeout=240) == 0  # the model is loaded
        learner_pid = ray.get(learner.pid.remote(), timeout=60)
        engine_masks, learner_masks = thread_affinities(engine_pid), thread_affinities(learner_pid)
        assert len(engine_masks) > 1 and len(learner_masks) > 1
        assert all(mask == {0} for mask in engine_masks.values()), engine_masks
        assert all(mask == {1} for mask in learner_masks.values()), learner_masks
    finally:
        ray_cluster.kill(learner, no_restart=True)
        engine.kill()
