"""The driver's loops in-process, on fakes of the actor clients (`streaming/actors/clients.py`), in about a
second: admission, learner and health loops over a real `ReplayBuffer`, a real `PromptStream`, a
real `MetricsLogger` and real driver state; the workers, learner and engines are fakes with the
clients' methods. The real-actor versions of these runs are test_e2e.py and test_preemption.py."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray

from streamrl.buffer.store import ReplayBuffer
from streamrl.buffer.types import BufferProgress
from streamrl.engines.base import EngineStats
from streamrl.observability.metrics import MetricsLogger
from streamrl.rollout.data import load_records
from streamrl.rollout.types import AgentData, FinishReason, RolloutOutcomes, Trajectory, TrajectoryStatus
from streamrl.streaming.actors.learner import Trained
from streamrl.streaming.config import load_config
from streamrl.streaming.driver import run_async, run_sync
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.pipeline import Pipeline
from streamrl.streaming.prompts import PromptStream
from streamrl.weight_sync.types import Published

TIMEOUT_S = 60


@pytest.fixture(autouse=True)
async def no_task_outlives_its_test():
    """Cancel what a test leaves running (a fake worker's trajectories past the end of training).
    Left pending, a task is destroyed when collected, and its finalizer logs "Task was destroyed but
    it is pending!" inside whatever another test runs then: once inside a parse (core/syntax.py)."""
    before = asyncio.all_tasks()
    yield
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=10)


@dataclass
class Served:
    """The version the fake engines serve (the fake learner's publish sets it)."""

    version: int = 0


class FakeBuffer:
    """`BufferClient`'s methods over an in-memory `ReplayBuffer` (what `BufferActor` does remotely)."""

    def __init__(self, cfg) -> None:
        self.rb = ReplayBuffer(cfg)
        self.sampled: list = []

    async def capacity(self, *, served_step: int, max_concurrent: int) -> int:
        return self.rb.capacity(served_step=served_step, max_concurrent=max_concurrent)

    async def has_group(self, group_id: str) -> bool:
        return self.rb.has_groups([group_id])[0]

    async def append_durable(self, rows: list[Trajectory]) -> None:
        self.rb.append(rows, durable=True)

    async def append(self, rows: list[Trajectory]) -> None:  # the rollout workers' sink
        self.rb.append(rows)

    async def sample(self, *, served_version: int, learner_step: int):
        batch = self.rb.sample(served_version=served_version, learner_step=learner_step)
        if batch is not None:
            self.sampled.append(batch)
        return batch

    async def progress(self) -> BufferProgress:
        return BufferProgress(
            in_flight=self.rb.num_in_flight, rows_appended=self.rb.num_rows_appended, changes=self.rb.num_changes
        )

    async def wait_progress(self, after: int, timeout_s: float) -> BufferProgress:
        deadline = time.monotonic() + timeout_s
        while self.rb.num_changes <= after and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        return await self.progress()

    async def resumable_ids(self) -> list[str]:
        return self.rb.resumable_ids()

    async def resumable(self, trajectory_ids: list[str]) -> list[Trajectory]:
        return self.rb.resumable(trajectory_ids)

    async def checkpoint(self) -> None:
        self.rb.checkpoint()

    async def stats(self) -> dict[str, float]:
        return self.rb.stats()

    async def memory(self) -> dict[str, float]:
        return {"memory/buffer_peak_gb": 0.0}

    async def close(self) -> None:
        self.rb.close()


@dataclass
class FakeLearner:
    served: Served
    version: int = 0
    published: list[int] = field(default_factory=list)
    on_step: object = None  # awaited after each step (a slow learner)
    dropped: dict[str, str] = field(default_factory=dict)  # engines out of the sync set, as a publish reports them
    checkpoint_path: str | None = None  # the checkpoint started and not yet finished

    async def train_step(self, batch) -> Trained:
        self.version += 1
        if self.on_step is not None:
            await self.on_step()
        return Trained(metrics={"learner/policy_version": float(self.version)}, samples=[])

    async def publish(self) -> Published:
        self.served.version = self.version
        self.published.append(self.version)
        return Published(policy_version=self.version, dropped_engines=dict(self.dropped), metrics={})

    async def start_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.checkpoint_path = path

    async def finish_checkpoint(self) -> str | None:
        path, self.checkpoint_path = self.checkpoint_path, None
        return path

    async def checkpoint_busy(self) -> bool:
        return False

    async def set_workers(self, workers) -> None:
        self.workers = workers

    async def shutdown(self) -> None:
        pass


