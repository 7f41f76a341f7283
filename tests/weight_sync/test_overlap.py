"""Stage while serving (`weight_sync.overlap`): engines receive and verify the new weights while they
generate and pause only for the commit; with `overlap = false` the whole sync runs paused.

Real gloo group and real worker extension (in-process engine doubles, as in test_coordinator.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streamrl.weight_sync.config import SyncTimeouts, TransportKind, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.distributed import DistributedTransport
from tests.weight_sync.fakes import DictWorker, NeverJoinsEngine, RecordingWorkers, ThreadEngine, toy_weights

pytestmark = pytest.mark.timeout(60)

SLOW_BUCKET_S = 0.3  # the learner's broadcast sleeps this long before each bucket


def _config(**overrides) -> WeightSyncConfig:
    base = dict(bucket_bytes=1024, timeouts=SyncTimeouts(transfer=5.0, load=5.0, pause=2.0, resume=2.0, verify=2.0))
    return WeightSyncConfig(**(base | overrides))


def _spy_receives(engines: list[ThreadEngine], events: list[tuple[str, str]]) -> None:
    """Log, when each engine's worker starts and ends receiving, whether the engine was paused."""
    for engine in engines:
        for name in ("_ws_receive", "_ws_read"):
            original = getattr(engine.worker, name)

            def spy(*args, engine=engine, original=original):
                events.append((engine.engine_id, f"receive-start paused={engine.paused}"))
                try:
                    return original(*args)
                finally:
                    events.append((engine.engine_id, f"receive-end paused={engine.paused}"))

            setattr(engine.worker, name, spy)


@pytest.mark.parametrize("transport", [TransportKind.DISTRIBUTED, TransportKind.FILESYSTEM])
@pytest.mark.parametrize("overlap", [True, False])
async def test_overlap_receives_while_serving_and_pauses_only_for_the_commit(overlap, transport, tmp_path):
    events: list[tuple[str, str]] = []
    engines = [ThreadEngine("e0", events), ThreadEngine("e1", events)]
    _spy_receives(engines, events)
    config = _config(overlap=overlap, transport=transport, fs_dir=str(tmp_path))
    slow = DistributedTransport(config, corrupt_hook=lambda i, flat: time.sleep(SLOW_BUCKET_S))
    coordinator = WeightSyncCoordinator(
        config,
        engines,
        workers=RecordingWorkers(events),
        transport=slow if transport is TransportKind.DISTRIBUTED else None,
    )
    weights = toy_weights(1)
    result = await coordinator.sync(weights)
    assert result.ok, result.error
    for engine in engines:
        assert engine.policy_version == 1 and engine.worker.num_loads == 1
        assert all(torch.equal(engine.worker.loaded[n], t) for n, t in weights)
    receives = [e for _, e in events if e.startswith("receive")]
    assert len(receives) == 4
    first_pause = events.index(("workers", "pause"))
    last_receive = max(i for i, (_, e) in enumerate(events) if e.startswith("receive"))
    if overlap:  # every receive ran (start to end) while the engines served, before any pause
        assert all(r.endswith("paused=False") for r in receives)
        assert last_receive < first_pause
    else:
        assert all(r.endswith("paused=True") for r in receives)
        assert first_pause < last_receive
    after = [e for _, e in events[first_pause:] if not e.startswith("receive")]
    assert after == ["pause", "pause:abort", "pause:abort", "version:1", "version:1", "resume", "resume", "resume"]
    # what the engines lost to the sync: with overlap only the commit, without it the transfer too
    assert result.paused_s >= result.load_s
    if overlap:
        assert result.paused_s < result.transfer_s or transport is TransportKind.FILESYSTEM
    else:
        assert result.paused_s >= result.transfer_s + result.load_s
    assert coordinator.metrics()["sync/paused_s"] == result.paused_s
    await coordinator.close()


