"""Hypothesis stateful test: random interleavings of admit / park / finish / fail / sample / crash +
recover against the real `ReplayBuffer` (durable log on disk) keep the async invariants:

- I1 prompts: the groups in the buffer are exactly the first `cursor` prompts (admission appends
  durably before the cursor moves), across any number of crashes;
- I2 no stranded work: the buffer's resumable trajectories are exactly the ones the model says are
  still running (after a crash, a trajectory whose final row was not yet flushed is resumable again,
  never lost);
- I3 admission counts every admitted-but-unconsumed trajectory (finished members of open groups too),
  capacity follows the formula, nothing is consumed twice, and no accepted group is dropped for age.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.store import ReplayBuffer
from streamrl.rollout.types import TrajectoryStatus
from tests.buffer.helpers import make_traj

G = 2  # group size
BATCH = 4
MAX_STALENESS = 1


def _gid(i: int) -> str:
    return f"p{i}"


def _kill(buf: ReplayBuffer) -> None:
    """What a SIGKILL leaves: frames already handed to the writer thread reach the OS, rows still
    held for coalescing do not; the directory lock dies with the process."""
    if buf._dir.traj is not None and buf._dir.traj._thread is not None:
        buf._dir.traj._thread.shutdown(wait=True)
    buf._dir.release()


class BufferMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        shm = Path("/dev/shm")  # tmpfs where there is one: the log's fsyncs cost nothing there
        self._tmp = tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None)
        self.cfg = BufferConfig(
            root_dir=str(Path(self._tmp.name) / "buf"),
            batch_size=BATCH,
            group_size=G,
            max_staleness=MAX_STALENESS,
            min_finished_per_group=1,
        )
        self.buf = ReplayBuffer(self.cfg)
        self.cursor = 0
        self.step = 0  # learner steps = learner version (sync every step)
        self.start_version: dict[str, int] = {}  # tid -> version its first token was sampled at
        self.status: dict[str, str] = {}  # tid -> running / finished / failed (the model)
        self.consumed: set[str] = set()

    def teardown(self):
        if hasattr(self, "buf"):
            self.buf.close()
            self._tmp.cleanup()

    # ---- the driver and the workers ------------------------------------------------------------

    @rule()
    def admit(self):
        if self.buf.capacity(served_step=self.step) < G:
            return
        gid = _gid(self.cursor)
        rows = [make_traj(gid, i, status=TrajectoryStatus.PARTIAL, num_response=0) for i in range(G)]
        self.buf.append(rows, durable=True)
        self.cursor += 1  # the cursor is saved only after the rows are durable
        for r in rows:
            self.status[r.trajectory_id] = "running"
            self.start_version[r.trajectory_id] = self.step

    def _running(self) -> list[str]:
        return sorted(t for t, s in self.status.items() if s == "running")

    @precondition(lambda self: any(s == "running" for s in self.status.values()))
    @rule(data=st.data(), outcome=st.sampled_from(["park", "finish", "finish", "fail"]), long=st.booleans())
    def progress(self, data, outcome, long):
        tid = data.draw(st.sampled_from(self._running()))
        gid, index = tid.split("/")
        status = {
            "park": TrajectoryStatus.PARTIAL,
            "finish": TrajectoryStatus.FINISHED,
            "fail": TrajectoryStatus.FAILED,
        }[outcome]
        reward = float(data.draw(st.integers(0, 1)))
        row = make_traj(
            gid,
            int(index),
            status=status,
            version=self.start_version[tid],
            num_response=40 if long else 4,
            reward=reward,
        )
        self.buf.append([row])
        self.status[tid] = {"park": "running", "finish": "finished", "fail": "failed"}[outcome]

    @rule()
    def sample(self):
        batch = self.buf.sample(served_version=self.step, learner_step=self.step + 1)
        if batch is None:
            return
        assert not self.consumed & set(batch.trajectory_ids), "a trajectory was consumed twice"
        assert all(self.status[t] == "finished" for t in batch.trajectory_ids)
        self.consumed |= set(batch.trajectory_ids)
        self.step += 1

    @rule()
    def crash_and_recover(self):
        _kill(self.buf)
        self.buf = ReplayBuffer(self.cfg, resume_learner_step=self.step)
        resumable = set(self.buf.resumable_ids())
        for tid, s in self.status.items():
            if tid in resumable:
                assert s != "failed" or tid not in self.consumed
                self.status[tid] = "running"  # its last row was not flushed: it runs again
            else:
                assert s != "running", f"{tid} was running but the recovered buffer lost it"

    # ---- invariants ---------------------------------------------------------------------------------

    @invariant()
    def prompts_exactly_once(self):
        if not hasattr(self, "buf"):
            return
        present = self.buf.has_groups([_gid(i) for i in range(self.cursor + 2)])
        assert present == [i < self.cursor for i in range(self.cursor + 2)]

    @invariant()
    def nothing_stranded(self):
        if not hasattr(self, "buf"):
            return
        assert set(self.buf.resumable_ids()) == set(self._running())

    @invariant()
    def admission_counts_everything_in_flight(self):
        if not hasattr(self, "buf"):
            return
        groups: dict[str, list[str]] = {}
        for tid, s in self.status.items():
            groups.setdefault(tid.split("/")[0], []).append(s)
        open_members = sum(len(m) for m in groups.values() if "running" in m)
        assert self.buf.num_in_flight == open_members
        stats = self.buf.stats()
        accepted = int(stats["buffer/accepted_trajectories"])
        expected = (MAX_STALENESS + self.step + 1) * BATCH - (accepted + open_members)
        assert self.buf.capacity(served_step=self.step) == max(0, expected // G * G)
        assert stats["buffer/evicted_over_age"] == 0  # over-age groups are trained, not dropped


TestBufferInvariants = BufferMachine.TestCase
TestBufferInvariants.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
