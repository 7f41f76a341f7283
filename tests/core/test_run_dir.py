"""`core.run_dir`: a run directory opens with one error when it is not a run, its records round-trip
as types, and a checkpoint is complete by one rule (sealed) for every reader."""

from __future__ import annotations

import json

import pytest

from streamrl.core.atomic import atomic_dir
from streamrl.core.run_dir import Accounting, Checkpoint, NotARunDirError, RunDir, RunInfo, why_incomplete


def _info(**kw) -> RunInfo:
    return RunInfo(run_name="r", model_path="/m", mode="async", config={"trainer": {"mode": "async"}}, **kw)


def test_a_folder_without_run_info_is_not_a_run_with_one_error(tmp_path):
    with pytest.raises(NotARunDirError, match=r"is not a streamrl run directory \(no run_info.json\)"):
        RunDir.open(tmp_path)
    with pytest.raises(NotARunDirError, match="is not a streamrl run directory"):
        RunDir(tmp_path).info()
    assert issubclass(NotARunDirError, ValueError)  # every CLI reports it as a bad input (exit 2)
    assert RunDir(tmp_path).started_parts() == []


def test_run_info_round_trips_and_says_what_is_missing(tmp_path):
    run = RunDir(tmp_path)
    info = _info(started_at=12.5, prompts_sha256="ab", num_prompts=3)
    run.write_info(info)
    assert RunDir.open(tmp_path).info() == info and run.started_parts() == ["run_info.json"]
    old = {k: v for k, v in info.to_dict().items() if k not in ("prompts_sha256", "num_prompts")} | {"extra": 1}
    run.run_info.write_text(json.dumps(old))  # a run from before the fingerprint, with a key we do not know
    assert run.info().prompts_sha256 is None and run.info().num_prompts is None
    run.run_info.write_text(json.dumps({"config": {}}))
    with pytest.raises(ValueError, match="lacks run_name, model_path, mode"):
        run.info()
    run.run_info.write_text('{"run_na')  # torn
    with pytest.raises(ValueError):
        run.info()


def test_complete_checkpoints_are_the_sealed_ones_oldest_first(tmp_path):
    def write(folder):
        (folder / "hf").mkdir()
        (folder / "state.json").write_text("{}")

    run = RunDir(tmp_path)
    for step in (10, 2):
        atomic_dir(run.checkpoint(step), write, sync=True)
    (run.checkpoints / "step_000011" / "hf").mkdir(parents=True)  # never sealed
    (run.checkpoints / "step_notes").mkdir()  # not a checkpoint's name
    assert [c.step for c in run.checkpoint_folders()] == [2, 10, 11]
    complete = run.complete_checkpoints()
    assert [c.name for c in complete] == ["step_000002", "step_000010"]
    assert complete[0].hf == run.checkpoint(2) / "hf" and complete[0].state_file.name == "state.json"
    (run.checkpoint(10) / "state.json").write_text("{}    ")  # a file no longer at its sealed size
    assert "bytes, the seal says" in why_incomplete(run.checkpoint(10))
    assert [c.step for c in run.complete_checkpoints()] == [2]
    assert Checkpoint.at(run.checkpoint(10)).step == 10
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        Checkpoint.at(run.checkpoints / "step_notes")


def test_eval_files_are_named_and_parsed_in_one_place(tmp_path):
    run = RunDir(tmp_path)
    for step, version in ((5, 7), (0, 0), (12, 20)):
        path = run.eval_file(step, version)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"")
    (run.eval / ".step_000013-v000021.parquet.tmp").write_bytes(b"")  # an unfinished atomic write
    assert [(e.served_step, e.policy_version) for e in run.eval_files()] == [(0, 0), (5, 7), (12, 20)]
    assert run.eval_files()[1].path.name == "step_000005-v000007.parquet"


def test_accounting_round_trips_and_is_none_when_the_run_was_killed(tmp_path):
    run = RunDir(tmp_path)
    assert run.accounting_record() is None
    acc = Accounting(learner_step=4, stranded=[], untracked=["t"], resumable=["t", "u"])
    run.write_accounting(acc)
    assert run.accounting_record() == acc
    run.accounting.write_text('{"learner_step": 4}')
    with pytest.raises(ValueError, match="lacks stranded, untracked, resumable"):
        run.accounting_record()
