"""Weight sync under engine faults, with in-process engine doubles (seconds, no vLLM):

- a pause that lands after the sync already resumed (a Ray call outlives its caller's timeout) must
  not leave the engine paused (fencing tokens);
- a commit that fails or times out on some engines is repaired before generation resumes, and no
  engine ever serves new weights under the old version label (I7);
- a dead engine (actor died, or never answers) leaves the sync set within the phase timeouts and the
  run goes on with the others; with no engine left, publishing raises a clear error (I6).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from streamrl.engines.base import NoHealthyEngineError, PauseMode, SamplingParams
from streamrl.weight_sync.config import SyncTimeouts, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from tests.weight_sync.fakes import ActorLike, DyingEngine, RecordingWorkers, ThreadEngine, toy_weights

pytestmark = pytest.mark.timeout(60)

TIMEOUTS = dict(transfer=3.0, load=1.0, pause=0.5, resume=1.0, verify=2.0, probe=0.5)


def _config(**overrides) -> WeightSyncConfig:
    timeouts = SyncTimeouts(**(TIMEOUTS | overrides.pop("timeouts", {})))
    return WeightSyncConfig(**({"bucket_bytes": 1024, "timeouts": timeouts} | overrides))


def _serves(engine: ThreadEngine, weights) -> bool:
    loaded = engine.worker.loaded
    return set(loaded) == {n for n, _ in weights} and all(torch.equal(loaded[n], t) for n, t in weights)


async def _generates(engine, timeout_s: float = 5.0) -> list[int]:
    out = await asyncio.wait_for(
        engine.generate(f"probe-{time.monotonic_ns()}", [1, 2], SamplingParams(max_tokens=3)), timeout_s
    )
    return out.policy_versions


# ---- (6) a late pause never wins over the resume -------------------------------------------------


@pytest.mark.parametrize("where", ["queued", "in_flight"])
async def test_pause_that_lands_after_the_resume_leaves_the_engine_serving(where):
    """queued: the pause call starts on the actor only after the sync gave up and resumed;
    in_flight: the pause started in time but lands after the resume."""
    engine = ThreadEngine("slow")
    delay = 1.5  # > the 0.5 s pause timeout
    if where == "queued":
        actor = ActorLike(engine, call_delays={"pause": delay})
    else:
        engine.pause_delay_s = delay
        actor = ActorLike(engine)
    coordinator = WeightSyncCoordinator(_config(), [actor])
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "pause", result.error
    await actor.settle()  # the late pause has landed on the engine
    assert not engine.paused, "a pause that landed after the resume left the engine paused"
    assert await _generates(engine) == [0, 0, 0]
    # A slow engine is not a dead one: it stays in the sync set and the next sync works.
    assert result.dropped_engine_ids == [] and coordinator.engines == [actor]
    engine.pause_delay_s = 0.0
    actor._delays.clear()
    retry = await coordinator.sync(toy_weights(1), policy_version=1)
    assert retry.ok, retry.error
    assert not engine.paused and engine.policy_version == 1 and _serves(engine, toy_weights(1))
    await coordinator.close()


# ---- (8) commit is all or nothing for what the engines serve --------------------------------------


def _assert_consistent(coordinator: WeightSyncCoordinator, engines: list[ThreadEngine], weights_by_version) -> None:
    """Every engine left in the sync set serves the coordinator's version under that label; no engine
    anywhere samples new weights under an old label (it relabels with the load, or refuses to sample)."""
    for engine in coordinator.engines:
        assert engine.policy_version == coordinator.served_version, engine.engine_id
    for engine in engines:
        if engine._fence.out_of_service is not None:
            continue  # refuses to sample (checked by the callers)
        assert _serves(engine, weights_by_version[engine.policy_version]), (engine.engine_id, engine.policy_version)


@pytest.mark.parametrize("fault", ["raises_once", "slow_once"])
async def test_commit_that_fails_once_on_one_engine_is_repaired_before_resume(fault):
    events: list[tuple[str, str]] = []
    good, flaky = ThreadEngine("good", events), ThreadEngine("flaky", events)
    if fault == "raises_once":
        flaky.worker.fail_loads = 1  # dies midway, half the tensors loaded
    else:
        flaky.worker.reload_delay_s = 1.5  # one load timeout (1 s) < delay < two
    coordinator = WeightSyncCoordinator(_config(), [good, flaky], workers=RecordingWorkers(events))
    weights = toy_weights(1)
    result = await coordinator.sync(weights)
    assert result.ok and result.policy_version == 1 and result.dropped_engine_ids == [], result.error
    assert coordinator.served_version == 1 and coordinator.engines == [good, flaky]
    _assert_consistent(coordinator, [good, flaky], {0: [], 1: weights})
    # Repaired before generation resumed: both labels flipped before any engine resumed.
    first_resume = events.index(("good", "resume"))
    assert ("flaky", "version:1") in events[:first_resume] and ("good", "version:1") in events[:first_resume]
    assert await _generates(flaky) == [1, 1, 1]
    await coordinator.close()


async def test_commit_that_keeps_failing_drops_the_engine_which_refuses_to_sample():
    good, broken = ThreadEngine("good"), ThreadEngine("broken")
    broken.worker.fail_loads = 2  # the load and the re-commit both die midway
    coordinator = WeightSyncCoordinator(_config(), [good, broken])
    weights = toy_weights(1)
    result = await coordinator.sync(weights)
    assert result.ok and result.policy_version == 1 and result.dropped_engine_ids == ["broken"], result.error
    assert coordinator.engines == [good] and "re-commit too" in coordinator.dropped["broken"]
    _assert_consistent(coordinator, [good, broken], {0: [], 1: weights})
    assert broken.policy_version == 0 and not _serves(broken, []) and not _serves(broken, weights)  # half loaded
    with pytest.raises(RuntimeError, match="out of service"):
        await _generates(broken)
    with pytest.raises(RuntimeError, match="out of service"):
        await broken.ping()
    # It stays out (it cannot answer a ping) and the run goes on with the others.
    result = await coordinator.sync(toy_weights(2))
    assert result.ok and coordinator.engines == [good] and good.policy_version == 2
    await coordinator.close()


async def test_commit_that_times_out_twice_loads_later_under_the_new_label():
    good, slow = ThreadEngine("good"), ThreadEngine("slow")
    slow.worker.reload_delay_s = 2.5  # longer than the load timeout (1 s) and its re-commit together
    coordinator = WeightSyncCoordinator(_config(), [good, slow])
    weights = toy_weights(1)
    result = await coordinator.sync(weights)
    assert result.ok and result.policy_version == 1 and result.dropped_engine_ids == ["slow"], result.error
    assert coordinator.engines == [good]
    _assert_consistent(coordinator, [good, slow], {0: [], 1: weights})
    for _ in range(100):  # the load that outlived both timeouts lands...
        if _serves(slow, weights):
            break
        await asyncio.sleep(0.05)
    assert _serves(slow, weights)
    await asyncio.sleep(0.1)  # ...and the event loop sees it finish
    assert slow.policy_version == 1, "new weights are served under the old version label"
    _assert_consistent(coordinator, [good, slow], {0: [], 1: weights})
    assert await _generates(slow) == [1, 1, 1]
    # It answers a ping again, so it rejoins the next sync and follows the fleet.
    slow.worker.reload_delay_s = 0.0
    result = await coordinator.sync(toy_weights(2))
    assert result.ok and coordinator.engines == [good, slow], result.error
    _assert_consistent(coordinator, [good, slow], {0: [], 1: weights, 2: toy_weights(2)})
    assert slow.policy_version == 2
    await coordinator.close()


# ---- (5) dead engines leave the sync set; none left -> a clear error ------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "paused_transfer"])
@pytest.mark.parametrize("hang", [False, True], ids=["actor_died", "never_answers"])
async def test_dead_engine_leaves_the_sync_set_and_the_run_goes_on(hang, overlap):
    events: list[tuple[str, str]] = []
    alive, doomed = ThreadEngine("alive", events), DyingEngine("doomed", events, hang=hang)
    config = _config(overlap=overlap)
    coordinator = WeightSyncCoordinator(config, [alive, doomed], workers=RecordingWorkers(events))
    assert (await coordinator.sync(toy_weights(1))).ok
    doomed.die()
    started = time.monotonic()
    result = await coordinator.sync(toy_weights(2))
    elapsed = time.monotonic() - started
    assert result.ok and result.policy_version == 2, result.error
    assert result.dropped_engine_ids == ["doomed"] and list(coordinator.dropped) == ["doomed"]
    assert alive.policy_version == 2 and _serves(alive, toy_weights(2))
    t = config.timeouts
    # bounded by the phase timeouts (overlap: the staging fails, then the probe), then one sync on the survivor
    assert elapsed < (t.transfer + t.probe if overlap else t.pause + t.resume) + 3.0
    assert events[-1] == ("workers", "resume")
    assert coordinator.metrics()["sync/num_engines"] == 1.0
    # Later syncs only ping the dead engine (bounded) and go on without it.
    result = await coordinator.sync(toy_weights(3))
    assert result.ok and alive.policy_version == 3 and coordinator.engines == [alive]
    await coordinator.close()


@pytest.mark.parametrize(
    ("overlap", "why"), [(True, "no answer to a ping after a failed transfer"), (False, "resume failed")]
)
async def test_no_engine_left_raises_a_clear_error(overlap, why):
    engines = [DyingEngine("e0"), DyingEngine("e1", hang=True)]
    coordinator = WeightSyncCoordinator(_config(overlap=overlap), engines)
    assert (await coordinator.sync(toy_weights(1))).ok
    for engine in engines:
        engine.die()
    with pytest.raises(NoHealthyEngineError, match=f"no healthy inference engine left: e0: {why}"):
        await coordinator.sync(toy_weights(2))
    with pytest.raises(RuntimeError, match="no healthy inference engine left"):  # and on every later call
        await coordinator.sync(toy_weights(2))


async def test_publisher_goes_on_without_a_dead_engine_then_raises_when_none_is_left(monkeypatch):
    from streamrl.weight_sync.publisher import WeightPublisher

    engines = [DyingEngine("engine-0"), DyingEngine("engine-1")]
    publisher = WeightPublisher(_config(pause_mode=PauseMode.KEEP), engines, [])
    assert (await publisher.publish(toy_weights(1), 1)).policy_version == 1
    engines[1].die()
    published = await publisher.publish(toy_weights(2), 2)
    assert published.policy_version == 2 and published.metrics["sync/num_engines_dropped"] == 1.0
    assert list(publisher.dropped_engines) == ["engine-1"]
    engines[0].die()
    with pytest.raises(RuntimeError, match="no healthy inference engine left"):
        await publisher.publish(toy_weights(3), 3)
