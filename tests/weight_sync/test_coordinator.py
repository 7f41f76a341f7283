"""The transactional sync over a real gloo group with in-process engine doubles (no vLLM, seconds).

Proves the protocol: phase order, resume in `finally`, checksum mismatch -> no load and no version
bump, a peer that never joins -> failure within the transfer timeout, retry after failure, the
filesystem transport and one broadcast into two engines.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from streamrl.engines.base import PauseMode
from streamrl.weight_sync.config import SyncTimeouts, TransportKind, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.distributed import DistributedTransport
from tests.weight_sync.fakes import NeverJoinsEngine, RecordingWorkers, ThreadEngine, toy_weights

pytestmark = pytest.mark.timeout(60)


def _config(**overrides) -> WeightSyncConfig:
    base = dict(bucket_bytes=1024, timeouts=SyncTimeouts(transfer=3.0, load=5.0, pause=2.0, resume=2.0, verify=2.0))
    return WeightSyncConfig(**(base | overrides))


def _assert_loaded(engine: ThreadEngine, weights) -> None:
    assert set(engine.worker.loaded) == {n for n, _ in weights}
    for name, tensor in weights:
        assert torch.equal(engine.worker.loaded[name], tensor), name


async def test_one_broadcast_updates_two_engines_in_protocol_order():
    events: list[tuple[str, str]] = []
    engines = [ThreadEngine("e0", events), ThreadEngine("e1", events)]
    workers = RecordingWorkers(events)
    coordinator = WeightSyncCoordinator(_config(), engines, workers=workers)
    weights = toy_weights(1)
    result = await coordinator.sync(weights)
    assert result.ok, result.error
    assert result.policy_version == 1 and coordinator.served_version == 1
    assert result.num_bytes > 0 and result.transfer_s > 0
    for engine in engines:
        _assert_loaded(engine, weights)
        assert engine.policy_version == 1
    assert events[0] == ("workers", "pause")
    assert [e for _, e in events[1:3]] == ["pause:abort", "pause:abort"]
    assert [e for _, e in events[3:5]] == ["version:1", "version:1"]
    assert [e for _, e in events[5:7]] == ["resume", "resume"]
    assert events[7] == ("workers", "resume")
    metrics = coordinator.metrics()
    assert metrics["sync/failed"] == 0.0 and metrics["sync/bytes"] == result.num_bytes
    # the group is reused by the next sync
    weights2 = toy_weights(2)
    assert (await coordinator.sync(weights2)).ok
    _assert_loaded(engines[1], weights2)
    assert engines[1].policy_version == 2
    assert coordinator.metrics()["sync/num_versions_skipped"] == 0.0
    # the workers' pause and resume carry their sync's fencing epoch, increasing from sync to sync
    (p1, e1), (r1, f1), (p2, e2), (r2, f2) = workers.epochs
    assert (p1, r1, p2, r2) == ("pause", "resume", "pause", "resume")
    assert e1 is not None and e1 == f1 < e2 == f2
    await coordinator.close()


# bucket 0: the zero-copy embedding; 1: packed float32; 3: the last bucket (int64), received last
@pytest.mark.parametrize(("bucket", "byte"), [(0, 1055), (1, 3), (3, 0)])
async def test_corruption_in_flight_is_detected_and_nothing_is_loaded(bucket, byte):
    engines = [ThreadEngine("e0"), ThreadEngine("e1")]

    def flip(bucket_index: int, flat: torch.Tensor) -> None:
        if bucket_index == bucket:
            flat[byte] ^= 0x40  # one bit of one element

    transport = DistributedTransport(_config(), corrupt_hook=flip)
    coordinator = WeightSyncCoordinator(_config(), engines, transport=transport)
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "verify"
    assert "checksum mismatch" in result.error and f"buckets [{bucket}]" in result.error
    assert all(e.worker.num_loads == 0 and e.policy_version == 0 for e in engines)
    assert all(e.worker._ws_staged is None for e in engines)  # staging discarded
    assert coordinator.metrics()["sync/failed"] == 1.0
    transport.corrupt_hook = None  # the next sync retries over a rebuilt group
    result = await coordinator.sync(toy_weights(1), policy_version=1)
    assert result.ok, result.error
    _assert_loaded(engines[0], toy_weights(1))
    assert coordinator.metrics()["sync/num_versions_skipped"] == 0.0
    # Coalescing: the learner is at version 4 by the next sync (sync_every 3, or failed syncs): the
    # engines go from 1 straight to 4, and 2 and 3 are counted as skipped, never sent.
    result = await coordinator.sync(toy_weights(4), policy_version=4)
    assert result.ok and all(e.policy_version == 4 for e in engines)
    _assert_loaded(engines[1], toy_weights(4))
    assert coordinator.metrics()["sync/num_versions_skipped"] == 2.0
    await coordinator.close()


async def test_peer_that_never_joins_fails_within_the_timeout_then_retry_succeeds():
    events: list[tuple[str, str]] = []
    alive = ThreadEngine("alive", events)
    config = _config()
    coordinator = WeightSyncCoordinator(
        config, [alive, NeverJoinsEngine("dead", events)], workers=RecordingWorkers(events)
    )
    started = time.monotonic()
    result = await coordinator.sync(toy_weights(1))
    elapsed = time.monotonic() - started
    assert not result.ok and result.failed_phase == "transfer"
    assert "did not form" in result.error and "3 ranks" in result.error
    assert elapsed < config.timeouts.transfer + 3.0
    assert alive.policy_version == 0 and alive.worker.num_loads == 0
    assert events == []  # staging failed while the engines served: nothing was paused (overlap)
    survivor = WeightSyncCoordinator(config, [alive])
    assert (await survivor.sync(toy_weights(1))).ok  # the live engine is not wedged by the failure
    assert alive.policy_version == 1
    await survivor.close()


async def test_keep_mode_leaves_rollout_workers_alone():
    events: list[tuple[str, str]] = []
    engine = ThreadEngine("e0", events)
    coordinator = WeightSyncCoordinator(_config(pause_mode=PauseMode.KEEP), [engine], workers=RecordingWorkers(events))
    assert (await coordinator.sync(toy_weights(1))).ok
    assert [e for _, e in events] == ["pause:keep", "version:1", "resume"]
    await coordinator.close()


async def test_failed_pause_still_resumes_and_reports():
    events: list[tuple[str, str]] = []
    engine = ThreadEngine("e0", events)
    coordinator = WeightSyncCoordinator(_config(), [engine], workers=RecordingWorkers(events, fail_pause=True))
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "pause" and "crashed while parking" in result.error
    assert ("e0", "resume") in events and events[-1] == ("workers", "resume")
    assert engine.policy_version == 0


class _TimingOutWorkers(RecordingWorkers):
    """Workers whose pause fails with a TimeoutError of its own (`own`) or outlives the phase deadline."""

    def __init__(self, events, *, own: bool) -> None:
        super().__init__(events)
        self.own = own

    async def pause(self, epoch=None) -> None:
        if self.own:
            raise TimeoutError("the loops did not park within their own 0.1s")
        await asyncio.sleep(30)


@pytest.mark.parametrize("own", [True, False], ids=["own-timeout", "deadline"])
async def test_a_phase_timeout_is_told_apart_from_a_timeout_inside_the_phase(own):
    """A TimeoutError raised inside a phase is that phase's error, not the phase deadline (a caller
    reading "did not finish within 120s" would look for a hang that never happened)."""
    events: list[tuple[str, str]] = []
    coordinator = WeightSyncCoordinator(
        _config(), [ThreadEngine("e0", events)], workers=_TimingOutWorkers(events, own=own)
    )
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "pause"
    if own:
        assert "their own 0.1s" in result.error and "within 2.0s" not in result.error
    else:
        assert "did not finish within 2.0s" in result.error
    await coordinator.close()


async def test_filesystem_transport_stages_from_versioned_folders(tmp_path):
    config = _config(transport=TransportKind.FILESYSTEM, fs_dir=str(tmp_path), keep_last_n=2)
    engines = [ThreadEngine("e0"), ThreadEngine("e1")]
    coordinator = WeightSyncCoordinator(config, engines)
    for version in (1, 2, 3):
        weights = toy_weights(version)
        result = await coordinator.sync(weights)
        assert result.ok and result.policy_version == version, result.error
        for engine in engines:
            _assert_loaded(engine, weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]
    assert (tmp_path / "v3" / "manifest.json").exists()


async def test_engine_staging_different_weights_fails_verification(tmp_path, monkeypatch):
    """The folder an engine reads holds other weights than the learner wrote (e.g. a stale version)."""
    from safetensors.torch import save_file

    from streamrl.weight_sync.filesystem import FilesystemTransport

    config = _config(transport=TransportKind.FILESYSTEM, fs_dir=str(tmp_path))
    write = FilesystemTransport._write_version

    def write_then_swap(self, tensors, policy_version, adapter):
        manifest, folder = write(self, tensors, policy_version, adapter)
        save_file(dict(toy_weights(99)), str(folder / "model.safetensors"))
        return manifest, folder

    monkeypatch.setattr(FilesystemTransport, "_write_version", write_then_swap)
    engine = ThreadEngine("e0")
    coordinator = WeightSyncCoordinator(config, [engine])
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "verify" and "checksum mismatch" in result.error
    assert "buckets [0, 1, 2]" in result.error  # the float buckets; `count` is the same in both
    assert engine.worker.num_loads == 0 and engine.policy_version == 0


async def test_bad_requests_raise_value_error():
    coordinator = WeightSyncCoordinator(_config(), [ThreadEngine("e0")])
    with pytest.raises(ValueError, match="must increase"):
        await coordinator.sync(toy_weights(), policy_version=0)
    with pytest.raises(ValueError, match="no tensors"):
        await coordinator.sync([])
    with pytest.raises(ValueError, match="unique"):
        WeightSyncCoordinator(_config(), [ThreadEngine("x"), ThreadEngine("x")])
