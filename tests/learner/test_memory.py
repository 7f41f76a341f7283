"""Learner memory reporting (`core/memory.py`) and the `memory/*` metrics of a train step."""

from __future__ import annotations

import asyncio
import sys

import pytest

from streamrl.core import memory
from tests.learner.test_engine import _batch

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS/VmHWM and malloc_trim are Linux/glibc")
def test_rss_peak_reset_and_trim():
    rss, peak = memory.rss_gb(), memory.peak_rss_gb()
    assert 0 < rss <= peak
    block = bytearray(256 * 1024**2)  # touched: 256 MiB resident
    assert memory.peak_rss_gb() >= rss + 0.2
    del block
    if memory.reset_peak_rss():  # the window restarts at the current RSS
        assert memory.peak_rss_gb() < rss + 0.2
    assert memory.trim_allocator()
    assert memory.peak_memory_gb("cpu") == pytest.approx(memory.peak_rss_gb(), abs=0.05)
    assert memory.cuda_peak_gb() is None or memory.cuda_peak_gb() >= 0


def test_learner_runtime_env():
    env = memory.learner_runtime_env(num_threads=3)
    assert env["OMP_NUM_THREADS"] == "3"
    assert {"MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} <= set(env)
    assert all(isinstance(v, str) and v.isdigit() for v in env.values())  # Ray env_vars are strings


def test_local_learner_reports_memory_per_step():
    from streamrl.streaming.actors.learner_backends import LocalLearner
    from streamrl.streaming.config import StreamRLConfig

    cfg = StreamRLConfig(model="tiny", learner={"device": "cpu", "micro_batch_tokens": 64, "logits_chunk_tokens": 16})
    learner = LocalLearner(cfg, None)
    metrics = asyncio.run(learner.train_step(_batch())).metrics
    assert metrics["learner/policy_version"] == 1.0
    assert 0 < metrics["memory/learner_rss_gb"] <= metrics["memory/learner_peak_gb"] + 0.05


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_group_learner_reports_its_fullest_rank(ray_cluster):
    from streamrl.streaming.actors.learner_backends import GroupLearner
    from streamrl.streaming.config import StreamRLConfig

    cfg = StreamRLConfig(
        model="tiny",
        learner={
            "device": "cpu",
            "num_workers": 2,
            "num_cpus_per_worker": 1,
            "micro_batch_tokens": 24,
            "logits_chunk_tokens": 7,
        },
    )
    learner = GroupLearner(cfg, None)
    try:
        env = learner.group.inspect_all(lambda engine: __import__("os").environ.get("MALLOC_ARENA_MAX"))
        assert env == [memory.MALLOC_ENV["MALLOC_ARENA_MAX"]] * 2  # every rank runs with the allocator settings
        metrics = asyncio.run(learner.train_step(_batch())).metrics
        assert learner.policy_version == 1
        assert 0 < metrics["memory/learner_rss_gb"] <= metrics["memory/learner_peak_gb"] + 0.05
    finally:
        asyncio.run(learner.shutdown())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_part_peak_counts_child_processes():
    """An engine's memory is mostly its EngineCore child: a part's peak must include children."""
    import subprocess

    own = memory.peak_rss_gb()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; b = bytearray(400 * 1024**2); sys.stdout.write('ok\\n'); sys.stdout.flush(); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ok\n"  # the 400 MiB are resident now
        reported = memory.part_memory("engine")
    finally:
        child.communicate("", timeout=30)
    assert set(reported) == {"memory/engine_peak_gb"}  # no CUDA here
    assert reported["memory/engine_peak_gb"] >= own + 0.35