async def test_overlapped_staging_that_fails_never_pauses_and_the_next_sync_loads():
    events: list[tuple[str, str]] = []
    engine = ThreadEngine("e0", events)

    def flip(index: int, flat: torch.Tensor) -> None:
        if index == 1:
            flat[3] ^= 0x40

    config = _config()
    transport = DistributedTransport(config, corrupt_hook=flip)
    coordinator = WeightSyncCoordinator(config, [engine], workers=RecordingWorkers(events), transport=transport)
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "verify"
    assert events == [] and result.paused_s == 0.0  # generation never stopped
    assert engine.policy_version == 0 and engine.worker.num_loads == 0
    assert engine.worker._ws_staged is None and engine.worker._ws_receiving is None
    transport.corrupt_hook = None
    result = await coordinator.sync(toy_weights(2), policy_version=1)
    assert result.ok, result.error
    assert engine.policy_version == 1 and torch.equal(engine.worker.loaded["embed.weight"], toy_weights(2)[0][1])
    await coordinator.close()


@pytest.mark.parametrize("overlap", [True, False])
async def test_peer_that_never_joins_pauses_nothing_with_overlap_and_resumes_without(overlap):
    events: list[tuple[str, str]] = []
    alive = ThreadEngine("alive", events)
    config = _config(overlap=overlap, timeouts=SyncTimeouts(transfer=2.0, load=5.0, pause=2.0, resume=2.0, verify=2.0))
    coordinator = WeightSyncCoordinator(
        config, [alive, NeverJoinsEngine("dead", events)], workers=RecordingWorkers(events)
    )
    result = await coordinator.sync(toy_weights(1))
    assert not result.ok and result.failed_phase == "transfer"
    assert alive.policy_version == 0 and alive.worker.num_loads == 0
    if overlap:
        assert events == []
    else:
        assert events[0] == ("workers", "pause") and events[-1] == ("workers", "resume")
        assert ("alive", "resume") in events
    await coordinator.close()


class _BlockedReceive(DictWorker):
    """A worker whose receive blocks until `release` is set, then returns a fixed staging (or raises)."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail = fail

    def _ws_receive(self, manifest_json: str, verify: bool):
        from streamrl.weight_sync.types import SyncManifest

        assert self.release.wait(10)
        if self.fail:
            raise ConnectionError("peer reset")
        return SyncManifest.from_json(manifest_json), [], [], 0


def _manifest(version: int = 3) -> str:
    from streamrl.weight_sync.types import SyncManifest

    return SyncManifest(policy_version=version, buckets=[]).to_json()


def test_background_receive_is_polled_then_finished_and_its_error_surfaces():
    worker = _BlockedReceive()
    assert worker.begin_receive_weights(_manifest(), True) == 0  # returns at once
    assert worker.receive_done() is False
    with pytest.raises(TimeoutError):
        worker.finish_receive_weights(0.05)
    worker.release.set()
    deadline = time.monotonic() + 10
    while not worker.receive_done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    report = worker.finish_receive_weights(1.0)
    assert report["policy_version"] == 3 and worker._ws_staged is not None

    failing = _BlockedReceive(fail=True)
    failing.begin_receive_weights(_manifest(), True)
    failing.release.set()
    with pytest.raises(ConnectionError, match="peer reset"):
        failing.finish_receive_weights(5.0)
    assert failing._ws_staged is None


def test_a_receive_discarded_while_running_never_stages():
    worker = _BlockedReceive()
    worker.begin_receive_weights(_manifest(), True)
    receive = worker._ws_receiving
    assert worker.discard_weights() is False
    worker.release.set()
    receive.thread.join(5)
    assert not receive.thread.is_alive()
    assert worker._ws_staged is None  # what the abandoned receive got is dropped
    with pytest.raises(RuntimeError, match="before begin"):
        worker.finish_receive_weights(1.0)
    # the next sync's receive works normally
    worker.begin_receive_weights(_manifest(4), True)
    assert worker.finish_receive_weights(5.0)["policy_version"] == 4
