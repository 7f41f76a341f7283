"""Elastic and preemptible engines during a real run (tiny model, real vLLM engines, real Ray): start
with 2 engines; `streamrl scale --engines 3` adds engine-2, which serves only once a sync brought it
to the served version; engine-0 is preempted with notice (drained: its generations go on elsewhere);
engine-1 is killed without notice (its requests fail over). The run finishes its steps and the
invariants hold: nothing lost or stranded, no token sampled from weights no sync published."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray]


async def _until(predicate, what: str, run: asyncio.Task, timeout_s: float = 240.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if await predicate():
            return
        if run.done():
            run.result()  # the run failed: its error, not a timeout
            raise AssertionError(f"the run ended before {what}")
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def _busy(engine, at_least: int = 1) -> bool:
    return (await engine.actor_stats()).num_running >= at_least


def _hold_learner(pipeline, gates: dict[int, asyncio.Event]) -> set[int]:
    """Learner step k waits for `gates[k]`: an engine starting on a loaded CPU takes longer than the
    whole tiny run, so the test, not timing, decides that the run is still going when it acts.
    Returns the steps waiting now (a learner waiting there is not syncing: no pause is under way)."""
    train_step, waiting = pipeline.learner.train_step, set()

    async def gated(batch_ref):
        step = pipeline.state.learner_step + 1
        if (gate := gates.get(step)) is not None:
            waiting.add(step)
            await gate.wait()
            waiting.discard(step)
        return await train_step(batch_ref)

    pipeline.learner.train_step = gated
    return waiting


async def _drain_while_generating(pipeline, engine, gates, waiting, run) -> int:
    """Drain `engine` while it runs generations and no weight sync pauses the workers (their pause
    parks every generation first, leaving the drain nothing to hand back): hold the learner before
    its next step, then drain once the engine runs two requests; if it never does, let a step through
    and try again."""
    from streamrl.streaming.elastic import drain

    for _ in range(5):
        step = pipeline.state.learner_step + 2  # step + 1 may be training already
        gates[step] = hold = asyncio.Event()
        try:
            await _until(lambda s=step: _at(s in waiting), f"the learner to wait at step {step}", run)
            for _ in range(300):
                if await _busy(engine, at_least=2):
                    return await drain(pipeline, engine.engine_id, why="preempted")
                await asyncio.sleep(0.1)
        finally:
            hold.set()
    raise AssertionError(f"{engine.engine_id} never ran two generations at once")


@pytest.mark.timeout(900)
async def test_engines_join_drain_and_die_during_a_run(ray_cluster, tmp_path, tiny_model_path):
    from streamrl.buffer.cli import load_frame
    from streamrl.streaming.config import load_config
    from streamrl.streaming.driver import run_async
    from streamrl.streaming.elastic import write_scale_request
    from streamrl.streaming.invariants import check_run
    from streamrl.streaming.train import build_pipeline

    cfg = load_config(
        "configs/tiny.toml",
        [
            f"trainer.run_root={tmp_path}",
            "trainer.run_name=elastic",
            "trainer.total_steps=14",
            "trainer.checkpoint_every=100",
            "rollout.num_engines=2",
            "wandb.enabled=false",
        ],
    )
    run_dir = tmp_path / "elastic"
    run_dir.mkdir()
    pipeline = await build_pipeline(cfg, run_dir, None)
    first = {e.engine_id: e for e in pipeline.engines}
    added, changed = asyncio.Event(), asyncio.Event()
    gates = {3: added, 10: changed}  # step 3 (and its sync) after engine-2 is in the set
    waiting = _hold_learner(pipeline, gates)
    run = asyncio.create_task(run_async(pipeline))
    try:
        await _until(lambda: _at(pipeline.state.learner_step >= 1), "the first step", run)
        write_scale_request(run_dir, engines=3)  # what `streamrl scale RUN_DIR --engines 3` writes
        await _until(lambda: _at(len(pipeline.engines) == 3), "engine-2 to start", run, timeout_s=400)
        assert pipeline.fleet.joining == {"engine-2"}
        added.set()
        await _until(lambda: _at("engine-2" in pipeline.fleet.joined), "engine-2 to serve", run)
        joined = pipeline.fleet.joined["engine-2"]
        # let in only once a sync committed the served version in it, before it sampled anything
        assert joined["policy_version"] >= joined["driver_policy_version"] >= 1, joined
        assert joined["num_generated_tokens"] == 0, joined
        new = next(e for e in pipeline.engines if e.engine_id == "engine-2")

        # preempted with notice, while it generates: its generations are handed back and go on elsewhere
        assert await _drain_while_generating(pipeline, first["engine-0"], gates, waiting, run) > 0
        assert pipeline.fleet.retired["engine-0"] == "preempted"

        # killed without notice, while it generates
        await _until(lambda: _busy(first["engine-1"]), "engine-1 to generate", run)
        first["engine-1"].kill()
        await _until(lambda: _at("engine-1" in pipeline.fleet.retired), "engine-1 retired", run)
        assert pipeline.fleet.retired["engine-1"] == "dead"
        assert [e.engine_id for e in pipeline.engines] == ["engine-2"]
        changed.set()
        await asyncio.wait_for(run, 600)
    finally:
        if not run.done():
            run.cancel()
        pipeline.metrics.close()

    assert pipeline.state.learner_step == 14
    assert (await new.actor_stats()).num_generated_tokens > 0  # engine-2 carried the run's end
    accounting = await pipeline.write_accounting()
    assert accounting["stranded"] == [] and accounting["untracked"] == [], accounting
    report = check_run(run_dir)  # I1, I2, I4 (no sampled token below version 0: none from base weights)
    assert report.ok, report.problems
    frame = load_frame(run_dir / "buffer")
    assert not (frame[frame["is_latest"]]["status"] == "failed").any()  # no trajectory lost to the changes
    for w in pipeline.workers:
        w.kill()
    for e in pipeline.engines:
        e.kill()


async def _at(value: bool) -> bool:
    return value
