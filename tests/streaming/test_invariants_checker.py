"""The chaos suite's oracle (`streaming/invariants.py`) on hand-built run directories: it passes a
correct run, including a batch whose group lost a member to a failure, and flags lost prompts, short
batches and finished members of a trained group that were never trained."""

from __future__ import annotations

import json

from streamrl.buffer.store import ReplayBuffer
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.rollout.types import TrajectoryStatus
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.invariants import check_run
from streamrl.streaming.prompts import first_group_ids
from tests.buffer.helpers import make_traj

F = TrajectoryStatus.FAILED


def _cfg() -> StreamRLConfig:
    return StreamRLConfig.model_validate(
        {"model": "tiny", "data": {"num_prompts": 8}, "buffer": {"batch_size": 8, "group_size": 4}}
    )


def _run(
    tmp_path,
    *,
    failed: tuple[str, int] | None = None,
    sample_batch: int = 8,
    steps: int = 1,
    cursor: int = 2,
    admitted: int = 2,
    tool_calls: int = 0,
    ledger: list[tuple[int, int, str]] | None = None,
):
    """A run whose buffer holds the groups of the first `admitted` prompts (4 each; the config's
    batch is 8), sampled `steps` times with batches of `sample_batch`, and whose saved cursor says
    `cursor` prompts were admitted. Every trajectory made `tool_calls` calls; `ledger` lines are
    (group index, sample index, call id) in `RUN_DIR/tool_ledger.jsonl`."""
    cfg = _cfg()
    run_dir = tmp_path / "run"
    buf_cfg = cfg.buffer.model_copy(update={"root_dir": str(run_dir / "buffer"), "batch_size": sample_batch})
    buf = ReplayBuffer(buf_cfg)
    gids = first_group_ids(cfg.data, admitted)
    for gid in gids:
        rows = [
            make_traj(gid, i, reward=float(i), status=F if (gid, i) == failed else TrajectoryStatus.FINISHED)
            for i in range(4)
        ]
        for r in rows:
            r.num_tool_calls = tool_calls
        buf.append(rows)
    for step in range(1, steps + 1):
        batch = buf.sample(served_version=0, learner_step=step)
        assert batch is not None
    buf.close()
    config = cfg.model_dump(mode="json")
    RunDir(run_dir).write_info(RunInfo(run_name="run", model_path="tiny", mode="async", config=config))
    (run_dir / "driver_state.json").write_text(
        json.dumps({"learner_step": steps, "cursor": cursor, "policy_version": steps})
    )
    if ledger is not None:
        lines = [
            json.dumps({"instance_id": f"{gids[g]}/{i}", "call_id": c, "arguments": {}, "pid": 1}) for g, i, c in ledger
        ]
        (run_dir / "tool_ledger.jsonl").write_text("".join(line + "\n" for line in lines) + '{"torn')
    return check_run(run_dir)


def test_a_correct_run_passes(tmp_path):
    report = _run(tmp_path)
    assert report.problems == [] and report.bad_batches == 0 and report.prompts_lost == 0


def test_a_group_that_lost_a_member_to_a_failure_still_makes_a_full_batch(tmp_path):
    gid = first_group_ids(StreamRLConfig.model_validate({"model": "tiny", "data": {"num_prompts": 8}}).data, 1)[0]
    report = _run(tmp_path, failed=(gid, 2))  # 7 trajectories in 2 whole groups
    assert report.problems == [] and report.bad_batches == 0


def test_short_batches_and_lost_prompts_are_flagged(tmp_path):
    report = _run(tmp_path / "a", sample_batch=4, steps=2)  # one group per step where the config says two
    assert report.bad_batches == 2
    assert report.problems == ["learner step 1 consumed 1 groups", "learner step 2 consumed 1 groups"]
    report = _run(tmp_path / "b", cursor=3)  # the cursor says 3 prompts were admitted, the log holds 2
    assert report.prompts_lost == 1 and report.problems[0].startswith("prompt lost: ")
    report = _run(tmp_path / "c", admitted=3)  # a group in the log beyond the cursor: admitted twice after a crash
    assert report.prompts_duplicated == 1 and report.problems[0].startswith("group beyond the cursor: ")


def test_tool_side_effects_are_counted_once_per_call(tmp_path):
    once = [(0, 0, "t1_call_0"), (0, 0, "t2_call_0"), (1, 3, "t1_call_0")]
    report = _run(tmp_path / "a", tool_calls=2, ledger=once)  # (a torn last line is skipped)
    assert report.problems == [] and report.tool_calls_executed == 3 and report.tool_side_effects_repeated == 0
    assert _run(tmp_path / "b").tool_calls_executed is None  # no ledger: nothing to check


def test_a_tool_call_run_twice_is_flagged(tmp_path):
    twice = [(0, 0, "t1_call_0"), (0, 1, "t1_call_0"), (0, 0, "t1_call_0")]
    report = _run(tmp_path, tool_calls=1, ledger=twice)
    assert report.tool_side_effects_repeated == 1 and not report.ok
    assert report.problems == [f"tool call ran 2 times: {first_group_ids(_cfg().data, 1)[0]}/0 t1_call_0"]


def test_more_side_effects_than_tool_calls_is_flagged(tmp_path):
    # Two distinct call ids but the trajectory made one call: a re-sampled turn re-ran its tool.
    report = _run(tmp_path, tool_calls=1, ledger=[(1, 2, "t1_call_0"), (1, 2, "t2_call_0")])
    assert report.tool_side_effects_repeated == 1 and len(report.problems) == 1
