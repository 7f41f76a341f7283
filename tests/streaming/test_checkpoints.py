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

    async def save_checkpoint(self, path: str) -> None:
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
        record_checkpoint(state, path)
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
