"""The run's checkpoints (`streaming/checkpoints.py`): the oldest pruned once a new one is complete, and
a resume that falls back to the newest complete checkpoint when the newest is torn, keeping the
driver's versions and the buffer's rollback step consistent with the weights it loads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from streamrl.core.atomic import atomic_dir
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.streaming.checkpoints import CheckpointRecord, record_checkpoint, use_newest_complete
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.driver import run_async
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.train import finished_already, open_run
from tests.streaming.test_driver_loops import TIMEOUT_S, _pipeline


class SealingLearner:
    """Wraps test_driver_loops' FakeLearner: its checkpoints are sealed folders, as the real learner's."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def start_checkpoint(self, path: str) -> None:
        atomic_dir(path, lambda d: (d / "optimizer.pt").write_bytes(b"x" * 64), sync=True)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("keep", "kept"), [(2, [7, 8]), (0, [1, 2, 3, 4, 5, 6, 7, 8])])
async def test_only_the_newest_keep_checkpoints_stay(tmp_path, keep, kept):
    pipeline, _, learner = _pipeline(tmp_path, "trainer.checkpoint_every=1", f"trainer.keep_checkpoints={keep}")
    pipeline.learner = SealingLearner(learner)
    try:
        await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    names = [f"step_{s:06d}" for s in kept]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == names  # nothing half-deleted left
    saved = DriverState.load(tmp_path / "driver_state.json")
    assert [Path(r.path).name for r in saved.checkpoints] == names and saved.checkpoint.endswith(names[-1])


