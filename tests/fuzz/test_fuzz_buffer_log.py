"""The buffer log reader on random corruption and truncation of segments, index files and the
manifest: recovery (`ReplayBuffer` on the directory, the real resume path) returns normally with the
damage in its `RecoveryReport`, and what it recovers is a subset of what was written, row for row.
Never an exception, never a hang."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.schema import batch_to_trajectories
from streamrl.buffer.store import ReplayBuffer
from tests.buffer.helpers import make_group

GROUPS = [f"g{i:02d}" for i in range(10)]


def _cfg(root: Path) -> BufferConfig:
    return BufferConfig(root_dir=str(root), batch_size=2, group_size=2, segment_max_bytes=5000)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A closed buffer directory: ten groups over several segments, two batches consumed."""
    root = tmp_path_factory.mktemp("buffer")
    buf = ReplayBuffer(_cfg(root))
    for gid in GROUPS:
        buf.append(make_group(gid, 2, num_response=24), durable=True)
    buf.sample(served_version=0, learner_step=1)
    buf.sample(served_version=0, learner_step=2)
    buf.close()
    return root


DAMAGE = st.lists(
    st.tuples(
        st.integers(0, 10**6),
        st.sampled_from(["flip", "truncate", "zero", "delete", "append"]),
        st.integers(0, 10**6),
        st.integers(1, 255),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.timeout(240)
@settings(
    max_examples=60,
    deadline=10_000,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damage=DAMAGE)
@example(damage=[(0, "delete", 0, 1)])  # consumed-000001.arrow gone, its .idx left: finding (1)
def test_corrupted_logs_recover_a_well_formed_subset(tmp_path, template, damage):
    root = tmp_path / "buf"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(template, root)
    files = sorted(p for p in root.iterdir() if p.name != "LOCK")
    for which, kind, pos, mask in damage:
        path = files[which % len(files)]
        if not path.exists():
            continue
        data = bytearray(path.read_bytes())
        at = pos % (len(data) + 1)
        if kind == "flip" and data:
            data[at % len(data)] ^= mask
        elif kind == "truncate":
            del data[at:]
        elif kind == "zero":
            data[at : at + mask] = bytes(len(data[at : at + mask]))
        elif kind == "append":
            data += bytes([mask]) * (pos % 64)
        if kind == "delete":
            path.unlink()
        else:
            path.write_bytes(bytes(data))
    buf = ReplayBuffer(_cfg(root))  # must not raise
    try:
        report = buf.recovery_report
        assert report.num_rows <= 2 * len(GROUPS)
        present = dict(zip(GROUPS, buf.has_groups(GROUPS)))
        step = 2
        while (batch := buf.sample(served_version=0, learner_step=step + 1)) is not None:
            step += 1
            for traj in batch_to_trajectories(batch.table):
                assert present[traj.group_id]
                original = make_group(traj.group_id, 2, num_response=24)[traj.sample_index]
                assert (traj.response_ids, traj.reward, traj.behavior_logprobs) == (
                    original.response_ids,
                    original.reward,
                    original.behavior_logprobs,
                )
    finally:
        buf.close()


def test_a_manifest_entry_without_a_frame_count_is_reported_not_raised(tmp_path, template):
    root = tmp_path / "buf"
    shutil.copytree(template, root)
    (root / "manifest.json").write_text('{"format_version": 1, "segments": {"traj": [{"name": "traj-000001"}]}}')
    buf = ReplayBuffer(_cfg(root))
    buf.close()
