"""`streamrl train --replay`: the logged batches, re-trained by a fresh learner, reproduce the
original learner's numbers bit for bit; an override changes them. The "original" run here is the
learner path of a real run (buffer sample -> `to_padded` -> `TrainingEngine.train_step`, metrics
through `MetricsLogger`) on a real durable buffer, without engines."""

from __future__ import annotations

import dataclasses

import pytest

from streamrl.buffer.store import ReplayBuffer
from streamrl.core.run_dir import RunDir, RunInfo
from streamrl.observability.metrics import MetricsLogger
from streamrl.streaming.config import load_config
from streamrl.streaming.replay import COMPARED, logged_batches, replay
from tests.buffer.helpers import make_traj
from tests.conftest import REPO


def _group(gid: str, version: int, rewards: list[float], seed: int):
    rows = []
    for i, reward in enumerate(rewards):
        t = make_traj(gid, i, num_response=6 + (seed + i) % 5, reward=reward, version=version)
        rows.append(
            dataclasses.replace(
                t, response_ids=[(17 * seed + 31 * i + 7 * k) % 500 + 50 for k in range(len(t.response_ids))]
            )
        )
    return rows


def _run_config(run_dir, tiny_model_path, *extra: str):
    cfg = load_config(
        REPO / "configs/tiny.toml",
        [
            f"model={tiny_model_path}",
            "buffer.batch_size=4",
            "buffer.group_size=2",
            "learner.lr=1e-3",
            "learner.correction.prox=loglinear",
            *extra,
        ],
    )
    cfg.learner.model = str(tiny_model_path)
    cfg.buffer.root_dir = str(run_dir / "buffer")
    info = RunInfo(run_name="run", model_path=str(tiny_model_path), mode="async", config=cfg.model_dump(mode="json"))
    RunDir(run_dir).write_info(info)
    return cfg


def _train(buf, engine, log, steps, *, fresh_groups: bool = True) -> list[dict]:
    """Learner steps as the driver runs them: two fresh groups per step (behaviour version one behind
    the served one but at the start), sample at the served version, train, log under the new label."""
    out = []
    for step in steps:
        served = engine.policy_version
        for g in range(2) if fresh_groups else ():
            buf.append(_group(f"s{step}g{g}", max(served - 1, 0), [1.0, 0.0] if g else [0.0, 1.0], seed=step * 3 + g))
        sampled = buf.sample(served_version=served, learner_step=step)
        metrics = engine.train_step(sampled.to_padded())
        log.log(metrics, learner_step=step, policy_version=engine.policy_version)
        out.append(metrics)
    return out


def _original_run(run_dir, tiny_model_path, steps: int = 3) -> list[dict]:
    from streamrl.learner.engine import TrainingEngine

    cfg = _run_config(run_dir, tiny_model_path)
    buf = ReplayBuffer(cfg.buffer)
    engine = TrainingEngine(cfg.learner)
    log = MetricsLogger(run_dir, wandb_cfg=None, console=False)
    out = _train(buf, engine, log, range(1, steps + 1))
    log.close()
    buf.close()
    return out


@pytest.mark.timeout(300)
def test_replay_reproduces_the_learner_bit_for_bit(tmp_path, tiny_model_path):
    original = _original_run(tmp_path, tiny_model_path)
    assert all(m["learner/grad_norm"] > 0 for m in original)  # real updates: the check can fail
    batches = logged_batches(tmp_path / "buffer")
    assert [step for step, _, _ in batches] == [1, 2, 3] and all(t.num_rows == 4 for _, t, _ in batches)
    records = replay(tmp_path, name="same")
    for got, want in zip(records, original, strict=True):
        for key in COMPARED:
            assert got[key] == want[key] == got[f"original/{key}"], (got["learner_step"], key)
    assert (tmp_path / "replays" / "same" / "metrics.jsonl").read_text().count("\n") == 3
    changed = replay(tmp_path, ["learner.lr=1e-2"], name="lr")
    assert changed[0]["learner/loss"] == original[0]["learner/loss"]  # same data, same start
    assert changed[1]["learner/loss"] != original[1]["learner/loss"]  # a different first update


@pytest.mark.timeout(300)
def test_replay_of_a_resumed_run_matches_the_learner_that_last_trained_each_step(tmp_path, tiny_model_path):
    """A run stopped after step 3 and resumed from its step-2 checkpoint: the resume rolls back step 3's
    consumption, re-trains step 3 from the checkpoint with its labels one higher (a resume relabels
    versions upward) and goes on to step 4. Replay trains steps 1..4 straight through from the start
    and must reproduce, bit for bit, what the learner that last trained each step logged."""
    from streamrl.learner.engine import TrainingEngine

    # two mini-batches: the second one's π_prox is interpolated by lag, so the version labels matter
    cfg = _run_config(tmp_path, tiny_model_path, "learner.num_minibatches=2")
    buf, engine = ReplayBuffer(cfg.buffer), TrainingEngine(cfg.learner)
    log = MetricsLogger(tmp_path, wandb_cfg=None, console=False)
    first = _train(buf, engine, log, [1, 2])
    engine.save_checkpoint(tmp_path / "ckpt_2")
    first += _train(buf, engine, log, [3])
    log.close()
    buf.close()  # stopped after step 3; its checkpoint is step 2's

    buf = ReplayBuffer(cfg.buffer, resume_learner_step=2)  # step 3's consumption rolled back
    engine = TrainingEngine(cfg.learner)
    engine.load_checkpoint(tmp_path / "ckpt_2")
    engine.policy_version += 1  # labels continue above every one used before
    log = MetricsLogger(tmp_path, wandb_cfg=None, console=False)
    resumed = _train(buf, engine, log, [3], fresh_groups=False)  # the rolled-back groups again
    resumed += _train(buf, engine, log, [4])
    log.close()
    buf.close()
    assert resumed[0]["learner/loss"] != first[2]["learner/loss"]  # the relabel moved step 3's lags

    assert [step for step, _, _ in logged_batches(tmp_path / "buffer")] == [1, 2, 3, 4]
    records = replay(tmp_path, name="resumed")
    for got, want in zip(records, [*first[:2], *resumed], strict=True):
        for key in COMPARED:
            assert got[key] == want[key] == got[f"original/{key}"], (got["learner_step"], key)
