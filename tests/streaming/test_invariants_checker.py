"""The chaos suite's oracle (`streaming/invariants.py`) on hand-built run directories: it passes a
correct run, including a batch whose group lost a member to a failure, and flags lost prompts, short
batches and finished members of a trained group that were never trained."""

from __future__ import annotations

import json

from buffer.store import ReplayBuffer
from rollout.types import TrajectoryStatus
from streaming.config import StreamRLConfig
from streaming.invariants import check_run
from streaming.prompts import PromptStream, group_id_for, load_records
from tests.buffer.helpers import make_traj

F = TrajectoryStatus.FAILED


def _group_ids(cfg: StreamRLConfig, n: int) -> list[str]:
    records = load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    stream = PromptStream(records, seed=cfg.data.seed, shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs)
    out = []
    for _ in range(n):
        record, epoch = stream.peek()
        out.append(group_id_for(record, epoch))
        stream.advance()
    return out


def _run(tmp_path, *, failed: tuple[str, int] | None = None, sample_batch: int = 8, steps: int = 1,
         cursor: int = 2, admitted: int = 2):
    """A run whose buffer holds the groups of the first `admitted` prompts (4 each; the config's
    batch is 8), sampled `steps` times with batches of `sample_batch`, and whose saved cursor says
    `cursor` prompts were admitted."""
    cfg = StreamRLConfig.model_validate({"model": "tiny", "data": {"num_prompts": 8},
                                        "buffer": {"batch_size": 8, "group_size": 4}})
    run_dir = tmp_path / "run"
    buf_cfg = cfg.buffer.model_copy(update={"root_dir": str(run_dir / "buffer"), "batch_size": sample_batch})
    buf = ReplayBuffer(buf_cfg)
    for gid in _group_ids(cfg, admitted):
        rows = [make_traj(gid, i, reward=float(i), status=F if (gid, i) == failed else TrajectoryStatus.FINISHED)
                for i in range(4)]
        buf.append(rows)
    for step in range(1, steps + 1):
        batch = buf.sample(served_version=0, learner_step=step)
        assert batch is not None
    buf.close()
    (run_dir / "run_info.json").write_text(json.dumps({"config": cfg.model_dump(mode="json")}))
    (run_dir / "driver_state.json").write_text(json.dumps({"learner_step": steps, "cursor": cursor, "policy_version": steps}))
    return check_run(run_dir)


def test_a_correct_run_passes(tmp_path):
    report = _run(tmp_path)
    assert report.problems == [] and report.bad_batches == 0 and report.prompts_lost == 0


def test_a_group_that_lost_a_member_to_a_failure_still_makes_a_full_batch(tmp_path):
    gid = _group_ids(StreamRLConfig.model_validate({"model": "tiny", "data": {"num_prompts": 8}}), 1)[0]
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
