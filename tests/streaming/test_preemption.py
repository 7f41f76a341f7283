"""Preemption of a rollout worker mid-run: its actor is killed while it holds trajectories; the
driver's health loop replaces it and another worker resumes them from their buffer rows; the run
finishes and no admitted trajectory is lost."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]


@pytest.mark.timeout(600)
async def test_killed_rollout_worker_is_replaced_and_its_trajectories_resume(ray_cluster, tmp_path, tiny_model_path):

    from streamrl.buffer.cli import load_frame
    from streamrl.streaming.config import load_config
    from streamrl.streaming.driver import run_async
    from streamrl.streaming.train import build_pipeline

    cfg = load_config(
        "configs/tiny.toml",
        [
            f"trainer.run_root={tmp_path}",
            "trainer.run_name=preempt",
            "trainer.total_steps=8",
            "trainer.checkpoint_every=100",
            "rollout.num_workers=2",
            "wandb.enabled=false",
        ],
    )
    run_dir = tmp_path / "preempt"
    run_dir.mkdir()
    pipeline = await build_pipeline(cfg, run_dir, None)
    victim = pipeline.workers[0]
    run = asyncio.create_task(run_async(pipeline))
    try:
        # Wait until the victim holds trajectories, then kill it (no graceful shutdown).
        for _ in range(1200):
            if await victim.num_outstanding() > 0 and pipeline.state.learner_step >= 1:
                break
            await asyncio.sleep(0.1)
        held = set(await victim.running_ids())
        assert held, "the worker to preempt never held a trajectory"
        victim.kill()
        for _ in range(600):  # the health loop notices within a poll or two, while the run goes on
            if pipeline.num_worker_replacements or run.done():
                break
            await asyncio.sleep(0.1)
        assert not run.done() or run.exception() is None
        await asyncio.wait_for(run, 480)
    finally:
        if not run.done():
            run.cancel()
        pipeline.metrics.close()

    assert pipeline.num_worker_replacements == 1
    assert victim not in pipeline.workers
    assert pipeline.state.learner_step == 8
    # I2 at the end: the workers are parked and every resumable row is held by a live worker.
    accounting = await pipeline.write_accounting()
    assert accounting["stranded"] == [] and accounting["untracked"] == [], accounting
    frame = load_frame(run_dir / "buffer")
    latest = frame[frame["is_latest"]].set_index("trajectory_id")
    # Every trajectory the dead worker held was taken over: its latest row is finished (another
    # worker resumed and finished it) or partial and held by a live worker now — never lost or failed.
    assert held <= set(latest.index)
    status = latest.loc[sorted(held), "status"]
    for tid, st in status.items():
        assert st == "finished" or (st == "partial" and tid in accounting["resumable"]), (tid, st)
    for w in pipeline.workers:
        w.kill()  # parked by the accounting; nothing more to run
