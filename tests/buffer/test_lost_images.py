"""Image bytes lost before a restart (a torn or deleted image segment): the groups whose rows
reference them are dropped with a counted error when sampled, before any consumption is recorded,
so a resume never crash-loops on them and the other groups train."""

from __future__ import annotations

import gc
from pathlib import Path

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.images import IMAGES_PREFIX
from streamrl.buffer.log import segment_paths
from streamrl.buffer.store import ReplayBuffer
from tests.buffer.helpers import make_group
from tests.buffer.test_images import RED, _image_group


def _cfg(root: Path) -> BufferConfig:
    return BufferConfig(root_dir=str(root), batch_size=4, group_size=2)


def test_groups_with_lost_images_are_dropped_before_consumption_is_recorded(tmp_path):
    buf = ReplayBuffer(_cfg(tmp_path))
    buf.append(make_group("t1", 2))
    buf.append(_image_group("img", [[RED]] * 2), images=[RED])
    buf.append(make_group("t2", 2))
    buf.close()
    for _, path in segment_paths(tmp_path, IMAGES_PREFIX):  # the image bytes are lost
        path.unlink()
        path.with_suffix(".idx").unlink()
    for attempt in range(2):  # the same on every resume
        buf = ReplayBuffer(_cfg(tmp_path))
        assert any("not in the image log" in line for line in buf.recovery_report.missing)
        problems = buf.stats()["buffer/recovery_problems"]
        if attempt == 0:
            batch = buf.sample(served_version=0, learner_step=1)  # t1 + img chosen first: img is dropped
            assert batch.table.column("group_id").to_pylist() == ["t1", "t1", "t2", "t2"]
            stats = buf.stats()
            assert stats["buffer/groups_dropped"] == 1 and stats["buffer/recovery_problems"] == problems + 1
            assert any(
                "dropped 1 ready groups (2 trajectories, first img)" in line for line in buf.recovery_report.missing
            )
        else:  # the consumption log did not record img: it is ready again, and dropped again
            assert buf.recovery_report.num_consumption_records == 4  # t1 and t2's
            buf.append(make_group("t3", 2))
            assert buf.sample(served_version=0, learner_step=2) is None  # img + t3 chosen, img dropped
            assert buf.stats()["buffer/groups_dropped"] == 1
            buf.append(make_group("t4", 2))
            batch = buf.sample(served_version=0, learner_step=2)
            assert batch.table.column("group_id").to_pylist() == ["t3", "t3", "t4", "t4"]
        buf.close()
        del buf
        gc.collect()
