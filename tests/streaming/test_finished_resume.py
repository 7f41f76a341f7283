"""`finished_already`: a resume with nothing left to do returns before any system starts."""

from __future__ import annotations

import pytest

from streamrl.core.run_dir import Accounting, RunDir
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.train import finished_already


def _cfg(total_steps: int) -> StreamRLConfig:
    return StreamRLConfig.model_validate({"trainer": {"total_steps": total_steps}})


@pytest.mark.parametrize(
    ("learner_step", "checkpoint_step", "accounting", "total_steps", "finished"),
    [
        (3, 3, {"learner_step": 3}, 3, True),
        (3, 3, {"learner_step": 3}, 5, False),  # total_steps raised on resume: train on
        (2, 2, {"learner_step": 2}, 3, False),  # not there yet
        (3, 2, {"learner_step": 3}, 3, False),  # the last step is not checkpointed: redo it
        (3, 3, None, 3, False),  # killed before the end-of-run accounting
        (3, 3, {"learner_step": 2}, 3, False),  # the accounting of an earlier end (a shorter total)
        (3, 3, "torn{", 3, False),  # torn by a kill mid-write
    ],
)
def test_finished_only_when_every_step_is_trained_checkpointed_and_accounted(
    tmp_path, learner_step, checkpoint_step, accounting, total_steps, finished
):
    state = DriverState(learner_step=learner_step, checkpoint_step=checkpoint_step)
    if isinstance(accounting, str):
        RunDir(tmp_path).accounting.write_text(accounting)
    elif accounting is not None:
        RunDir(tmp_path).write_accounting(Accounting(**accounting, stranded=[], untracked=[], resumable=[]))
    assert finished_already(_cfg(total_steps), tmp_path, state) is finished


def test_a_fresh_run_is_never_finished(tmp_path):
    assert finished_already(_cfg(1), tmp_path, None) is False


@pytest.mark.parametrize("left", ["run_info.json", "driver_state.json", "buffer"])
def test_a_new_run_never_opens_a_directory_that_holds_a_run(tmp_path, left, capsys):
    """Found by the chaos bench reusing a kept folder: `streamrl train ... trainer.run_name=X` over an
    old run X started a fresh learner (version 0) on X's buffer log, and failed on "batch has tokens of
    policy_version 28 > learner policy_version 0" (or, with compatible versions, would have trained on
    both runs' trajectories). It is now one clear error, and nothing of the old run is touched."""
    from streamrl.streaming.cli import main
    from streamrl.streaming.train import open_run

    overrides = [f"trainer.run_root={tmp_path}", "trainer.run_name=r"]
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    assert open_run("configs/tiny.toml", overrides, None)[1] == run_dir  # an empty folder is fine
    (run_dir / "logs").mkdir()  # so is one where a start failed before the run existed
    assert open_run("configs/tiny.toml", overrides, None)[1] == run_dir
    (run_dir / left).mkdir() if left == "buffer" else (run_dir / left).write_text("{}")
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["train", "--config", "configs/tiny.toml", *overrides]) == 2
    assert (
        f"{run_dir} already holds a run ({left}): continue it with `streamrl train --resume {run_dir}`"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in run_dir.iterdir()) == before
