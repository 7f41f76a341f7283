"""Controlled staleness: with `weight_sync.publish_lag = k` the publisher sends the weights of k
versions ago, labelled with their own version, so a synchronous run trains every token at lag k."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from streamrl.streaming.config import load_config
from streamrl.weight_sync.config import WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.publisher import LaggedWeights, WeightPublisher
from streamrl.weight_sync.types import SyncResult


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((2,), float(step)))]


def test_lagged_weights_return_the_version_k_behind_as_it_was():
    lagged = LaggedWeights(2)
    live = torch.zeros(2)
    for step in (1, 2):
        live.fill_(step)
        assert lagged.push(step, [("w", live)]) is None  # not yet two versions older
    for step in (3, 4, 5):
        live.fill_(step)  # the learner updates its tensors in place: the kept copy must not move
        version, tensors = lagged.push(step, [("w", live)])
        assert version == step - 2 and tensors[0][1].tolist() == [step - 2.0] * 2


class RecordingCoordinator:
    """The coordinator's label and its rule, with a sync that only records what it was sent."""

    served_version = WeightSyncCoordinator.served_version
    is_new = WeightSyncCoordinator.is_new

    def __init__(self) -> None:
        self._served_version = 0
        self.sent: list[tuple[int, float]] = []
        self.dropped: dict[str, str] = {}

    async def sync(self, named_tensors, target: int, *, adapter=None) -> SyncResult:
        assert adapter is None  # full weights: no LoRA adapter spec travels
        ((name, tensor),) = list(named_tensors)
        self.sent.append((target, float(tensor[0])))
        self._served_version = target
        return SyncResult(ok=True, policy_version=target, engine_ids=["engine-0"])

    def metrics(self) -> dict[str, float]:
        return {"sync/policy_version": float(self.served_version)}


@pytest.mark.parametrize("lag", [0, 1, 3])
async def test_the_publisher_serves_exactly_lag_versions_behind(lag):
    publisher = WeightPublisher(
        WeightSyncConfig(publish_lag=lag), clients=[SimpleNamespace(engine_id="engine-0", policy_version=0)], workers=[]
    )
    publisher.coordinator = RecordingCoordinator()
    served = []
    for step in range(1, 7):
        served.append((await publisher.publish(_weights(step), step)).policy_version)
    assert served == [max(step - lag, 0) for step in range(1, 7)]
    # every sync sent the weights of the version it is labelled with
    assert publisher.coordinator.sent == [(v, float(v)) for v in range(1, 7 - lag)]


def test_a_fixed_lag_needs_the_synchronous_trainer():
    with pytest.raises(ValueError, match='publish_lag=2 .* needs trainer.mode = "sync"'):
        load_config(None, ["weight_sync.publish_lag=2"])
    with pytest.raises(ValueError, match="sync_every 2"):
        load_config(None, ["weight_sync.publish_lag=2", "trainer.mode=sync", "trainer.sync_every=2"])
    assert load_config(None, ["weight_sync.publish_lag=2", "trainer.mode=sync"]).weight_sync.publish_lag == 2
