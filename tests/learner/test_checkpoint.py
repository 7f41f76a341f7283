"""Learner checkpoints: sealed on disk, restored exactly, and never unpickled beyond tensors and plain values."""

from __future__ import annotations

import random

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