class FakeWorker:
    """Finishes each submitted trajectory after a short random delay, labelled with the served
    version; `kill` loses everything it runs (only the buffer's partial rows remain)."""

    def __init__(self, worker_id: str, buffer: FakeBuffer, served: Served, seed: int) -> None:
        self.die_on_submit: int | None = None  # dies right after accepting its k-th submission
        self.num_submits = 0
        self.lost: set[str] = set()
        self.worker_id = worker_id
        self.buffer, self.served = buffer, served
        self.rng = random.Random(seed)
        self.tasks: dict[str, asyncio.Task] = {}
        self.dead = False
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.num_finished = 0
        self.ever_held: set[str] = set()
        self.finished: set[str] = set()
        self.uniform: set[str] = set()  # groups whose samples all get reward 0 (the DAPO filter drops them)
        self.fail_with: str | None = None  # every trajectory fails with this error (a FAILED row)
        self.num_failed = 0

    def _alive(self) -> None:
        if self.dead:
            raise ray.exceptions.RayActorError()

    async def submit(self, items: list[AgentData]) -> int:
        self._alive()
        for data in items:
            self.ever_held.add(data.trajectory_id)
            self.tasks[data.trajectory_id] = asyncio.create_task(self._run(data, self.rng.uniform(0.001, 0.02)))
        self.num_submits += 1
        if self.num_submits == self.die_on_submit:
            asyncio.get_running_loop().call_soon(self.kill)
        return len(self.tasks)

    async def _run(self, data: AgentData, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self.unpaused.wait()
        version = self.served.version
        row = Trajectory(
            trajectory_id=data.trajectory_id,
            group_id=data.group_id,
            sample_index=data.sample_index,
            agent_name=data.agent_name,
            prompt_ids=[1, 2, 3],
            response_ids=[5, 6, 7],
            response_mask=[1, 1, 1],
            behavior_logprobs=[-0.5] * 3,
            policy_versions=[version] * 3,
            reward=0.0 if data.group_id in self.uniform else float(data.sample_index % 2),
            status=TrajectoryStatus.FAILED if self.fail_with else TrajectoryStatus.FINISHED,
            finish_reason=FinishReason.ERROR if self.fail_with else FinishReason.STOP,
            attempt=data.attempt,  # as `AgentLoopBase.to_trajectory` does
        )
        await self.buffer.append([row])
        if self.fail_with:
            self.num_failed += 1
        else:
            self.num_finished += 1
        self.finished.add(data.trajectory_id)
        del self.tasks[data.trajectory_id]

    async def num_outstanding(self) -> int:
        self._alive()
        return len(self.tasks)

    async def running_ids(self) -> list[str]:
        self._alive()
        return list(self.tasks)

    async def route(self, keep_out: list[str]) -> list[str]:
        self._alive()
        return []

    async def pause(self) -> None:
        self._alive()
        self.unpaused.clear()

    async def metrics(self) -> dict[str, float]:
        self._alive()
        return {"rollout/num_finished": float(self.num_finished)}

    async def memory(self) -> dict[str, float]:
        self._alive()
        return {"memory/rollout_worker_peak_gb": 0.0}

    async def outcomes(self) -> RolloutOutcomes:
        self._alive()
        reasons = {self.fail_with: self.num_failed} if self.num_failed else {}
        return RolloutOutcomes(
            worker_id=self.worker_id,
            num_finished=self.num_finished,
            num_failed=self.num_failed,
            failure_reasons=reasons,
        )

    async def shutdown(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    def kill(self) -> None:
        self.dead = True
        self.lost |= set(self.tasks)
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()


@dataclass
class FakeEngine:
    served: Served

    async def actor_stats(self) -> EngineStats:
        return EngineStats(
            engine_id="engine-0",
            policy_version=self.served.version,
            num_running=0,
            busy_s=1.0,
            uptime_s=2.0,
            num_generated_tokens=0,
            num_prompt_tokens=0,
            num_aborted=0,
        )

    async def memory(self) -> dict[str, float]:
        return {"memory/engine_peak_gb": 0.0}


def _pipeline(tmp_path: Path, *overrides: str, num_workers: int = 2) -> tuple[Pipeline, FakeBuffer, FakeLearner]:
    cfg = load_config(
        None,
        [
            "trainer.total_steps=8",
            "trainer.checkpoint_every=3",
            "trainer.stall_timeout_s=600",
            "buffer.group_size=2",
            "buffer.batch_size=4",
            "buffer.max_staleness=1",
            "rollout.max_concurrent_per_worker=8",
            "data.num_prompts=64",
            "wandb.enabled=false",
            f"rollout.num_workers={num_workers}",
            *overrides,
        ],
    )
    served = Served()
    buffer = FakeBuffer(cfg.buffer)
    learner = FakeLearner(served)
    created: list[FakeWorker] = []

    def new_worker(pipeline: Pipeline, worker_id: str) -> FakeWorker:
        worker = FakeWorker(worker_id, buffer, served, seed=len(created))
        created.append(worker)
        return worker

    records = load_records("arithmetic", cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    pipeline = Pipeline(
        cfg=cfg,
        run_dir=tmp_path,
        model_path="fake",
        engines=[FakeEngine(served)],
        workers=[],
        buffer=buffer,
        learner=learner,
        stream=PromptStream(records, seed=0, shuffle=False, num_epochs=1),
        metrics=MetricsLogger(tmp_path, wandb_cfg=None, console=False),
        state=DriverState(),
        new_worker=new_worker,
    )
    pipeline.workers = [new_worker(pipeline, f"worker-{i}") for i in range(num_workers)]
    pipeline.created_workers = created
    return pipeline, buffer, learner


async def _run_to_end(pipeline: Pipeline) -> dict:
    """Run the async loops to the end of training (bounded) and write the run's accounting; the
    metrics file is closed either way."""
    try:
        await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
        return await pipeline.write_accounting()
    finally:
        pipeline.metrics.close()


def _check_batches(pipeline: Pipeline, buffer: FakeBuffer) -> set[str]:
    """Every step trained whole groups within the staleness bound, no trajectory twice; returns
    the trained trajectory ids."""
    cfg = pipeline.cfg.buffer
    trained: list[str] = []
    for batch in buffer.sampled:
        groups = batch.table.column("group_id").to_pylist()
        assert all(groups.count(g) == cfg.group_size for g in groups), groups
        assert max(batch.lags) <= cfg.max_staleness, (batch.served_version, batch.lags)
        trained += batch.trajectory_ids
    assert len(trained) == len(set(trained)) == pipeline.state.learner_step * cfg.batch_size
    return set(trained)


def _check_admission(pipeline: Pipeline, buffer: FakeBuffer) -> None:
    """Every prompt before the cursor is in the buffer exactly as one whole group; none after it."""
    stream = pipeline.stream
    admitted = [f"{r.group_id}@e0" for r in stream.records[: pipeline.state.cursor]]
    assert buffer.rb.has_groups(admitted) == [True] * len(admitted)
    if pipeline.state.cursor < len(stream.records):
        assert buffer.rb.has_groups([f"{stream.records[pipeline.state.cursor].group_id}@e0"]) == [False]
    assert pipeline.state.num_admitted == len(admitted) * pipeline.cfg.group_size


@pytest.mark.timeout(TIMEOUT_S)
async def test_async_loops_train_whole_fresh_groups_and_admit_each_prompt_once(tmp_path):
    pipeline, buffer, learner = _pipeline(tmp_path)
    accounting = await _run_to_end(pipeline)
    assert pipeline.state.learner_step == 8 and learner.published == list(range(1, 9))
    assert pipeline.state.policy_version == 8
    _check_batches(pipeline, buffer)
    _check_admission(pipeline, buffer)
    assert accounting["stranded"] == [] and accounting["untracked"] == []
    # trainer.keep_checkpoints = 2: step_000003 went once step_000008 was complete
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000006", "step_000008"]


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_publish_record_alone_tells_the_driver_which_engines_leave_routing(tmp_path):
    """The driver learns the dropped engines from the publish's own record: no second call."""
    pipeline, _, learner = _pipeline(tmp_path)
    try:
        learner.dropped = {"engine-1": "resume failed: no answer within 5.0s"}
        metrics = await pipeline.publish_weights()
        assert pipeline.kept_out == ["engine-1"] and metrics["sync/num_engines_excluded"] == 1.0
        learner.dropped = {}  # it answered a ping before the next sync: back in the set
        metrics = await pipeline.publish_weights()
        assert pipeline.kept_out == [] and metrics["sync/num_engines_excluded"] == 0.0
    finally:
        pipeline.metrics.close()


async def test_sync_loop_trains_on_policy(tmp_path):
    pipeline, buffer, learner = _pipeline(tmp_path, "trainer.mode=sync", "trainer.total_steps=4")
    try:
        await asyncio.wait_for(run_sync(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    assert pipeline.state.learner_step == 4
    assert all(max(b.lags) == 0 for b in buffer.sampled)  # on-policy: every batch at the served version
    _check_batches(pipeline, buffer)
    _check_admission(pipeline, buffer)
    assert pipeline.state.cursor == 4 * pipeline.cfg.buffer.groups_per_batch  # exactly one batch admitted per step


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_killed_worker_is_replaced_and_what_it_ran_is_finished_by_another(tmp_path):
    pipeline, buffer, learner = _pipeline(tmp_path)
    victim = pipeline.workers[0]
    victim.die_on_submit = 2  # while it runs two fresh groups' members

    async def slow_step() -> None:  # a learner step outlasts the health check (not a race with it)
        while victim.dead and not pipeline.num_worker_replacements:
            await asyncio.sleep(0.01)

    learner.on_step = slow_step
    accounting = await _run_to_end(pipeline)
    lost = victim.lost
    assert len(lost) >= 2, "the victim ran nothing when it was killed: the test proves nothing"
    assert pipeline.num_worker_replacements == 1 and victim not in pipeline.workers
    assert pipeline.state.learner_step == 8
    _check_batches(pipeline, buffer)
    _check_admission(pipeline, buffer)
    assert accounting["stranded"] == [] and accounting["untracked"] == []
    # what the victim lost was resubmitted to a live worker (never lost, never failed)
    survivors = [w for w in pipeline.created_workers if w is not victim]
    finished = set().union(*(w.finished for w in survivors))
    held_now = set().union(*(w.tasks for w in survivors))
    assert not lost & victim.finished
    for tid in lost:  # finished by another worker, or still running there (a partial row, held)
        assert tid in finished or (tid in held_now and tid in accounting["resumable"]), tid


@pytest.mark.timeout(TIMEOUT_S)
async def test_a_worker_dying_at_the_end_of_the_run_strands_nothing(tmp_path):
    """The chaos suite found this: a worker killed right before the end-of-run accounting left
    durable partial rows nobody held. The accounting replaces it and hands its work over first."""
    pipeline, buffer, learner = _pipeline(tmp_path)
    try:
        await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
        for w in pipeline.workers:
            w.unpaused.clear()  # what is submitted now stays in flight
        assert await pipeline.admit_next_group()
        victim = max(pipeline.workers, key=lambda w: len(w.tasks))
        assert victim.tasks, "the victim holds nothing: the test proves nothing"
        victim.kill()
        accounting = await pipeline.write_accounting()
    finally:
        pipeline.metrics.close()
    assert pipeline.num_worker_replacements == 1 and victim not in pipeline.workers
    assert accounting["stranded"] == [] and accounting["untracked"] == []
    survivors = pipeline.workers  # the replacement and the worker that never died
    assert victim.lost and victim.lost <= set().union(*(w.ever_held for w in survivors))
    for tid in victim.lost:  # finished by a survivor, or held there with its partial row
        assert any(tid in w.finished or (tid in w.tasks and tid in accounting["resumable"]) for w in survivors), tid


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("mode,max_staleness", [("async", 1), ("async", 0), ("sync", 1)])
async def test_the_loops_wake_on_events_not_on_a_timer(tmp_path, monkeypatch, mode, max_staleness):
    """With the loops' safety-net timeout at 30 s, a run of 8 steps still ends in seconds: admission
    wakes when rows arrive or a publish raises capacity, the learner when a row arrives. One lost
    wake-up would cost 30 s and fail the deadline. With max_staleness=0 nothing is in flight when a
    step's weights are published, so only the publish can wake admission."""
    from streamrl.streaming import driver

    monkeypatch.setattr(driver, "WAIT_S", 30.0)
    pipeline, buffer, learner = _pipeline(tmp_path, f"trainer.mode={mode}", f"buffer.max_staleness={max_staleness}")

    async def slow_step() -> None:  # admission looks (and finds no room) between the sample and the publish
        await asyncio.sleep(0.05)

    learner.on_step = slow_step
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(run_async(pipeline) if mode == "async" else run_sync(pipeline), 20.0)
    finally:
        pipeline.metrics.close()
    assert pipeline.state.learner_step == 8
    assert time.monotonic() - t0 < 20.0


@pytest.mark.timeout(TIMEOUT_S)
async def test_sync_loop_replaces_groups_the_filter_drops(tmp_path):
    """On-policy with DAPO filtering: the sync loop admits only one batch's groups; when some come back
    with all-equal rewards (dropped) it admits more until a batch is ready, instead of waiting for the
    stall timeout. Every batch is still on-policy and no dropped group is trained."""
    pipeline, buffer, learner = _pipeline(
        tmp_path, "trainer.mode=sync", "trainer.total_steps=4", "buffer.filter_uniform_reward_groups=true"
    )
    uniform = {f"{r.group_id}@e0" for r in pipeline.stream.records[0:12:3]}  # prompts 0, 3, 6, 9
    for worker in pipeline.workers:
        worker.uniform = uniform
    try:
        await asyncio.wait_for(run_sync(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    assert pipeline.state.learner_step == 4
    assert all(max(b.lags) == 0 for b in buffer.sampled)
    trained_groups = {g for b in buffer.sampled for g in b.table.column("group_id").to_pylist()}
    admitted = [f"{r.group_id}@e0" for r in pipeline.stream.records[: pipeline.state.cursor]]
    assert trained_groups == set(admitted) - uniform and uniform <= set(admitted)
    _check_batches(pipeline, buffer)
    _check_admission(pipeline, buffer)
    assert pipeline.state.cursor == 4 * pipeline.cfg.buffer.groups_per_batch + len(
        uniform
    )  # one more per dropped group


@pytest.mark.timeout(TIMEOUT_S)
async def test_end_of_run_accounting_waits_for_a_trajectory_still_being_scored(tmp_path):
    """A paused worker still runs what does not use the engine: a trajectory whose (slow) reward is
    being computed when the accounting pauses the workers is held, then writes its terminal row and
    leaves the worker. Read in between, it looked "held without a partial row" (the chaos bench's
    hostile-reward run: 4 untracked). The accounting waits, at most a tool call plus a reward call,
    for such trajectories to settle; one that never does is still reported."""
    pipeline, buffer, learner = _pipeline(
        tmp_path, "rollout.agent.reward_timeout_s=1", "rollout.agent.tool_timeout_s=0.5"
    )
    worker = pipeline.workers[0]

    async def scoring(tid: str, seconds: float) -> None:
        await asyncio.sleep(seconds)  # its terminal row is written; then it leaves the worker
        del worker.tasks[tid]

    worker.tasks["g-scored@e0/0"] = asyncio.create_task(scoring("g-scored@e0/0", 0.3))
    try:
        accounting = await pipeline.write_accounting()
        assert accounting["untracked"] == [] and accounting["stranded"] == []
        worker.tasks["g-stuck@e0/0"] = asyncio.create_task(asyncio.sleep(60))  # never settles
        t0 = time.monotonic()
        accounting = await pipeline.write_accounting()
        assert accounting["untracked"] == ["g-stuck@e0/0"] and time.monotonic() - t0 < 5
    finally:
        await worker.shutdown()
        pipeline.metrics.close()


@pytest.mark.timeout(TIMEOUT_S)
async def test_sync_generation_rounds_train_on_policy_and_never_overlap_a_step(tmp_path):
    """verl's gen_batch_size: each round admits 4 groups (a batch holds 2), waits for the whole
    round, trains; the leftovers are evicted as stale (max_staleness = 0), never trained later."""
    pipeline, buffer, learner = _pipeline(
        tmp_path,
        "trainer.mode=sync",
        "trainer.total_steps=4",
        "trainer.sync_generation_groups=4",
        "buffer.max_staleness=0",
        "buffer.over_age=evict",
    )
    in_flight_at_step: list[int] = []
    train_step = learner.train_step

    async def recording_step(batch):
        in_flight_at_step.append(buffer.rb.num_in_flight)
        return await train_step(batch)

    learner.train_step = recording_step
    try:
        await asyncio.wait_for(run_sync(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
    assert pipeline.state.learner_step == 4 and in_flight_at_step == [0, 0, 0, 0]
    assert all(max(b.lags) == 0 for b in buffer.sampled)
    _check_batches(pipeline, buffer)
    _check_admission(pipeline, buffer)
    assert pipeline.state.cursor == 4 * 4  # one round of 4 groups per step (nothing filtered by the fakes)
    assert buffer.rb.stats()["buffer/evicted_over_age"] == 3 * 2 * 2  # each step's 2 leftover groups, but the last's


@pytest.mark.parametrize("staleness", ["buffer.max_staleness=0", "buffer.max_staleness=1"])
def test_sync_generation_rounds_larger_than_a_batch_need_max_staleness_0_and_eviction(staleness):
    """Leftover groups of a round would train at the next step (max_staleness 1, or the default
    over_age = "train"): refused."""
    overrides = ["trainer.mode=sync", "buffer.group_size=2", "buffer.batch_size=4", "trainer.sync_generation_groups=4"]
    with pytest.raises(ValueError, match="set buffer.max_staleness = 0"):
        load_config(None, [*overrides, staleness])
