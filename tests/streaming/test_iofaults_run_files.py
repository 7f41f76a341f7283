"""I/O faults (ENOSPC, EIO, torn and short writes, a failing fsync; `core/iofaults.py`) on a learner
checkpoint and on `driver_state.json`, at exact points of the real write paths (`learner.checkpoint`,
`core.atomic`): the error names the file and the errno, no torn or unsealed checkpoint is ever what a
resume selects (`use_newest_complete`), the previous state file stays intact and loadable, and a real
driver stopped by such a fault leaves a run directory a resume continues without losing a row.

The checkpoints are of a tiny stand-in `TrainState` (a linear layer, AdamW, LambdaLR): the real
`save_checkpoint` / `load_checkpoint` on small tensors, no model, no engine."""

from __future__ import annotations

import asyncio
import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from streamrl.core import iofaults
from streamrl.core.atomic import SEAL, WriteFailedError, unsealed_reason
from streamrl.core.iofaults import Fault, FaultKind, FaultPlan
from streamrl.learner.checkpoint import CheckpointWriteError, CheckpointWriter, load_checkpoint, save_checkpoint
from streamrl.streaming.checkpoints import CheckpointRecord, record_checkpoint, use_newest_complete
from streamrl.streaming.driver import run_async
from streamrl.streaming.pipeline import DriverState
from tests.streaming.test_driver_loops import TIMEOUT_S, _pipeline

pytestmark = pytest.mark.timeout(120)