def _run_dir_with_checkpoints(tmp_path: Path, steps: list[int]) -> tuple[Path, DriverState]:
    """A run directory as a run with `version_offset` 10 leaves it: a sealed checkpoint at each step."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    config = StreamRLConfig().model_dump(mode="json")
    RunDir(run_dir).write_info(RunInfo(run_name="run", model_path="tiny", mode="async", config=config))
    state = DriverState(version_offset=10)
    for step in steps:
        state.learner_step, state.policy_version = step, step + 10
        path = run_dir / "checkpoints" / f"step_{step:06d}"
        atomic_dir(path, lambda d: (d / "optimizer.pt").write_bytes(b"x" * 64), sync=True)
        record_checkpoint(state, CheckpointRecord.at(state, path))
    state.learner_step, state.policy_version = steps[-1] + 2, steps[-1] + 12  # trained on past the last one
    state.version_high_water = state.policy_version
    state.save(run_dir / "driver_state.json")
    return run_dir, state


def test_a_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    run_dir, _ = _run_dir_with_checkpoints(tmp_path, [3, 6])
    (run_dir / "checkpoints" / "step_000006" / "optimizer.pt").write_bytes(b"")  # torn by a lost machine
    _, _, state = open_run(None, [], str(run_dir))
    assert state.checkpoint == str(run_dir / "checkpoints" / "step_000003")
    assert (state.checkpoint_step, state.checkpoint_policy_version, state.checkpoint_version_offset) == (3, 13, 10)
    assert [r.step for r in state.checkpoints] == [3]
    assert not finished_already(StreamRLConfig(trainer={"total_steps": 8}), run_dir, state)
    # what build_pipeline does next: the buffer rolls consumption back to checkpoint_step, and the
    # learner restarts at step 3 with a label above every version handed out before (I4)
    state.rewind_to_checkpoint(max_version_seen=18)
    assert state.learner_step == 3 and state.policy_version == 19 and state.served_step == 3


def test_a_resume_with_the_newest_checkpoint_whole_keeps_it(tmp_path):
    run_dir, saved = _run_dir_with_checkpoints(tmp_path, [3, 6])
    _, _, state = open_run(None, [], str(run_dir))
    assert state == saved and state.checkpoint_step == 6


def test_no_complete_checkpoint_restarts_from_the_initial_model(tmp_path):
    run_dir, _ = _run_dir_with_checkpoints(tmp_path, [3])
    (run_dir / "checkpoints" / "step_000003" / "optimizer.pt").unlink()
    _, _, state = open_run(None, [], str(run_dir))
    assert state.checkpoint is None and state.checkpoint_step == 0 and state.checkpoints == []
    state.rewind_to_checkpoint()
    assert state.learner_step == 0 and state.policy_version == 16 and state.served_step == 0


def test_a_state_without_checkpoint_records_checks_its_one_pointer(tmp_path):
    """driver_state.json written before checkpoints were recorded: the pointer is the only record."""
    folder = tmp_path / "step_000004"
    atomic_dir(folder, lambda d: (d / "state.json").write_text("{}"), sync=True)
    state = DriverState(checkpoint=str(folder), checkpoint_step=4, checkpoint_version_offset=2)
    use_newest_complete(state)
    assert state.checkpoints == [CheckpointRecord(path=str(folder), step=4, policy_version=0, version_offset=2)]
    (folder / "state.json").unlink()
    use_newest_complete(state)
    assert state.checkpoint is None and state.checkpoint_version_offset == 0


class GatedLearner(SealingLearner):
    """Seals a checkpoint only once `gate` is set (those named in `held`, or all if None), as a
    background write that is still running."""

    def __init__(self, inner, held: set[str] | None = None) -> None:
        super().__init__(inner)
        self.gate, self.held, self.started = asyncio.Event(), held, None
        self.names: list[str] = []  # every checkpoint started

    def _held(self, path: str | None) -> bool:
        return path is not None and (self.held is None or Path(path).name in self.held) and not self.gate.is_set()

    async def start_checkpoint(self, path: str) -> None:
        self.started = path
        self.names.append(Path(path).name)

    async def checkpoint_busy(self) -> bool:
        return self._held(self.started)

    async def finish_checkpoint(self) -> str | None:
        path, self.started = self.started, None
        if path is not None:
            if self._held(path):
                await self.gate.wait()
            await SealingLearner.start_checkpoint(self, path)
        return path


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_checkpoint_is_recorded_once_sealed_with_the_step_it_was_taken_at(tmp_path):
    """While the write runs the learner trains on and the saved state names the older checkpoint only;
    once sealed, the record carries the step and label of the snapshot, not of the steps after it."""
    pipeline, _, learner = _pipeline(tmp_path, "trainer.keep_checkpoints=0")
    pipeline.learner = gated = GatedLearner(learner)
    state_file = tmp_path / "driver_state.json"
    try:
        gated.gate.set()
        pipeline.state.learner_step, pipeline.state.policy_version = 3, 3
        await pipeline.checkpoint()
        assert await pipeline.settle_checkpoint(wait=False) == tmp_path / "checkpoints" / "step_000003"
        gated.gate.clear()
        pipeline.state.learner_step, pipeline.state.policy_version = 6, 6
        await pipeline.checkpoint()
        pipeline.state.learner_step, pipeline.state.policy_version = 7, 7  # trained on during the write
        assert await pipeline.settle_checkpoint(wait=False) is None
        saved = DriverState.load(state_file)
        assert [r.step for r in saved.checkpoints] == [3] and saved.checkpoint_step == 3  # a crash now resumes at 3
        gated.gate.set()
        assert await pipeline.settle_checkpoint(wait=False) == tmp_path / "checkpoints" / "step_000006"
        saved = DriverState.load(state_file)
        assert [(r.step, r.policy_version) for r in saved.checkpoints] == [(3, 3), (6, 6)]
        assert (saved.checkpoint_step, saved.checkpoint_policy_version) == (6, 6)
        assert await pipeline.settle_checkpoint() is None  # nothing in flight
    finally:
        pipeline.metrics.close()


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_run_ends_only_after_its_last_checkpoint_is_recorded(tmp_path):
    """The learner loop's last checkpoint is still being written when the last step ends: the run
    waits for it, and the saved state names the final step."""
    pipeline, _, learner = _pipeline(tmp_path, "trainer.checkpoint_every=4")
    pipeline.learner = gated = GatedLearner(learner, held={"step_000008"})
    loop = asyncio.create_task(run_async(pipeline))
    try:
        while "step_000008" not in gated.names:
            await asyncio.sleep(0.01)
            assert not loop.done(), loop.exception() if loop.done() else None
        await asyncio.sleep(0.2)
        assert not loop.done()  # held by the write
        gated.gate.set()
        await asyncio.wait_for(loop, TIMEOUT_S)
    finally:
        loop.cancel()
        pipeline.metrics.close()
    saved = DriverState.load(tmp_path / "driver_state.json")
    assert saved.checkpoint_step == 8 and [r.step for r in saved.checkpoints] == [4, 8]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("write_fails", [False, True])
async def test_a_failed_run_records_the_checkpoint_it_was_writing(tmp_path, caplog, write_fails):
    """The run failed for another reason while a checkpoint was being written: a write that succeeds
    is recorded (a resume retrains less); one that fails is logged, records nothing and does not mask
    the run's own error."""
    from streamrl.learner.checkpoint import CheckpointWriteError
    from streamrl.streaming.train import _settle_checkpoint_on_failure

    pipeline, _, learner = _pipeline(tmp_path)
    pipeline.learner = gated = GatedLearner(learner)
    if write_fails:

        async def fail() -> str:
            raise CheckpointWriteError(28, "saving the checkpoint of policy_version=2 failed: ENOSPC")

        gated.finish_checkpoint = fail
    gated.gate.set()
    try:
        pipeline.state.learner_step, pipeline.state.policy_version = 2, 2
        await pipeline.checkpoint()
        await _settle_checkpoint_on_failure(pipeline)
    finally:
        pipeline.metrics.close()
    assert pipeline.checkpoint_in_flight is None
    if write_fails:
        assert "could not be recorded" in caplog.text and not (tmp_path / "driver_state.json").exists()
    else:
        assert DriverState.load(tmp_path / "driver_state.json").checkpoint_step == 2
