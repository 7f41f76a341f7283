"""Learner checkpoints: sealed on disk, restored exactly, and never unpickled beyond tensors and plain values."""

from __future__ import annotations

import errno
import random
import threading

import numpy as np
import pytest
import torch

from streamrl.core.atomic import SEAL, unsealed_reason
from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from tests.learner.test_engine import _batch

pytestmark = pytest.mark.timeout(120)


class _RunsCode:
    """What a tampered checkpoint could carry: unpickling it calls `Path.touch(target)`."""

    def __init__(self, target) -> None:
        self.target = target

    def __reduce__(self):
        return (type(self.target).touch, (self.target,))


def _engine() -> TrainingEngine:
    cfg = LearnerConfig(model="tiny", device="cpu", lr=1e-3, micro_batch_tokens=64, seed=3, warmup_steps=3)
    return TrainingEngine(cfg)


def _draws(engine: TrainingEngine) -> tuple:
    return (
        torch.rand(3).tolist(),
        random.random(),
        np.random.rand(2).tolist(),
        torch.rand(2, generator=engine.generator).tolist(),
    )


def test_round_trip_restores_optimizer_scheduler_and_rng(tmp_path):
    first = _engine()
    first.train_step(_batch())
    first.save_checkpoint(tmp_path / "ckpt")
    assert unsealed_reason(tmp_path / "ckpt") is None and (tmp_path / "ckpt" / SEAL).is_file()
    expected = _draws(first)

    resumed = _engine()
    _draws(resumed)  # move every RNG away from the saved state
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert _draws(resumed) == expected
    assert resumed.scheduler.state_dict() == first.scheduler.state_dict()
    assert resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    saved, loaded = first.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for key, state in saved["state"].items():
        assert all(torch.equal(state[k], loaded["state"][key][k]) for k in state)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng.pt"])
def test_a_pickle_that_runs_code_is_refused(tmp_path, name):
    engine = _engine()
    engine.save_checkpoint(tmp_path / "ckpt")
    target = tmp_path / "code-ran"
    torch.save({"state": _RunsCode(target)}, tmp_path / "ckpt" / name)
    with pytest.raises(ValueError, match="refused"):
        _engine().load_checkpoint(tmp_path / "ckpt")
    assert not target.exists()


def test_a_torn_checkpoint_is_recognised(tmp_path):
    engine = _engine()
    engine.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "scheduler.pt").unlink()
    assert "scheduler.pt is missing" in unsealed_reason(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "optimizer.pt").write_bytes(b"")  # the rename survived a lost machine, the bytes did not
    assert "optimizer.pt has 0 bytes" in unsealed_reason(tmp_path / "ckpt")
    (tmp_path / "ckpt" / SEAL).unlink()
    assert SEAL in unsealed_reason(tmp_path / "ckpt")


# ---- checkpoints written in the background (trainer.async_checkpoint) ----------------------------


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _gated_writes(monkeypatch) -> tuple[threading.Event, list[str]]:
    """Background writes wait for the returned event; the list logs each write's end and each snapshot."""
    from streamrl.learner import checkpoint as ckpt

    gate, log = threading.Event(), []
    write, snapshot = ckpt.write_snapshot, ckpt.take_snapshot

    def gated_write(snap):
        assert gate.wait(60), "the test never opened the gate"
        out = write(snap)
        log.append(f"written {out.name}")
        return out

    def logged_snapshot(ts, directory):
        log.append(f"snapshot {directory.name}")
        return snapshot(ts, directory)

    monkeypatch.setattr(ckpt, "write_snapshot", gated_write)
    monkeypatch.setattr(ckpt, "take_snapshot", logged_snapshot)
    return gate, log


def test_a_background_checkpoint_holds_the_state_it_started_with(tmp_path, monkeypatch):
    """Training on while the write is held back changes nothing in it: its files are byte for byte
    those of an inline save of the same state, and differ from a save after those steps."""
    engine = _engine()
    engine.train_step(_batch())
    engine.save_checkpoint(tmp_path / "inline")
    gate, _ = _gated_writes(monkeypatch)
    engine.start_checkpoint(tmp_path / "background")
    assert engine.checkpoint_busy
    engine.train_step(_batch())
    engine.train_step(_batch())
    gate.set()
    assert engine.finish_checkpoint() == str(tmp_path / "background") and not engine.checkpoint_busy
    assert unsealed_reason(tmp_path / "background") is None
    assert _files(tmp_path / "background") == _files(tmp_path / "inline")
    engine.save_checkpoint(tmp_path / "later")
    later = _files(tmp_path / "later")
    assert later["optimizer.pt"] != _files(tmp_path / "inline")["optimizer.pt"]
    weights = [name for name in later if name.endswith(".safetensors")]
    assert weights and all(later[n] != _files(tmp_path / "inline")[n] for n in weights)
    assert engine.finish_checkpoint() is None  # nothing in flight


def test_a_new_checkpoint_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    """At most one snapshot is held besides the live state: the second one is taken after the first
    is written."""
    engine = _engine()
    gate, log = _gated_writes(monkeypatch)
    engine.start_checkpoint(tmp_path / "first")
    second = threading.Thread(target=engine.start_checkpoint, args=(tmp_path / "second",))
    second.start()
    gate.set()
    second.join(60)
    assert engine.finish_checkpoint() == str(tmp_path / "second")
    assert log == ["snapshot first", "written first", "snapshot second", "written second"]


def test_a_failed_background_write_is_raised_when_collected(tmp_path):
    """ENOSPC on the writer thread: `finish_checkpoint` raises it (errno and file), nothing is in
    place, no partial folder is left, and the next checkpoint is written."""
    from streamrl.core import iofaults
    from streamrl.core.iofaults import Fault, FaultKind, FaultPlan
    from streamrl.learner.checkpoint import CheckpointWriteError

    engine = _engine()
    with iofaults.install(FaultPlan((Fault(kind=FaultKind.ENOSPC, at=3, log="ckpt/optimizer.pt"),))):
        engine.start_checkpoint(tmp_path / "step_000001")
        with pytest.raises(CheckpointWriteError, match="ENOSPC") as failed:
            engine.finish_checkpoint()
    assert failed.value.errno == errno.ENOSPC and "optimizer.pt" in str(failed.value)
    assert list(tmp_path.iterdir()) == []
    engine.start_checkpoint(tmp_path / "step_000002")
    assert engine.finish_checkpoint() == str(tmp_path / "step_000002")
    assert unsealed_reason(tmp_path / "step_000002") is None
