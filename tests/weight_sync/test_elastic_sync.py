"""Sync-set membership changes without a restart (elastic engines): an engine added mid-run reaches
the current weights at the next sync (the transport's group is rebuilt over the new members), one
removed is never touched again, and the last engine cannot be removed. Real gloo group, in-process
engine doubles (seconds)."""

from __future__ import annotations

import pytest
import torch

from streamrl.weight_sync.config import SyncTimeouts, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from tests.weight_sync.fakes import RecordingWorkers, ThreadEngine, toy_weights

pytestmark = pytest.mark.timeout(60)


def _config() -> WeightSyncConfig:
    return WeightSyncConfig(
        bucket_bytes=1024, timeouts=SyncTimeouts(transfer=3.0, load=5.0, pause=2.0, resume=2.0, verify=2.0)
    )


def _holds(engine: ThreadEngine, weights) -> bool:
    return set(engine.worker.loaded) == {n for n, _ in weights} and all(
        torch.equal(engine.worker.loaded[n], t) for n, t in weights
    )


async def test_added_engine_reaches_the_next_version_and_a_removed_one_is_left_alone():
    e0, e1 = ThreadEngine("e0"), ThreadEngine("e1")
    coordinator = WeightSyncCoordinator(_config(), [e0, e1], workers=RecordingWorkers([]))
    assert (await coordinator.sync(toy_weights(1))).ok
    joining = ThreadEngine("e2")
    joining.policy_version = -1  # base weights: below every real version until a sync commits it
    assert await coordinator.add_engines([joining, ThreadEngine("e1")]) == ["e2"]  # a known id is ignored
    assert joining.worker.loaded == {} and coordinator.served_version == 1  # nothing moves before a sync

    result = await coordinator.sync(toy_weights(2))
    assert result.ok, result.error
    assert result.engine_ids == ["e0", "e1", "e2"]
    assert joining.policy_version == 2 and _holds(joining, toy_weights(2))

    assert await coordinator.remove_engines(["e0", "e9"]) == ["e0"]
    result = await coordinator.sync(toy_weights(3))
    assert result.ok and result.engine_ids == ["e1", "e2"], result.error
    assert _holds(e1, toy_weights(3)) and _holds(joining, toy_weights(3))
    assert e0.policy_version == 2 and _holds(e0, toy_weights(2))  # out of the set: untouched
    assert coordinator.metrics()["sync/num_engines"] == 2.0
    with pytest.raises(ValueError, match="no engine"):
        await coordinator.remove_engines(["e1", "e2"])
    await coordinator.close()


async def test_removing_a_dropped_engine_forgets_why_it_was_dropped():
    engines = [ThreadEngine("e0"), ThreadEngine("e1")]
    coordinator = WeightSyncCoordinator(_config(), engines)
    coordinator.dropped["e1"] = "resume failed"
    assert await coordinator.remove_engines(["e1"]) == ["e1"]
    assert coordinator.dropped == {} and [e.engine_id for e in coordinator.engines] == ["e0"]