class _LM(torch.nn.Module):
    """The part of a HF model `learner.checkpoint` uses: parameters, `config`, `save_pretrained`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)
        self.config = SimpleNamespace(tie_word_embeddings=False)

    def save_pretrained(self, out, state_dict=None, safe_serialization=True) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = state_dict if state_dict is not None else self.state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
        (out / "config.json").write_text("{}")


class _Tokenizer:
    def save_pretrained(self, out) -> None:
        (Path(out) / "tokenizer.json").write_text("{}")


def _train_state(seed: int = 0) -> SimpleNamespace:
    torch.manual_seed(seed)
    lm = _LM()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    ts = SimpleNamespace(
        policy=SimpleNamespace(lm=lm, value_head=None),
        optimizer=optimizer,
        scheduler=scheduler,
        tokenizer=_Tokenizer(),
        generator=torch.Generator().manual_seed(seed),
        cfg=SimpleNamespace(model_dump=lambda mode: {"lr": 1e-2}),
        is_distributed=False,
        rank=0,
        policy_version=0,
        num_optimizer_steps=0,
        lora=None,
    )
    _step(ts)
    return ts


def _step(ts: SimpleNamespace) -> None:
    """One optimizer step: new weights, optimizer moments, scheduler position."""
    ts.optimizer.zero_grad()
    ts.policy.lm.proj(torch.randn(3, 8)).pow(2).sum().backward()
    ts.optimizer.step()
    ts.scheduler.step()
    ts.policy_version += 1
    ts.num_optimizer_steps += 1


def _weights(ts: SimpleNamespace) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ts.policy.lm.state_dict().items()}


# (kind, target, call): a hard fault on one of the checkpoint's files. Every file of ours is written
# through the plan; the HF weights (written by safetensors) meet it at the seal's fsync.
CHECKPOINT_FAULTS = [
    (FaultKind.ENOSPC, "ckpt/optimizer.pt", 0),
    (FaultKind.TORN, "ckpt/optimizer.pt", 2),  # part of the optimizer state is on disk, then ENOSPC
    (FaultKind.EIO, "ckpt/scheduler.pt", 0),
    (FaultKind.EIO, "ckpt/rng.pt", 1),
    (FaultKind.ENOSPC, "ckpt/state.json", 0),
    (FaultKind.TORN, f"ckpt/{SEAL}", 0),  # the seal itself torn
    (FaultKind.FSYNC_EIO, "ckpt/hf/model.safetensors", 0),  # the model weights' fsync
    (FaultKind.FSYNC_EIO, "ckpt/optimizer.pt", 0),
    (FaultKind.FSYNC_EIO, f"ckpt/{SEAL}", 0),  # the seal written, its fsync fails
]
ERRNO = {FaultKind.ENOSPC: errno.ENOSPC, FaultKind.TORN: errno.ENOSPC, FaultKind.EIO: errno.EIO}


def _plan(kind: FaultKind, target: str, at: int) -> FaultPlan:
    return FaultPlan((Fault(kind=kind, at=at, log=target, nbytes=7),))


def _run_with_one_checkpoint(tmp_path: Path) -> tuple[Path, SimpleNamespace, dict, DriverState]:
    """A run directory whose saved state records one complete checkpoint (step 1)."""
    ts = _train_state()
    first = tmp_path / "checkpoints" / "step_000001"
    save_checkpoint(ts, first)
    state = DriverState(learner_step=1, policy_version=1)
    record_checkpoint(state, CheckpointRecord.at(state, first))
    state.save(tmp_path / "driver_state.json")
    return first, ts, _weights(ts), state


def _resumed_checkpoint(run_dir: Path) -> Path | None:
    """What `streamrl train --resume` loads: the saved state, pointed at its newest complete checkpoint."""
    state = DriverState.load(run_dir / "driver_state.json")
    use_newest_complete(state)
    return Path(state.checkpoint) if state.checkpoint else None


@pytest.mark.parametrize(("kind", "target", "at"), CHECKPOINT_FAULTS, ids=lambda v: getattr(v, "value", str(v)))
def test_a_failed_checkpoint_write_stops_clearly_and_is_never_resumed_from(tmp_path, kind, target, at):
    first, ts, first_weights, state = _run_with_one_checkpoint(tmp_path)
    _step(ts)
    second = tmp_path / "checkpoints" / "step_000002"
    plan = _plan(kind, target, at)
    with iofaults.install(plan), pytest.raises(CheckpointWriteError) as failed:
        save_checkpoint(ts, second)
    assert plan.injected == [f"{target} {kind.op} #{at} {kind.value}"]
    error = failed.value
    assert isinstance(error, OSError) and error.errno == ERRNO.get(kind, errno.EIO)
    message = str(error)
    assert errno.errorcode[error.errno] in message and "--resume" in message
    assert str(second.resolve() / target.removeprefix("ckpt/")) in message  # the failing file, by its final path
    # nothing of the failed checkpoint is left under any name: no folder, no partial copy, no seal
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    # the driver records a checkpoint only once its save returned; were it recorded anyway (a state saved
    # by a buggy caller), the resume's selection still refuses it
    assert _resumed_checkpoint(tmp_path) == first and unsealed_reason(first) is None
    state.learner_step = state.policy_version = 2
    record_checkpoint(state, CheckpointRecord.at(state, second))
    state.save(tmp_path / "driver_state.json")
    assert _resumed_checkpoint(tmp_path) == first
    # and the checkpoint it resumes from loads whole: step 1's weights
    fresh = _train_state(seed=1)
    assert load_checkpoint(fresh, first) == (1, 1)
    assert all(torch.equal(fresh.policy.lm.state_dict()[k], v) for k, v in first_weights.items())


@pytest.mark.parametrize(("kind", "target", "at"), CHECKPOINT_FAULTS[:3] + CHECKPOINT_FAULTS[5:7])
def test_a_failed_rewrite_of_a_step_keeps_its_complete_checkpoint(tmp_path, kind, target, at):
    """After a resume the run reaches a step it checkpointed before and saves it again: a failure then
    keeps the old folder whole (and still the one a resume selects)."""
    first, ts, first_weights, _ = _run_with_one_checkpoint(tmp_path)
    _step(ts)
    with iofaults.install(_plan(kind, target, at)), pytest.raises(CheckpointWriteError):
        save_checkpoint(ts, first)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert unsealed_reason(first) is None and _resumed_checkpoint(tmp_path) == first
    fresh = _train_state(seed=1)
    load_checkpoint(fresh, first)
    assert all(torch.equal(fresh.policy.lm.state_dict()[k], v) for k, v in first_weights.items())


def test_short_writes_everywhere_still_make_a_whole_checkpoint(tmp_path):
    """A short write is legal (`write()` may return early): every file is finished, sealed at its full
    size and loads back exactly."""
    ts = _train_state()
    plan = FaultPlan(seed=3, rate=1.0, kinds=(FaultKind.SHORT,), logs=("ckpt",), max_faults=10_000)
    with iofaults.install(plan):
        save_checkpoint(ts, tmp_path / "step_000001")
    assert sum(" write " in f for f in plan.injected) >= 10  # every write of every file of ours came short
    assert {f.split()[0] for f in plan.injected} >= {"ckpt/optimizer.pt", "ckpt/rng.pt", f"ckpt/{SEAL}"}
    assert unsealed_reason(tmp_path / "step_000001") is None
    fresh = _train_state(seed=1)
    load_checkpoint(fresh, tmp_path / "step_000001")
    assert all(torch.equal(fresh.policy.lm.state_dict()[k], v) for k, v in _weights(ts).items())
    saved, loaded = ts.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])
    assert torch.equal(ts.generator.get_state(), fresh.generator.get_state())


# ---- driver_state.json ------------------------------------------------------------------------------

STATE_FAULTS = [
    (FaultKind.ENOSPC, "write", 0),
    (FaultKind.EIO, "write", 0),
    (FaultKind.TORN, "write", 0),  # part of the new state reached the (temporary) file, then ENOSPC
    (FaultKind.FSYNC_EIO, "fsync", 0),
]


@pytest.mark.parametrize(("kind", "op", "at"), STATE_FAULTS, ids=lambda v: getattr(v, "value", str(v)))
def test_a_failed_driver_state_save_keeps_the_previous_file_and_says_so(tmp_path, kind, op, at):
    path = tmp_path / "driver_state.json"
    _, _, _, before = _run_with_one_checkpoint(tmp_path)
    before.cursor, before.num_admitted = 5, 10
    before.save(path)
    saved = path.read_bytes()
    after = DriverState.load(path)
    after.cursor, after.num_admitted, after.learner_step = 9, 18, 2
    plan = FaultPlan((Fault(kind=kind, at=at, log="run/driver_state.json", nbytes=20),))
    with iofaults.install(plan), pytest.raises(WriteFailedError) as failed:
        after.save(path)
    assert plan.injected == [f"run/driver_state.json {op} #{at} {kind.value}"]
    error = failed.value
    assert error.errno == ERRNO.get(kind, errno.EIO)
    assert str(path) in str(error) and errno.errorcode[error.errno] in str(error) and "intact" in str(error)
    assert path.read_bytes() == saved  # the previous file, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "driver_state.json"]  # no temp left
    loaded = DriverState.load(path)
    assert (loaded.cursor, loaded.num_admitted) == (5, 10)
    assert _resumed_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000001"


def test_short_writes_of_the_driver_state_are_finished(tmp_path):
    path = tmp_path / "driver_state.json"
    state = DriverState(cursor=7, num_admitted=14, learner_step=3)
    plan = FaultPlan((Fault(kind=FaultKind.SHORT, at=0, log="run/driver_state.json", nbytes=5),))
    with iofaults.install(plan):
        state.save(path)
    assert plan.injected == ["run/driver_state.json write #0 short"]
    assert json.loads(path.read_text())["cursor"] == 7 and DriverState.load(path) == state


def test_the_plan_syntax_names_checkpoint_and_run_file_targets():
    plan = iofaults.parse("at=ckpt/SEALED.json:write:0:torn,at=run/driver_state.json:fsync:3:fsync_eio,logs=ckpt")
    assert set(plan.faults) == {("ckpt/SEALED.json", "write", 0), ("run/driver_state.json", "fsync", 3)}
    assert iofaults.selected("ckpt/hf/model.safetensors", plan.logs) and not iofaults.selected("run/x", plan.logs)
    assert not iofaults.selected("ckpts/x", ("ckpt",)) and iofaults.selected("traj", None)


# ---- a real driver stopped by an I/O fault ------------------------------------------------------------


class CheckpointingLearner:
    """The driver tests' FakeLearner, whose checkpoints are the real learner's (a `CheckpointWriter`
    of a tiny train state, writing on its background thread), so a checkpoint fault hits the real
    writer behind `Pipeline.checkpoint` / `settle_checkpoint`."""

    def __init__(self, inner) -> None:
        self.inner, self.ts, self.writer = inner, _train_state(), CheckpointWriter()

    async def start_checkpoint(self, path: str) -> None:
        self.ts.policy_version = self.inner.version
        self.writer.start(self.ts, Path(path))

    async def finish_checkpoint(self) -> str | None:
        path = await asyncio.to_thread(self.writer.wait)
        return None if path is None else str(path)

    async def checkpoint_busy(self) -> bool:
        return self.writer.busy

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(TIMEOUT_S * 2)
@pytest.mark.parametrize(
    "fault",
    [
        Fault(kind=FaultKind.EIO, at=12, log="run/driver_state.json"),  # mid-admission
        Fault(kind=FaultKind.FSYNC_EIO, at=20, log="run/driver_state.json"),
        Fault(kind=FaultKind.TORN, at=1, log=f"ckpt/{SEAL}"),  # the second checkpoint's seal
        Fault(kind=FaultKind.ENOSPC, at=70, log="ckpt/optimizer.pt"),  # 64 writes a save: the second one
    ],
    ids=lambda f: f"{f.log}-{f.kind.value}",
)
async def test_a_run_stopped_by_an_io_fault_resumes_without_losing_a_row(tmp_path, fault):
    """The driver's loops stop on the fault with the error in the chain; the run directory then holds
    an intact state naming only complete checkpoints, and every acknowledged group in the buffer log."""
    pipeline, buffer, learner = _pipeline(
        tmp_path, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2", f"buffer.root_dir={tmp_path / 'buffer'}"
    )
    pipeline.learner = CheckpointingLearner(learner)
    acked: list[str] = []
    append_durable = buffer.append_durable

    async def acknowledged(rows) -> None:
        await append_durable(rows)
        acked.append(rows[0].group_id)

    buffer.append_durable = acknowledged
    plan = FaultPlan((fault,))
    try:
        with iofaults.install(plan), pytest.raises(RuntimeError, match="loop failed") as stopped:
            await asyncio.wait_for(run_async(pipeline), TIMEOUT_S)
    finally:
        pipeline.metrics.close()
        buffer.rb.close()
    assert plan.injected == [f"{fault.log} {fault.kind.op} #{fault.at} {fault.kind.value}"]
    cause = stopped.value.__cause__
    assert isinstance(cause, WriteFailedError), repr(cause)
    assert errno.errorcode[cause.errno] in str(cause) and fault.log.split("/")[-1] in str(cause)
    assert isinstance(cause, CheckpointWriteError) == fault.log.startswith("ckpt/")
    # what `--resume` starts from: the saved state (whole), its newest checkpoint complete, no reference
    # to a folder that is not
    saved = DriverState.load(tmp_path / "driver_state.json")
    assert saved.checkpoints, "the fault should land after the first checkpoint"
    assert all(unsealed_reason(Path(r.path)) is None for r in saved.checkpoints)
    resumed = _resumed_checkpoint(tmp_path)
    assert resumed == Path(saved.checkpoints[-1].path) and load_checkpoint(_train_state(seed=1), resumed)
    assert all(p.name.startswith("step_") for p in (tmp_path / "checkpoints").iterdir())  # no partial folder
    # the buffer log is the truth for rows: every acknowledged group is in it, the cursor never ahead of it
    from streamrl.buffer.store import ReplayBuffer

    reopened = ReplayBuffer(pipeline.cfg.buffer, resume_learner_step=saved.checkpoint_step)
    try:
        assert acked and reopened.has_groups(acked) == [True] * len(acked)
        assert saved.num_admitted <= len(acked) * pipeline.cfg.group_size
    finally:
        reopened.close()
