"""Non-finite learner steps on the driver side: a skipped step publishes nothing, and
`learner.max_nonfinite_steps` skipped steps in a row stop the run with an error that says why."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.learner.types import StepResult
from streamrl.streaming.actors.learner import LearnerActor, Trained
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.driver import run_async
from streamrl.streaming.errors import NonFiniteTrainingError, explain_failure
from streamrl.weight_sync.types import Published
from tests.buffer.helpers import make_group
from tests.streaming.test_driver_loops import TIMEOUT_S, _pipeline


class SkippingBackend:
    """`LocalLearner`'s methods; `skips[k]` says whether step k + 1 is skipped as non-finite."""

    def __init__(self, cfg: StreamRLConfig, init_checkpoint: str | None) -> None:
        self.policy_version = 0
        self.served = 0  # what the engines serve: the publisher's label, as the real backends ask it
        self.skips: list[bool] = []
        self.num_publishes = 0

    async def train_step(self, padded) -> StepResult:
        self.policy_version += 1
        return StepResult(policy_version=self.policy_version, metrics={}, skipped_nonfinite=self.skips.pop(0))

    async def connect(self, engines, workers, policy_version: int) -> None:
        pass

    async def publish(self) -> Published:
        self.num_publishes += 1
        self.served = self.policy_version
        return Published(policy_version=self.served, dropped_engines={}, metrics={"sync/total_s": 0.1})

    async def unchanged(self) -> Published:
        return Published(policy_version=self.served, dropped_engines={}, metrics={})


def _sampled_batch():
    buffer = ReplayBuffer(BufferConfig(group_size=2, batch_size=2))
    buffer.append(make_group("g", 2))
    return buffer.sample(served_version=0, learner_step=1)


async def test_the_learner_actor_publishes_nothing_after_skipped_steps(monkeypatch):
    from streamrl.streaming.actors import learner_backends

    monkeypatch.setattr(learner_backends, "LocalLearner", SkippingBackend)
    actor = LearnerActor.__ray_actor_class__(StreamRLConfig())  # the actor's class, in this process
    backend = actor.learner
    await actor.connect([], [], 0)
    backend.skips = [True, False, True, True]
    trained = await actor.train_step(_sampled_batch())
    assert trained.skipped_nonfinite
    assert (
        await actor.publish() == Published(policy_version=0, dropped_engines={}, metrics={})
        and backend.num_publishes == 0
    )
    assert not (await actor.train_step(_sampled_batch())).skipped_nonfinite
    assert (await actor.publish()).policy_version == 2 and backend.num_publishes == 1
    await actor.train_step(_sampled_batch())
    await actor.train_step(_sampled_batch())
    assert (await actor.publish()).policy_version == 2 and backend.num_publishes == 1  # nothing new since


async def test_engines_connected_at_another_version_get_the_learner_s_weights_at_the_next_publish(monkeypatch):
    """A LoRA adapter resume connects engines that serve the base model (-1) to a learner at 6."""
    from streamrl.streaming.actors import learner_backends

    monkeypatch.setattr(learner_backends, "LocalLearner", SkippingBackend)
    actor = LearnerActor.__ray_actor_class__(StreamRLConfig())
    backend = actor.learner
    backend.policy_version = 6
    await actor.connect([], [], -1)
    assert (await actor.publish()).policy_version == 6 and backend.num_publishes == 1
    assert (await actor.publish()).policy_version == 6 and backend.num_publishes == 1  # nothing new since
    await actor.connect([], [], 6)  # engines that serve the learner's weights: nothing to send
    assert (await actor.publish()).policy_version == 6 and backend.num_publishes == 1


class SkippingLearner:
    """Wraps test_driver_loops' FakeLearner: steps listed in `skipped` come back skipped."""

    def __init__(self, inner, skipped: set[int]) -> None:
        self.inner, self.skipped = inner, skipped

    async def train_step(self, batch) -> Trained:
        trained = await self.inner.train_step(batch)
        return dataclasses.replace(trained, skipped_nonfinite=self.inner.version in self.skipped)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(TIMEOUT_S)
async def test_max_nonfinite_steps_in_a_row_stop_the_run_with_a_clear_error(tmp_path):
    pipeline, _, learner = _pipeline(tmp_path, "learner.max_nonfinite_steps=3")
    pipeline.learner = SkippingLearner(learner, skipped={2, 3, 4, 5})
    try:
        with pytest.raises(RuntimeError, match="learner loop failed") as failed:
            await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    assert isinstance(failed.value.__cause__, NonFiniteTrainingError)
    assert pipeline.state.learner_step == 4  # steps 2, 3 and 4 were skipped in a row
    why = explain_failure(failed.value, tmp_path)
    assert "3 learner steps in a row" in why and "learner.max_nonfinite_steps" in why


@pytest.mark.timeout(TIMEOUT_S)
async def test_skipped_steps_that_are_not_in_a_row_let_the_run_finish(tmp_path):
    pipeline, _, learner = _pipeline(tmp_path, "learner.max_nonfinite_steps=2")
    pipeline.learner = SkippingLearner(learner, skipped={1, 3, 5, 7})
    try:
        await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    assert pipeline.state.learner_step == 8 and pipeline.num_nonfinite_in_row == 0
